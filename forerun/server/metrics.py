"""Prometheus metrics under vLLM's names, exported as both ``vllm:*`` and ``forerun:*``.

Every family is defined once, unprefixed, and written out under each prefix with the same
samples: dashboards and alerts built for vLLM read ``vllm:*`` unmodified, and those built
for forerun's earlier ``forerun:*`` names keep working. The cost is a scrape twice the size
(a few KB), which is why there is no flag: nothing is gained by choosing.

Labels are vLLM's: ``model_name`` (the first served name) and ``engine`` (the engine's
index, always ``"0"`` here); ``request_success`` adds ``finished_reason``, which is
``abort`` for requests aborted before they finished (client gone, timeout, shutdown).

Request-level numbers are observed in the API process as outputs are dispatched, one
sequence at a time (each choice of an ``n > 1`` request on its own, as vLLM's children);
``request_params_n`` is observed once per request when it is admitted. Engine-side numbers
(running/waiting, KV usage, prefix cache, preemptions) are the core's own counters,
refreshed from its ``stats()`` on every scrape.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from forerun.core.stats import EngineStats, counter_metrics
from forerun.outputs import RequestOutput
from forerun.sampling_params import SamplingParams

PREFIXES = ("vllm:", "forerun:")
LABELS = ["model_name", "engine"]
ENGINE_INDEX = "0"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# Whole-request phases last seconds to minutes (vLLM's request latency buckets).
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_N_BUCKETS = (1, 2, 5, 10, 20)
# request_success's finished_reason values present (at zero) before any request finishes.
FINISH_REASONS = ("stop", "length", "abort", "error")


def buckets_1_2_5(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets)."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10 ** exponent
            if value > limit:
                return out
            out.append(float(value))
        exponent += 1


def powers_of_two(limit: int) -> list[float]:
    """1, 2, 4, ... below ``limit``, then ``limit`` itself (a step's token budget)."""
    out, value = [], 1
    while value < limit:
        out.append(float(value))
        value *= 2
    out.append(float(max(1, limit)))
    return out


class _EngineStatsCollector(Collector):
    """The latest engine-core stats snapshot as gauges and counters (unprefixed)."""

    def __init__(self, model_name: str, cache_info: Mapping[str, str]) -> None:
        self.model_name = model_name
        self.cache_info = dict(cache_info)
        # Empty until the first scrape has fetched a snapshot; one per data-parallel engine.
        self.stats: list[EngineStats] = []

    def describe(self) -> Iterable[Metric]:
        return []  # nothing to check for clashes: collect() is empty until the first scrape

    def collect(self) -> Iterator[Metric]:
        # One family per metric, one sample per engine (label engine="<rank>").
        families: dict[str, Metric] = {}
        for index, stats in enumerate(self.stats):
            for fam in self._collect_one(stats, [self.model_name, str(index)]):
                if fam.name in families:
                    families[fam.name].samples += fam.samples
                else:
                    families[fam.name] = fam
        yield from families.values()

    def _collect_one(self, stats: EngineStats, labels: list[str]) -> Iterator[Metric]:
        sched, kv = stats.scheduler, stats.kv_cache

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(labels, value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.",
                    sched.num_running_reqs)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.",
                    sched.num_waiting_reqs)
        by_reason = GaugeMetricFamily(
            "num_requests_waiting_by_reason",
            "Waiting requests by reason: capacity (KV blocks, budget, max_num_seqs), "
            "deferred (a grammar compiling, a preemption's output in flight) or remote_kvs "
            "(a KV connector loading their blocks).",
            labels=[*LABELS, "reason"])
        deferred = sched.num_waiting_reqs_deferred
        remote = sched.num_waiting_reqs_for_remote_kvs
        by_reason.add_metric([*labels, "capacity"], sched.num_waiting_reqs - deferred - remote)
        by_reason.add_metric([*labels, "deferred"], deferred)
        by_reason.add_metric([*labels, "remote_kvs"], remote)
        yield by_reason
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).",
                    kv.usage)
        yield counter("prefix_cache_queries", "Tokens looked up in the prefix cache.",
                      kv.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Tokens found in the prefix cache.",
                      kv.prefix_cache_hits)
        for field_name, metric, doc in counter_metrics():
            value = getattr(sched, field_name)
            if not isinstance(value, list):
                yield counter(metric, doc, value)
                continue
            per_pos = CounterMetricFamily(metric, doc, labels=[*LABELS, "position"])
            for pos, n in enumerate(value):  # one sample per draft position
                per_pos.add_metric([*labels, str(pos)], n)
            yield per_pos
        # vLLM's info gauge: constant 1, the KV cache's configuration in its labels.
        info = {**self.cache_info, "num_gpu_blocks": str(kv.num_blocks), "engine": labels[1]}
        names = sorted(info)
        g = GaugeMetricFamily("cache_config_info", "Information of the KV cache's config.",
                              labels=names)
        g.add_metric([info[k] for k in names], 1.0)
        yield g


