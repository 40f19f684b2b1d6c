"""Typed stats snapshots: each part is made by its owner, the engine core assembles them.

They are msgspec Structs because the whole crosses the process boundary (the API server's
``/metrics`` asks the engine-core process for it). Frozen: a snapshot, not live counters.
"""

from __future__ import annotations

import typing
from typing import Annotated, Any

import msgspec


def _counter(metric: str | None, doc: str) -> msgspec.Meta:
    """A counter's Prometheus name (``forerun:<metric>``; None: not exported) and help."""
    return msgspec.Meta(description=doc, extra={"metric": metric})


class SchedulerCounters(msgspec.Struct, kw_only=True):
    """The scheduler's counters since start, kept live by it; :class:`SchedulerStats` is
    their snapshot (plus the queues), and ``/metrics`` exports each that names a metric."""

    steps: Annotated[int, _counter(None, "Non-empty steps scheduled.")] = 0
    num_preemptions: Annotated[int, _counter(
        "num_preemptions", "Requests preempted for lack of KV blocks.")] = 0
    wasted_tokens: Annotated[int, _counter(
        "wasted_tokens", "Tokens computed and then thrown away.")] = 0
    num_scheduled_tokens: Annotated[int, _counter(None, "Tokens scheduled.")] = 0
    # Speculative decoding: request-steps that verified drafts, drafts verified, drafts
    # accepted (in total and at each draft position).
    spec_num_drafts: Annotated[int, _counter(
        "spec_decode_num_drafts", "Request-steps that verified drafts.")] = 0
    spec_num_draft_tokens: Annotated[int, _counter(
        "spec_decode_num_draft_tokens", "Draft tokens verified.")] = 0
    spec_num_accepted_tokens: Annotated[int, _counter(
        "spec_decode_num_accepted_tokens", "Draft tokens accepted.")] = 0
    spec_num_accepted_tokens_per_pos: Annotated[list[int], _counter(
        "spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by position in the draft.")] = msgspec.field(
            default_factory=list)


def counter_metrics() -> list[tuple[str, str, str]]:
    """(field, metric name, help) of every :class:`SchedulerCounters` field with a metric."""
    out = []
    for name, hint in typing.get_type_hints(SchedulerCounters, include_extras=True).items():
        meta = hint.__metadata__[0]
        if meta.extra["metric"] is not None:
            out.append((name, meta.extra["metric"], meta.description))
    return out


class SchedulerStats(SchedulerCounters, frozen=True, kw_only=True):
    """``Scheduler.make_stats()``: its queues now and its counters since start."""

    num_running_reqs: int
    num_waiting_reqs: int
    # Waiting requests that could not run even with room to spare (vLLM's "deferred"
    # reason): a grammar still compiling, or stale output of a preemption in flight. The
    # rest wait for capacity (KV blocks, the token budget, max_num_seqs).
    num_waiting_reqs_deferred: int = 0
    # Waiting requests whose blocks a KV connector is filling (WAITING_FOR_REMOTE_KVS).
    num_waiting_reqs_for_remote_kvs: int = 0
    # Grammar (structured output) counters; zero on an engine without a grammar backend.
    num_grammars_compiled: int = 0
    num_grammar_compile_errors: int = 0
    num_grammar_rejected_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted drafts over verified drafts (0 before any)."""
        if not self.spec_num_draft_tokens:
            return 0.0
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens


class KVCacheStats(msgspec.Struct, frozen=True, kw_only=True):
    """``KVCacheManager.make_stats()``: block counts now and prefix-cache counters."""

    num_blocks: int
    num_free_blocks: int
    # Block references parked behind a step fence (freed once that step is processed).
    num_deferred_blocks: int
    # Fraction of blocks not on the free list (parked blocks count as used).
    usage: float
    # Prefix-cache lookups since start, in tokens.
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float


class RecentSpan(msgspec.Struct, frozen=True, array_like=True):
    """One recent step span, timed in seconds before the snapshot (``start <= end <= 0``):
    the core's clock means nothing to another process, the age does."""

    name: str
    lane: str
    start: float
    end: float
    step: int


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    """``EngineCore.stats()``: the scheduler's and the KV cache's parts plus the engine's."""

    scheduler: SchedulerStats
    kv_cache: KVCacheStats
    async_scheduling: bool
    max_concurrent_batches: int
    # Worker time in forward + sample over the wall time of the stats window.
    device_busy_fraction: float
    # Mean time the worker waited between finishing one step and starting the next.
    worker_idle_ms_per_step: float
    # Steps whose sampling waited for the previous step's output (grammar requests).
    num_deferred_samplings: int
    # Bytes of model weights held (every form: quantized blocks, packed copies), 0 if unknown.
    weight_bytes: int = 0
    # The spans of the last ``span_window_s`` seconds when asked for (the web page's
    # timeline); empty by default, so stats stay small for /metrics and benchmarks.
    recent_spans: list[RecentSpan] = msgspec.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Nested plain dicts, for JSON (benchmark reports, logs)."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out
