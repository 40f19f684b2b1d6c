"""Builds one kernel file with another ``-march`` than the machine's default, so that tests
run the bodies of other instruction sets (a test helper: the engine builds only native)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

from forerun.model import cpu_kernels


def build_quant_variant(march: str, out_dir: Path,
                        sources: tuple[str, ...] = cpu_kernels.GGUF_SOURCES,
                        bind: Callable[[ctypes.CDLL], None] = cpu_kernels.bind_gguf_kernels,
                        ) -> ctypes.CDLL:
    """``csrc/<sources>`` alone, built with ``-march=<march>`` into ``out_dir`` (as
    ``<first source>-<march>.so``), loaded and its entry points typed by ``bind``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{Path(sources[0]).stem}-{march}.so"
    lib = cpu_kernels.build_library([cpu_kernels._CSRC / source for source in sources], target,
                                    march, suffix=f"-{march}")
    bind(lib)
    return lib


def cpu_flags() -> set[str]:
    """This CPU's feature flags (``/proc/cpuinfo``); empty where it cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def build_variants(tmp: Path, variants: dict[str, set[str]], sources: tuple[str, ...],
                   bind: Callable[[ctypes.CDLL], None]) -> dict[str, ctypes.CDLL | None]:
    """Loaded builds of ``csrc/<sources>`` for each ``-march`` in ``variants`` whose CPU flags
    this machine has (``native`` -> None: the kernel library itself)."""
    libs: dict[str, ctypes.CDLL | None] = {"native": None}
    flags = cpu_flags()
    for march, needs in variants.items():
        if needs <= flags:
            try:
                libs[march] = build_quant_variant(march, tmp, sources, bind)
            except RuntimeError:  # the compiler does not know this -march
                continue
    return libs
