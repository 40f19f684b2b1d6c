"""Keeps torch's OpenMP thread team on the worker thread alone.

With the OpenMP backend every OS thread that runs a parallel torch op gets a thread team of
its own. Once the process manages more OpenMP threads than it has CPUs, libgomp stops
spinning between parallel regions and parks its threads at once, so every one of the
thousands of small parallel regions in a decode step pays a futex wake-up. Measured on the
2-core machine: a gated-MLP block that takes 1.05 ms when only one thread has ever run torch
ops takes 1.3-1.6 ms in both threads once a second thread has, and a SmolLM2 decode step at
64 sequences goes from 108 ms to 145-175 ms. The engine thread therefore runs its own torch
ops (which are small) inline on one thread, and the worker thread, where the model runs,
owns the only team.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch

from forerun import envs

logger = logging.getLogger(__name__)



def _libgomp() -> ctypes.CDLL | None:
    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    bundled = Path(torch.__file__).resolve().parent / "lib" / "libgomp.so.1"
    try:
        # Already loaded by torch, so this returns the same runtime, not a second copy.
        return ctypes.CDLL(str(bundled) if bundled.exists() else "libgomp.so.1")
    except OSError:
        return None


class CallerThreadsGuard:
    """Runs the calling thread's torch ops on one thread until :meth:`restore`."""

    def __init__(self) -> None:
        self._gomp = _libgomp() if envs.single_omp_team_enabled() else None
        self._previous = 0
        if self._gomp is None:
            return
        # Forces ATen's per-thread lazy initialisation now; it would otherwise reset this
        # thread's count to the process default on its first parallel op.
        self._previous = torch.get_num_threads()
        self._gomp.omp_set_num_threads(1)
        logger.debug("engine thread: torch intra-op threads %d -> 1 (the worker keeps %d)",
                     self._previous, self._previous)

    def restore(self) -> None:
        """Give the calling thread its previous thread count back (at engine shutdown)."""
        if self._gomp is not None and self._previous > 0:
            self._gomp.omp_set_num_threads(self._previous)
            self._previous = 0


def take_cpu_share(index: int, count: int) -> list[int]:
    """Pin the calling thread (and the threads it starts) to share ``index`` of ``count``
    shares of this process's CPUs and size torch's team to it; returns the CPUs.

    Several engine or tensor-parallel processes on one machine each take their own share,
    so that their OpenMP teams do not fight over the same cores.
    """
    cpus = sorted(os.sched_getaffinity(0))
    mine = cpus[index::count] or cpus  # more shares than CPUs: share them all
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))
    return mine
