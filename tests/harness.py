"""Drive the real scheduler and engine core with the fake worker, checking invariants.

:class:`Harness` wraps ``schedule`` and ``update_from_output`` of a real ``Scheduler`` or
``AsyncScheduler`` so that :func:`check_invariants` runs after *every* schedule and every
update event. It keeps its own ledger of the steps in flight (which requests each step
scheduled, how many tokens, which of them sample), so the scheduler's counters are compared
with an independent account rather than with themselves.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from forerun.core.async_scheduler import AsyncScheduler
from forerun.core.block_hash import make_block_hasher
from forerun.core.block_pool import KVCacheBlock
from forerun.core.hybrid_kv_cache_manager import HybridKVCacheManager
from forerun.core.kv_cache_manager import KVCacheManager, cdiv
from forerun.core.kv_cache_spec import KVCacheGroupSpec
from forerun.core.output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from forerun.core.scheduler import Scheduler, SchedulerConfig
from forerun.engine.core import EngineCore
from forerun.kv_connector.base import KVConnectorRole
from forerun.kv_connector.offloading_connector import OffloadingConnector
from forerun.request import Request, RequestStatus
from forerun.sampling_params import SamplingParams
from tests.fake_executor import EOS, FakeExecutor, token_for
from tests.fake_kv_connector import FakeConnectorWorker, FakeStore


def make_request(
    req_id: str,
    prompt: list[int],
    max_tokens: int,
    block_size: int,
    cache_salt: str | None = None,
) -> Request:
    """A greedy request that stops on the fake worker's EOS, with prefix-cache hashing."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    params.update_from_model([EOS])
    return Request(req_id, prompt, params, cache_salt=cache_salt,
                   block_hasher=make_block_hasher(block_size))


def expected_output(
    req_id: str, prompt_len: int, max_tokens: int, eos_at: int | None
) -> tuple[list[int], str]:
    """The oracle: what a lossless engine must deliver for one request with the fake.

    The k-th output (1-based) is sampled for position ``prompt_len + k - 1``; generation
    ends at EOS (``eos_at``-th output) or after ``max_tokens`` outputs.
    """
    n = max_tokens if eos_at is None else min(max_tokens, eos_at)
    ids = [token_for(req_id, prompt_len + k - 1) for k in range(1, n + 1)]
    if eos_at is not None and eos_at <= max_tokens:
        ids[-1] = EOS
        return ids, "stop"
    return ids, "length"


@dataclass
class StepRecord:
    """The harness's own ledger entry for one scheduled, unprocessed step."""

    so: SchedulerOutput
    sampling: set[str]  # requests this step will sample a token for
    seq: int = 0  # the scheduler's step sequence number (the fence's unit)
    # Per request, the block ids this step reads or writes, from the worker's view of the
    # request's block tables (the window's blocks only, in a sliding group).
    touched: dict[str, set[int]] = field(default_factory=dict)


