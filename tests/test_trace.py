"""Tracer accounting: device-busy time, worker idle gaps between steps, the trace file."""

from __future__ import annotations

import json

import forerun.trace as trace_mod
from forerun.trace import ENGINE_LANE, WORKER_LANE, Tracer


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_span(tracer: Tracer, clock: FakeClock, name: str, lane: str, step: int,
             start: float, end: float) -> None:
    clock.now = start
    with tracer.span(name, lane, step):
        clock.now = end


def test_worker_idle_counts_only_gaps_between_steps(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(trace_mod.time, "perf_counter", clock)
    t = Tracer(enabled=True)
    # step 1: prepare 0-1, forward 1-10, sample 10-11 ; engine work 11-14 ; step 2 at 14.
    run_span(t, clock, "prepare", WORKER_LANE, 1, 0, 1)
    run_span(t, clock, "forward", WORKER_LANE, 1, 1, 10)
    run_span(t, clock, "sample", WORKER_LANE, 1, 10, 11)
    run_span(t, clock, "update", ENGINE_LANE, 1, 11, 14)
    run_span(t, clock, "prepare", WORKER_LANE, 2, 14, 15)
    run_span(t, clock, "forward", WORKER_LANE, 2, 15, 20)
    run_span(t, clock, "sample", WORKER_LANE, 2, 20.5, 21)  # a gap inside a step: not idle
    run_span(t, clock, "prepare", WORKER_LANE, 3, 21, 22)  # back to back: a zero gap
    assert t.worker_step_gaps == 2
    assert t.worker_idle_s == 3.0
    assert t.device_busy_s == 9 + 1 + 5 + 0.5
    trace = t.to_chrome_trace()
    names = [e["name"] for e in trace["traceEvents"] if e["ph"] == "X"]
    assert names.count("forward") == 2 and "update" in names
    json.dumps(trace)


def test_reset_window_forgets_the_gap_before_the_next_step(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(trace_mod.time, "perf_counter", clock)
    t = Tracer()
    run_span(t, clock, "forward", WORKER_LANE, 1, 0, 5)
    t.reset_window()
    run_span(t, clock, "forward", WORKER_LANE, 2, 100, 105)  # idle while nobody asked
    assert t.worker_step_gaps == 0 and t.worker_idle_s == 0.0
    assert t.device_busy_s == 5 and t.spans == []
