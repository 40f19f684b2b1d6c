"""The small-batch path: every decoder layer of a step with few tokens in one C call.

A single stream decodes one token per step, and at that size the op-by-op forward spends
as long in Python and per-call overhead as in streaming the weights. This path hands the
whole stack (``csrc/decoder_stack.c``) the addresses of every layer's plain weights and
KV cache once, and the step's attention inputs, so a step costs one ctypes call for the
layers, one matmul for the logits, and the weight reads. The functions are those of the
op-by-op path; only the matmul kernel differs (``csrc/small_matmul.c``).

Used on CPU, in float32 and bfloat16, for steps of at most
``envs.small_batch_tokens()`` tokens, when the C kernels are built; otherwise the model
runs its layers one op at a time.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from forerun import envs
from forerun.model import cpu_kernels
from forerun.model.attention import AttentionMetadata, KVCache

if TYPE_CHECKING:
    from forerun.model.llama import LlamaForCausalLM

_NUM_LAYER_PTRS = 12  # the enum at the top of decoder_stack.c


class _StackArgs(ctypes.Structure):
    """``stack_args_t`` of decoder_stack.c."""

    _fields_ = [
        ("hidden", ctypes.c_int64), ("num_heads", ctypes.c_int64),
        ("num_kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64),
        ("intermediate", ctypes.c_int64), ("block_size", ctypes.c_int64),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        ("cos_half", ctypes.c_void_p), ("sin_half", ctypes.c_void_p),
        ("slot_mapping", ctypes.c_void_p), ("block_tables", ctypes.c_void_p),
        ("table_stride", ctypes.c_int64),
        ("token_seq", ctypes.c_void_p), ("token_len", ctypes.c_void_p),
    ]


def _addr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class SmallBatchStack:
    """Runs a Llama-family model's decoder layers for a small step in one C call.

    The table of weight addresses is built on first use (after loading and prepacking, when
    the weights no longer move); the KV cache addresses are filled in per cache list, since
    several engines in one process share the model but not their caches.
    """

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        cfg = model.config
        self._weights: torch.Tensor | None = None  # [L, 12] int64 addresses
        self._tables: dict[int, torch.Tensor] = {}  # id(first K cache) -> full table
        self._keep: list[torch.Tensor] = []  # weights made contiguous for the table
        self._args = _StackArgs(
            hidden=cfg.hidden_size, num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
            intermediate=cfg.intermediate_size, eps=cfg.rms_norm_eps,
            scale=cfg.head_dim ** -0.5)

    def applies(self, x: torch.Tensor) -> bool:
        """True if a step whose embeddings are ``x`` ``[T, hidden]`` takes this path."""
        return (x.dim() == 2 and x.shape[0] <= envs.small_batch_tokens()
                and cpu_kernels.supports(x.dtype, x.device))

    def _plain(self, t: torch.Tensor | None, dtype: torch.dtype) -> int:
        if t is None:
            return 0
        assert t.dtype == dtype, f"weight of dtype {t.dtype} in a {dtype} model"
        if not t.is_contiguous():
            t = t.contiguous()
            self._keep.append(t)
        return t.data_ptr()

    def _weight_table(self, dtype: torch.dtype) -> torch.Tensor:
        if self._weights is None:
            rows = []
            for layer in self.model.model.layers:
                attn, mlp = layer.self_attn, layer.mlp
                rows.append([
                    self._plain(layer.input_layernorm.weight, dtype),
                    self._plain(attn.qkv_proj.weight, dtype),
                    self._plain(attn.qkv_proj.bias, dtype),
                    self._plain(attn.q_norm.weight if attn.q_norm is not None else None, dtype),
                    self._plain(attn.k_norm.weight if attn.k_norm is not None else None, dtype),
                    self._plain(attn.o_proj.weight, dtype),
                    self._plain(attn.o_proj.bias, dtype),
                    self._plain(layer.post_attention_layernorm.weight, dtype),
                    self._plain(mlp.gate_up_proj.weight, dtype),
                    self._plain(mlp.down_proj.weight, dtype),
                    0, 0,
                ])
            self._weights = torch.tensor(rows, dtype=torch.int64).reshape(
                -1, _NUM_LAYER_PTRS)
        return self._weights

    def _layer_table(self, kv_caches: list[KVCache], dtype: torch.dtype) -> torch.Tensor:
        key = id(kv_caches[0][0]) if kv_caches else 0
        table = self._tables.get(key)
        if table is None or (kv_caches and table[0, 10] != kv_caches[0][0].data_ptr()):
            table = self._weight_table(dtype).clone()
            for i, (k, v) in enumerate(kv_caches):
                assert k.is_contiguous() and v.is_contiguous()
                table[i, 10] = k.data_ptr()
                table[i, 11] = v.data_ptr()
            self._tables[key] = table
        return table

    def forward(self, x: torch.Tensor, cos_half: torch.Tensor, sin_half: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        """The final-normed hidden states ``[T, hidden]`` of embeddings ``x`` (overwritten)."""
        x = x.contiguous()
        table = self._layer_table(kv_caches, x.dtype)
        token_seq, token_len = meta.token_indices()
        block_tables = meta.block_tables
        if block_tables.stride(1) != 1:
            block_tables = block_tables.contiguous()
        cos_half, sin_half = cos_half.contiguous(), sin_half.contiguous()
        slot_mapping = meta.slot_mapping.contiguous()
        a = self._args
        a.block_size = meta.block_size
        a.cos_half, a.sin_half = cos_half.data_ptr(), sin_half.data_ptr()
        a.slot_mapping, a.block_tables = slot_mapping.data_ptr(), block_tables.data_ptr()
        a.table_stride = block_tables.stride(0)
        a.token_seq, a.token_len = token_seq.data_ptr(), token_len.data_ptr()
        residual = torch.empty_like(x)
        final_norm = self.model.model.norm.weight
        rc = cpu_kernels.decoder_stack(x.dtype)(
            table.shape[0], table.data_ptr(), _addr(final_norm), x.data_ptr(),
            residual.data_ptr(), x.shape[0], ctypes.addressof(a))
        if rc != 0:
            raise MemoryError("the small-batch path could not allocate its scratch space")
        return x
