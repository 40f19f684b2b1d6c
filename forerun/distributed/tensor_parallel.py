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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from forerun.distributed.parallel_state import TensorParallelGroup
from forerun.model.moe import FusedMoE


class RowParallel(nn.Module):
    """A linear over this rank's input columns, summed over the ranks, then the bias."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 group: TensorParallelGroup) -> None:
        super().__init__()
        self.linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False,
                                device=weight.device, dtype=weight.dtype)
        self.linear.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
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


class VocabParallelHead(nn.Module):
    """The output head over this rank's vocabulary rows; the logits of all ranks gathered."""

    def __init__(self, weight: torch.Tensor, vocab_size: int,
                 group: TensorParallelGroup) -> None:
        super().__init__()
        self.proj = nn.Linear(weight.shape[1], weight.shape[0], bias=False,
                              device=weight.device, dtype=weight.dtype)
        self.proj.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
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
    every expert's width, gate/up by rows and down by columns."""
    size, rank = group.size, group.rank
    assert moe.w13 is not None and moe.w2 is not None
    if expert_parallel:
        per = moe.num_experts // size
        moe.local_experts = range(rank * per, (rank + 1) * per)
        keep = slice(rank * per, (rank + 1) * per)
        w13, w2 = moe.w13[keep], moe.w2[keep]
        b13 = None if moe.b13 is None else moe.b13[keep]
        b2 = None if moe.b2 is None else moe.b2[keep]
    else:
        full, inter = moe.intermediate_size, moe.intermediate_size // size
        rows = torch.cat([torch.arange(rank * inter, (rank + 1) * inter),
                          full + torch.arange(rank * inter, (rank + 1) * inter)])
        w13, w2 = moe.w13[:, rows], moe.w2[:, :, rank * inter:(rank + 1) * inter]
        b13 = None if moe.b13 is None else moe.b13[:, rows]
        # Each rank's down projection is a partial sum; the bias joins it once (rank 0).
        b2 = None if moe.b2 is None else moe.b2 if rank == 0 else torch.zeros_like(moe.b2)
        moe.intermediate_size = inter
    moe.w13 = nn.Parameter(w13.contiguous(), requires_grad=False)
    moe.w2 = nn.Parameter(w2.contiguous(), requires_grad=False)
    if b13 is not None and b2 is not None:  # gpt-oss's expert biases
        moe.b13 = nn.Parameter(b13.contiguous(), requires_grad=False)
        moe.b2 = nn.Parameter(b2.contiguous(), requires_grad=False)
    moe.tp_group = group


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                    device=weight.device, dtype=weight.dtype)
    lin.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    return lin


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
        idx = torch.cat(rows)
        w, b = attn.qkv_proj.weight, attn.qkv_proj.bias
        attn.qkv_proj = _linear(w[idx], None if b is None else b[idx])
        attn.num_heads, attn.num_kv_heads = hq, hkv
        if attn.sinks is not None:  # gpt-oss: one per query head, with its head
            attn.sinks = nn.Parameter(attn.sinks[rank * hq:(rank + 1) * hq].contiguous(),
                                      requires_grad=False)
        attn.q_size, attn.kv_size = hq * d, hkv * d
        o = attn.o_proj
        attn.o_proj = RowParallel(o.weight[:, rank * hq * d:(rank + 1) * hq * d], o.bias,
                                  group)
        mlp = layer.mlp
        if isinstance(mlp, FusedMoE):
            shard_moe(mlp, group, expert_parallel)
            continue
        inter = mlp.intermediate_size // size
        gu = mlp.gate_up_proj.weight
        full = mlp.intermediate_size
        mlp.gate_up_proj = _linear(torch.cat([gu[rank * inter:(rank + 1) * inter],
                                              gu[full + rank * inter: full + (rank + 1) * inter]]),
                                   None)
        mlp.intermediate_size = inter
        dw = mlp.down_proj.weight
        mlp.down_proj = RowParallel(dw[:, rank * inter:(rank + 1) * inter], None, group)
    stage = model.pp_stage
    emb = None
    if model.model.embed_tokens is not None:  # a middle pipeline stage has none
        emb = VocabParallelEmbedding(model.model.embed_tokens.weight, group)
        model.model.embed_tokens = emb
    if stage is None or stage.is_last:
        if model.lm_head is None:  # tied: the head reads the embedding's rows
            assert emb is not None
            head_rows = emb.weight
        else:
            head_rows = VocabParallelEmbedding(model.lm_head.weight, group).weight
            model.lm_head = None
        model.tp_head = VocabParallelHead(head_rows, model.config.vocab_size, group)
    # The one-call small-batch path has no all-reduce between its layers.
    model.small_batch.available = False
