"""Builds and loads forerun's C kernels for the CPU: paged attention, the KV cache write,
the fused elementwise ops of a decoder layer (residual add + RMSNorm, SiLU-and-multiply,
rotary) and the sampler's row kernels (argmax, random sampling).

The kernels (``csrc/*.c``) are plain C with OpenMP, compiled on first use by the system C
compiler (``$CC``, default ``cc``) for the machine at hand (``-march=native``) and loaded with
``ctypes``, which releases the GIL for the call. The shared object is kept under
``<cache>/kernels/`` keyed by the source, the flags, the compiler and the CPU, so the
compile (the files in parallel, one per core) happens once per machine. If no compiler is available or the build
fails, a warning is logged once and the model falls back to its pure-torch path, which
computes the same functions. ``FORERUN_CPU_KERNELS=0`` forces that fallback.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from forerun import envs
from forerun.model import kv_quant
from forerun.model.cache import cache_root

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = sorted(_CSRC.glob("*.c"))
_HEADERS = sorted(_CSRC.glob("*.h"))
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
# GCC vectorizes with 256-bit registers even where AVX-512 exists. 512-bit ones made the
# auto-vectorized elementwise kernels over a prefill step's activations 1.3-1.4x faster
# (RMSNorm 0.56 -> 0.42 ms, SiLU-and-multiply 1.50 -> 1.08 ms at 2048 tokens of SmolLM2 on a
# 2-core CPU; the bf16 bodies written with AVX512-BF16 since: 0.17 and 0.74 ms); the decode
# kernels showed no gain, so they keep the default.
_FILE_FLAGS = {"elementwise.c": ["-mprefer-vector-width=512"]}
# Linked in a separate step without -ffast-math: with it, GCC links crtfastmath.o, whose
# constructor turns on flush-to-zero and denormals-are-zero for the whole process when the
# library loads, silently changing the float results of everything else in it.
_LINK_FLAGS = ["-fopenmp", "-shared"]
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}
_bf16_fast: bool | None = None  # small_matmul_is_fast(bfloat16), once known
_amx: bool | None = None  # small_matmul_has_amx(), once known
_prompt_attention: bool | None = None  # prompt_attention_available(), once known

_DTYPE_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p


def _cpu_identity() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str, out_dir: Path) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=False).stdout
    key = hashlib.sha256(
        "\0".join([*(src.read_text() for src in [*_SOURCES, *_HEADERS]), " ".join(_FLAGS),
                   repr(sorted(_FILE_FLAGS.items())),
                   " ".join(_LINK_FLAGS), version,
                   _cpu_identity(), platform.machine()]).encode()
    ).hexdigest()[:16]
    target = out_dir / f"forerun_kernels-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    with tempfile.TemporaryDirectory(dir=out_dir) as obj_dir:
        try:
            objects = compile_objects(compiler, _FLAGS, _SOURCES, Path(obj_dir))
            _run([compiler, *_LINK_FLAGS, "-o", tmp, *objects, "-lm"])
            os.replace(tmp, target)  # atomic: a concurrent builder never sees half a file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    logger.info("compiled %s -> %s", ", ".join(src.name for src in _SOURCES), target)
    return target


def compile_objects(compiler: str, flags: list[str], sources: list[Path],
                    obj_dir: Path, suffix: str = "") -> list[str]:
    """Compile each of ``sources`` to ``obj_dir/<stem><suffix>.o`` with ``flags`` (plus its
    :data:`_FILE_FLAGS`), one compiler process per core at a time; returns the objects in
    the order of ``sources``. Raises RuntimeError with the compiler's message on failure."""
    objects = [str(obj_dir / f"{src.stem}{suffix}.o") for src in sources]
    commands = [[compiler, *flags, *_FILE_FLAGS.get(src.name, []), "-c", str(src), "-o", obj]
                for src, obj in zip(sources, objects, strict=True)]
    # The compiles are independent and each uses one core: on 2 cores the first-use build
    # of every kernel file takes about half the time this way.
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        for _ in pool.map(_run, commands):
            pass
    return objects


def build_library(sources: list[Path], target: Path, march: str = "native",
                  suffix: str = "") -> ctypes.CDLL:
    """``sources`` alone (each with the headers beside it), compiled as the kernel library
    is but with ``-march=<march>``, objects named ``<stem><suffix>.o`` beside ``target``,
    linked into ``target`` and loaded (its entry points untyped): the tests' builds for
    other instruction sets, and a benchmark's build of another source tree."""
    compiler = envs.c_compiler()
    flags = [f if f != "-march=native" else f"-march={march}" for f in _FLAGS]
    objects = compile_objects(compiler, flags, sources, target.parent, suffix)
    _run([compiler, *_LINK_FLAGS, "-o", str(target), *objects, "-lm"])
    return ctypes.CDLL(str(target))


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip()[-2000:])


