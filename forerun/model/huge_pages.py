"""Weights that a step streams, kept in one buffer advised for transparent huge pages.

A decode step at a few tokens is a read of every weight matrix, each a few MiB, one after
another. In 4 KiB pages the CPU's hardware prefetchers stop at every page boundary and every
page costs a TLB entry, so a stream of 1-4 MiB matrices reads at about half the rate of one
long stream; in 2 MiB pages it reads at the long stream's rate (the README has the numbers).
Linux gives an anonymous mapping huge pages when it is advised with ``MADV_HUGEPAGE`` (the
default THP mode, ``madvise``, does nothing for memory that is not), so the small-batch
path's packed weights are copied, back to back, into one such mapping.

Where the advice is unavailable (another OS, THP ``never``) the buffer is ordinary memory and
only the copy remains. ``FORERUN_HUGE_PAGES=0`` turns the advice off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap

import torch

from forerun import envs

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_ALIGN = 64  # a cache line: every tensor starts on one, as the AVX-512 kernels like


def empty_bytes(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of ``nbytes`` starting on a 2 MiB boundary of an
    anonymous mapping advised for huge pages (ordinary pages where that is unavailable)."""
    # One huge page more than needed, so that the data can start on a 2 MiB boundary
    # wherever the kernel places the mapping (only whole aligned 2 MiB ranges get huge pages).
    size = (-(-nbytes // HUGE_PAGE) + 1) * HUGE_PAGE
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None and envs.huge_pages_enabled():
        try:
            buf.madvise(advice)
        except OSError as exc:  # e.g. a kernel built without THP
            logger.debug("madvise(MADV_HUGEPAGE) failed: %s", exc)
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # keeps the mapping alive
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start:start + nbytes]


def aligned_bytes(t: torch.Tensor) -> int:
    """Bytes ``t`` takes in an :class:`Arena` (its size rounded up to a cache line)."""
    return -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN


class Arena:
    """One buffer from :func:`empty_bytes` of ``nbytes``, handed out front to back:
    :meth:`copy` puts a tensor's copy at the next cache line (each copy keeps the buffer
    alive). A caller that moves weights here one module at a time and drops the old ones as
    it goes (:func:`release_freed_memory` now and then) holds one copy and a bit, not two."""

    def __init__(self, nbytes: int) -> None:
        self._raw = empty_bytes(max(nbytes, _ALIGN))
        self._used = 0

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        size = aligned_bytes(t)
        if self._used + size > self._raw.numel():
            raise ValueError(f"arena of {self._raw.numel()} bytes has {self._raw.numel() - self._used} "
                             f"left, {size} asked")
        nbytes = t.numel() * t.element_size()
        dst = self._raw[self._used:self._used + nbytes].view(t.dtype).view(t.shape)
        dst.copy_(t)
        self._used += size
        return dst


def arena_copy(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of CPU ``tensors``, back to back in one :class:`Arena`."""
    arena = Arena(sum(aligned_bytes(t) for t in tensors))
    return [arena.copy(t) for t in tensors]


def release_freed_memory() -> None:
    """Give the heap's free pages back to the OS (glibc's ``malloc_trim``; a no-op
    elsewhere). Weights moved into the arena leave their old copies freed but resident:
    a MoE model's experts are thousands of 1-2 MiB tensors, which malloc keeps in its heap
    (the 12-layer Qwen3-30B-A3B shape in Q4_K_M held 9.6 GiB after load, 5.3 with this; the
    1B Q4_K_M 1.75 and 1.41)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