class _Prefixed(Collector):
    """Every family of ``inner``, once under each prefix, with the same samples."""

    def __init__(self, inner: CollectorRegistry, prefixes: tuple[str, ...]) -> None:
        self.inner = inner
        self.prefixes = prefixes

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        families = list(self.inner.collect())
        for prefix in self.prefixes:
            for fam in families:
                m = Metric(prefix + fam.name, fam.documentation, fam.type, fam.unit)
                m.samples = [s._replace(name=prefix + s.name) for s in fam.samples]
                yield m


class ServerMetrics:
    """Owns private registries; implements AsyncLLM's OutputObserver protocol."""

    def __init__(self, model_name: str, max_model_len: int = 2048,
                 max_num_batched_tokens: int = 2048,
                 cache_info: Mapping[str, str] | None = None,
                 prefixes: tuple[str, ...] = PREFIXES) -> None:
        self.model_name = model_name
        self.inner = CollectorRegistry(auto_describe=False)
        r = self.inner

        def hist(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(name, doc, LABELS, registry=r, buckets=tuple(buckets))

        tokens = buckets_1_2_5(max_model_len)
        self.ttft = hist("time_to_first_token_seconds", "Time to first token.",
                         _LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between output tokens.",
                        _LATENCY_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduling.",
                          _LATENCY_BUCKETS)
        self.inference = hist("request_inference_time_seconds",
                              "First scheduling to last token (running phase).",
                              _REQUEST_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds",
                            "First scheduling to first token (prefill phase).",
                            _REQUEST_BUCKETS)
        self.decode = hist("request_decode_time_seconds",
                           "First token to last token (decode phase).", _REQUEST_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Decode time over output tokens after the first, per request.",
                         _TPOT_BUCKETS)
        self.request_prompt_tokens = hist("request_prompt_tokens",
                                          "Prompt tokens of each finished request.", tokens)
        self.request_generation_tokens = hist(
            "request_generation_tokens", "Generated tokens of each finished request.", tokens)
        self.params_n = hist("request_params_n", "The n request parameter.", _N_BUCKETS)
        self.params_max_tokens = hist("request_params_max_tokens",
                                      "The max_tokens request parameter (as resolved).",
                                      tokens)
        self.iteration_tokens = hist("iteration_tokens_total",
                                     "Prompt plus generated tokens per engine step.",
                                     powers_of_two(max_num_batched_tokens))
        self.prompt_tokens = Counter("prompt_tokens", "Prefilled prompt tokens.", LABELS,
                                     registry=r)
        self.generation_tokens = Counter("generation_tokens", "Generated tokens.", LABELS,
                                         registry=r)
        self.request_success = Counter("request_success", "Finished requests.",
                                       LABELS + ["finished_reason"], registry=r)
        # Every series exists from the start, at zero, as in vLLM: rate() and alerts see a
        # 0 rather than no data before the first request.
        for metric in (self.ttft, self.itl, self.e2e, self.queue, self.inference,
                       self.prefill, self.decode, self.tpot, self.request_prompt_tokens,
                       self.request_generation_tokens, self.params_n, self.params_max_tokens,
                       self.iteration_tokens, self.prompt_tokens, self.generation_tokens):
            metric.labels(model_name, ENGINE_INDEX)
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, ENGINE_INDEX, reason)
        self.engine = _EngineStatsCollector(model_name, cache_info or {})
        r.register(self.engine)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Prefixed(self.inner, prefixes))
        self._labels = (model_name, ENGINE_INDEX)
        self._last_token_time: dict[str, float] = {}
        # Tokens of the engine step being dispatched; outputs of one step arrive in one
        # synchronous burst, so the step ends when the event loop next runs anything else,
        # or earlier if a request shows up twice (two steps read in one burst).
        self._step_tokens = 0
        self._step_ids: set[str] = set()
        self._flush_scheduled = False

    def on_request(self, params: SamplingParams) -> None:
        """A request admitted: its ``n`` once, its ``max_tokens`` once per sequence."""
        lab = self._labels
        self.params_n.labels(*lab).observe(params.n)
        if params.max_tokens is not None:
            hist = self.params_max_tokens.labels(*lab)
            for _ in range(params.n):
                hist.observe(params.max_tokens)

    def on_output(self, out: RequestOutput) -> None:
        m, lab = out.metrics, self._labels
        n_new = len(out.new_token_ids)
        step_tokens = n_new
        if m is not None and n_new and m.last_token_time is not None:
            prev = self._last_token_time.get(out.request_id)
            if prev is None:
                if m.first_token_time is not None:
                    self.ttft.labels(*lab).observe(m.first_token_time - m.arrival_time)
                if m.first_scheduled_time is not None:
                    self.queue.labels(*lab).observe(
                        max(0.0, m.first_scheduled_time - m.arrival_time))
                self.prompt_tokens.labels(*lab).inc(len(out.prompt_token_ids))
                step_tokens += len(out.prompt_token_ids)
            else:
                self.itl.labels(*lab).observe(m.last_token_time - prev)
            self._last_token_time[out.request_id] = m.last_token_time
        if n_new:
            self.generation_tokens.labels(*lab).inc(n_new)
        self._count_step(out.request_id, step_tokens)
        if out.finished:
            self._last_token_time.pop(out.request_id, None)
            self._observe_finished(out)

    def _observe_finished(self, out: RequestOutput) -> None:
        lab, m = self._labels, out.metrics
        reason = out.outputs[0].finish_reason or "unknown"
        self.request_success.labels(*lab, reason).inc()
        n_gen = len(out.outputs[0].token_ids)
        self.request_prompt_tokens.labels(*lab).observe(len(out.prompt_token_ids))
        self.request_generation_tokens.labels(*lab).observe(n_gen)
        if m is None:
            return
        if m.finished_time is not None:
            self.e2e.labels(*lab).observe(m.finished_time - m.arrival_time)
        start, first, last = m.first_scheduled_time, m.first_token_time, m.last_token_time
        if start is not None and first is not None and last is not None:
            self.prefill.labels(*lab).observe(max(0.0, first - start))
            self.decode.labels(*lab).observe(max(0.0, last - first))
            self.inference.labels(*lab).observe(max(0.0, last - start))
            if n_gen > 1:
                self.tpot.labels(*lab).observe(max(0.0, last - first) / (n_gen - 1))

    def _count_step(self, request_id: str, tokens: int) -> None:
        if request_id in self._step_ids:
            self._flush_step()
        self._step_ids.add(request_id)
        self._step_tokens += tokens
        if self._flush_scheduled:
            return
        try:
            asyncio.get_running_loop().call_soon(self._flush_step)
            self._flush_scheduled = True
        except RuntimeError:  # no event loop (direct use): every output is its own step
            self._flush_step()

    def _flush_step(self) -> None:
        self._flush_scheduled = False
        if self._step_tokens:
            self.iteration_tokens.labels(*self._labels).observe(self._step_tokens)
        self._step_tokens = 0
        self._step_ids.clear()

    def on_abort(self, request_id: str) -> None:
        """An aborted sequence: counted as finished with reason ``abort``, as in vLLM."""
        self._last_token_time.pop(request_id, None)
        self.request_success.labels(*self._labels, "abort").inc()

    def update_engine_stats(self, stats: list[EngineStats]) -> None:
        """The latest snapshots, one per data-parallel engine (rank order)."""
        self.engine.stats = list(stats)

    def render(self) -> bytes:
        return generate_latest(self.registry)
