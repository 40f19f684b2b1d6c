"""Tensor parallelism for the Llama family, applied to a loaded model in place.

Each rank keeps its share of the attention heads and of the MLP's intermediate columns:
the fused q/k/v and gate/up projections are split by output rows (column parallel, no
communication), o_proj and down_proj by input columns (row parallel), each followed by one
all-reduce, so a layer costs two all-reduces (a mixture-of-experts layer: by each expert's
width, or by whole experts with expert parallelism; one all-reduce of its output). KV heads are split with the query heads, so
each rank's KV cache holds only its heads. The embedding and the output head are split
by vocabulary rows: a rank looks up the ids in its range (zeros elsewhere) and an
all-reduce sums the rows; for the logits each rank computes its slice and an all-gather
joins them.

Weights held as GGUF blocks (``quantization="gguf"``) are split the same way in their
blocks: a rank keeps its output rows of a column-parallel linear, and its input columns of
a row-parallel one, which must then be cut between blocks (32 values, 256 for the
K-quants); the embedding and head keep their vocabulary rows in blocks, and a mixture of
experts' block-backed experts are split by whole experts or by width as float ones are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from forerun.distributed.parallel_state import TensorParallelGroup
from forerun.model.moe import FusedMoE
from forerun.model.quant.gguf_linear import GGUFEmbedding, GGUFLinear


class RowParallel(nn.Module):
    """A linear over this rank's input columns (``linear``: float or GGUF blocks, without
    bias), summed over the ranks, then the bias."""

    def __init__(self, linear: nn.Module, bias: torch.Tensor | None,
                 group: TensorParallelGroup) -> None:
        super().__init__()
        self.linear = linear
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(self.linear(x).contiguous())
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding (the vocabulary padded to a multiple of the size)."""

    def __init__(self, full: torch.Tensor, group: TensorParallelGroup) -> None:
        super().__init__()
        per = -(-full.shape[0] // group.size)
        self.start = group.rank * per
        rows = full[self.start: self.start + per]
        if rows.shape[0] < per:  # the last rank's rows past the vocabulary are zeros
            rows = torch.cat([rows, rows.new_zeros(per - rows.shape[0], rows.shape[1])])
        self.weight = nn.Parameter(rows.contiguous(), requires_grad=False)
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.group.all_reduce(rows * inside.unsqueeze(-1).to(rows.dtype))


class VocabParallelGGUFEmbedding(nn.Module):
    """:class:`VocabParallelEmbedding` over GGUF blocks: this rank's rows of the table,
    held in blocks (zero rows past the vocabulary), a lookup dequantizing only its rows."""

    def __init__(self, full: GGUFEmbedding, group: TensorParallelGroup) -> None:
        super().__init__()
        table = full._table[0]
        n = table.out_features
        per = -(-n // group.size)
        self.start = group.rank * per
        ids = torch.arange(self.start, min(self.start + per, n))
        self.table = table.take_rows(ids, pad=per - len(ids))
        self.rows_held, self.dtype = per, full.dtype
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = (ids - self.start).reshape(-1)
        inside = (local >= 0) & (local < self.rows_held)
        rows = self.table.rows(local.clamp(0, self.rows_held - 1)).to(self.dtype)
        rows = rows * inside.unsqueeze(-1).to(rows.dtype)
        return self.group.all_reduce(rows.reshape(*ids.shape, -1))


class VocabParallelHead(nn.Module):
    """The output head over this rank's vocabulary rows (``proj``: float or GGUF blocks);
    the logits of all ranks gathered."""

    def __init__(self, proj: nn.Module, vocab_size: int, group: TensorParallelGroup) -> None:
        super().__init__()
        self.proj = proj
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if isinstance(self.proj, GGUFLinear):  # float32 in, as the one-process GGUF head
            hidden = hidden.float()
        local = self.proj(hidden).float().contiguous()
        parts = [torch.empty_like(local) for _ in range(self.group.size)]
        self.group.all_gather(parts, local)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


def check_tensor_parallel(config, size: int, expert_parallel: bool = False) -> None:
    """Refuse sizes the model cannot be split by, naming the flag."""
    if size > 1 and config.architecture == "Olmo2ForCausalLM":
        # Its q/k norm spans all heads: a rank's share would need the others' to normalise.
        raise ValueError("tensor_parallel_size > 1 does not run Olmo2ForCausalLM (q/k norm "
                         "over the whole projection); use tensor_parallel_size=1")
    checks = [("num_attention_heads", config.num_attention_heads),
              ("num_key_value_heads", config.num_key_value_heads)]
    if not all(config.is_moe_layer(i) for i in range(config.num_hidden_layers)):
        checks.append(("intermediate_size", config.intermediate_size))
    if config.num_experts:
        checks.append(("num_experts", config.num_experts) if expert_parallel else
                      ("moe_intermediate_size", config.moe_intermediate_size))
    for what, n in checks:
        if n % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide the model's "
                             f"{what} ({n}); choose a divisor of it")


def shard_moe(moe: FusedMoE, group: TensorParallelGroup, expert_parallel: bool) -> None:
    """This rank's share of a mixture-of-experts layer; its output is summed over the ranks
    (one all-reduce, as a dense MLP's down projection). With ``expert_parallel`` a rank
    keeps whole experts, ``num_experts / size`` of them, and adds only their rows (every
    rank routes every token: the activations are replicated); otherwise it keeps a slice of
    every expert's width, gate/up by rows and down by columns (block-backed experts too)."""
    size, rank = group.size, group.rank
    full, inter = moe.intermediate_size, moe.intermediate_size // size
    per = moe.num_experts // size
    keep = slice(rank * per, (rank + 1) * per)
    rows = torch.cat([torch.arange(rank * inter, (rank + 1) * inter),
                      full + torch.arange(rank * inter, (rank + 1) * inter)])
    b13, b2 = moe.b13, moe.b2
    if b13 is not None and b2 is not None:  # gpt-oss's expert biases
        if expert_parallel:
            b13, b2 = b13[keep], b2[keep]
        else:
            # Each rank's down projection is a partial sum; the bias joins it once (rank 0).
            b13, b2 = b13[:, rows], b2 if rank == 0 else torch.zeros_like(b2)
        moe.b13 = nn.Parameter(b13.contiguous(), requires_grad=False)
        moe.b2 = nn.Parameter(b2.contiguous(), requires_grad=False)
    experts = None
    if moe.quant_experts is not None:  # quantization="gguf": block-backed experts
        experts = [(gate_up, down) for gate_up, down in moe.quant_experts]
        if expert_parallel:
            experts = experts[keep]
        else:
            experts = [(gate_up.take_rows(rows), down.take_columns(rank * inter,
                                                                   (rank + 1) * inter))
                       for gate_up, down in experts]
        moe.quant_experts = None
    else:
        assert moe.w13 is not None and moe.w2 is not None
        w13, w2 = ((moe.w13[keep], moe.w2[keep]) if expert_parallel else
                   (moe.w13[:, rows], moe.w2[:, :, rank * inter:(rank + 1) * inter]))
        moe.w13 = nn.Parameter(w13.contiguous(), requires_grad=False)
        moe.w2 = nn.Parameter(w2.contiguous(), requires_grad=False)
    if expert_parallel:
        moe.local_experts = range(rank * per, (rank + 1) * per)
    else:
        moe.intermediate_size = inter
    if experts is not None:
        moe.use_quantized_experts(experts)
    moe.tp_group = group


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                    device=weight.device, dtype=weight.dtype)
    lin.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    return lin