def _load() -> ctypes.CDLL | None:
    if not envs.cpu_kernels_enabled():
        logger.info("FORERUN_CPU_KERNELS=0: the model uses its pure-torch path")
        return None
    compiler = envs.c_compiler()
    if shutil.which(compiler) is None:
        logger.warning("no C compiler (%s) found: the model uses its slower pure-torch "
                       "path", compiler)
        return None
    root = cache_root()
    out_dir = (root if root is not None else Path(tempfile.gettempdir()) / "forerun") / "kernels"
    try:
        lib = ctypes.CDLL(str(_build(compiler, out_dir)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("could not build the CPU kernels, using the pure-torch path: %s", exc)
        return None
    for suffix in _DTYPE_SUFFIX.values():
        for name, args in (("paged_attention", [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr,
                                                _ptr, _i64, _i64, _i64, _i64, _i64,
                                                ctypes.c_float, _i64, ctypes.c_float, _ptr]),
                           ("rms_norm", [_ptr, _ptr, _ptr, _i64, _i64, ctypes.c_float]),
                           ("silu_and_mul", [_ptr, _ptr, _i64, _i64]),
                           ("gelu_tanh_and_mul", [_ptr, _ptr, _i64, _i64]),
                           ("rotary", [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr]),
                           ("small_matmul", [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64]),
                           ("decoder_stack", [_i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr]),
                           ("decoder_stack_q", [_i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr]),
                           ("decoder_stack_l", [_i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr])):
            fn = getattr(lib, f"{name}_{suffix}")
            fn.restype = ctypes.c_int
            fn.argtypes = args
    moe_args = [_ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr]
    for name in ("moe_block_f32", "moe_block_bf16", "moe_block_q_f32", "moe_block_q_bf16",
                 "moe_block_l_f32", "moe_block_l_bf16"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = moe_args
    lib.rowmajor_matmul_bf16.restype = ctypes.c_int
    lib.rowmajor_matmul_bf16.argtypes = [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64]
    lib.rowmajor_matmul_amx_set.restype = ctypes.c_int
    lib.rowmajor_matmul_amx_set.argtypes = [ctypes.c_int]
    bind_gguf_kernels(lib)
    bind_int8_kernels(lib)
    bind_prompt_attention(lib)
    lib.kv_cache_write.restype = ctypes.c_int
    lib.kv_cache_write.argtypes = [_ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64,
                                   _i64]
    lib.kv_cache_write_kvq.restype = ctypes.c_int
    lib.kv_cache_write_kvq.argtypes = [_ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64,
                                       _i64, _i64, _i64, _i64, _i64]
    lib.paged_attention_kvq.restype = ctypes.c_int
    lib.paged_attention_kvq.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64,
                                        _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64,
                                        ctypes.c_float, _i64, ctypes.c_float, _ptr, _i64]
    lib.argmax_rows_f32.restype = ctypes.c_int
    lib.argmax_rows_f32.argtypes = [_ptr, _ptr, _i64, _i64]
    lib.small_matmul_bf16_is_fast.restype = ctypes.c_int
    lib.small_matmul_bf16_is_fast.argtypes = []
    lib.small_matmul_amx_bf16.restype = ctypes.c_int
    lib.small_matmul_amx_bf16.argtypes = [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64]
    lib.sample_rows_f32.restype = ctypes.c_int
    lib.sample_rows_f32.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr]
    lib.cpu_amx_set.restype = ctypes.c_int
    lib.cpu_amx_set.argtypes = [ctypes.c_int]
    if not envs.cpu_amx_enabled():
        lib.cpu_amx_set(0)
        logger.info("FORERUN_CPU_AMX=0: the C kernels run as on a CPU without AMX")
    return lib


def kernel_library() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on first use; None where it is unavailable."""
    if "lib" in _loaded:  # the per-layer fast path: no lock once decided
        return _loaded["lib"]
    with _lock:
        if "lib" not in _loaded:
            _loaded["lib"] = _load()
        return _loaded["lib"]


def supports(dtype: torch.dtype, device: torch.device) -> bool:
    """True if the C kernels can run for tensors of this dtype on this device."""
    return device.type == "cpu" and dtype in _DTYPE_SUFFIX and kernel_library() is not None


def _fn(name: str, dtype: torch.dtype) -> ctypes._CFuncPtr:
    lib = kernel_library()
    assert lib is not None, "call supports() first"
    return getattr(lib, f"{name}_{_DTYPE_SUFFIX[dtype]}")


def rms_norm_(x: torch.Tensor, weight: torch.Tensor, eps: float,
              residual: torch.Tensor | None = None) -> None:
    """In place over the last dimension of contiguous ``x``; with ``residual`` (same shape,
    contiguous), first ``residual += x`` and then ``x = rms_norm(residual)``."""
    dim = x.shape[-1]
    assert x.is_contiguous() and weight.is_contiguous() and weight.dtype == x.dtype
    if residual is not None:
        assert residual.is_contiguous() and residual.shape == x.shape
    _fn("rms_norm", x.dtype)(x.data_ptr(), None if residual is None else residual.data_ptr(),
                             weight.data_ptr(), x.numel() // dim, dim, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[..., :d]) * gate_up[..., d:]`` for contiguous ``gate_up`` ``[..., 2d]``."""
    return _act_and_mul("silu_and_mul", gate_up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate_up[..., :d], approximate="tanh") * gate_up[..., d:]`` (GeGLU), as
    :func:`silu_and_mul`; in bf16 the product is rounded once, not after the GELU too."""
    return _act_and_mul("gelu_tanh_and_mul", gate_up)


def _act_and_mul(name: str, gate_up: torch.Tensor) -> torch.Tensor:
    gate_up = gate_up.contiguous()
    d = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], d)
    _fn(name, gate_up.dtype)(gate_up.data_ptr(), out.data_ptr(), out.numel() // d, d)
    return out


def rotary_(x: torch.Tensor, cos_half: torch.Tensor, sin_half: torch.Tensor) -> None:
    """Rotate ``x`` ``[T, heads, head_dim]`` in place (heads contiguous inside a token's row,
    which may be a strided view into a wider row); ``cos_half``/``sin_half`` float32
    ``[T, head_dim / 2]``."""
    t, heads, d = x.shape
    assert x.stride(2) == 1 and x.stride(1) == d, "heads must be contiguous within a row"
    assert cos_half.dtype == torch.float32 and cos_half.is_contiguous()
    assert sin_half.is_contiguous() and cos_half.shape == (t, d // 2)
    _fn("rotary", x.dtype)(x.data_ptr(), t, heads, x.stride(0), d, cos_half.data_ptr(),
                           sin_half.data_ptr())


def _check_rows(x: torch.Tensor) -> None:
    # [T, heads, head_dim] with heads contiguous inside a token's row (a view into the fused
    # qkv output qualifies); tokens may be any number of elements apart.
    assert x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2], "bad row layout"


PROMPT_ATTENTION_SOURCES = ("prompt_attention.c",)


def bind_prompt_attention(lib: ctypes.CDLL) -> None:
    """Type csrc/prompt_attention.c's entry points in ``lib`` (the engine's library, or a
    test's build of :data:`PROMPT_ATTENTION_SOURCES` alone for another instruction set)."""
    lib.prompt_attention_available.restype = ctypes.c_int
    lib.prompt_attention_available.argtypes = []
    lib.prompt_attention_bf16.restype = ctypes.c_int
    lib.prompt_attention_bf16.argtypes = [_ptr, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr,
                                          _i64, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _i64]


def has_prompt_attention(dtype: torch.dtype) -> bool:
    """Whether :func:`prompt_attention` runs for ``dtype`` on this CPU (bfloat16 where the
    build has AVX512-BF16)."""
    global _prompt_attention
    if dtype != torch.bfloat16:
        return False
    if _prompt_attention is None:
        lib = kernel_library()
        _prompt_attention = lib is not None and lib.prompt_attention_available() == 1
    return _prompt_attention


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_prompts: int,
                     n_q: int, n_k: int, scale: float, window: int | None = None
                     ) -> torch.Tensor:
    """Causal attention of ``n_prompts`` prompt chunks over dense K/V (csrc/prompt_attention.c).

    ``q`` ``[n_prompts * n_q, H, D]`` with heads contiguous within a token (any token
    stride), ``k`` and ``v`` ``[n_prompts * n_k, KVH, D]`` with any token and head strides,
    bfloat16, each token's ``D`` values contiguous; chunk ``c``'s query ``i`` sits at
    position ``n_k - n_q + i`` and sees its chunk's keys ``0 .. n_k - n_q + i`` (with a
    ``window``, only the last ``window`` of them). Returns
    ``[n_prompts * n_q, H, D]`` contiguous; raises ValueError for a shape the kernel does
    not take (check :func:`has_prompt_attention` first)."""
    _check_rows(q)
    assert k.stride(2) == 1 and v.stride(2) == 1, "bad row layout"
    t, num_heads, d = q.shape
    assert t == n_prompts * n_q and k.shape[0] == v.shape[0] == n_prompts * n_k
    out = q.new_empty(t, num_heads, d)
    rc = kernel_library().prompt_attention_bf16(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(),
        v.stride(0), v.stride(1), out.data_ptr(), n_prompts, n_q, n_k, num_heads, k.shape[1], d,
        scale, window or 0)
    if rc == -2:
        raise ValueError(f"prompt attention: unsupported shape q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}")
    if rc != 0:
        raise MemoryError("prompt attention could not allocate its scratch space")
    return out


