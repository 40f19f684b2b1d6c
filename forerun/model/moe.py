"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral, gpt-oss): a router picks ``top_k`` of
``num_experts`` gated experts per token, and the layer's output is their weighted sum.

gpt-oss differs in three options: its router has a bias and takes the softmax over the
chosen ``top_k`` logits only; its experts have biases (``b13`` ``[E, 2 * I]``, ``b2``
``[E, H]``); and their activation is the clamped SwiGLU (:func:`clamped_swiglu`).

All tokens of a step are routed at once; their (token, expert) pairs are then grouped by
expert, so each expert that received tokens runs its gate/up and down projections as one
matmul over its rows (a GEMV at decode, a GEMM at prefill), and the weighted rows are added
back to their tokens in one scatter-add. Experts that received no tokens cost nothing, so a
decode step reads only the chosen experts' weights. The experts are stored stacked:
``w13`` ``[E, 2 * I, H]`` (each expert's gate rows, then its up rows) and ``w2`` ``[E, H, I]``.

Where the C kernels run, a layer without gpt-oss's options runs in one C call
(``csrc/moe_block.c``, the one-call decoder stack's MoE block) at every step size: routing,
grouping and every chosen expert's matmuls without a Python call per expert. A 16-token
step of Qwen3-30B-A3B's layer chooses ~100 of its 128 experts, which one at a time from
Python cost more than their matmuls.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from forerun.model import cpu_kernels


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   softmax_over_top_k: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights float32 [T, top_k], expert ids int64 [T, top_k])``: the softmax over all
    experts in float32, its ``top_k`` largest, renormalised to sum to 1 when asked
    (Mixtral always; Qwen3-MoE with ``norm_topk_prob``); with ``softmax_over_top_k``
    (gpt-oss) the ``top_k`` largest logits, then the softmax over those alone."""
    if softmax_over_top_k:
        top, ids = torch.topk(router_logits.float(), top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if cpu_kernels.supports(gate_up.dtype, gate_up.device) and gate_up.is_contiguous():
        return cpu_kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation of ``[..., 2 * I]`` (gate columns, then up):
    ``(clamp(u, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g`` the gate clamped
    to at most ``limit``."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` for every token row ``t``
    of ``x`` ``[T, H]``, where ``expert_e(v) = w2[e] @ (silu(g) * u)`` and ``(g, u) = w13[e] @ v``.

    Each expert's contribution is weighted in float32 and added in the model's dtype, in
    increasing expert order per token (as transformers' reference adds them)."""
    return grouped_experts(
        x, topk_weights, topk_ids, w13.shape[0],
        lambda e, rows: F.linear(_silu_and_mul(F.linear(rows, w13[e])), w2[e]))


def grouped_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    num_experts: int, run_expert: Callable[[int, torch.Tensor], torch.Tensor]
                    ) -> torch.Tensor:
    """:func:`fused_experts` with each expert's MLP given as ``run_expert(e, rows)`` (its
    weights in any form: stacked floats, or GGUF blocks)."""
    t, h = x.shape
    if t == 0:
        return x.new_zeros(0, h)
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    # Stable: a token's pairs stay in expert order, and within an expert in token order.
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    token_of = order // k
    rows = x.index_select(0, token_of)
    outs: list[torch.Tensor] = []
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        outs.append(run_expert(e, rows[start:start + n]))
        start += n
    expert_out = torch.cat(outs) if len(outs) > 1 else outs[0]
    weighted = (expert_out.float() * topk_weights.reshape(-1)[order, None]).to(x.dtype)
    out = torch.zeros(t, h, dtype=x.dtype, device=x.device)
    out.index_add_(0, token_of, weighted)
    return out


# Plain experts take the C block up to this many (token, expert) pairs per expert.
_C_PLAIN_ROWS = 16


