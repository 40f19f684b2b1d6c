"""The small-batch path: every decoder layer of a step with few tokens in one C call.

A single stream decodes one token per step, and at that size the op-by-op forward spends
as long in Python and per-call overhead as in streaming the weights. This path hands the
whole stack (``csrc/decoder_stack.c``) the addresses of every layer's plain weights and
KV cache once, and the step's attention inputs, so a step costs one ctypes call for the
layers, one matmul for the logits, and the weight reads. The functions are those of the
op-by-op path; only the matmul kernel differs (``csrc/small_matmul.c``).

Used on CPU, in float32 and bfloat16, for steps of at most :meth:`SmallBatchStack.max_tokens`
tokens, when the C kernels are built; otherwise the model runs its layers one op at a time.
That is 8 tokens, or 128 in bfloat16 where the small matmul has its AVX512-BF16 body
(register tiles of 12 rows x 32 columns past 8 rows; AMX tiles where the CPU has them): there
it reads each weight from memory once for any batch (again from cache past a tile), where
oneDNN's matmuls of a decode step of 32 sequences read SmolLM2's layer weights about 1.4x
slower (13.4 against 9.6 ms for all 30 layers on a 2-core CPU), and the one call also saves
the op-by-op path's per-op overhead (decode step of 32 sequences 41 -> 26 ms, of 128
sequences 91 -> 78 ms).

In bfloat16 on a CPU with AVX512-BF16 and no AMX the packed copy is also what larger steps
compute with (:class:`~forerun.model.packed_linear.TileLinear`, the small matmul's GEMM,
level with oneDNN's there), so the model holds its linear weights once.

With ``quantization="gguf"`` (every layer linear a :class:`GGUFLinear`) the same stack runs
with the GGUF matmul (``csrc/gguf_matmul.c``: the 32-value types and the K-quants alike) in
place of the small matmul: the table's weight addresses are then the linears' block
descriptors, no copy is made, and a step reads each weight in its GGUF blocks.

With ``quantization="int8"`` a layer holds :class:`Int8Linear` (o, gate/up, down) beside a
plain q/k/v, and a GGUF file can hold some linears in blocks beside plain tensors (gpt-oss's
MXFP4 experts beside bf16 attention): the stack then takes a descriptor per linear
(``linear_t`` of ``decoder_stack.c``: the packed weight, the int8 rows with their scales and
row sums, or the GGUF block descriptor) and runs each with its own kernel, the int8 ones as
``Int8Linear.forward`` does op by op (the same row quantization, exact integer sums, the
same rescale). A mixture of experts' int8 or GGUF experts are ``linear_t`` too, run by the
MoE block (``csrc/moe_block.c``) over the same dispatch, so a decode step reads only the
chosen experts' rows or blocks. Plain experts are read
as they are stored (float32 rows, or bfloat16 rows by ``csrc/rowmajor_bf16.c``): no packed
copy of them is made.
"""

from __future__ import annotations

import ctypes
import logging
from typing import TYPE_CHECKING

import torch

from forerun import envs
from forerun.model import cpu_kernels, huge_pages, kv_quant
from forerun.model.attention import AttentionMetadata, KVCache
from forerun.model.layers import GatedMLP
from forerun.model.moe import FusedMoE
from forerun.model.packed_linear import TileLinear
from forerun.model.quant.gguf_linear import GGUFLinear
from forerun.model.quant.int8_linear import Int8Linear

if TYPE_CHECKING:
    from forerun.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

_NUM_LAYER_PTRS = 19  # the enum at the top of decoder_stack.c
_MAX_TABLES = 8
# How many bytes of weights move to the huge-page arena between two trims of the heap.
_TRIM_BYTES = 256 << 20


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
        ("num_experts", ctypes.c_int64), ("top_k", ctypes.c_int64),
        ("moe_intermediate", ctypes.c_int64), ("renormalize", ctypes.c_int64),
        ("layer_tables", ctypes.c_void_p),
        ("kv_type", ctypes.c_int64),
    ]


