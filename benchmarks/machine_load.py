"""Is the machine quiet enough to time on? A check to call at the start of a timed section.

Two numbers: the 1-minute load average (what ``uptime`` shows), and the cores busy right
now, sampled from ``/proc/stat`` over half a second while the caller itself is idle
(hypervisor steal counts as busy: another guest had the core). The load average also
counts the benchmark's own work of the last minute (a warm-up or a run on both cores that
just ended leaves it near 2 on a quiet machine), so it decides only where nothing of the
benchmark's own ran just before (``own_work=False``, the start of a run); after that the
busy cores decide, and the load average is recorded. llama.cpp's threads spin-wait, so one
core taken by another process can make it 10-50x slower
(../shared/reference/peer-baselines.md); never trust a number timed beside a busy process.
"""

from __future__ import annotations

import os
import sys
import time

LOAD_LIMIT = 1.5  # 1-minute load average above which a section warns
BUSY_LIMIT = 0.3  # cores busy (by others) while this process waits


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies over all CPUs from /proc/stat's first line."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait


def busy_cores(interval: float = 0.5) -> float | None:
    """Cores busy over ``interval`` seconds (None where /proc/stat cannot be read)."""
    try:
        b0, t0 = _cpu_times()
        time.sleep(interval)
        b1, t1 = _cpu_times()
    except OSError:
        return None
    ncpu = os.cpu_count() or 1
    return ncpu * (b1 - b0) / max(t1 - t0, 1)


def check_quiet(section: str, own_work: bool = True, load_limit: float = LOAD_LIMIT,
                busy_limit: float = BUSY_LIMIT) -> dict[str, float | str | bool | None]:
    """Measure the load before ``section`` is timed; warn on stderr if it is too high.

    ``own_work``: the benchmark itself may have run in the last minute, so the load average
    is recorded but only the cores busy now can warn. Returns what it saw, for the
    results' JSON (``quiet`` False when it warned).
    """
    load = os.getloadavg()[0]
    busy = busy_cores()
    loud = ((not own_work and load > load_limit)
            or (busy is not None and busy > busy_limit))
    if loud:
        now = f", {busy:.2f} cores busy now" if busy is not None else ""
        print(f"WARNING: {section}: 1-minute load average {load:.2f}{now}; another process "
              f"may be busy, so these timings are not trustworthy", file=sys.stderr, flush=True)
    return {"section": section, "loadavg_1m": load, "busy_cores": busy, "quiet": not loud}
