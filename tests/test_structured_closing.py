"""The budget-aware ending of JSON outputs (forerun/structured/closing.py).

Oracles: ``json.loads`` and ``jsonschema`` (with its format checker) for every completion
and every output the closing phase ended; the same request with
``disable_budget_closing=True`` (same seed) for the tokens before the closing phase; the
synchronous engine for the asynchronous one; the ``openai`` client against the server.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import jsonschema
import openai
import pytest
import xgrammar as xgr

from forerun import SamplingParams, StructuredOutputsParams
from forerun.server.structured import structured_outputs_of
from forerun.structured.closing import CLOSING_MARGIN, JsonLexer, walk_completion
from forerun.structured.manager import StructuredOutputManager
from tests.conftest import assert_all_blocks_free
from tests.server_harness import MODEL

S = StructuredOutputsParams
CHECKER = jsonschema.FormatChecker()

TAGS = {"type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string"}},
                       "ok": {"type": "boolean"}},
        "required": ["tags", "ok"]}
BOOK = {"type": "object", "properties": {
    "title": {"type": "string"},
    "authors": {"type": "array", "minItems": 1, "items": {
        "type": "object", "properties": {"name": {"type": "string"},
                                         "born": {"type": "integer", "minimum": 1000}},
        "required": ["name", "born"]}},
    "year": {"type": "integer"}}, "required": ["title", "authors", "year"]}
FORMATS = {"type": "object", "properties": {
    "when": {"type": "string", "format": "date-time"},
    "day": {"type": "string", "format": "date"},
    "email": {"type": "string", "format": "email"},
    "ip": {"type": "string", "format": "ipv4"},
    "phone": {"type": "string", "pattern": "^\\+?[0-9]{7,12}$"},
    "code": {"type": "string", "minLength": 3, "maxLength": 5},
    "level": {"enum": ["debug", "info", "warning"]},
    "n": {"type": "number", "minimum": 1, "maximum": 9},
    "note": {"type": ["string", "null"]}},
    "required": ["when", "day", "email", "ip", "phone", "code", "level", "n"]}
# Documents in each schema; every prefix of each is a state the walk must complete from.
DOCS = [
    (TAGS, {"tags": ["red", "blue \"sky\"", "a\\b"], "ok": True}),
    (BOOK, {"title": "Dune", "authors": [{"name": "Frank Herbert", "born": 1920}],
            "year": 1965}),
    (FORMATS, {"when": "2024-05-06T07:08:09.5+02:00", "day": "2024-05-06",
               "email": "ann@example.org", "ip": "10.0.0.1", "phone": "+1234567",
               "code": "abcd", "level": "info", "n": 2.5, "note": None}),
    (None, {"a": [1, 2.5, {"b": None}], "c": "x"}),
]


def _spec(schema: dict[str, Any] | None, **opts: Any) -> S:
    return S(json_object=True, **opts) if schema is None else S(json=schema, **opts)


@functools.cache
def _validator(schema_json: str) -> Any:
    """One validator per schema: ``jsonschema.validate`` checks the schema itself on every
    call, most of its time over the hundreds of prefixes below."""
    schema = json.loads(schema_json)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema, format_checker=CHECKER)


def _valid(text: str, schema: dict[str, Any] | None) -> None:
    _validator(json.dumps(schema or {"type": "object"}, sort_keys=True)).validate(json.loads(text))


# ----- the plan: from every prefix of a document, a completion the schema validates -----
@pytest.mark.parametrize("any_ws", [False, True])
@pytest.mark.parametrize("schema, value", DOCS)
def test_every_prefix_completes_to_json_the_schema_validates(grammar_backend, schema, value, any_ws):
    so = _spec(schema, disable_any_whitespace=not any_ws)
    compiled = grammar_backend._compile(so)
    doc = json.dumps(value)  # ", " and ": ": what the compact grammar takes
    planner = grammar_backend.closing_planner()
    for end in range(len(doc) + 1):
        m = xgr.GrammarMatcher(compiled)
        assert m.accept_string(doc[:end]), doc[:end]
        lexer = JsonLexer()
        lexer.feed(doc[:end].encode())
        rest = walk_completion(m.fork(), lexer)
        assert rest is not None, doc[:end]
        _valid(doc[:end] + rest, schema)
        ids = planner.plan(m, lexer)
        assert ids is not None
        # The plan's tokens spell a completion the grammar accepts to its end.
        for t in ids:
            assert m.accept_token(t)
        assert m.is_completed()
        _valid(doc[:end] + "".join(planner.token_bytes[t].decode() for t in ids), schema)


def test_the_plan_closes_the_innermost_structure_first(grammar_backend):
    so = S(json=TAGS)
    m = xgr.GrammarMatcher(grammar_backend._compile(so))
    prefix = '{"tags": ["blue", "bl'
    assert m.accept_string(prefix)
    lexer = JsonLexer()
    lexer.feed(prefix.encode())
    assert walk_completion(m.fork(), lexer) == '"], "ok": false}'
    assert lexer.in_value_string and lexer.stack == [ord("{"), ord("[")]


# ----- the option ----------------------------------------------------------------------
def test_the_option_is_a_boolean_for_json_choice_and_regex():
    assert S(json=TAGS).budget_closing and S(json_object=True).budget_closing
    assert S(regex="a+").budget_closing and S(choice=["a"]).budget_closing
    assert not S(grammar='root ::= "a"').budget_closing
    for spec in (S(json=TAGS, disable_budget_closing=True),
                 S(regex="a+", disable_budget_closing=True),
                 S(choice=["a"], disable_budget_closing=True)):
        assert not spec.budget_closing
    with pytest.raises(ValueError, match="disable_budget_closing: must be a boolean"):
        S(json=TAGS, disable_budget_closing="yes")
    with pytest.raises(ValueError, match="disable_budget_closing"):
        SamplingParams(structured_outputs={"json": TAGS, "disable_budget_closing": 1})
    so = S(json=TAGS, disable_budget_closing=True)
    assert S.from_any(so.to_dict()) == so
    # On the server, beside response_format (an options-only structured_outputs object).
    rf = {"type": "json_schema", "json_schema": {"schema": TAGS}}
    got = structured_outputs_of({"response_format": rf,
                                 "structured_outputs": {"disable_budget_closing": True}})
    assert got == so


# ----- end to end on SmolLM2 -----------------------------------------------------------
ASK = [
    ("List the tags of a blog post about colours and say whether it is ok.", TAGS),
    ("Describe a book: its title, authors and year.", BOOK),
    ("Describe a cat as a JSON object.", None),
]
MAX_TOKENS = 40


def _params(schema, temperature: float, seed: int | None, **opts: Any) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=seed,
                          structured_outputs=_spec(schema, **opts))


def _chat(llm, temperature: float, monkeypatch: pytest.MonkeyPatch | None = None,
          **opts: Any) -> tuple[list[Any], dict[str, tuple[int, int]]]:
    """Outputs of every ASK (seeded when sampling), and where each closing phase began
    (the tokens delivered before it, and the length of the plan it began with)."""
    starts: dict[str, tuple[int, int]] = {}
    if monkeypatch is not None:
        original = StructuredOutputManager._close_within_budget

        def spy(self, request, row):
            original(self, request, row)
            st = request.structured_output_request.closing
            if st.started_at is not None and request.request_id not in starts:
                starts[request.request_id] = (st.started_at, len(st.plan))

        monkeypatch.setattr(StructuredOutputManager, "_close_within_budget", spy)
    convs = [[{"role": "user", "content": p + " Answer in JSON."}] for p, _ in ASK]
    params = [_params(schema, temperature, i + 3 if temperature else None, **opts)
              for i, (_, schema) in enumerate(ASK)]
    outs = llm.chat(convs, params, use_tqdm=False)
    if monkeypatch is not None:
        monkeypatch.undo()
    assert_all_blocks_free(llm)
    return outs, starts


@pytest.fixture(scope="module", params=[0.0, 0.7], ids=["greedy", "t0.7"])
def runs(request, llm_cache):
    """Closing on (sync, async) and off (sync), for the same seeded requests."""
    temperature = request.param
    mp = pytest.MonkeyPatch()
    on_sync, starts = _chat(llm_cache(async_scheduling="off"), temperature, mp)
    on_async, _ = _chat(llm_cache(async_scheduling="on"), temperature)
    off, _ = _chat(llm_cache(async_scheduling="off"), temperature,
                   disable_budget_closing=True)
    return on_sync, on_async, off, starts


def test_closed_outputs_are_json_the_schema_validates(runs):
    on, _, off, starts = runs
    closed = 0
    for (_, schema), out, out_off in zip(ASK, on, off, strict=True):
        comp = out.outputs[0]
        assert len(comp.token_ids) <= MAX_TOKENS
        _valid(comp.text, schema)
        if out.request_id in starts:
            closed += 1
            # Ended by the budget, not by the model: said honestly.
            assert comp.finish_reason == "length", comp
        else:
            assert comp.finish_reason == "stop", comp
            assert comp.token_ids == out_off.outputs[0].token_ids
    # The budget is too small for these prompts: without the ending, JSON is cut.
    cut = [o for o in off if o.outputs[0].finish_reason == "length"]
    assert closed >= 2 and len(cut) >= 2
    for o in cut:
        with pytest.raises(json.JSONDecodeError):
            json.loads(o.outputs[0].text)


def test_tokens_before_the_closing_phase_are_the_unconstrained_ones(runs):
    on, _, off, starts = runs
    assert starts
    for out, out_off in zip(on, off, strict=True):
        if out.request_id not in starts:
            continue
        start, plan_len = starts[out.request_id]
        # The phase begins only within reach of the end: the plan's length plus the margin.
        assert MAX_TOKENS - start <= plan_len + CLOSING_MARGIN
        assert out.outputs[0].token_ids[:start] == out_off.outputs[0].token_ids[:start]
        assert out.outputs[0].token_ids != out_off.outputs[0].token_ids


def test_async_gives_the_tokens_of_sync(runs):
    on_sync, on_async, _, _ = runs
    assert [o.outputs[0].token_ids for o in on_sync] == \
        [o.outputs[0].token_ids for o in on_async]
    assert [o.outputs[0].finish_reason for o in on_sync] == \
        [o.outputs[0].finish_reason for o in on_async]


def test_a_budget_too_small_for_any_completion_is_still_cut(llm_cache):
    llm = llm_cache(async_scheduling="off")
    out = llm.generate(["Tags as JSON:"], SamplingParams(
        max_tokens=4, temperature=0.0, structured_outputs=S(json=TAGS)), use_tqdm=False)
    comp = out[0].outputs[0]
    assert len(comp.token_ids) == 4 and comp.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(comp.text)


# ----- through the server --------------------------------------------------------------
@pytest.mark.slow
def test_server_closes_json_within_max_tokens_unless_disabled(
        shared_server_client: openai.OpenAI) -> None:
    client = shared_server_client
    ask = [{"role": "user", "content": ASK[0][0] + " Answer in JSON."}]
    rf = {"type": "json_schema", "json_schema": {"name": "tags", "schema": TAGS}}
    r = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=MAX_TOKENS,
                                       temperature=0, response_format=rf)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens <= MAX_TOKENS
    _valid(r.choices[0].message.content, TAGS)
    r = client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=MAX_TOKENS, temperature=0, response_format=rf,
        extra_body={"structured_outputs": {"disable_budget_closing": True}})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == MAX_TOKENS
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.choices[0].message.content)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=ask, max_tokens=4, response_format=rf,
            extra_body={"structured_outputs": {"disable_budget_closing": "no"}})
    assert "disable_budget_closing" in e.value.body["message"], e.value.body


# ----- choice and regex: a whole choice, a full match ----------------------------------
# Long choices; the shortest, "blue whale swimming", takes 3 tokens (checked below).
CHOICES = ["yellow submarine in the sea", "green grass of the valley", "blue whale swimming"]
WORD = r"[a-z]{3,20}\."
COLOUR = [{"role": "user", "content": "My favourite colour is"}]
LONG_WORD = [{"role": "user", "content": "The longest word I know is"}]


def _fewest_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("mode", ["off", "on"])
def test_choice_and_regex_end_inside_their_language_sync_and_async(llm_cache, mode):
    llm = llm_cache(async_scheduling=mode)
    shortest = min(_fewest_tokens(llm.get_tokenizer(), c) for c in CHOICES)
    assert shortest == 3
    cases = [(COLOUR, S(choice=CHOICES), shortest, lambda t: t in CHOICES),
             (LONG_WORD, S(regex=WORD), 3, lambda t: re.fullmatch(WORD, t))]
    for conv, spec, max_tokens, ok in cases:
        on, off = (llm.chat(conv, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                 structured_outputs=s), use_tqdm=False)[0]
                   .outputs[0]
                   for s in (spec, S(**{**spec.to_dict(), "disable_budget_closing": True})))
        # Without the ending max_tokens cuts the answer mid-word (the bug); with it the
        # answer is whole, in no more tokens.
        assert off.finish_reason == "length" and not ok(off.text), off
        assert ok(on.text) and len(on.token_ids) <= max_tokens, on
        assert on.finish_reason in ("stop", "length")
    assert_all_blocks_free(llm)


def test_async_choice_and_regex_endings_give_the_tokens_of_sync(llm_cache):
    outs = []
    for mode in ("off", "on"):
        llm = llm_cache(async_scheduling=mode)
        outs.append([llm.chat(conv, SamplingParams(max_tokens=4, temperature=0.8, seed=5,
                                                   structured_outputs=spec),
                              use_tqdm=False)[0].outputs[0].token_ids
                     for conv, spec in ((COLOUR, S(choice=CHOICES)), (LONG_WORD, S(regex=WORD)))])
    assert outs[0] == outs[1]


def test_a_choice_or_regex_budget_too_small_for_any_answer_is_still_cut(llm_cache):
    llm = llm_cache(async_scheduling="off")
    for conv, spec, max_tokens in ((COLOUR, S(choice=CHOICES), 2),
                                   (LONG_WORD, S(regex=r"[a-z]{15,20}\."), 1)):
        comp = llm.chat(conv, SamplingParams(max_tokens=max_tokens, temperature=0,
                                             structured_outputs=spec), use_tqdm=False)[0].outputs[0]
        assert len(comp.token_ids) == max_tokens and comp.finish_reason == "length", comp
        assert comp.text not in CHOICES and not re.fullmatch(spec.regex or "x^", comp.text)


def test_a_choice_that_fits_is_the_models_own(llm_cache):
    # Room for the model's own answer: narrowing removes nothing it would have chosen.
    llm = llm_cache(async_scheduling="off")
    on, off = (llm.chat(COLOUR, SamplingParams(max_tokens=16, temperature=0, structured_outputs=s),
                        use_tqdm=False)[0].outputs[0]
               for s in (S(choice=CHOICES), S(choice=CHOICES, disable_budget_closing=True)))
    assert on.token_ids == off.token_ids and on.text in CHOICES


@pytest.mark.slow
def test_server_ends_choice_and_regex_inside_their_language(
        shared_server_client: openai.OpenAI) -> None:
    client = shared_server_client
    for extra, max_tokens, ok in (({"guided_choice": CHOICES}, 3, lambda t: t in CHOICES),
                                  ({"structured_outputs": {"choice": CHOICES}}, 3,
                                   lambda t: t in CHOICES),
                                  ({"guided_regex": WORD}, 3, lambda t: re.fullmatch(WORD, t))):
        ask = COLOUR if "regex" not in str(extra) else LONG_WORD
        r = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=max_tokens,
                                           temperature=0, extra_body=extra)
        assert ok(r.choices[0].message.content), (extra, r.choices[0])
        assert r.usage.completion_tokens <= max_tokens
        off = dict(extra)
        if "structured_outputs" in off:
            off["structured_outputs"] = {**off["structured_outputs"],
                                         "disable_budget_closing": True}
        else:
            off["structured_outputs"] = {"disable_budget_closing": True}
        r = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=max_tokens,
                                           temperature=0, extra_body=off)
        assert r.choices[0].finish_reason == "length"
        assert not ok(r.choices[0].message.content), (off, r.choices[0])
    # No answer fits in 2 tokens: cut, finish reason length, as before.
    r = client.completions.create(model=MODEL, prompt="My favourite colour is", max_tokens=2,
                                  temperature=0, extra_body={"guided_choice": CHOICES})
    assert r.choices[0].finish_reason == "length" and r.choices[0].text not in CHOICES
