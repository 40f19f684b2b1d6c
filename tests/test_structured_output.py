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


# ----- structured output after the reasoning (reasoning_parser) --------------------------
# A scripted "model": it wants to write its script token by token, but a step's grammar
# mask wins (it then takes the lowest id the mask allows), and it records whether each of
# its outputs was masked. Scripts are SmolLM2 token ids, the grammar backend's vocabulary.

class _ScriptedExecutor(FakeExecutor):
    def __init__(self, script: dict[str, list[int]]) -> None:
        super().__init__()
        self.script = script
        self.masked: dict[str, list[bool]] = {}

    def sample_tokens(self, grammar_bitmask: object = None):
        fut = super().sample_tokens(grammar_bitmask)
        out = fut.result()
        rows = ({} if grammar_bitmask is None
                else {r: i for i, r in enumerate(grammar_bitmask.req_ids)})
        for rid, ids in zip(out.req_ids, out.sampled_token_ids, strict=True):
            if not ids:
                continue
            done = self.masked.setdefault(rid, [])
            script = self.script[rid]
            token = script[len(done)] if len(done) < len(script) else EOS
            if rid in rows:
                words = grammar_bitmask.bitmask[rows[rid]].tolist()
                allowed = [32 * w + b for w, word in enumerate(words) for b in range(32)
                           if (word >> b) & 1]
                if token not in allowed:
                    token = allowed[0]
            done.append(rid in rows)
            ids[0] = self.sampled[rid][-1] = token
        return fut


def _scripted(grammar_backend, async_on: bool, reqs: list[tuple[str, list[int], S]],
              scripts: dict[str, list[int]]) -> tuple[dict[str, list[int]], dict[str, list]]:
    """Each request's output ids and masked-or-not flags, run on the scripted model."""
    executor = _ScriptedExecutor(scripts)
    core = _core(async_on, StructuredOutputManager(grammar_backend), executor)
    for rid, prompt, so in reqs:
        params = SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=so)
        params.update_from_model([EOS])
        core.add_request(Request(rid, prompt, params))
    got = _run(core)
    kv = core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.block_pool.num_blocks
    ids = {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in got.items()}
    for rid, outs in got.items():
        assert outs[-1].finish_reason == "stop", (rid, outs[-1])
    # Async scheduling samples once more past the stop token; that sample is dropped.
    masked = {rid: flags[:len(ids[rid])] for rid, flags in executor.masked.items()}
    return ids, masked


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


THREE_DIGITS = S(regex="[0-9]{3}")


