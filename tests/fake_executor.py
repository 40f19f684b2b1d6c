"""A deterministic, pipelined fake worker: a test double for scheduler and engine tests.

It keeps its own view of each request (as a real worker does), samples a token only when
a step reaches the end of the sequence, and emits position-tagged tokens so that tests can
check each output was sampled for the right position.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from forerun.core.output import ModelRunnerOutput, SchedulerOutput

EOS = 2


def token_for(req_id: str, position: int) -> int:
    """A token id that encodes the position it was sampled for (never EOS)."""
    return 100_000 + position * 1_000 + (sum(map(ord, req_id)) % 997)


@dataclass
class _WorkerReq:
    prompt_len: int
    num_tokens: int  # known + sampled-by-this-worker
    num_computed: int = 0
    num_drafts: int = 0  # drafts this worker holds for the request's next step


def hash_accept(seed: int) -> Callable[[str, int, int], int]:
    """A scripted acceptance: a pseudo-random number of the ``d`` drafts, from (id, position)."""
    def accept(req_id: str, position: int, d: int) -> int:
        return (hash((seed, req_id, position)) & 0xFFFF) % (d + 1)
    return accept


@dataclass
class FakeExecutor:
    """Executes steps in FIFO order; ``eos_at[req_id] = k`` makes the k-th output EOS.

    With ``strict`` (the default) it also cross-checks the scheduler against its own view:
    a running request's ``num_computed_tokens`` must match what this worker computed, no
    step may compute a position whose token does not exist yet, and a resumed request must
    come back with exactly its prompt plus every token this worker sampled for it.
    """

    eos_at: dict[str, int] = field(default_factory=dict)
    reqs: dict[str, _WorkerReq] = field(default_factory=dict)
    prompt_lens: dict[str, int] = field(default_factory=dict)
    executed: list[SchedulerOutput] = field(default_factory=list)
    strict: bool = True
    prompts: dict[str, list[int]] = field(default_factory=dict)
    sampled: dict[str, list[int]] = field(default_factory=dict)
    # Speculative decoding: drafts found for a request whose next token is at `position`
    # (at most num_speculative_tokens), and how many of d drafts at `position` are accepted.
    num_speculative_tokens: int = 0
    drafts_found: Callable[[str, int], int] | None = None
    accept: Callable[[str, int, int], int] | None = None
    # Rejected drafts per step sampled here whose output the scheduler has not applied: the
    # scheduler's num_computed_tokens is ahead of this worker's by exactly these.
    unapplied_rejections: dict[int, dict[str, int]] = field(default_factory=dict)
    # A KV connector's worker half (tests/fake_kv_connector.py), if the scheduler has one.
    kv_connector: Any = None
    _pending: list[SchedulerOutput] = field(default_factory=list)

    def mark_applied(self, step_id: int) -> None:
        """The scheduler applied this step's output (the harness calls this)."""
        self.unapplied_rejections.pop(step_id, None)

    def execute_model(self, so: SchedulerOutput) -> Future[None]:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.reqs.pop(rid, None)
        for new in so.scheduled_new_reqs:
            prompt = self.prompts.setdefault(new.req_id, list(new.prompt_token_ids))
            if self.strict:
                expected = prompt + self.sampled.get(new.req_id, [])
                assert new.prompt_token_ids == expected, (
                    f"{new.req_id} resumed with {new.prompt_token_ids}, worker has {expected}")
            plen = self.prompt_lens.setdefault(new.req_id, len(new.prompt_token_ids))
            self.reqs[new.req_id] = _WorkerReq(plen, len(new.prompt_token_ids))
        for rid, c in zip(so.scheduled_cached_reqs.req_ids,
                          so.scheduled_cached_reqs.num_computed_tokens, strict=True):
            if self.strict:
                ahead = sum(r.get(rid, 0) for r in self.unapplied_rejections.values())
                assert self.reqs[rid].num_computed + ahead == c, (
                    f"{rid}: scheduler says {c} computed, worker has {self.reqs[rid]} "
                    f"and {ahead} rejected drafts not yet applied")
        for new in so.scheduled_new_reqs:
            self.reqs[new.req_id].num_computed = new.num_computed_tokens
        if self.kv_connector is not None and so.kv_connector_metadata is not None:
            self.kv_connector.start(so.kv_connector_metadata)
        self._pending.append(so)
        self.executed.append(so)
        f: Future[None] = Future()
        f.set_result(None)
        return f

    def sample_tokens(self, grammar_bitmask: object = None) -> Future[ModelRunnerOutput]:
        so = self._pending.pop(0)
        req_ids, sampled = [], []
        out = ModelRunnerOutput([], {}, [])
        rejections: dict[str, int] = {}
        for rid, n in so.num_scheduled_tokens.items():
            r = self.reqs[rid]
            num_spec = so.scheduled_spec_decode_tokens.get(rid, 0)
            assert num_spec <= self.num_speculative_tokens, (rid, num_spec)
            d = min(num_spec, r.num_drafts)  # a real drafter may have found fewer
            end = r.num_computed + n - num_spec  # the end of the known tokens computed
            if self.strict:
                assert end <= r.num_tokens, f"{rid}: computes position {end - 1} of {r}"
                assert not num_spec or end == r.num_tokens, f"{rid}: drafts mid-prompt {r}"
            ids: list[int] = []
            if end >= r.num_tokens:  # reached the end of the sequence: this step samples
                a = self.accept(rid, end, d) if d and self.accept is not None else 0
                assert 0 <= a <= d
                for j in range(a + 1):
                    out_index = end + j - r.prompt_len + 1
                    ids.append(EOS if self.eos_at.get(rid) == out_index
                               else token_for(rid, end + j))
                r.num_tokens = end + a + 1
                self.sampled.setdefault(rid, []).extend(ids)
                r.num_computed = end + a
                if d:
                    out.num_draft_tokens[rid] = d
                if num_spec:
                    rejections[rid] = num_spec - a
                r.num_drafts = (min(self.num_speculative_tokens,
                                    self.drafts_found(rid, r.num_tokens))
                                if self.drafts_found is not None else 0)
                out.num_next_draft_tokens[rid] = r.num_drafts
            else:
                r.num_computed = end
            req_ids.append(rid)
            sampled.append(ids)
        if rejections:
            self.unapplied_rejections[so.step_id] = rejections
        if self.kv_connector is not None:
            out.kv_connector_output = self.kv_connector.finish_step()
        out.req_ids, out.sampled_token_ids = req_ids, sampled
        out.req_id_to_index = {r: i for i, r in enumerate(req_ids)}
        f: Future[ModelRunnerOutput] = Future()
        f.set_result(out)
        return f