class FusedMoE(nn.Module):
    """A sparse MLP layer: the router (``gate``, a linear layer to one logit per expert) and
    the stacked experts ``w13`` / ``w2`` (see the module docstring); with
    quantization="gguf" or "int8", ``quant_experts`` instead: per expert its gate/up and
    down as linears over the file's blocks or int8 rows (and ``w13`` / ``w2`` None).

    gpt-oss's options: ``router_bias``, ``softmax_over_top_k`` (see :func:`select_experts`),
    ``expert_bias`` (``b13`` / ``b2``, added to each expert's gate/up and down outputs) and
    ``swiglu`` ``(alpha, limit)``: :func:`clamped_swiglu` in place of SiLU-and-multiply."""

    # The C block reads the router's rows (as float32): oneDNN's reordered copy would hide
    # them and send every step past the small-batch path to the per-expert loop.
    unpacked_linears = ("gate",)

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int,
                 top_k: int, renormalize: bool, *, router_bias: bool = False,
                 softmax_over_top_k: bool = False, expert_bias: bool = False,
                 swiglu: tuple[float, float] | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.top_k = top_k
        self.renormalize = renormalize
        self.softmax_over_top_k = softmax_over_top_k
        self.swiglu = swiglu
        self.gate = nn.Linear(hidden_size, num_experts, bias=router_bias)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size),
                               requires_grad=False)
        self.b13: nn.Parameter | None = None
        self.b2: nn.Parameter | None = None
        if expert_bias:
            self.b13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size),
                                    requires_grad=False)
            self.b2 = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.quant_experts: nn.ModuleList | None = None
        # Tensor parallel (forerun/distributed/tensor_parallel.py): the output is summed over
        # the group; with expert parallelism this rank holds the experts in local_experts
        # (w13/w2 index 0 is the first of them) and adds only their rows.
        self.tp_group: Any = None
        self.local_experts: range | None = None
        # The C block's inputs (see _c_block), built on first use: (key, kind, router rows,
        # expert address table, options, what the table and options point into).
        self._c_cache: tuple[Any, ...] | None = None

    def use_quantized_experts(self, experts: list[tuple[nn.Module, nn.Module]]) -> None:
        """Run expert ``e`` as ``experts[e] = (gate_up, down)`` and drop the stacked floats
        (with expert parallelism, ``experts[i]`` is local expert ``local_experts[i]``)."""
        held = self.num_experts if self.local_experts is None else len(self.local_experts)
        if len(experts) != held:
            raise ValueError(f"{len(experts)} experts given, the layer holds {held}")
        self.quant_experts = nn.ModuleList(nn.ModuleList(pair) for pair in experts)
        self.w13 = None
        self.w2 = None

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.swiglu is None:
            return _silu_and_mul(gate_up)
        return clamped_swiglu(gate_up, *self.swiglu)

    def _bias(self, y: torch.Tensor, bias: torch.Tensor | None, i: int) -> torch.Tensor:
        return y if bias is None else y + bias[i]

    def _c_block(self, x: torch.Tensor
                 ) -> tuple[str, torch.Tensor, torch.Tensor, tuple | None] | None:
        """``(kind, router float32 [E, H], expert addresses int64 [2E], the fields of
        :class:`cpu_kernels.MoeOpts` or None)`` for :func:`cpu_kernels.moe_block` where it
        computes this layer for ``x``; else None."""
        biases = [b for b in (self.b13, self.b2) if b is not None]
        if (self.local_experts is not None or x.dim() != 2 or x.shape[0] == 0
                or not isinstance(self.gate, nn.Linear)
                or any(b.dtype != x.dtype or not b.is_contiguous() for b in biases)
                or not cpu_kernels.supports(x.dtype, x.device)):
            return None
        quant = self.quant_experts
        if quant is None and (self.w13.dtype != x.dtype or (
                x.shape[0] * self.top_k > _C_PLAIN_ROWS * self.num_experts
                and not (x.dtype == torch.bfloat16 and cpu_kernels.small_matmul_has_amx()))):
            # Plain experts (float32 or bfloat16 rows as stored): past ~16 rows an expert,
            # torch's GEMM (MKL, oneDNN) beats the block's row kernels by more than the
            # Python calls cost (Qwen3-30B-A3B's layer in float32: the block 1.9x faster at
            # 64 tokens, 1.2x at 256, level at 512; block-backed experts run the same
            # kernels either way). bfloat16 rows on AMX tiles beat torch at every size.
            return None
        inputs = self.c_inputs()
        return None if inputs is None else inputs[:4]

    def c_inputs(self) -> tuple[str, torch.Tensor, torch.Tensor, tuple | None, list[Any]] | None:
        """What the C block (this layer's :func:`cpu_kernels.moe_block` call, or its entry in
        the one-call stack's table) reads: ``(kind, router float32 [E, H], expert addresses
        int64 [2E], the fields of :class:`cpu_kernels.MoeOpts` or None, what the table and
        options point into)``, built once per set of weights; None for experts of a kind the
        block does not take."""
        quant = self.quant_experts
        biases = [b for b in (self.b13, self.b2) if b is not None]
        # The table is keyed by what it points into; holding those keeps their addresses.
        held = quant if quant is not None else (self.w13, self.w2)
        key = (id(held) if quant is not None else (self.w13.data_ptr(), self.w2.data_ptr()),
               self.gate.weight.data_ptr(),
               None if self.gate.bias is None else self.gate.bias.data_ptr(),
               *(b.data_ptr() for b in biases))
        if self._c_cache is not None and self._c_cache[0] == key:
            return self._c_cache[1:]
        router = self.gate.weight.detach().float().contiguous()
        keep: list[Any] = [held]
        if quant is None:
            kind = "plain"
            addrs = [a for e in range(self.num_experts)
                     for a in (self.w13[e].data_ptr(), self.w2[e].data_ptr())]
        elif all(hasattr(lin, "desc") for pair in quant for lin in pair):  # GGUF blocks
            kind = "gguf"
            addrs = [ctypes.addressof(lin.desc) for pair in quant for lin in pair]
        elif all(hasattr(lin, "weight_q") for pair in quant for lin in pair):  # int8 rows
            kind = "mixed"
            descs = [cpu_kernels.LinearDesc(
                kind=cpu_kernels.LIN_INT8, w=lin.weight_q.data_ptr(),
                scale=lin.weight_scale.data_ptr(), wsum=lin.weight_sum.data_ptr())
                for pair in quant for lin in pair]
            keep.append(descs)
            addrs = [ctypes.addressof(d) for d in descs]
        else:
            return None
        opts, opt_tensors = self.c_options()
        keep += opt_tensors
        table = torch.tensor(addrs, dtype=torch.int64)
        self._c_cache = (key, kind, router, table, opts, keep)
        return kind, router, table, opts, keep

    def c_options(self) -> tuple[tuple | None, list[torch.Tensor | None]]:
        """The fields of :class:`cpu_kernels.MoeOpts` for gpt-oss's additions (None for a
        layer without them: Qwen3-MoE, Mixtral), and the tensors they point into, which the
        caller keeps alive."""
        router_bias = (None if self.gate.bias is None
                       else self.gate.bias.detach().float().contiguous())
        # Plain values here (a module with a ctypes struct of pointers cannot be deep-copied,
        # as tensor parallelism's sharding does); the caller makes the struct.
        keep = [router_bias, self.b13, self.b2]
        if (router_bias is None and not self.softmax_over_top_k and self.b13 is None
                and self.b2 is None and self.swiglu is None):
            return None, keep
        alpha, limit = self.swiglu if self.swiglu is not None else (0.0, 0.0)
        return (None if router_bias is None else router_bias.data_ptr(),
                int(self.softmax_over_top_k),
                None if self.b13 is None else self.b13.data_ptr(),
                None if self.b2 is None else self.b2.data_ptr(), alpha, limit), keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        block = self._c_block(x)
        if block is not None:
            kind, router, table, opts = block
            out = torch.empty_like(x)
            cpu_kernels.moe_block(kind, x.contiguous(), out, self.num_experts, self.top_k,
                                  self.intermediate_size, self.renormalize, router, table,
                                  None if opts is None else cpu_kernels.MoeOpts(*opts))
            return out if self.tp_group is None else self.tp_group.all_reduce(out)
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize,
                                      self.softmax_over_top_k)
        local, b13, b2 = self.local_experts, self.b13, self.b2
        quant, w13, w2 = self.quant_experts, self.w13, self.w2
        if quant is None and local is None and self.swiglu is None and b13 is None:
            out = fused_experts(x, w13, w2, weights, ids)
        else:
            def run(e: int, rows: torch.Tensor) -> torch.Tensor:
                if local is not None and e not in local:
                    # another rank's expert: its rows come from there
                    return rows.new_zeros(rows.shape[0], rows.shape[1])
                i = e if local is None else e - local.start
                if quant is not None:
                    gate_up, down = quant[i]
                    return self._bias(down(self._act(self._bias(gate_up(rows), b13, i))), b2, i)
                h = self._act(F.linear(rows, w13[i], None if b13 is None else b13[i]))
                return F.linear(h, w2[i], None if b2 is None else b2[i])

            out = grouped_experts(x, weights, ids, self.num_experts, run)
        return out if self.tp_group is None else self.tp_group.all_reduce(out.contiguous())