def unsupported_features(model: LlamaForCausalLM) -> list[str]:
    """What the model does that ``decoder_stack.c`` does not (empty: the stack runs it
    exactly).

    The C stack runs pre-norm Llama blocks (optionally per-head q/k norm, biases, MoE, a
    per-layer sliding window) with rotary over the whole head in every layer and a residual
    add without a multiplier; embedding multipliers and logit scaling or soft-capping run
    outside it (in Python), and the attention scale is passed in. gpt-oss's attention sinks
    and MoE options (router bias, softmax over the top k, expert biases, clamped SwiGLU) are
    the stack's too.
    """
    from forerun.model.llama import DecoderLayer, SandwichNormDecoderLayer

    cfg = model.config
    layers = list(model.model.layers)
    found = []
    if any(isinstance(layer, SandwichNormDecoderLayer) for layer in layers) \
            or model.norm_offset:
        found.append("Gemma norms")
    elif not all(type(layer) is DecoderLayer for layer in layers):
        found.append("norms after the attention and MLP blocks (post-norm layers)")
    if any(layer.self_attn.qk_norm == "full" for layer in layers):
        found.append("q/k norm over the whole projection")
    if cfg.rope_dim != cfg.head_dim:
        found.append("partial rotary")
    if cfg.nope_layers:
        found.append("layers without rotary (NoPE)")
    if cfg.residual_multiplier != 1.0:
        found.append("a residual multiplier")
    if model.scale_embeddings:
        found.append("embedding scale")
    if cfg.hidden_act != "silu":
        found.append(f"{cfg.hidden_act} MLP")
    if cfg.attn_logit_softcapping:
        found.append("attention soft-capping")
    if cfg.rope_local_theta is not None:
        found.append("per-layer rope")
    return found


