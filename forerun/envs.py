"""Every environment switch forerun reads, in one place (read when asked, so tests can set
them per call).

| variable | default | meaning |
|---|---|---|
| ``FORERUN_CACHE_DIR`` | ``~/.cache/forerun`` | converted models and built kernels; ``off`` disables |
| ``CC`` | ``cc`` | the C compiler that builds the CPU kernels |
| ``FORERUN_CPU_KERNELS`` | ``1`` | ``0``: the model's pure-torch path instead of the C kernels |
| ``FORERUN_CPU_PREPACK`` | ``1`` | ``0``: plain linear weights (no oneDNN reorder) |
| ``FORERUN_CPU_BF16_TILES`` | ``1`` | ``0``: on a CPU with AVX512-BF16 and no AMX, bfloat16 steps past the small-batch path's size run on oneDNN's reordered copy of the linear weights (a second copy) instead of the register-tile GEMM on the small-batch path's packed copy |
| ``FORERUN_CPU_AMX`` | ``1`` | ``0``: forerun's C kernels use no AMX tiles and choose their paths as on a CPU without AMX (measuring that CPU's paths on one with it; torch's oneDNN follows ``ONEDNN_MAX_CPU_ISA``, e.g. ``AVX512_CORE_BF16``) |
| ``FORERUN_SINGLE_OMP_TEAM`` | ``1`` | ``0``: leave the engine thread's torch thread count alone |
| ``FORERUN_API_KEY`` | unset | ``forerun serve``'s API key when ``--api-key`` is not given (a flag shows in ``ps``) |
| ``FORERUN_SMALL_BATCH_TOKENS`` | ``128`` in bfloat16 with AMX, else ``8`` | steps of at most this many tokens run every decoder layer in one C call; ``0`` turns that path off |
| ``FORERUN_HUGE_PAGES`` | ``1`` | ``0``: the small-batch path's packed weights are not advised for transparent huge pages |
| ``FORERUN_COLLECTIVE_TIMEOUT_S`` | ``60`` | a TP/PP rank that does not answer a collective or a send within this many seconds fails the step (a hung rank becomes an error) |
| ``FORERUN_WORKER_MULTIPROC_METHOD`` | ``spawn`` | how forerun starts its engine-core and rank processes: ``spawn`` (a fresh interpreter each) or ``forkserver`` (forked from one server process that imported torch and forerun once: a process that starts many engines pays the imports once) |
| ``FORERUN_RANK_FAULT`` | unset | tests only: ``RANK:load`` makes that tensor/pipeline-parallel rank raise while it loads its weights (a start-up fault) |
"""

from __future__ import annotations

import os

CACHE_DIR = "FORERUN_CACHE_DIR"
API_KEY = "FORERUN_API_KEY"


def cache_dir() -> str | None:
    """The raw ``FORERUN_CACHE_DIR`` value (``None`` when unset)."""
    return os.environ.get(CACHE_DIR)


def api_key() -> str | None:
    """``FORERUN_API_KEY``, or None when unset or empty."""
    return os.environ.get(API_KEY) or None


def c_compiler() -> str:
    return os.environ.get("CC", "cc")


def _flag(name: str) -> bool:
    return os.environ.get(name, "1") != "0"


def cpu_kernels_enabled() -> bool:
    return _flag("FORERUN_CPU_KERNELS")


def cpu_amx_enabled() -> bool:
    return _flag("FORERUN_CPU_AMX")


def cpu_prepack_enabled() -> bool:
    return _flag("FORERUN_CPU_PREPACK")


def cpu_bf16_tiles_enabled() -> bool:
    return _flag("FORERUN_CPU_BF16_TILES")


def single_omp_team_enabled() -> bool:
    return _flag("FORERUN_SINGLE_OMP_TEAM")


def huge_pages_enabled() -> bool:
    return _flag("FORERUN_HUGE_PAGES")


def small_batch_tokens() -> int | None:
    """Largest step (in tokens) for the one-call small-batch path; 0 = off; None (unset):
    the path's own default (``SmallBatchStack.max_tokens``)."""
    value = os.environ.get("FORERUN_SMALL_BATCH_TOKENS")
    if value is None:
        return None
    try:
        return max(0, int(value))
    except ValueError:
        raise ValueError(f"FORERUN_SMALL_BATCH_TOKENS must be an integer, got {value!r}") from None


def master_addr() -> str | None:
    """``MASTER_ADDR``: the rendezvous host of a multi-node group (torch.distributed's name)."""
    return os.environ.get("MASTER_ADDR") or None


def master_port() -> int | None:
    """``MASTER_PORT``: the rendezvous port of a multi-node group."""
    value = os.environ.get("MASTER_PORT")
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"MASTER_PORT must be an integer, got {value!r}") from None


def worker_multiproc_method() -> str:
    """``FORERUN_WORKER_MULTIPROC_METHOD``: ``spawn`` (default) or ``forkserver``."""
    value = os.environ.get("FORERUN_WORKER_MULTIPROC_METHOD") or "spawn"
    if value not in ("spawn", "forkserver"):
        raise ValueError("FORERUN_WORKER_MULTIPROC_METHOD must be spawn or forkserver, "
                         f"got {value!r}")
    return value


def launcher_rank() -> tuple[int, int] | None:
    """(RANK, WORLD_SIZE) when a launcher such as ``torchrun`` started this process as one
    of several, else None."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None or world is None:
        return None
    try:
        return int(rank), int(world)
    except ValueError:
        raise ValueError(f"RANK and WORLD_SIZE must be integers, got {rank!r}, {world!r}") \
            from None


def elastic_agent_store() -> bool:
    """Set by ``torchrun`` when its agent already serves the rendezvous store at
    MASTER_ADDR:MASTER_PORT (the ranks must join it as clients, through ``env://``)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def collective_timeout_s() -> float:
    """``FORERUN_COLLECTIVE_TIMEOUT_S``: how long a rank waits for another in a collective."""
    value = os.environ.get("FORERUN_COLLECTIVE_TIMEOUT_S", "60")
    try:
        timeout = float(value)
    except ValueError:
        timeout = -1.0
    if not timeout > 0:
        raise ValueError(f"FORERUN_COLLECTIVE_TIMEOUT_S must be a positive number of seconds, "
                         f"got {value!r}")
    return timeout


RANK_FAULT_STAGES = ("load",)


def rank_fault() -> tuple[int, str] | None:
    """``FORERUN_RANK_FAULT`` (``RANK:STAGE``): the start-up fault a test injects into one
    rank, or None when unset."""
    value = os.environ.get("FORERUN_RANK_FAULT")
    if not value:
        return None
    rank, _, stage = value.partition(":")
    if not rank.isdigit() or stage not in RANK_FAULT_STAGES:
        raise ValueError(f"FORERUN_RANK_FAULT must be RANK:STAGE with STAGE one of "
                         f"{', '.join(RANK_FAULT_STAGES)}; got {value!r}")
    return int(rank), stage