@pytest.mark.parametrize("async_on", [False, True])
def test_the_grammar_starts_at_the_token_after_the_reasoning_ends(
        grammar_backend, smollm2_tokenizer, async_on):
    tok = smollm2_tokenizer
    # The thinking holds what [0-9]{3} forbids; the answer's first wish ("x") is forbidden.
    think = {"deepseek_r1": _ids(tok, "Hm, <a> {b} & 'c'?") + _ids(tok, "</think>"),
             "openai_gptoss": _ids(tok, "<|channel|>analysis<|message|>Hm, 'x'!<|end|>"
                                        "<|start|>assistant")
             + _ids(tok, "<|channel|>final <|constrain|>json<|message|>")}
    answer = _ids(tok, "x12") + _ids(tok, "34")
    prompt = _ids(tok, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    reqs = [(name, prompt, S(regex="[0-9]{3}", reasoning_parser=name)) for name in think]
    reqs.append(("plain", prompt, THREE_DIGITS))  # no parser: masked from the first token
    scripts = {name: think[name] + answer for name in think}
    scripts["plain"] = think["deepseek_r1"] + answer
    ids, masked = _scripted(grammar_backend, async_on, reqs, scripts)
    for name, reasoning in think.items():
        n = len(reasoning)
        # Every reasoning token as scripted (nothing masked), the marker's last included;
        # masked from the next token on, so the forbidden "x" was replaced.
        assert ids[name][:n] == reasoning
        assert masked[name] == [False] * n + [True] * (len(ids[name]) - n)
        assert ids[name][n] != answer[0]
        text = tok.decode(ids[name][n:], skip_special_tokens=True)
        assert re.fullmatch("[0-9]{3}", text), text
    assert all(masked["plain"]) and ids["plain"][0] != scripts["plain"][0]
    assert re.fullmatch("[0-9]{3}", tok.decode(ids["plain"], skip_special_tokens=True))


def test_reasoning_gate_is_the_same_under_sync_and_async_scheduling(grammar_backend,
                                                                    smollm2_tokenizer):
    tok = smollm2_tokenizer
    script = _ids(tok, "ok") + _ids(tok, "</think>") + _ids(tok, '{"n": 7}')
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    reqs = [(f"r{i}", _ids(tok, f"prompt {i}"), S(json=schema, reasoning_parser="qwen3"))
            for i in range(3)]
    # r1's prompt closed the thought already (Qwen3 with thinking off): masked at once.
    reqs[1] = ("r1", _ids(tok, "q<think>\n\n</think>\n\n"), reqs[1][2])
    scripts = {rid: script for rid, _, _ in reqs}
    sync, sync_masked = _scripted(grammar_backend, False, reqs, scripts)
    async_, async_masked = _scripted(grammar_backend, True, reqs, scripts)
    assert sync == async_ and sync_masked == async_masked
    assert all(sync_masked["r1"]) and not any(sync_masked["r0"][:4])
    for rid in ("r0", "r2"):
        assert json.loads(tok.decode(sync[rid][4:], skip_special_tokens=True)) == {"n": 7}
    jsonschema.validate(json.loads(tok.decode(sync["r1"], skip_special_tokens=True)), schema)


def test_enable_in_reasoning_constrains_the_reasoning_too(grammar_backend,
                                                         smollm2_tokenizer):
    tok = smollm2_tokenizer
    so = S(regex="[0-9]{3}", reasoning_parser="deepseek_r1", enable_in_reasoning=True)
    assert so.after_reasoning is None and S(**{**so.to_dict(), "enable_in_reasoning": None}) \
        .after_reasoning == "deepseek_r1"
    script = _ids(tok, "Hm</think>123")
    ids, masked = _scripted(grammar_backend, False, [("r", _ids(tok, "p"), so)],
                            {"r": script})
    assert all(masked["r"]) and ids["r"][0] != script[0]


def test_an_unknown_reasoning_parser_is_refused_before_it_runs():
    with pytest.raises(ValueError, match="structured_outputs.reasoning_parser: .*known: "
                                         "deepseek_r1, openai_gptoss, qwen3"):
        validate_structured_outputs(S(regex="a", reasoning_parser="r1"))
    with pytest.raises(ValueError, match="reasoning_parser: must be a string"):
        S(regex="a", reasoning_parser=1)


def test_the_model_thinks_freely_then_answers_in_json_sync_and_async(llm_cache):
    # SmolLM2 continues the pattern on its own (greedy): its thought holds "<" and "!",
    # which the schema forbids; only what follows its </think> is constrained.
    count = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
             "additionalProperties": False}
    shots = "".join(f'<think>n < {k}!</think>\n{{"n": {k}}}\n' for k in range(1, 5))
    prompts = [shots + "<think>", "Count up.\n" + shots + "<think>"]
    params = [greedy(30, S(json=count, reasoning_parser="deepseek_r1")),
              seeded(30, 11, S(json=count, reasoning_parser="deepseek_r1"))]
    outs = {}
    for mode in ("off", "on"):
        llm = llm_cache(async_scheduling=mode)
        outs[mode] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert_all_blocks_free(llm)
    assert [o.token_ids for o in outs["off"]] == [o.token_ids for o in outs["on"]]
    for o in outs["on"]:
        thought, sep, answer = o.text.partition("</think>")
        assert sep and re.search("[<!]", thought), o.text
        jsonschema.validate(json.loads(answer), count)
        assert o.finish_reason == "stop"
