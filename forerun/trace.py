"""Per-step spans, so that the overlap of scheduling and compute can be seen."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ENGINE_LANE = "engine (scheduler)"
WORKER_LANE = "worker (device)"
DEVICE_SPANS = frozenset({"forward", "sample"})


@dataclass(slots=True)
class Span:
    """One timed piece of work on one lane."""

    name: str
    lane: str
    start: float
    end: float
    step: int


class Tracer:
    """Records spans when enabled and always sums device-busy time.

    Device-busy time (forward + sample on the worker) is kept even without a trace file,
    because ``device_busy_fraction`` is a stat the engine always reports.
    """

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self.spans: list[Span] = []
        self.device_busy_s = 0.0
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()

    @contextmanager
    def span(self, name: str, lane: str, step: int = -1) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            if name in DEVICE_SPANS:
                self.device_busy_s += end - start
            if self.enabled:
                with self._lock:
                    self.spans.append(Span(name, lane, start, end, step))

    def reset(self) -> None:
        with self._lock:
            self.spans.clear()
            self.device_busy_s = 0.0

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
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_chrome_trace()))
