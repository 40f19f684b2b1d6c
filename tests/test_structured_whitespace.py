"""JSON constraints bound whitespace by default; ``disable_any_whitespace=False`` restores
any whitespace; a structured output cut by ``max_tokens`` says ``length``."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
import xgrammar as xgr

from forerun import SamplingParams, StructuredOutputsParams
from forerun.server.structured import structured_outputs_of
from tests.conftest import assert_all_blocks_free
from tests.server_harness import MODEL

S = StructuredOutputsParams

# The schema: greedy decoding on SmolLM2 ran away in newlines between its fields.
TAGS = {
    "type": "object",
    "properties": {"tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                   "ok": {"type": "boolean"}},
    "required": ["tags", "ok"],
    "additionalProperties": False,
}
# Whitespace JSON allows between tokens (json.loads parses it), as in the output.
RUNAWAY = '{"tags":["blue","blue","blue"]\n\n,\n"ok"\n\n:\n\n\n\ntrue}'
VALUE = {"tags": ["blue", "blue", "blue"], "ok": True}


@pytest.fixture(scope="module")
def llm(llm_cache: Any) -> Any:
    # The same configuration as test_structured_output.py: one engine for both.
    return llm_cache(async_scheduling="off")


def _matcher(llm: Any, so: S) -> xgr.GrammarMatcher:
    backend = llm.llm_engine.scheduler.structured_output_manager.backend
    return xgr.GrammarMatcher(backend._compile(so))


def _accepts(llm: Any, so: S, text: str) -> bool:
    """Whether the grammar takes ``text`` and is then complete (only EOS may follow)."""
    m = _matcher(llm, so)
    return m.accept_string(text) and m.is_completed()


def test_runaway_whitespace_is_json_the_old_grammar_accepted() -> None:
    # The oracle for the tests below: the string is JSON and matches the schema.
    jsonschema.validate(json.loads(RUNAWAY), TAGS)


@pytest.mark.parametrize("so", [S(json=TAGS), S(json=json.dumps(TAGS)),
                                S(json=TAGS, disable_any_whitespace=True)],
                         ids=["default", "schema-string", "disable_any_whitespace"])
def test_json_schema_refuses_runaway_whitespace_and_accepts_compact_json(llm: Any,
                                                                          so: S) -> None:
    assert not _accepts(llm, so, RUNAWAY)
    m = _matcher(llm, so)
    assert m.accept_string('{"tags": ["blue"]')
    assert not m.accept_string("\n\n\n")
    # json.dumps's one-line form (", " and ": ") is the form the grammar allows.
    assert _accepts(llm, so, json.dumps(VALUE))


def test_disable_any_whitespace_false_restores_any_whitespace(llm: Any) -> None:
    so = S(json=TAGS, disable_any_whitespace=False)
    assert _accepts(llm, so, RUNAWAY)
    assert _accepts(llm, so, json.dumps(VALUE, indent=4))
    assert _accepts(llm, so, json.dumps(VALUE, separators=(",", ":")))


def test_json_object_bounds_whitespace_unless_asked_for_any(llm: Any) -> None:
    text = '{"a"\n\n\n:\n\n1}'
    assert json.loads(text) == {"a": 1}
    assert not _accepts(llm, S(json_object=True), text)
    assert _accepts(llm, S(json_object=True), json.dumps({"a": 1, "b": [True, None]}))
    assert _accepts(llm, S(json_object=True, disable_any_whitespace=False), text)


def test_compiled_grammars_are_cached_per_whitespace_option(llm: Any) -> None:
    # Alternate the option on one schema: a cache keyed on the schema alone would hand the
    # first compilation to the second request.
    for daw in (None, False, None, False):
        assert _accepts(llm, S(json=TAGS, disable_any_whitespace=daw), RUNAWAY) is (
            daw is False)


def test_disable_any_whitespace_must_be_a_boolean() -> None:
    with pytest.raises(ValueError, match="disable_any_whitespace: must be a boolean"):
        S(json=TAGS, disable_any_whitespace="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="disable_any_whitespace: must be a boolean"):
        SamplingParams(structured_outputs={"json": TAGS, "disable_any_whitespace": 1})
    sp = SamplingParams(structured_outputs={"json": TAGS, "disable_any_whitespace": False})
    assert sp.structured_outputs.to_dict() == {"json": TAGS, "disable_any_whitespace": False}


@pytest.mark.parametrize("fields, kind", [
    ({"response_format": {"type": "json_object"}}, "json_object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": TAGS}}}, "json"),
    ({"guided_json": TAGS}, "json"),
])
def test_server_structured_outputs_options_apply_to_the_other_field(fields: dict[str, Any],
                                                                    kind: str) -> None:
    so = structured_outputs_of({**fields, "structured_outputs": {"disable_any_whitespace": False}})
    assert so is not None and so.kind == kind and so.disable_any_whitespace is False
    so = structured_outputs_of(fields)
    assert so is not None and so.disable_any_whitespace is None


def test_server_structured_outputs_options_alone_are_refused() -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        structured_outputs_of({"structured_outputs": {"disable_any_whitespace": False}})


def test_greedy_json_validates_with_no_stray_whitespace(llm: Any) -> None:
    out = llm.chat([{"role": "user", "content": "List tags for a post about colours and say "
                     "whether it is ok, as JSON."}],
                   SamplingParams(max_tokens=80, temperature=0.0,
                                  structured_outputs=S(json=TAGS)), use_tqdm=False)
    comp = out[0].outputs[0]
    assert comp.finish_reason == "stop", comp
    value = json.loads(comp.text)
    jsonschema.validate(value, TAGS)
    # json.dumps writes the same value in the one-line form: nothing else was added.
    assert comp.text == json.dumps(value, ensure_ascii=False)
    assert_all_blocks_free(llm)


def test_structured_output_cut_by_max_tokens_finishes_with_length(llm: Any) -> None:
    so = S(json=TAGS)
    out = llm.generate(["Tags as JSON:"], SamplingParams(max_tokens=4, temperature=0.0,
                                                         structured_outputs=so),
                       use_tqdm=False)
    comp = out[0].outputs[0]
    assert len(comp.token_ids) == 4
    with pytest.raises(json.JSONDecodeError):
        json.loads(comp.text)
    assert comp.finish_reason == "length"
    m = _matcher(llm, so)   # what was delivered is a prefix the grammar accepts
    assert all(m.accept_token(t) for t in comp.token_ids)


# ----- through the server ---------------------------------------------------------------
@pytest.mark.slow
def test_server_cut_json_says_length_and_the_option_is_an_extra(
        shared_server_client: openai.OpenAI) -> None:
    client = shared_server_client
    ask = [{"role": "user", "content": "Tags for a post about colours, as JSON."}]
    rf = {"type": "json_schema", "json_schema": {"name": "tags", "schema": TAGS}}
    r = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=4,
                                       temperature=0, response_format=rf)
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.choices[0].message.content)
    r = client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=80, temperature=0, response_format=rf,
        extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), TAGS)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=ask, max_tokens=4, response_format=rf,
            extra_body={"structured_outputs": {"disable_any_whitespace": "no"}})
    assert "disable_any_whitespace" in e.value.body["message"], e.value.body
