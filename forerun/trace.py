"""Per-step spans, so that the overlap of scheduling and compute can be seen."""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from forerun.core.stats import RecentSpan

ENGINE_LANE = "engine (scheduler)"
WORKER_LANE = "worker (device)"
DEVICE_SPANS = frozenset({"forward", "sample"})
# Spans kept, always, for the live timeline (``recent_spans``): a few seconds of steps even
# at hundreds of steps a second, and a few hundred KB at most.
RECENT_SPANS = 4096


@dataclass(slots=True)
class CounterSample:
    """Values of a named counter track at one moment (a Chrome trace "C" event)."""

    name: str
    time: float
    step: int
    values: dict[str, float]


@dataclass(slots=True)
class Span:
    """One timed piece of work on one lane."""

    name: str
    lane: str
    start: float
    end: float
    step: int


class Tracer:
    """Records spans when enabled and always sums device-busy and worker-idle time.

    Device-busy time (forward + sample on the worker) and the worker's idle gap between
    one step and the next are kept even without a trace file: they are stats the engine
    always reports, and the gap is exactly what async scheduling exists to remove. So are
    the last :data:`RECENT_SPANS` spans, in a ring, for the web page's live timeline.
    """

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self.spans: list[Span] = []
        self.counters: list[CounterSample] = []
        self.device_busy_s = 0.0
        self.worker_idle_s = 0.0
        self.worker_step_gaps = 0
        self._worker_step = -1
        self._worker_last_end: float | None = None
        # (name, lane, start, end, step): tuples, as the ring is filled on every span.
        self.recent: deque[tuple[str, str, float, float, int]] = deque(maxlen=RECENT_SPANS)
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()

    def reset_window(self) -> None:
        """Start counting busy and idle time afresh (the next step's gap is not counted)."""
        self.device_busy_s = 0.0
        self.worker_idle_s = 0.0
        self.worker_step_gaps = 0
        self._worker_last_end = None

    @contextmanager
    def span(self, name: str, lane: str, step: int = -1) -> Iterator[None]:
        start = time.perf_counter()
        if lane == WORKER_LANE and step != self._worker_step:
            # The worker's first span of a new step: how long did it wait for work?
            if self._worker_last_end is not None:
                self.worker_idle_s += start - self._worker_last_end
                self.worker_step_gaps += 1
            self._worker_step = step
        try:
            yield
        finally:
            end = time.perf_counter()
            if lane == WORKER_LANE:
                self._worker_last_end = end
            if name in DEVICE_SPANS:
                self.device_busy_s += end - start
            # Engine and worker threads both append; the lock keeps a reader's copy whole.
            with self._lock:
                self.recent.append((name, lane, start, end, step))
            if self.enabled:
                with self._lock:
                    self.spans.append(Span(name, lane, start, end, step))

    def recent_spans(self, window_s: float) -> list[RecentSpan]:
        """The spans that ended in the last ``window_s`` seconds, aged from now."""
        if window_s <= 0:
            return []
        now = time.perf_counter()
        with self._lock:
            spans = list(self.recent)
        cutoff = now - window_s
        return [RecentSpan(name, lane, start - now, end - now, step)
                for name, lane, start, end, step in spans if end >= cutoff]

    def counter(self, name: str, step: int, values: dict[str, float]) -> None:
        """Record a counter sample (e.g. accepted drafts per position) when enabled."""
        if self.enabled:
            with self._lock:
                self.counters.append(CounterSample(name, time.perf_counter(), step, values))

    def reset(self) -> None:
        with self._lock:
            self.spans.clear()
            self.counters.clear()
        self.reset_window()

    def to_chrome_trace(self) -> dict:
        lanes = {ENGINE_LANE: 1, WORKER_LANE: 2}
        events: list[dict] = [
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": lane}}
            for lane, tid in lanes.items()
        ]
        for s in self.spans:
            events.append({
                "name": s.name, "ph": "X", "pid": 1, "tid": lanes.get(s.lane, 3),
                "ts": (s.start - self._t0) * 1e6, "dur": (s.end - s.start) * 1e6,
                "args": {"step": s.step},
            })
        for c in self.counters:
            events.append({"name": c.name, "ph": "C", "pid": 1, "ts": (c.time - self._t0) * 1e6,
                           "args": {**c.values, "step": c.step}})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_chrome_trace()))
