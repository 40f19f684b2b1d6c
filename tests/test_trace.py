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


def test_recent_spans_are_kept_without_a_trace_file_and_aged_from_now(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(trace_mod.time, "perf_counter", clock)
    t = Tracer(enabled=False)  # the web page's timeline needs no --trace-file
    run_span(t, clock, "schedule", ENGINE_LANE, 1, 0.0, 0.5)
    run_span(t, clock, "forward", WORKER_LANE, 1, 0.5, 3.0)
    run_span(t, clock, "update", ENGINE_LANE, 1, 3.0, 3.5)
    clock.now = 4.0
    assert t.spans == []
    # Only spans that ended in the window, timed in seconds before now.
    assert [(s.name, s.lane, s.start, s.end, s.step) for s in t.recent_spans(1.5)] == [
        ("forward", WORKER_LANE, -3.5, -1.0, 1), ("update", ENGINE_LANE, -1.0, -0.5, 1)]
    assert t.recent_spans(0.0) == []


def test_the_recent_ring_keeps_the_newest_spans(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(trace_mod.time, "perf_counter", clock)
    t = Tracer()
    for step in range(trace_mod.RECENT_SPANS + 10):
        run_span(t, clock, "forward", WORKER_LANE, step, step, step + 1)
    spans = t.recent_spans(float("inf"))
    assert len(spans) == trace_mod.RECENT_SPANS
    assert spans[0].step == 10 and spans[-1].step == trace_mod.RECENT_SPANS + 9
