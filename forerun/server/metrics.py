"""Prometheus metrics with vLLM's names under the ``forerun:`` prefix.

Request latencies are observed in the API process as outputs are dispatched; engine-side
numbers (running/waiting, KV usage, prefix cache, preemptions) are the core's own counters,
refreshed from its ``stats()`` on every scrape.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from forerun.core.stats import EngineStats
from forerun.outputs import RequestOutput

_P = "forerun:"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


class _EngineStatsCollector(Collector):
    """Exposes the latest engine-core stats snapshot as gauges and counters."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        # None until the first scrape has fetched a snapshot.
        self.stats: EngineStats | None = None

    def collect(self) -> Iterator[Metric]:
        if self.stats is None:
            return
        sched, kv, labels = self.stats.scheduler, self.stats.kv_cache, [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(_P + name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(_P + name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.",
                    sched.num_running_reqs)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.",
                    sched.num_waiting_reqs)
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).",
                    kv.usage)
        yield counter("prefix_cache_queries", "Tokens looked up in the prefix cache.",
                      kv.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Tokens found in the prefix cache.",
                      kv.prefix_cache_hits)
        yield counter("num_preemptions", "Requests preempted for lack of KV blocks.",
                      sched.num_preemptions)
        yield counter("wasted_tokens", "Tokens computed and then thrown away.",
                      sched.wasted_tokens)


class ServerMetrics:
    """Owns a private registry; implements AsyncLLM's OutputObserver protocol."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        label = ["model_name"]
        self.model_name = model_name
        r = self.registry

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(_P + name, doc, label, registry=r, buckets=_LATENCY_BUCKETS)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.")
        self.itl = hist("inter_token_latency_seconds", "Time between output tokens.")
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.")
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduling.")
        self.prompt_tokens = Counter(_P + "prompt_tokens", "Prefilled prompt tokens.", label,
                                     registry=r)
        self.generation_tokens = Counter(_P + "generation_tokens", "Generated tokens.", label,
                                         registry=r)
        self.request_success = Counter(_P + "request_success", "Finished requests.",
                                       label + ["finished_reason"], registry=r)
        self.engine = _EngineStatsCollector(model_name)
        r.register(self.engine)
        self._last_token_time: dict[str, float] = {}

    def on_output(self, out: RequestOutput) -> None:
        m, name = out.metrics, self.model_name
        n_new = len(out.new_token_ids)
        if m is not None and n_new and m.last_token_time is not None:
            prev = self._last_token_time.get(out.request_id)
            if prev is None:
                if m.first_token_time is not None:
                    self.ttft.labels(name).observe(m.first_token_time - m.arrival_time)
                if m.first_scheduled_time is not None:
                    self.queue.labels(name).observe(
                        max(0.0, m.first_scheduled_time - m.arrival_time))
                self.prompt_tokens.labels(name).inc(len(out.prompt_token_ids))
            else:
                self.itl.labels(name).observe(m.last_token_time - prev)
            self._last_token_time[out.request_id] = m.last_token_time
        if n_new:
            self.generation_tokens.labels(name).inc(n_new)
        if out.finished:
            self._last_token_time.pop(out.request_id, None)
            if m is not None and m.finished_time is not None:
                self.e2e.labels(name).observe(m.finished_time - m.arrival_time)
            reason = out.outputs[0].finish_reason or "unknown"
            self.request_success.labels(name, reason).inc()

    def on_abort(self, request_id: str) -> None:
        self._last_token_time.pop(request_id, None)

    def update_engine_stats(self, stats: EngineStats) -> None:
        self.engine.stats = stats

    def render(self) -> bytes:
        return generate_latest(self.registry)