@dataclass
class Harness:
    """A real scheduler + EngineCore + FakeExecutor, with invariant checks on every event."""

    async_scheduling: bool
    depth: int
    num_blocks: int
    block_size: int
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 4096
    defer_block_free: bool | None = None
    enable_caching: bool = True
    eos_at: dict[str, int] = field(default_factory=dict)
    check: bool = True
    # Speculative decoding in the fake worker: K, drafts found and acceptance scripts.
    num_speculative_tokens: int = 0
    drafts_found: Callable[[str, int], int] | None = None
    accept: Callable[[str, int, int], int] | None = None
    # The scheduler's pipeline rules (about 1/pp of the requests per step, no request whose
    # last sample is in the newest pp - 1 steps); the fake worker has no stages.
    pipeline_parallel_size: int = 1
    # Two or more: a HybridKVCacheManager with these groups (num_blocks usable blocks).
    kv_cache_groups: list[KVCacheGroupSpec] | None = None
    # An offloading connector (its real scheduler half, the fake worker half): the seed of
    # the transfers' scripted delays, and which stored blocks a load finds gone.
    connector_seed: int | None = None
    lose_block: Callable[[bytes], bool] | None = None

    def __post_init__(self) -> None:
        defer = self.defer_block_free
        if defer is None:
            defer = self.depth > 1
        config = SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            defer_block_free=defer,
            num_speculative_tokens=self.num_speculative_tokens,
            pipeline_parallel_size=self.pipeline_parallel_size,
        )
        kv: KVCacheManager
        if self.kv_cache_groups is not None and len(self.kv_cache_groups) > 1:
            kv = HybridKVCacheManager(self.kv_cache_groups, self.num_blocks, self.block_size,
                                      self.enable_caching)
        else:
            kv = KVCacheManager(self.num_blocks, self.block_size, self.enable_caching)
        cls = AsyncScheduler if self.async_scheduling else Scheduler
        self.store: FakeStore | None = None
        connector = None
        if self.connector_seed is not None:
            self.store = FakeStore()
            connector = OffloadingConnector(KVConnectorRole.SCHEDULER, self.store,  # type: ignore[arg-type]
                                            self.block_size)
        self.scheduler: Scheduler = cls(config, kv, None, connector)
        self.kv = kv
        self.executor = FakeExecutor(
            eos_at=self.eos_at, num_speculative_tokens=self.num_speculative_tokens,
            drafts_found=self.drafts_found, accept=self.accept)
        self.fake_connector: FakeConnectorWorker | None = None
        if self.store is not None:
            self.fake_connector = FakeConnectorWorker(self.store, self.connector_seed or 0,
                                                      self.lose_block)
            self.executor.kv_connector = self.fake_connector
        self.engine = EngineCore(self.scheduler, self.executor,
                                 max_concurrent_batches=self.depth)
        self.in_flight: deque[StepRecord] = deque()
        # The worker's block tables (what the scheduler sent), per request and group, and
        # where each running request's newest scheduled step started.
        self.worker_tables: dict[str, list[list[int]]] = {}
        self.step_start: dict[str, int] = {}
        # Most real blocks a request held in each sliding group (the admission bound test).
        self.max_live_sliding: dict[str, int] = {}
        self.last_preempt_step: dict[str, int] = {}
        self.outputs: dict[str, list[int]] = {}
        self.finish_reason: dict[str, str | None] = {}
        self.prompt_lens: dict[str, int] = {}
        self.scheduled_tokens: Counter[str] = Counter()
        self.num_events = 0
        self.on_schedule: list[Callable[[SchedulerOutput], None]] = []
        self.on_update: list[Callable[[SchedulerOutput], None]] = []
        self.min_placeholders_seen = 0
        # (request id, its stale in-flight tokens) for every preemption, in order.
        self.preemptions: list[tuple[str, int]] = []
        self._orig_schedule = self.scheduler.schedule
        self._orig_update = self.scheduler.update_from_output
        self.scheduler.schedule = self._schedule  # type: ignore[method-assign]
        self.scheduler.update_from_output = self._update  # type: ignore[method-assign]

    # ----- wrapped events -----------------------------------------------------------------
    def _schedule(self) -> SchedulerOutput:
        so = self._orig_schedule()
        for rid in sorted(so.preempted_req_ids):
            self.last_preempt_step[rid] = so.step_id
            self.preemptions.append((rid, self.scheduler.requests[rid].num_stale_output_tokens))
        sampling = {
            rid for rid in so.num_scheduled_tokens
            if not self.scheduler.requests[rid].is_prefill_chunk
        }
        for rid, n in so.num_scheduled_tokens.items():
            self.scheduled_tokens[rid] += n
        record = StepRecord(so, sampling, self.scheduler.sched_step_seq)
        if self.check:  # only the invariants read it (and benchmarks run unchecked)
            self._check_loads_fenced(so)
            self._record_touched(so, record)
        self.in_flight.append(record)
        self._after_event()
        for hook in self.on_schedule:
            hook(so)
        return so

    def _update(self, so: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        oldest = self.in_flight.popleft()
        assert oldest.so is so, "steps must be processed once each, in FIFO order"
        outputs = self._orig_update(so, out)
        self.executor.mark_applied(so.step_id)
        self._after_event()
        for hook in self.on_update:
            hook(so)
        return outputs

    def _check_loads_fenced(self, so: SchedulerOutput) -> None:
        """A load may write only blocks that no step in flight reads or writes, and only
        blocks its request holds alone."""
        meta = so.kv_connector_metadata
        for t in meta.loads if meta is not None else ():
            held = {b.block_id for b in self.kv.get_blocks(t.req_id)}
            for bid in t.block_ids:
                assert bid in held, ("a load into a block its request does not hold", t)
                assert self.kv.block_pool.blocks[bid].ref_cnt == 1, ("a shared block loaded", t)
                for rec in self.in_flight:
                    for rid, touched in rec.touched.items():
                        assert bid not in touched, (
                            "a load into a block a step in flight touches", t, rid, rec.seq)

    def _record_touched(self, so: SchedulerOutput, record: StepRecord) -> None:
        """Follow the worker's tables and note which blocks each request's step uses."""
        for new in so.scheduled_new_reqs:
            self.worker_tables[new.req_id] = [list(ids) for ids in new.block_ids]
        cached = so.scheduled_cached_reqs
        for rid, new_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            for table, ids in zip(self.worker_tables[rid], new_ids, strict=True):
                table.extend(ids)
        bs, kv = self.block_size, self.kv
        null = kv.null_block.block_id if isinstance(kv, HybridKVCacheManager) else None
        for rid, n in so.num_scheduled_tokens.items():
            start = self.scheduler.requests[rid].num_computed_tokens - n
            self.step_start[rid] = start
            end_block = cdiv(start + n, bs)
            touched: set[int] = set()
            for gid, table in enumerate(self.worker_tables[rid]):
                assert len(table) >= end_block, (rid, gid, len(table), start, n)
                lo = 0
                if isinstance(kv, HybridKVCacheManager):
                    lo = kv.managers[gid].first_visible_block(start)
                ids = table[lo:end_block]
                assert null not in ids, ("a step reads or writes the null block", rid, gid)
                touched.update(ids)
            record.touched[rid] = touched

    def _after_event(self) -> None:
        self.num_events += 1
        for r in self.scheduler.requests.values():
            self.min_placeholders_seen = min(self.min_placeholders_seen,
                                             r.num_output_placeholders)
        if self.check:
            check_invariants(self)

    # ----- driving --------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.prompt_lens[request.request_id] = request.num_prompt_tokens
        self.outputs[request.request_id] = []
        self.finish_reason[request.request_id] = None
        self.engine.add_request(request)

    def abort(self, req_id: str) -> None:
        request = self.scheduler.requests.get(req_id)
        self.engine.abort_requests([req_id])
        if request is not None:
            self.finish_reason[req_id] = "abort"
        if self.check:
            check_invariants(self)

    def step(self) -> list[EngineCoreOutput]:
        outputs = self.engine.run_step()
        for o in outputs:
            assert self.finish_reason[o.request_id] is None, f"output after finish: {o}"
            self.outputs[o.request_id].extend(o.new_token_ids)
            if o.finish_reason is not None:
                self.finish_reason[o.request_id] = o.finish_reason
        return outputs

    def run_until_idle(self, max_steps: int = 10_000) -> int:
        steps = 0
        while self.engine.has_work():
            self.step()
            steps += 1
            assert steps <= max_steps, "engine made no progress (livelock?)"
        return steps

    def assert_all_released(self) -> None:
        s, kv = self.scheduler, self.kv
        assert not s.requests and not s.running and not s.waiting
        assert not s._delayed_free and not s._load_target
        assert self.fake_connector is None or not self.fake_connector.pending
        assert not self.in_flight and not self.engine.batch_queue
        assert not kv.deferred_frees
        assert not kv.req_to_blocks and not kv.num_cached_block
        assert kv.num_free_blocks == self.num_blocks
        if isinstance(kv, HybridKVCacheManager):
            assert not kv.group_req_to_blocks
            assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks if b is not kv.null_block)
        else:
            assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def block_tables(kv: KVCacheManager) -> dict[str, tuple[list[KVCacheBlock], ...]]:
    """Each request's block list per KV cache group (one group for KVCacheManager)."""
    if isinstance(kv, HybridKVCacheManager):
        return kv.group_req_to_blocks
    return {rid: (blocks,) for rid, blocks in kv.req_to_blocks.items()}