def _take_rows(linear: nn.Module, ids: torch.Tensor) -> nn.Module:
    """Output rows ``ids`` of a float or block-backed linear (column parallel)."""
    if isinstance(linear, GGUFLinear):
        return linear.take_rows(ids)
    b = linear.bias
    return _linear(linear.weight[ids], None if b is None else b[ids])


def _row_parallel(linear: nn.Module, start: int, end: int,
                  group: TensorParallelGroup) -> RowParallel:
    """Input columns ``start:end`` of a float or block-backed linear (row parallel)."""
    part = (linear.take_columns(start, end) if isinstance(linear, GGUFLinear) else
            _linear(linear.weight[:, start:end], None))
    return RowParallel(part, linear.bias, group)


def shard_model(model: nn.Module, group: TensorParallelGroup,
                expert_parallel: bool = False) -> None:
    """Keep this rank's share of every layer (see the module docstring and
    :func:`shard_moe`); before prepack."""
    size, rank = group.size, group.rank
    check_tensor_parallel(model.config, size, expert_parallel)
    for layer in model.model.layers:
        attn = layer.self_attn
        d = attn.head_dim
        hq, hkv = attn.num_heads // size, attn.num_kv_heads // size
        q_size, kv_size = attn.q_size, attn.kv_size
        rows = [torch.arange(rank * hq * d, (rank + 1) * hq * d),
                q_size + torch.arange(rank * hkv * d, (rank + 1) * hkv * d),
                q_size + kv_size + torch.arange(rank * hkv * d, (rank + 1) * hkv * d)]
        attn.qkv_proj = _take_rows(attn.qkv_proj, torch.cat(rows))
        attn.num_heads, attn.num_kv_heads = hq, hkv
        if attn.sinks is not None:  # gpt-oss: one per query head, with its head
            attn.sinks = nn.Parameter(attn.sinks[rank * hq:(rank + 1) * hq].contiguous(),
                                      requires_grad=False)
        attn.q_size, attn.kv_size = hq * d, hkv * d
        attn.o_proj = _row_parallel(attn.o_proj, rank * hq * d, (rank + 1) * hq * d, group)
        mlp = layer.mlp
        if isinstance(mlp, FusedMoE):
            shard_moe(mlp, group, expert_parallel)
            continue
        inter, full = mlp.intermediate_size // size, mlp.intermediate_size
        mlp.gate_up_proj = _take_rows(mlp.gate_up_proj, torch.cat([
            torch.arange(rank * inter, (rank + 1) * inter),
            full + torch.arange(rank * inter, (rank + 1) * inter)]))
        mlp.intermediate_size = inter
        mlp.down_proj = _row_parallel(mlp.down_proj, rank * inter, (rank + 1) * inter, group)
    stage = model.pp_stage
    emb: nn.Module | None = None
    embed = model.model.embed_tokens  # a middle pipeline stage has none
    if isinstance(embed, GGUFEmbedding):
        emb = VocabParallelGGUFEmbedding(embed, group)
    elif embed is not None:
        emb = VocabParallelEmbedding(embed.weight, group)
    model.model.embed_tokens = emb
    if stage is None or stage.is_last:
        vocab = model.config.vocab_size
        if model.lm_head is None:  # tied: the head reads the embedding's rows
            assert emb is not None
            head: nn.Module = (emb.table if isinstance(emb, VocabParallelGGUFEmbedding) else
                               _linear(emb.weight, None))
        elif isinstance(model.lm_head, GGUFLinear):
            n = model.lm_head.out_features
            per = -(-n // size)
            ids = torch.arange(rank * per, min((rank + 1) * per, n))
            head = model.lm_head.take_rows(ids, pad=per - len(ids))
            model.lm_head = None
        else:
            head = _linear(VocabParallelEmbedding(model.lm_head.weight, group).weight, None)
            model.lm_head = None
        model.tp_head = VocabParallelHead(head, vocab, group)
    model.quant_head = None  # the whole head's blocks: tp_head holds this rank's
    # The one-call small-batch path has no all-reduce between its layers.
    model.small_batch.available = False