def kv_cache_write(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor,
                   kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Store ``k``/``v`` ``[T, KVH, D]`` in the cache slots ``slot_mapping`` ``[T]`` int64;
    caches as :func:`forerun.model.attention.new_kv_cache` lays them out (a quantized one
    with its ``kv_scales``, updated as docs/kv_cache.md "Quantized KV" says)."""
    _check_rows(k)
    _check_rows(v)
    assert k.stride(0) == v.stride(0) and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
    t, kvh, d = k.shape
    lib = kernel_library()
    assert lib is not None, "call supports() first"
    if kv_scales is not None:
        ks, vs = kv_scales
        assert k.dtype == v.dtype and k_cache.dtype == v_cache.dtype
        assert ks.dtype == vs.dtype == torch.float32 and ks.is_contiguous() and vs.is_contiguous()
        rc = lib.kv_cache_write_kvq(k.data_ptr(), v.data_ptr(), k.stride(0),
                                    slot_mapping.data_ptr(), k_cache.data_ptr(),
                                    v_cache.data_ptr(), ks.data_ptr(), vs.data_ptr(), t, kvh,
                                    v_cache.shape[2], d, int(k.dtype == torch.bfloat16),
                                    kv_quant.kind_code(k_cache.dtype))
        if rc != 0:
            raise ValueError(f"kv_cache_write: unsupported cache dtype {k_cache.dtype}")
        return
    assert k.dtype == v.dtype == k_cache.dtype == v_cache.dtype
    rc = lib.kv_cache_write(k.data_ptr(), v.data_ptr(), k.stride(0), slot_mapping.data_ptr(),
                            k_cache.data_ptr(), v_cache.data_ptr(), t, kvh, v_cache.shape[2], d,
                            k.element_size())
    if rc != 0:
        raise ValueError(f"kv_cache_write: unsupported dtype {k.dtype}")


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, token_seq: torch.Tensor, token_len: torch.Tensor,
    scale: float, out: torch.Tensor | None = None, window: int | None = None,
    softcap: float | None = None, sinks: torch.Tensor | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of every query token over its sequence's paged context.

    ``q`` ``[T, H, D]`` (heads contiguous within a row); caches as
    :func:`forerun.model.attention.new_kv_cache` lays them out; ``block_tables`` ``[S, W]`` int64; for each token,
    ``token_seq`` ``[T]`` is its row in ``block_tables`` and ``token_len`` ``[T]`` the number
    of context positions it attends to (its position + 1). A ``window`` keeps only the last
    ``window`` of those (a sliding-window layer; blocks before it are not read), and
    ``softcap`` caps each scaled score as ``softcap * tanh(score / softcap)``; ``sinks``
    ``[H]`` (gpt-oss) adds ``exp(sinks[h])`` to head ``h``'s softmax denominator. Returns
    ``[T, H, D]`` contiguous (written into ``out`` when given). A quantized cache comes
    with its ``kv_scales`` (K, V) ``[num_blocks, KVH]`` float32, and is dequantized inside
    the kernel's dot products.
    """
    _check_rows(q)
    t, num_heads, d = q.shape
    _, kvh, bs, _ = v_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    assert token_seq.is_contiguous() and token_len.is_contiguous()
    if out is None:
        out = q.new_empty(t, num_heads, d)
    assert out.is_contiguous() and out.shape == q.shape and out.dtype == q.dtype
    if sinks is not None:  # the kernel reads one float32 per query head
        sinks = sinks.detach().float().contiguous()
        assert sinks.shape == (num_heads,)
    if kv_scales is not None:
        ks, vs = kv_scales
        assert ks.is_contiguous() and vs.is_contiguous() and ks.dtype == torch.float32
        assert q.dtype in _DTYPE_SUFFIX
        rc = kernel_library().paged_attention_kvq(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), ks.data_ptr(),
            vs.data_ptr(), kv_quant.kind_code(k_cache.dtype), block_tables.data_ptr(),
            block_tables.stride(0), token_seq.data_ptr(), token_len.data_ptr(),
            out.data_ptr(), t, num_heads, kvh, bs, d, scale, window or 0, softcap or 0.0,
            None if sinks is None else sinks.data_ptr(), int(q.dtype == torch.bfloat16))
        if rc == -2:
            raise ValueError(f"paged attention: unsupported cache dtype {k_cache.dtype}")
        if rc != 0:
            raise MemoryError("paged attention could not allocate its scratch space")
        return out
    rc = _fn("paged_attention", q.dtype)(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), token_seq.data_ptr(),
        token_len.data_ptr(), out.data_ptr(), t, num_heads, kvh, bs, d, scale, window or 0,
        softcap or 0.0, None if sinks is None else sinks.data_ptr())
    if rc != 0:
        raise MemoryError("paged attention could not allocate its scratch space")
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for a contiguous 2-D float32 tensor without NaN (first index of
    the maximum, like torch)."""
    assert x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _fn("argmax_rows", torch.float32)(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1])
    return out


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor, min_p: torch.Tensor, uniforms: torch.Tensor
                ) -> torch.Tensor:
    """One token per row of contiguous float32 ``logits`` ``[S, V]``: argmax where
    ``temperature`` is 0, else an inverse-CDF draw at ``uniforms`` (float64 in [0, 1)) from
    the softmax at that temperature restricted by ``min_p`` (0 = off), ``top_k`` (int64,
    0 = off) and ``top_p`` (1 = off). Every per-row tensor is contiguous ``[S]`` float32
    unless said otherwise."""
    assert logits.dim() == 2 and logits.dtype == torch.float32 and logits.is_contiguous()
    rows, vocab = logits.shape
    for t, dt in ((temperature, torch.float32), (top_k, torch.int64), (top_p, torch.float32),
                  (min_p, torch.float32), (uniforms, torch.float64)):
        assert t.dtype == dt and t.is_contiguous() and t.shape == (rows,), t
    out = torch.empty(rows, dtype=torch.int64)
    lib = kernel_library()
    assert lib is not None, "call supports() first"
    rc = lib.sample_rows_f32(logits.data_ptr(), rows, vocab, temperature.data_ptr(),
                             top_k.data_ptr(), top_p.data_ptr(), min_p.data_ptr(),
                             uniforms.data_ptr(), out.data_ptr())
    if rc != 0:
        raise MemoryError("sampling could not allocate its scratch space")
    return out


def small_matmul_is_fast(dtype: torch.dtype) -> bool:
    """True if :func:`small_matmul` has a vectorised body for ``dtype`` on this CPU (float32
    always; bfloat16 where the CPU has AVX512-BF16)."""
    if dtype == torch.float32:
        return True
    if dtype != torch.bfloat16:
        return False
    global _bf16_fast
    if _bf16_fast is None:  # asked every step: one ctypes call per process
        lib = kernel_library()
        _bf16_fast = lib is not None and lib.small_matmul_bf16_is_fast() == 1
    return _bf16_fast


def decoder_stack(dtype: torch.dtype) -> ctypes._CFuncPtr:
    """The C entry that runs every decoder layer of a small step (see
    :mod:`forerun.model.small_batch`, which builds its arguments)."""
    return _fn("decoder_stack", dtype)


def decoder_stack_quantized(dtype: torch.dtype) -> ctypes._CFuncPtr:
    """The decoder stack over GGUF block descriptors (quantization="gguf")."""
    return _fn("decoder_stack_q", dtype)


class LinearDesc(ctypes.Structure):
    """``linear_t`` of decoder_stack.c: a linear of a plain (small matmul's form), an int8
    (``LIN_INT8``: int8 rows, per-row scales and row sums) or a GGUF kind (``LIN_GGUF``: the
    blocks' :class:`QWeightDesc`), for the stack's mixed linears and the MoE block's
    experts among them."""

    _fields_ = [("kind", ctypes.c_int64), ("w", ctypes.c_void_p),
                ("scale", ctypes.c_void_p), ("wsum", ctypes.c_void_p)]


LIN_PLAIN, LIN_INT8, LIN_GGUF = 0, 1, 2  # linear_t's kinds


def rowmajor_matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for contiguous bfloat16 ``x [m, k]`` and ``w [n, k]`` as stored
    (csrc/rowmajor_bf16.c: the MoE block's plain bfloat16 experts)."""
    lib = kernel_library()
    assert lib is not None, "call supports() first"
    assert x.dtype == w.dtype == torch.bfloat16 and x.is_contiguous() and w.is_contiguous()
    out = x.new_empty(x.shape[0], w.shape[0])
    rc = lib.rowmajor_matmul_bf16(x.data_ptr(), w.data_ptr(),
                                  None if bias is None else bias.contiguous().data_ptr(),
                                  out.data_ptr(), x.shape[0], w.shape[0], x.shape[1])
    if rc != 0:
        raise MemoryError(f"rowmajor_matmul_bf16 failed ({rc})")
    return out


def set_cpu_amx(enabled: bool) -> bool:
    """Let every AMX body of the kernel library run where the CPU has AMX, or none of them
    (the paths a CPU without AMX takes; ``FORERUN_CPU_AMX=0`` at load); returns the
    previous setting (False where the library has no AMX bodies)."""
    global _amx
    lib = kernel_library()
    assert lib is not None, "call supports() first"
    previous = bool(lib.cpu_amx_set(int(enabled)))
    _amx = None  # small_matmul_has_amx() asks again
    return previous


def set_rowmajor_amx(enabled: bool) -> bool:
    """Let :func:`rowmajor_matmul` take its AMX body (many rows, where the CPU has AMX) or
    not (the dot-product body every CPU runs); returns the previous setting."""
    lib = kernel_library()
    assert lib is not None, "call supports() first"
    return bool(lib.rowmajor_matmul_amx_set(int(enabled)))


class MoeOpts(ctypes.Structure):
    """``moe_opts_t`` of csrc/moe_opts.h: gpt-oss's additions to a MoE layer (router bias,
    softmax over the top k, expert biases, the clamped SwiGLU); pointers are addresses."""

    _fields_ = [("router_bias", ctypes.c_void_p), ("softmax_over_top_k", ctypes.c_int64),
                ("b13", ctypes.c_void_p), ("b2", ctypes.c_void_p),
                ("swiglu_alpha", ctypes.c_float), ("swiglu_limit", ctypes.c_float)]


def moe_block(kind: str, x: torch.Tensor, out: torch.Tensor, num_experts: int, top_k: int,
              intermediate: int, renormalize: bool, router: torch.Tensor,
              experts: torch.Tensor, opts: MoeOpts | None = None) -> None:
    """``out [t, H]`` = the MoE MLP of contiguous ``x [t, H]`` by csrc/moe_block.c: routing
    by the float32 ``router [E, H]`` rows, every chosen expert over its tokens' rows.
    ``experts`` int64 ``[2E]``: expert e's gate/up and down weight addresses, of ``kind``
    ``"plain"`` (rows of ``x``'s type), ``"gguf"`` (block descriptors) or ``"mixed"``
    (:class:`LinearDesc`); ``opts`` what the layer adds (gpt-oss), whose tensors the caller
    keeps alive."""
    name = {"plain": "moe_block", "gguf": "moe_block_q", "mixed": "moe_block_l"}[kind]
    rc = _fn(name, x.dtype)(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], num_experts,
                            top_k, intermediate, int(renormalize), router.data_ptr(),
                            experts.data_ptr(), None if opts is None else ctypes.addressof(opts))
    if rc != 0:
        raise MemoryError(f"{name} failed ({rc})")


def decoder_stack_mixed(dtype: torch.dtype) -> ctypes._CFuncPtr:
    """The decoder stack over per-linear descriptors (``linear_t``: plain or int8;
    quantization="int8")."""
    return _fn("decoder_stack_l", dtype)


@dataclass(slots=True)
class SmallMatmulWeight:
    """A linear weight ``[n, k]`` as :func:`small_matmul` reads it: the plain tensor in
    float32; in bfloat16 a copy packed for AVX512-BF16 dot products,
    ``[ceil(n / 16), k / 2, 16, 2]`` (see csrc/small_matmul.c)."""

    data: torch.Tensor
    n: int
    k: int


def pack_small_matmul_weight(weight: torch.Tensor) -> SmallMatmulWeight:
    """The form of ``weight`` ``[n, k]`` that :func:`small_matmul` reads (bfloat16 needs an
    even ``k``)."""
    n, k = weight.shape
    if weight.dtype != torch.bfloat16:
        return SmallMatmulWeight(weight.detach().contiguous(), n, k)
    if k % 2:
        raise ValueError(f"bfloat16 small matmul needs an even inner dimension, got {k}")
    blocks = -(-n // 16)
    padded = weight.new_zeros(blocks * 16, k)
    padded[:n] = weight.detach()
    data = padded.view(blocks, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return SmallMatmulWeight(data, n, k)


def small_matmul(x: torch.Tensor, weight: SmallMatmulWeight,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` for contiguous ``x`` ``[..., k]`` with few rows, streaming the
    weight once for all rows (in bfloat16 on AMX tiles past 8 rows, where the CPU has them)."""
    return _small_matmul_call("small_matmul", x, weight, bias)


def _small_matmul_call(entry: str, x: torch.Tensor, weight: SmallMatmulWeight,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """``entry`` (``small_matmul``, or ``small_matmul_amx``: the AMX body or an error) run."""
    k, n = weight.k, weight.n
    assert x.is_contiguous() and x.shape[-1] == k and x.dtype == weight.data.dtype
    assert bias is None or bias.dtype == x.dtype
    out = x.new_empty(*x.shape[:-1], n)
    fn = _fn(entry, x.dtype)
    rc = fn(x.data_ptr(), weight.data.data_ptr(), None if bias is None else bias.data_ptr(),
            out.data_ptr(), x.numel() // k, n, k)
    if rc == -2:
        raise RuntimeError("the AMX body of the small matmul cannot run here")
    if rc != 0:
        raise MemoryError("small matmul could not allocate its scratch space")
    return out


def small_matmul_has_amx() -> bool:
    """True where the bfloat16 small matmul runs batches of more than 8 rows on AMX tiles
    (built with AMX, and the kernel grants the tile state), reading each weight once."""
    global _amx
    if _amx is None:
        _amx = False
        if kernel_library() is not None and small_matmul_is_fast(torch.bfloat16):
            w = pack_small_matmul_weight(torch.ones(16, 32, dtype=torch.bfloat16))
            try:
                y = _small_matmul_call("small_matmul_amx",
                                       torch.ones(16, 32, dtype=torch.bfloat16), w, None)
                _amx = bool((y == 32).all())
            except RuntimeError:
                pass
    return _amx


# ---- GGUF blocks (csrc/gguf_matmul.c, quant_matmul.c) ------------------------------------
QUANT_MAX_PARTS = 4  # QW_MAXPARTS in csrc/qweight.h
# The files of the GGUF matmul, which a test may build alone for another instruction set.
GGUF_SOURCES = ("gguf_matmul.c", "quant_matmul.c", "quant_amx.c", "ktile_gemm.c")


class QWeightDesc(ctypes.Structure):
    """``qweight_t`` of csrc/qweight.h: a linear weight as row ranges of GGUF blocks."""

    _fields_ = [("nparts", ctypes.c_int64), ("type", ctypes.c_int64 * QUANT_MAX_PARTS),
                ("rows", ctypes.c_int64 * QUANT_MAX_PARTS),
                ("data", ctypes.c_void_p * QUANT_MAX_PARTS)]


def bind_gguf_kernels(lib: ctypes.CDLL) -> None:
    """Declare the signatures of the GGUF-block kernels on a loaded library (the kernel
    library, or a test's build of :data:`GGUF_SOURCES` alone for another instruction set)."""
    for suffix in (*_DTYPE_SUFFIX.values(), "bf16_f32"):
        fn = getattr(lib, f"gguf_matmul_{suffix}")
        fn.restype = ctypes.c_int
        fn.argtypes = [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64]
    for suffix in _DTYPE_SUFFIX.values():
        fn = getattr(lib, f"int8_quantize_rows_{suffix}")
        fn.restype = ctypes.c_int
        fn.argtypes = [_ptr, _ptr, _ptr, _i64, _i64]
        fn = getattr(lib, f"int8_dequant_{suffix}")
        fn.restype = ctypes.c_int
        fn.argtypes = [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64]
    lib.quant_matmul_isa.restype = ctypes.c_int
    lib.quant_matmul_isa.argtypes = []
    lib.quant_matmul_amx_set.restype = ctypes.c_int
    lib.quant_matmul_amx_set.argtypes = [ctypes.c_int]


def set_gguf_amx(enabled: bool, lib: ctypes.CDLL | None = None) -> bool:
    """Let the GGUF matmul take its AMX path (csrc/quant_amx.c: bfloat16, many rows, the
    weight dequantized to bfloat16 tiles) where the CPU has AMX, or not (the integer bodies
    every CPU runs); returns the previous setting."""
    lib = lib or kernel_library()
    assert lib is not None, "call supports() first"
    return bool(lib.quant_matmul_amx_set(int(enabled)))


def gguf_matmul(x: torch.Tensor, desc: QWeightDesc, n: int, bias: torch.Tensor | None,
                lib: ctypes.CDLL | None = None, out_dtype: torch.dtype | None = None
                ) -> torch.Tensor:
    """``x @ W.T + bias`` for contiguous ``x`` ``[..., k]`` (float32 or bfloat16), ``W``
    ``[n, k]`` the GGUF blocks ``desc`` points to (parts of any natively run type), in
    ``x``'s dtype, or float32 from bfloat16 ``x`` where ``out_dtype`` says so (the bias then
    float32 too)."""
    lib = lib or kernel_library()
    assert lib is not None, "call supports() first"
    k = x.shape[-1]
    out_dtype = out_dtype or x.dtype
    assert out_dtype == x.dtype or (x.dtype, out_dtype) == (torch.bfloat16, torch.float32)
    assert x.is_contiguous() and (bias is None or bias.dtype == out_dtype)
    out = x.new_empty(*x.shape[:-1], n, dtype=out_dtype)
    suffix = _DTYPE_SUFFIX[x.dtype] if out_dtype == x.dtype else "bf16_f32"
    rc = getattr(lib, f"gguf_matmul_{suffix}")(
        x.data_ptr(), ctypes.addressof(desc), None if bias is None else bias.data_ptr(),
        out.data_ptr(), x.numel() // k, n, k)
    if rc == -1:
        raise MemoryError("GGUF matmul could not allocate its scratch space")
    if rc != 0:
        raise ValueError("GGUF matmul: unsupported block type or shape")
    return out


_ISA_NAMES = {3: "avx512vnni", 2: "vnni", 1: "avx2"}


def quant_matmul_isa(lib: ctypes.CDLL | None = None) -> str:
    """Which body the tile kernel (csrc/quant_matmul.c: every native GGUF type) was built
    with: ``avx512vnni``, ``vnni`` (256-bit: AVX-VNNI), ``avx2`` or ``c``."""
    lib = lib or kernel_library()
    assert lib is not None, "call supports() first"
    return _ISA_NAMES.get(lib.quant_matmul_isa(), "c")


def int8_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row int8 of contiguous 2-D ``x``: ``(q int8 [m, k], s float32 [m])`` with
    ``x ~ q * s``, ``s = max|row| / 127``, rounded to nearest even."""
    m, k = x.shape
    assert x.is_contiguous()
    q = torch.empty(m, k, dtype=torch.int8)
    s = torch.empty(m, dtype=torch.float32)
    _fn("int8_quantize_rows", x.dtype)(x.data_ptr(), q.data_ptr(), s.data_ptr(), m, k)
    return q, s


def int8_dequant(acc: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor,
                 bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``acc * sx[:, None] * sw[None, :] + bias`` in ``dtype``, for int32 ``acc`` ``[m, n]``."""
    m, n = acc.shape
    assert acc.is_contiguous() and acc.dtype == torch.int32
    assert bias is None or bias.dtype == dtype
    y = torch.empty(m, n, dtype=dtype)
    _fn("int8_dequant", dtype)(acc.data_ptr(), sx.data_ptr(), sw.data_ptr(),
                               None if bias is None else bias.data_ptr(), y.data_ptr(), m, n)
    return y


def bind_int8_kernels(lib: ctypes.CDLL) -> None:
    """Declare the signatures of the int8 matmul (csrc/int8_matmul.c) on a loaded library
    (the kernel library, or a test's build of int8_matmul.c alone)."""
    lib.int8_matmul_acc.restype = ctypes.c_int
    lib.int8_matmul_acc.argtypes = [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64]
    lib.int8_matmul_isa.restype = ctypes.c_int
    lib.int8_matmul_isa.argtypes = []


INT8_TILE_ROWS = 16  # weight rows per tile of csrc/int8_matmul.c


def int8_tile_weights(wq: torch.Tensor) -> torch.Tensor:
    """int8 rows ``wq`` ``[n, k]`` in the tiles of csrc/int8_matmul.c: ``[ceil(n / 16),
    kp / 4, 16, 4]`` (``kp`` = ``k`` rounded up to 4; zeros past ``n`` and ``k``), line ``j``
    of tile ``g`` holding bytes ``4j..4j+3`` of rows ``16g..16g+15``."""
    n, k = wq.shape
    g, kp = -(-n // INT8_TILE_ROWS), -(-k // 4) * 4
    padded = torch.nn.functional.pad(wq, (0, kp - k, 0, g * INT8_TILE_ROWS - n))
    return padded.view(g, INT8_TILE_ROWS, kp // 4, 4).permute(0, 2, 1, 3).contiguous()


def int8_tiles_to_rows(tiles: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The ``[n, k]`` int8 rows of :func:`int8_tile_weights`'s tiles (a new tensor)."""
    g, lines = tiles.shape[:2]
    return tiles.permute(0, 2, 1, 3).reshape(g * INT8_TILE_ROWS, lines * 4)[:n, :k].contiguous()


def int8_matmul_acc(xq: torch.Tensor, tiles: torch.Tensor, wsum: torch.Tensor, n: int,
                    out: torch.Tensor | None = None,
                    lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """The exact int32 sums ``xq @ W.T`` of int8 ``xq`` ``[m, k]`` and the ``n`` weight rows
    held as :func:`int8_tile_weights` tiles, with their :func:`int8_weight_sums` (what
    ``torch._int_mm(xq, W.t())`` returns), into ``out`` if given."""
    lib = lib or kernel_library()
    assert lib is not None, "call supports() first"
    m, k = xq.shape
    g = -(-n // INT8_TILE_ROWS)
    assert xq.is_contiguous() and tiles.is_contiguous() and tiles.dtype == torch.int8
    assert tiles.shape == (g, -(-k // 4), INT8_TILE_ROWS, 4), (tiles.shape, n, k)
    assert wsum.dtype == torch.int32 and wsum.shape == (g * INT8_TILE_ROWS,)
    if out is None:
        out = torch.empty(m, n, dtype=torch.int32)
    assert out.shape == (m, n) and out.dtype == torch.int32 and out.is_contiguous()
    if lib.int8_matmul_acc(xq.data_ptr(), tiles.data_ptr(), wsum.data_ptr(), out.data_ptr(),
                           m, n, k) != 0:
        raise MemoryError("int8 matmul could not allocate its scratch space")
    return out


def int8_weight_sums(wq: torch.Tensor) -> torch.Tensor:
    """Each int8 weight row's sum (int32, zeros to a whole tile: ``[ceil(n / 16) * 16]``): the
    correction the VNNI body of :func:`int8_matmul_acc` subtracts (times 128) for its
    unsigned activations."""
    n = wq.shape[0]
    sums = wq.sum(dim=1, dtype=torch.int32)
    return torch.nn.functional.pad(sums, (0, -(-n // INT8_TILE_ROWS) * INT8_TILE_ROWS - n))


def int8_matmul_isa(lib: ctypes.CDLL | None = None) -> str:
    """Which body the int8 matmul was built with: ``avx512vnni``, ``avx2`` or ``c``."""
    lib = lib or kernel_library()
    assert lib is not None, "call supports() first"
    return {2: "avx512vnni", 1: "avx2"}.get(lib.int8_matmul_isa(), "c")