def check_invariants(h: Harness) -> None:
    """Every invariant the scheduler promises between events; raises AssertionError."""
    s, kv = h.scheduler, h.kv
    pool = kv.block_pool
    bs = kv.block_size
    is_async = isinstance(s, AsyncScheduler)

    # The queues partition the live requests.
    running_ids = [r.request_id for r in s.running]
    waiting_ids = [r.request_id for r in s.waiting]
    assert len(set(running_ids)) == len(running_ids)
    assert set(running_ids).isdisjoint(waiting_ids)
    assert set(running_ids) | set(waiting_ids) == set(s.requests)
    assert len(s.running) <= s.config.max_num_seqs

    for rid, r in s.requests.items():
        T, C, P = r.num_tokens, r.num_computed_tokens, r.num_output_placeholders
        assert P >= 0, r
        if not is_async:
            assert P == 0, r
        assert not r.is_finished(), r
        # The ledger: tokens of this request in steps not yet processed.
        in_flight = sum(rec.so.num_scheduled_tokens.get(rid, 0) for rec in h.in_flight)
        assert r.num_in_flight_tokens == in_flight, (r, in_flight)
        cut = h.last_preempt_step.get(rid, -1)
        stale = sum(rec.so.num_scheduled_tokens.get(rid, 0)
                    for rec in h.in_flight if rec.so.step_id < cut)
        assert r.num_stale_output_tokens == stale, (r, stale)
        assert 0 <= r.num_stale_output_tokens <= r.num_in_flight_tokens
        # Tokens promised by sampling steps in flight of the current (post-preemption)
        # life: one each, plus its drafts counted as if accepted.
        current = [rec.so for rec in h.in_flight if rec.so.step_id > cut and rid in rec.sampling]
        promised = sum(1 + so.scheduled_spec_decode_tokens.get(rid, 0) for so in current)
        assert 0 <= r.num_spec_tokens <= s.config.num_speculative_tokens, r
        # The max_tokens guard: never promise more tokens than the request may have.
        assert r.num_output_tokens + P <= r.max_tokens, r
        if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            # It holds the device hit's blocks and those being loaded; nothing in flight.
            assert C % bs == 0 and P == 0 and r.num_in_flight_tokens == 0, r
            assert rid in kv.req_to_blocks and r in s.waiting, r
            assert s._load_target[rid] > C, r
        elif r.status == RequestStatus.RUNNING:
            assert r.num_stale_output_tokens == 0, r
            assert P == (promised if is_async else 0), (r, promised)
            if r.is_prefill_chunk:
                assert P == 0 and C < T, r
            else:
                # C - P is the confirmed frontier: all but the newest known token.
                assert C - P == T - 1 + (0 if is_async else promised), (r, promised)
        else:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), r
            assert C == 0 and P == 0, r
            assert rid not in kv.req_to_blocks, r
            assert rid not in kv.num_cached_block, r

    # Block ownership: every reference is accounted for by a holder or a deferred entry.
    hybrid = isinstance(kv, HybridKVCacheManager)
    null = kv.null_block if hybrid else None
    tables = block_tables(kv)
    if hybrid:
        assert not kv.req_to_blocks
        assert null is not None and null.ref_cnt == 1 and null.block_hash is None
    loading = {rid for rid, r in s.requests.items()
               if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS}
    assert set(s._load_target) == loading
    assert set(tables) <= set(running_ids) | loading | set(s._delayed_free), (
        set(tables), running_ids)
    assert set(s._delayed_free).isdisjoint(s.requests)
    # A transfer in flight uses blocks its request (live or ended) still holds alone.
    for x in h.fake_connector.pending if h.fake_connector is not None else ():
        held = {b.block_id for b in kv.get_blocks(x.transfer.req_id)}
        assert set(x.transfer.block_ids) <= held, x
        if x.kind == "load":
            assert all(pool.blocks[b].ref_cnt == 1 for b in x.transfer.block_ids), x
            for rec in h.in_flight:
                for touched in rec.touched.values():
                    assert touched.isdisjoint(x.transfer.block_ids), (x, rec.seq)
    refs: Counter[int] = Counter()
    holders: dict[int, set[str]] = {}
    for rid, groups in tables.items():
        assert len(groups) == (kv.num_groups if hybrid else 1), rid
        # Every group's table covers the same positions.
        assert all(len(g) == len(groups[0]) for g in groups), rid
        real = [b for g in groups for b in g if b is not null]
        assert real, rid
        ids = [b.block_id for b in real]
        assert len(set(ids)) == len(ids), (rid, ids)
        for b in real:
            refs[b.block_id] += 1
            holders.setdefault(b.block_id, set()).add(rid)
    deferred_ids: set[int] = set()
    parked_until: dict[int, int] = {}  # block id -> the newest fence it is parked behind
    fences = [fence for fence, _ in kv.deferred_frees]
    assert fences == sorted(fences)
    assert not fences or fences[0] > s.processed_step_seq
    assert not fences or fences[-1] <= s.sched_step_seq
    if not s.defer_block_free:
        assert not kv.deferred_frees
    for fence, blocks in kv.deferred_frees:
        for b in blocks:
            assert b is not null
            refs[b.block_id] += 1
            deferred_ids.add(b.block_id)
            parked_until[b.block_id] = max(fence, parked_until.get(b.block_id, 0))
    for bid, owners in holders.items():
        if len(owners) > 1:
            block = pool.blocks[bid]
            assert block.block_hash is not None and block.ref_cnt >= 2, (block, owners)
    free_ids = [b.block_id for b in pool.free_block_queue]
    assert len(free_ids) == pool.get_num_free_blocks() == len(set(free_ids))
    for block in pool.blocks:
        if block is not null:
            assert block.ref_cnt == refs[block.block_id], (block, refs[block.block_id])
    assert set(free_ids) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    held = set(refs)
    assert len(free_ids) + len(held) + (1 if hybrid else 0) == pool.num_blocks
    assert held == set(holders) | deferred_ids

    # Every block a step in flight reads or writes is still the request's: in its table,
    # or parked behind a fence that step has not passed (the fence, at any depth). Without
    # the fence and more than one step in flight, frees are immediate by configuration.
    for rec in h.in_flight if (s.defer_block_free or h.depth == 1) else ():
        for rid, touched in rec.touched.items():
            mine = {b.block_id for g in tables.get(rid, ()) for b in g}
            for bid in touched:
                assert bid in mine or parked_until.get(bid, -1) >= rec.seq, (
                    "a block in use by a step in flight was released", rid, bid, rec.seq)

    # Prefix cache: only full blocks wholly below min(T, C), under the request's own hash
    # (keyed by group in a hybrid cache).
    for rid, groups in tables.items():
        if rid in s._delayed_free:
            continue  # ended: its blocks wait for a transfer
        r = s.requests[rid]
        frontier = min(r.num_tokens, r.num_computed_tokens)
        num_cached = kv.num_cached_block.get(rid, 0)
        assert num_cached * bs <= frontier, (r, num_cached)
        for gid, blocks in enumerate(groups):
            for i, b in enumerate(blocks):
                if b is null:
                    continue
                if i < num_cached:
                    key = kv.managers[gid].cache_key(r.block_hashes[i]) if hybrid \
                        else r.block_hashes[i]
                    assert b.block_hash == key, (r, gid, i, b)
                else:
                    assert b.block_hash is None, (r, gid, i, b)
            assert len(blocks) * bs >= r.num_computed_tokens, (r, len(blocks))
    if hybrid:
        check_sliding_windows(h, tables)
    for h_, entry in pool.cached_block_hash_to_block.items():
        assert entry
        for bid, b in entry.items():
            assert b.block_id == bid and b.block_hash == h_
    hashed = {b.block_id for b in pool.blocks if b.block_hash is not None}
    in_map = {bid for e in pool.cached_block_hash_to_block.values() for bid in e}
    assert hashed == in_map


def check_sliding_windows(h: Harness, tables: dict[str, tuple[list[KVCacheBlock], ...]]) -> None:
    """A sliding group holds no block wholly before what its newest step can see, and every
    block any query from ``num_computed_tokens`` on can see."""
    kv = h.kv
    assert isinstance(kv, HybridKVCacheManager)
    null = kv.null_block
    for rid, groups in tables.items():
        r = h.scheduler.requests[rid]
        start = h.step_start[rid]
        for manager in kv._sliding:
            blocks = groups[manager.group_id]
            gone = manager.first_visible_block(start)
            kept = manager.first_visible_block(r.num_computed_tokens)
            assert all(b is null for b in blocks[:gone]), (rid, manager.group_id, start)
            assert all(b is not null for b in blocks[kept:]), (rid, manager.group_id, kept)
            live = len(blocks) - sum(1 for b in blocks if b is null)
            key = rid
            h.max_live_sliding[key] = max(h.max_live_sliding.get(key, 0), live)
