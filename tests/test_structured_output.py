"""Structured output: specs, grammar errors, and grammar requests on SmolLM2 in sync and
async mode (identical tokens; the forward of a deferred step still overlaps)."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future

import jsonschema
import pytest
import xgrammar as xgr

from forerun import SamplingParams, StructuredOutputsParams
from forerun.core.async_scheduler import AsyncScheduler
from forerun.core.kv_cache_manager import KVCacheManager
from forerun.core.scheduler import Scheduler, SchedulerConfig
from forerun.engine.core import EngineCore
from forerun.request import Request, RequestStatus
from forerun.structured.backend import validate_structured_outputs
from forerun.structured.manager import StructuredOutputManager
from forerun.trace import ENGINE_LANE, WORKER_LANE
from tests.conftest import assert_all_blocks_free
from tests.fake_executor import EOS, FakeExecutor

S = StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}
COLORS = {
    "type": "object",
    "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                   "minItems": 1, "maxItems": 3},
        "score": {"type": "number"},
    },
    "required": ["colors", "score"],
    "additionalProperties": False,
}
FLAGS = {
    "type": "object",
    "properties": {"mood": {"enum": ["happy", "sad"]}, "ok": {"type": "boolean"}},
    "required": ["mood", "ok"],
    "additionalProperties": False,
}
ARITH = r"""
root ::= term | term op term | term op term op term
term ::= num | "(" num op num ")"
num ::= [1-9] | [1-9] [0-9]
op ::= "+" | "-" | "*"
"""
_NUM = r"[1-9][0-9]?"
_OP = r"[+\-*]"
_TERM = rf"(?:{_NUM}|\({_NUM}{_OP}{_NUM}\))"
ARITH_RE = re.compile(rf"{_TERM}(?:{_OP}{_TERM}){{0,2}}")
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CHOICES = ["positive", "negative", "neutral"]


def greedy(max_tokens: int, so: S | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=so)


def seeded(max_tokens: int, seed: int, so: S | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=seed,
                          structured_outputs=so)


# (prompt, params): grammar and ordinary requests in one batch, greedy and seeded.
BATCH = [
    ("A person as JSON with name, age and address:", greedy(64, S(json=PERSON))),
    ("Favourite colours and a score, as JSON:", greedy(40, S(json=json.dumps(COLORS)))),
    ("How do you feel? Answer in JSON:", seeded(32, 5, S(json=FLAGS))),
    ("Any JSON object about a cat:", greedy(32, S(json_object=True))),
    ("Call me at", greedy(16, S(regex=PHONE))),
    ("My number is", seeded(16, 9, S(regex=PHONE))),
    ("The review 'I loved it' is", greedy(8, S(choice=CHOICES))),
    ("Sentiment of 'meh':", seeded(8, 3, S(choice=CHOICES))),
    ("A sum: ", greedy(16, S(grammar=ARITH))),
    ("The capital of France is", greedy(16)),
    ("Once upon a time", seeded(16, 7)),
]


@pytest.fixture(scope="module")
def runs(llm_cache):
    """The batch through the sync and the async engine; the async run is traced."""
    results = {}
    for mode in ("off", "on"):
        llm = llm_cache(async_scheduling=mode)
        tracer = llm.llm_engine.tracer
        tracer.reset()
        tracer.enabled = mode == "on"
        before = llm.stats().num_deferred_samplings
        try:
            outs = llm.generate([p for p, _ in BATCH], [sp for _, sp in BATCH],
                                use_tqdm=False)
        finally:
            tracer.enabled = False
        spans = list(tracer.spans)
        tracer.reset()
        deferred = llm.stats().num_deferred_samplings - before
        assert_all_blocks_free(llm)
        results[mode] = (llm, outs, deferred, spans)
    return results


def _matcher(llm, so: S) -> xgr.GrammarMatcher:
    backend = llm.llm_engine.scheduler.structured_output_manager.backend
    return xgr.GrammarMatcher(backend._compile(so))


def _check_prefix(llm, so: S, token_ids: list[int]) -> None:
    """A length-capped output must still be a prefix the grammar accepts, token by token."""
    m = _matcher(llm, so)
    for t in token_ids:
        assert m.accept_token(t), (so, token_ids)


@pytest.mark.parametrize("mode", ["off", "on"])
def test_outputs_follow_their_grammars(runs, mode):
    llm, outs, _, _ = runs[mode]
    finished_json = 0
    for (_, sp), out in zip(BATCH, outs, strict=True):
        so = sp.structured_outputs
        comp = out.outputs[0]
        assert comp.finish_reason in ("stop", "length"), comp
        if so is None:
            continue
        if comp.finish_reason == "length":
            _check_prefix(llm, so, comp.token_ids)
            continue
        text = comp.text
        if so.kind in ("json", "json_object"):
            value = json.loads(text)
            schema = so.json if isinstance(so.json, dict) else (
                json.loads(so.json) if so.json else {"type": "object"})
            jsonschema.validate(value, schema)
            finished_json += 1
        elif so.kind == "regex":
            assert re.fullmatch(so.regex, text), text
        elif so.kind == "choice":
            assert text in CHOICES, text
        elif so.kind == "grammar":
            assert ARITH_RE.fullmatch(text), text
    assert finished_json >= 2, [o.outputs[0].text for o in outs]


def test_async_and_sync_give_identical_tokens(runs):
    sync = [o.outputs[0].token_ids for o in runs["off"][1]]
    async_ = [o.outputs[0].token_ids for o in runs["on"][1]]
    assert sync == async_


def test_deferred_sampling_keeps_the_forward_overlapped(runs):
    assert runs["off"][2] == 0
    _, _, deferred, spans = runs["on"]
    assert deferred > 0
    forward = {s.step: s for s in spans if s.name == "forward" and s.lane == WORKER_LANE}
    update = {s.step: s for s in spans if s.name == "update" and s.lane == ENGINE_LANE}
    waits = [s for s in spans if s.name == "deferred_sample_wait"]
    assert len(waits) == deferred
    checked = hidden = started_first = 0
    for w in waits:
        f = forward.get(w.step)
        # The step applied inside the wait is the newest one before w.step.
        u = max((u for u in update.values() if u.step < w.step), key=lambda u: u.step,
                default=None)
        if f is None or u is None:
            continue
        checked += 1
        # The previous step's output is applied (its grammars advanced) inside the wait.
        assert w.start <= u.start and u.end <= w.end
        # Forward N+1 was queued before that wait; the mask for N+1 was ready, and its
        # sampling queued, before forward N+1 ended: the deferral cost the device nothing.
        hidden += w.end <= f.end
        # Often forward N+1 is already running while step N's output is being applied
        # (the two race for the GIL when the update is short, hence only counted).
        started_first += f.start < u.end
    assert checked > 0
    assert hidden >= 0.8 * checked, (hidden, started_first, checked)


def test_invalid_specs_raise_value_error_naming_the_problem(llm_cache):
    llm = llm_cache(async_scheduling="off")
    bad = {
        "structured_outputs.json": S(json={"type": "objec"}),
        "not valid JSON": S(json="{not json"),
        "structured_outputs.regex": S(regex="a(b"),
        "structured_outputs.grammar": S(grammar='root ::= "a" | '),
    }
    for needle, so in bad.items():
        with pytest.raises(ValueError, match=re.escape(needle)):
            llm.generate(["hi", "ok"], [greedy(4), greedy(4, so)], use_tqdm=False)
        with pytest.raises(ValueError, match=re.escape(needle)):
            llm.llm_engine.add_request("bad", "hi", greedy(4, so))
    assert not llm.llm_engine.has_unfinished_requests()
    assert_all_blocks_free(llm)


def test_params_need_exactly_one_field():
    with pytest.raises(ValueError, match="exactly one of"):
        S()
    with pytest.raises(ValueError, match="got json, regex"):
        S(json={}, regex="a")
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        S(choice=[])
    with pytest.raises(ValueError, match="unknown field"):
        SamplingParams(structured_outputs={"jsn": {}})
    sp = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert sp.structured_outputs == S(choice=["a", "b"])
    assert S(choice=["a", "b"]).to_dict() == {"choice": ["a", "b"]}
    validate_structured_outputs(S(choice=['say "hi"\n', "back\\slash"]))
    validate_structured_outputs(S(json_object=True))


# ----- scheduler level: a rejected token, a grammar that never compiles -----------------
def _core(async_on: bool, manager: StructuredOutputManager,
          executor: object | None = None) -> EngineCore:
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256,
                             defer_block_free=async_on)
    cls = AsyncScheduler if async_on else Scheduler
    scheduler = cls(config, KVCacheManager(64, 4, True), manager)
    return EngineCore(scheduler, executor or FakeExecutor(), 2 if async_on else 1)


def _request(rid: str, n_prompt: int, max_tokens: int, so: S | None = None) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=so)
    params.update_from_model([EOS])
    return Request(rid, list(range(10, 10 + n_prompt)), params)


def _run(core: EngineCore) -> dict[str, list]:
    got: dict[str, list] = {}
    for _ in range(200):
        if not core.has_work():
            break
        for o in core.run_step():
            got.setdefault(o.request_id, []).append(o)
    assert not core.has_work()
    return got


@pytest.mark.parametrize("async_on", [False, True])
def test_a_rejected_token_ends_only_its_own_request(grammar_backend, async_on):
    # FakeExecutor ignores the mask and emits ids no grammar accepts.
    core = _core(async_on, StructuredOutputManager(grammar_backend))
    core.add_request(_request("plain-a", 6, 5))
    core.add_request(_request("grammar", 7, 5, S(regex="[a-z]+")))
    core.add_request(_request("plain-b", 3, 4))
    got = _run(core)
    assert got["grammar"][-1].finish_reason == "error"
    assert all(not o.new_token_ids for o in got["grammar"])
    assert sum(len(o.new_token_ids) for o in got["plain-a"]) == 5
    assert got["plain-a"][-1].finish_reason == "length"
    assert got["plain-b"][-1].finish_reason == "length"
    kv = core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.block_pool.num_blocks
    assert core.stats().scheduler.num_grammar_rejected_tokens == 1


class _NeverCompiles:
    """A backend stand-in whose compilations never finish."""

    def __init__(self) -> None:
        self.futures: list[Future] = []

    def compile_async(self, params: S) -> Future:
        self.futures.append(Future())
        return self.futures[-1]

    def shutdown(self) -> None:
        pass


@pytest.mark.parametrize("async_on", [False, True])
def test_a_grammar_that_takes_too_long_fails_alone(async_on):
    core = _core(async_on, StructuredOutputManager(_NeverCompiles(), compile_timeout_s=0.05))
    core.add_request(_request("slow", 5, 4, S(json_object=True)))
    core.add_request(_request("plain", 5, 4))
    assert core.scheduler.requests["slow"].status == (
        RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR)
    got = _run(core)
    # The plain request ran while the grammar was pending, then the grammar timed out.
    assert got["plain"][-1].finish_reason == "length"
    assert [o.finish_reason for o in got["slow"]] == ["error"]
    assert core.stats().scheduler.num_grammar_compile_errors == 1
