"""Builds and loads forerun's C kernels for the CPU (today: paged decode attention).

The kernels are plain C with OpenMP, compiled on first use by the system C compiler
(``$CC``, default ``cc``) for the machine at hand (``-march=native``) and loaded with
``ctypes``, which releases the GIL for the call. The shared object is kept under
``<cache>/kernels/`` keyed by the source, the flags, the compiler and the CPU, so the
compile (about a second) happens once per machine. If no compiler is available or the build
fails, a warning is logged once and attention falls back to the pure-torch path, which
computes the same function. ``FORERUN_CPU_KERNELS=0`` forces that fallback.
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
from pathlib import Path

import torch

from forerun.model.cache import cache_root

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_decode_attention.c"
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-shared"]
_ENV_SWITCH = "FORERUN_CPU_KERNELS"
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}

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
        "\0".join([_SOURCE.read_text(), " ".join(_FLAGS), version, _cpu_identity(),
                   platform.machine()]).encode()
    ).hexdigest()[:16]
    target = out_dir / f"{_SOURCE.stem}-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *_FLAGS, "-o", tmp, str(_SOURCE), "-lm"],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr.strip()[-2000:])
        os.replace(tmp, target)  # atomic: a concurrent builder never sees half a file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("compiled %s -> %s", _SOURCE.name, target)
    return target


def _load() -> ctypes.CDLL | None:
    if os.environ.get(_ENV_SWITCH, "1") == "0":
        logger.info("%s=0: attention uses the pure-torch path", _ENV_SWITCH)
        return None
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        logger.warning("no C compiler (%s) found: decode attention uses the slower "
                       "pure-torch path", compiler)
        return None
    root = cache_root()
    out_dir = (root if root is not None else Path(tempfile.gettempdir()) / "forerun") / "kernels"
    try:
        lib = ctypes.CDLL(str(_build(compiler, out_dir)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("could not build the CPU attention kernel, using the pure-torch "
                       "path: %s", exc)
        return None
    for name in ("paged_decode_attention_f32", "paged_decode_attention_bf16"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [_ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64,
                       ctypes.c_float]
    return lib


def kernel_library() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on first use; None where it is unavailable."""
    with _lock:
        if "lib" not in _loaded:
            _loaded["lib"] = _load()
        return _loaded["lib"]


_DTYPE_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def supports(dtype: torch.dtype, device: torch.device) -> bool:
    """True if the C decode attention can run for this cache dtype and device."""
    return device.type == "cpu" and dtype in _DTYPE_SUFFIX and kernel_library() is not None


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    ``q`` ``[B, H, D]``; caches ``[num_blocks, KVH, block_size, D]``; ``block_tables``
    ``[B, >= ceil(max(seq_lens) / block_size)]`` int64 with unit column stride;
    ``seq_lens`` ``[B]`` int64. Returns ``[B, H, D]`` in ``q``'s dtype.
    """
    lib = kernel_library()
    assert lib is not None, "call supports() first"
    fn = getattr(lib, f"paged_decode_attention_{_DTYPE_SUFFIX[q.dtype]}")
    q = q.contiguous()
    b, num_heads, d = q.shape
    _, kvh, bs, _ = k_cache.shape
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    out = torch.empty_like(q)
    rc = fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            block_tables.stride(0), seq_lens.data_ptr(), out.data_ptr(), b, num_heads, kvh,
            bs, d, scale)
    if rc != 0:
        raise MemoryError("paged decode attention could not allocate its scratch space")
    return out