def _addr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class SmallBatchStack:
    """Runs a Llama-family model's decoder layers for a small step in one C call.

    :meth:`pack` takes each linear weight into the form the small matmul reads (in bfloat16
    a copy packed for its dot products; in float32 the weight itself), before the model's
    prepack drops the plain weights; the table of addresses is built from those copies on
    first use. The KV cache addresses are filled in per cache list, since several engines in
    one process share the model but not their caches.
    """

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        cfg = model.config
        self._linears: dict[str, cpu_kernels.SmallMatmulWeight] | None = None
        self._weights: torch.Tensor | None = None  # [L, 12] int64 addresses
        # The caches' addresses -> the full table; a few entries (one per engine in use).
        self._tables: dict[tuple[int, ...], torch.Tensor] = {}
        self._args = _StackArgs(
            hidden=cfg.hidden_size, num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
            intermediate=cfg.intermediate_size, eps=cfg.rms_norm_eps,
            scale=model.model.layers[0].self_attn.scale if len(model.model.layers) else 1.0,
            num_experts=cfg.num_experts,
            top_k=cfg.num_experts_per_tok, moe_intermediate=cfg.moe_intermediate_size,
            renormalize=int(cfg.norm_topk_prob))
        # MoE layers: per layer the C block's inputs (router, expert addresses and what they
        # point into), kept alive while the table holds their addresses.
        self._moe_kept: list[tuple] = []
        self._moe_entries: dict[int, tuple[int, int, int]] = {}
        self._moe_opts: list[cpu_kernels.MoeOpts] = []  # gpt-oss's, by address in the table
        self._sinks: list[torch.Tensor] = []  # gpt-oss's attention sinks as float32
        # Asked every step (applies): whether any layer is a mixture of experts.
        self._has_moe = any(isinstance(layer.mlp, FusedMoE) for layer in model.model.layers)
        # False once prepacking dropped the plain weights without a packed copy here, or
        # from the start for a model with a feature the C stack does not implement.
        missing = unsupported_features(model)
        self.refusal = ", ".join(missing) if missing else None
        self.available = self.refusal is None
        if self.refusal is not None:
            logger.info("small-batch path off for %s: the C stack has no %s",
                        cfg.architecture, self.refusal)
        # bfloat16 packs column pairs: every inner dimension must be even.
        self._even = all(d % 2 == 0 for d in (cfg.hidden_size, cfg.intermediate_size,
                                              cfg.num_attention_heads * cfg.head_dim))
        # Once pack() or applies() has seen the layers: "gguf" (every layer linear in GGUF
        # blocks), "plain" (every one an nn.Linear), "mixed" (Int8Linear or GGUFLinear
        # beside plain ones).
        self.mode: str | None = None
        # "mixed": the table's linear_t, kept alive (its experts' are in _moe_kept).
        self._descs: list[cpu_kernels.LinearDesc] = []
        self._default_tokens: dict[torch.dtype, int] = {}  # max_tokens' default per dtype

    def _layer_slots(self) -> list[tuple[str, torch.nn.Module, str]]:
        """(key, owner, attribute) of every layer's attention and dense MLP linears (a MoE
        layer's experts aside)."""
        out = []
        for i, layer in enumerate(self.model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            out += [(f"{i}.qkv", attn, "qkv_proj"), (f"{i}.o", attn, "o_proj")]
            if isinstance(mlp, GatedMLP):
                out += [(f"{i}.gate_up", mlp, "gate_up_proj"), (f"{i}.down", mlp, "down_proj")]
        return out

    def _layer_linears(self) -> list[tuple[str, torch.nn.Module]]:
        """Every layer's attention and dense MLP linears (a MoE layer's experts aside)."""
        return [(key, getattr(owner, name)) for key, owner, name in self._layer_slots()]

    def _moe_layers(self) -> list[tuple[int, FusedMoE]]:
        return [(i, layer.mlp) for i, layer in enumerate(self.model.model.layers)
                if isinstance(layer.mlp, FusedMoE)]

    def _mode(self) -> str | None:
        """"gguf": every layer linear (and expert) is in GGUF blocks; "plain": every one is
        a plain ``nn.Linear`` (and stacked float experts); "mixed": linears of more than one
        of those kinds or :class:`Int8Linear`, and any experts int8 or GGUF; None: another
        mix, which the stack cannot run."""
        if not all(isinstance(layer.mlp, GatedMLP | FusedMoE)
                   for layer in self.model.model.layers):
            return None
        kinds = {"gguf" if isinstance(m, GGUFLinear) else "int8"
                 if isinstance(m, Int8Linear) else "plain"
                 if isinstance(m, torch.nn.Linear | TileLinear) else None
                 for _, m in self._layer_linears()}
        kinds |= {"plain" if moe.quant_experts is None else "int8"
                  if isinstance(moe.quant_experts[0][0], Int8Linear) else "gguf"
                  for _, moe in self._moe_layers()}
        if None in kinds:
            return None
        if len(kinds) > 1 or "int8" in kinds:
            quant_experts = all(moe.quant_experts is not None for _, moe in self._moe_layers())
            return "mixed" if quant_experts else None
        return kinds.pop() if kinds else "plain"

    def can_run(self, dtype: torch.dtype) -> bool:
        """True if this path has a fast body for ``dtype`` and the model's linears."""
        mode = self._mode() if self.mode is None else self.mode
        if mode is None:
            return False
        return mode == "gguf" or cpu_kernels.small_matmul_is_fast(dtype)

    def max_tokens(self, dtype: torch.dtype) -> int:
        """The largest step this path takes: ``FORERUN_SMALL_BATCH_TOKENS`` if set; else 128
        for plain bfloat16 weights where the small matmul has its AVX512-BF16 body (register
        tiles past 8 rows, or AMX tiles), 64 for GGUF blocks where their tile kernel is
        512-bit (AVX512-VNNI: 8 activation rows per pass over a group held in L1; 16 streams
        of a 1B Q4_K_M decode 1.15-1.25x faster at 32 than at 8, one core), 32 for int8
        layers beside bfloat16 ones where both have their AVX-512 bodies and oneDNN has no
        AMX (:meth:`_int8_rows_fast`), and 8 otherwise (past 8 rows the float32 and other
        bodies read each weight again per few rows)."""
        limit = envs.small_batch_tokens()
        if limit is not None:
            return limit
        default = self._default_tokens.get(dtype)
        if default is None:  # asked every step
            if self.mode == "gguf":
                wide = cpu_kernels.quant_matmul_isa() == "avx512vnni"
                default = 64 if wide else 8
            else:
                tiles = (dtype == torch.bfloat16 and self.mode == "plain"
                         and cpu_kernels.small_matmul_is_fast(dtype))
                default = 128 if tiles else 32 if self._int8_rows_fast(dtype) else 8
            self._default_tokens[dtype] = default
        return default

    def _int8_rows_fast(self, dtype: torch.dtype) -> bool:
        """True for a dense model of int8 and bfloat16 linears where the int8 kernel has its
        AVX512-VNNI body, the bfloat16 one its register tiles, and oneDNN no AMX: one call
        saves the op-by-op path's per-op overhead (the 1B shape's 32-sequence decode step
        254 -> 185 ms on a 2-core Zen 4, with the row-major int8 body of the time)."""
        if (self.mode != "mixed" or self._has_moe or dtype != torch.bfloat16
                or not cpu_kernels.small_matmul_is_fast(dtype)
                or "AMX" in torch.backends.cpu.get_cpu_capability()):
            return False
        kinds = {type(m) for _, m in self._layer_linears()}
        return (Int8Linear in kinds and GGUFLinear not in kinds
                and cpu_kernels.int8_matmul_isa() == "avx512vnni")

    def applies(self, x: torch.Tensor) -> bool:
        """True if a step whose embeddings are ``x`` ``[T, hidden]`` takes this path."""
        if not (self.available and x.dim() == 2 and cpu_kernels.supports(x.dtype, x.device)):
            return False
        if self.mode is None:
            self.mode = self._mode()
            if self.mode is None:
                self.available = False
                return False
        if x.shape[0] > self.max_tokens(x.dtype):
            return False
        if self.mode == "gguf":
            return True
        return ((self._even or x.dtype == torch.float32)
                and cpu_kernels.small_matmul_is_fast(x.dtype))

    def pack(self) -> None:
        """Take every linear weight (and the output head) into the small matmul's form;
        needs the plain weights, so it runs before they are reordered for oneDNN."""
        if self._linears is not None:
            return
        if self.mode is None:
            self.mode = self._mode()
        # Before prepacking reorders the routers for oneDNN (their plain rows are read here).
        self._moe_entries = {i: self._moe_entry(moe) for i, moe in self._moe_layers()}
        linears: dict[str, cpu_kernels.SmallMatmulWeight] = {}
        if self.mode in ("plain", "mixed"):
            for key, module in self._layer_linears():
                if not isinstance(module, Int8Linear | GGUFLinear):
                    linears[key] = cpu_kernels.pack_small_matmul_weight(module.weight)
        if self.model.quant_head is None:
            head = self.model.lm_head
            linears["head"] = cpu_kernels.pack_small_matmul_weight(
                head.weight if head is not None else self.model.model.embed_tokens.weight)
        # A step streams these one after another: in huge pages it streams them at the rate
        # of one long read (see huge_pages.py). The bfloat16 copies and the GGUF blocks move
        # there; float32 reads the model's own weights, which a second copy would double.
        # The int8 linears' rows move there too (their own tensors: op by op reads the same).
        packed = [w for w in linears.values() if w.data.dtype == torch.bfloat16]
        owned: list[GGUFLinear | Int8Linear] = [
            m for _, m in self._layer_linears() if isinstance(m, GGUFLinear | Int8Linear)]
        if self.mode in ("gguf", "mixed") and isinstance(self.model.quant_head, GGUFLinear):
            owned.append(self.model.quant_head)
        # A MoE step reads a few experts of a few MiB each, chosen anew every token: in huge
        # pages each is one TLB entry or two, and the prefetchers run across its pages.
        owned += [lin for _, moe in self._moe_layers() if moe.quant_experts is not None
                  for pair in moe.quant_experts for lin in pair
                  if isinstance(lin, GGUFLinear)]
        # Module by module, each old copy freed once moved and the heap trimmed every
        # _TRIM_BYTES: moving all first held both copies (the 12-layer Qwen3-30B-A3B shape
        # in Q4_K_M peaked at 9.7 GiB for 4.4 GiB of blocks).
        total = sum(huge_pages.aligned_bytes(w.data) for w in packed) + sum(
            huge_pages.aligned_bytes(t) for m in owned for t in m.resident_tensors())
        if total:
            arena, moved = huge_pages.Arena(total), 0
            for item in [*packed, *owned]:
                if isinstance(item, GGUFLinear | Int8Linear):
                    new = [arena.copy(t) for t in item.resident_tensors()]
                    item.relocate(new)
                else:
                    new = [arena.copy(item.data)]
                    item.data = new[0]
                moved += sum(huge_pages.aligned_bytes(t) for t in new)
                if moved >= _TRIM_BYTES:
                    huge_pages.release_freed_memory()
                    moved = 0
            huge_pages.release_freed_memory()
        self._linears = linears

    def serves_every_step(self, dtype: torch.dtype) -> bool:
        """True where this path's packed copies are also the weights for steps past its size:
        plain bfloat16 linears on a CPU with the small matmul's AVX512-BF16 register tiles
        and no AMX, where its GEMM is level with oneDNN's from 32 rows on (on AMX oneDNN's
        tiles are faster, and keep their own reordered copy)."""
        return (dtype == torch.bfloat16 and self.mode == "plain" and self._linears is not None
                and "head" in self._linears and self._even and envs.cpu_bf16_tiles_enabled()
                and cpu_kernels.small_matmul_is_fast(dtype)
                and not cpu_kernels.small_matmul_has_amx())

    def tile_linears(self) -> dict[str, TileLinear]:
        """Every layer linear (and the output head, as ``"head"``) as a :class:`TileLinear`
        on this path's packed copy, swapped into the layers in place of the plain linears,
        so that the model keeps one copy of its weights; the head is the caller's to place
        (a tied head shares the embedding, which the lookup still needs as plain rows)."""
        assert self._linears is not None
        tiled = {"head": TileLinear(self._linears["head"], None)}
        for key, owner, name in self._layer_slots():
            tiled[key] = TileLinear(self._linears[key], getattr(owner, name).bias)
            setattr(owner, name, tiled[key])
        return tiled

    def resident_tensors(self) -> list[torch.Tensor]:
        """This path's own weight copies (none before :meth:`pack`, or with GGUF blocks)."""
        return [] if self._linears is None else [w.data for w in self._linears.values()]

    def streamed_bytes(self) -> int:
        """Bytes of linear weights (output head included) one step of this path reads."""
        self.pack()
        assert self._linears is not None
        total = sum(w.data.numel() * w.data.element_size() for w in self._linears.values())
        for _, m in self._layer_linears():
            if isinstance(m, GGUFLinear):
                total += sum(raw.numel() for raw in m.resident_tensors())
            elif isinstance(m, Int8Linear):  # rows and scales (the row sums read once each)
                total += m.weight_q.numel() + 4 * m.weight_scale.numel()
        head = self.model.quant_head
        if head is not None:
            total += sum(raw.numel() for raw in head.resident_tensors())
        return total

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of a few hidden rows through the packed output head."""
        self.pack()
        assert self._linears is not None
        return cpu_kernels.small_matmul(hidden.contiguous(), self._linears["head"], None).float()

    def _weight_table(self) -> torch.Tensor:
        if self._weights is None:
            self.pack()
            assert self._linears is not None
            if self.mode == "gguf":  # the GGUF linears' block descriptors
                w = {k: ctypes.addressof(m.desc) for k, m in self._layer_linears()}
            elif self.mode == "mixed":  # a linear_t per linear
                self._descs = [self._linear_desc(k, m) for k, m in self._layer_linears()]
                w = {k: ctypes.addressof(d)
                     for (k, _), d in zip(self._layer_linears(), self._descs, strict=True)}
            else:
                w = {k: _addr(v.data) for k, v in self._linears.items()}
            rows = []
            for i, layer in enumerate(self.model.model.layers):
                attn = layer.self_attn
                router, experts, opts = self._moe_entries.get(i, (0, 0, 0))
                sinks = 0
                if attn.sinks is not None:  # the kernel reads one float32 per query head
                    f32 = attn.sinks.detach().float().contiguous()
                    self._sinks.append(f32)
                    sinks = f32.data_ptr()
                rows.append([
                    _addr(layer.input_layernorm.weight),
                    w[f"{i}.qkv"],
                    _addr(attn.qkv_proj.bias),
                    _addr(attn.q_norm.weight if attn.q_norm is not None else None),
                    _addr(attn.k_norm.weight if attn.k_norm is not None else None),
                    w[f"{i}.o"],
                    _addr(attn.o_proj.bias),
                    _addr(layer.post_attention_layernorm.weight),
                    w.get(f"{i}.gate_up", 0),
                    w.get(f"{i}.down", 0),
                    0, 0,
                    router, experts,
                    self.model.config.layer_window(i) or 0,
                    0, 0,
                    sinks, opts,
                ])
            self._weights = torch.tensor(rows, dtype=torch.int64).reshape(
                -1, _NUM_LAYER_PTRS)
        return self._weights

    def _linear_desc(self, key: str, module: torch.nn.Module) -> cpu_kernels.LinearDesc:
        """``linear_t`` of one layer linear: its int8 rows, scales and row sums, its GGUF
        block descriptor, or the packed copy :meth:`pack` made."""
        if isinstance(module, GGUFLinear):
            return cpu_kernels.LinearDesc(kind=cpu_kernels.LIN_GGUF,
                                          w=ctypes.addressof(module.desc))
        if isinstance(module, Int8Linear):
            return cpu_kernels.LinearDesc(kind=cpu_kernels.LIN_INT8,
                                          w=module.weight_q.data_ptr(),
                                          scale=module.weight_scale.data_ptr(),
                                          wsum=module.weight_sum.data_ptr())
        assert self._linears is not None
        return cpu_kernels.LinearDesc(kind=cpu_kernels.LIN_PLAIN,
                                      w=self._linears[key].data.data_ptr())

    def _moe_entry(self, moe: FusedMoE) -> tuple[int, int, int]:
        """A MoE layer's table entries, as the layer's own C block reads them
        (:meth:`FusedMoE.c_inputs`): its router as float32 [E, H], each expert's gate/up and
        down weight (block descriptors, int8 ``linear_t``, or plain rows), and its
        :class:`cpu_kernels.MoeOpts` (gpt-oss; 0 for none)."""
        inputs = moe.c_inputs()
        assert inputs is not None, "_mode admits only experts the block takes"
        kind, router, experts, fields, keep = inputs
        # Int8 experts' rows stay where they are (not moved to huge pages), and GGUF ones
        # are read through their descriptors, which move with them: the addresses hold.
        self._moe_kept.append(inputs)
        if self.mode == "mixed" and kind == "gguf":  # the mixed stack reads linear_t
            descs = [cpu_kernels.LinearDesc(kind=cpu_kernels.LIN_GGUF, w=addr)
                     for addr in experts.tolist()]
            experts = torch.tensor([ctypes.addressof(d) for d in descs], dtype=torch.int64)
            self._moe_kept.append((descs, experts))
        opts = 0
        if fields is not None:
            self._moe_opts.append(cpu_kernels.MoeOpts(*fields))
            opts = ctypes.addressof(self._moe_opts[-1])
        return router.data_ptr(), experts.data_ptr(), opts

    def _layer_table(self, kv_caches: list[KVCache]) -> torch.Tensor:
        # Keyed by every address, not by object identity: a freed cache's memory can come
        # back as another engine's, layer by layer at different places.
        key = tuple(t.data_ptr() for kv in kv_caches for t in kv)
        table = self._tables.get(key)
        if table is None:
            table = self._weight_table().clone()
            for i, kv in enumerate(kv_caches):
                assert all(t.is_contiguous() for t in kv)
                table[i, 10] = kv[0].data_ptr()
                table[i, 11] = kv[1].data_ptr()
                if len(kv) == 4:  # a quantized cache's K and V scales
                    table[i, 15] = kv[2].data_ptr()
                    table[i, 16] = kv[3].data_ptr()
            if len(self._tables) >= _MAX_TABLES:
                self._tables.pop(next(iter(self._tables)))
            self._tables[key] = table
        return table

    def forward(self, x: torch.Tensor, cos_half: torch.Tensor, sin_half: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        """The final-normed hidden states ``[T, hidden]`` of embeddings ``x`` (overwritten)."""
        x = x.contiguous()
        table = self._layer_table(kv_caches)
        token_seq, token_len = meta.token_indices()
        block_tables = meta.block_tables
        if block_tables.stride(1) != 1:
            block_tables = block_tables.contiguous()
        cos_half, sin_half = cos_half.contiguous(), sin_half.contiguous()
        slot_mapping = meta.slot_mapping.contiguous()
        a = self._args
        a.block_size = meta.block_size
        a.kv_type = kv_quant.kind_code(kv_caches[0][0].dtype) if kv_caches else 0
        a.cos_half, a.sin_half = cos_half.data_ptr(), sin_half.data_ptr()
        a.slot_mapping, a.block_tables = slot_mapping.data_ptr(), block_tables.data_ptr()
        a.table_stride = block_tables.stride(0)
        a.token_seq, a.token_len = token_seq.data_ptr(), token_len.data_ptr()
        # Several KV cache groups: each layer's group's table and slots (kept alive here).
        keep, a.layer_tables = self._group_tables(meta, block_tables.stride(0))
        residual = torch.empty_like(x)
        final_norm = self.model.model.norm.weight
        stack = (cpu_kernels.decoder_stack_quantized if self.mode == "gguf"
                 else cpu_kernels.decoder_stack_mixed if self.mode == "mixed"
                 else cpu_kernels.decoder_stack)
        rc = stack(x.dtype)(
            table.shape[0], table.data_ptr(), _addr(final_norm), x.data_ptr(),
            residual.data_ptr(), x.shape[0], ctypes.addressof(a))
        del keep
        if rc != 0:
            raise MemoryError("the small-batch path could not allocate its scratch space")
        return x

    def _group_tables(self, meta: AttentionMetadata, stride: int
                      ) -> tuple[list[torch.Tensor], int | None]:
        """With several KV cache groups: the tensors to keep alive and the address of the
        ``[layers, 2]`` table of each layer's block table and slot mapping; else ([], None)."""
        if meta.layer_metas is None:
            return [], None
        keep: list[torch.Tensor] = []
        addrs: list[int] = []
        by_meta: dict[int, tuple[int, int]] = {}
        for i in range(len(meta.layer_metas)):
            m = meta.for_layer(i)
            pair = by_meta.get(id(m))
            if pair is None:
                tables, slots = m.block_tables.contiguous(), m.slot_mapping.contiguous()
                # Every group's table has one entry per block of each sequence: one width.
                assert tables.stride(0) == stride, (tables.shape, stride)
                keep += [tables, slots]
                pair = by_meta[id(m)] = (tables.data_ptr(), slots.data_ptr())
            addrs += pair
        table = torch.tensor(addrs, dtype=torch.int64)
        keep.append(table)
        return keep, table.data_ptr()
