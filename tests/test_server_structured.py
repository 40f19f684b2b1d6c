"""Structured output through ``forerun serve`` (engine in its own process), openai client."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import openai
import pytest

from tests.server_harness import MODEL, ServerHandle, start_server

pytestmark = pytest.mark.slow


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20},
                   "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
        "additionalProperties": False}
ASK = [{"role": "user", "content": "Name a big city and its population, as JSON."}]


@pytest.fixture(scope="module")
def server() -> ServerHandle:
    handle = start_server()  # same arguments as test_server.py: the session shares it
    handle.wait_healthy()
    return handle


@pytest.fixture()
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_chat_response_format_json_schema(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=48, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": SCHEMA}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_chat_response_format_json_object(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=48, temperature=0,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("extra, check", [
    ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ({"guided_regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
    ({"structured_outputs": {"choice": ["red", "blue"]}}, lambda t: t in ("red", "blue")),
    ({"guided_json": FLAG}, lambda t: jsonschema.validate(json.loads(t), FLAG) is None),
])
def test_completion_vllm_fields(client: openai.OpenAI, extra: dict[str, Any], check) -> None:
    r = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=48, temperature=0,
                                  extra_body=extra)
    assert r.choices[0].finish_reason == "stop"
    assert check(r.choices[0].text), r.choices[0].text


@pytest.mark.parametrize("extra, param", [
    ({"guided_regex": "a(b"}, "structured_outputs.regex"),
    ({"guided_json": {"type": "objec"}}, "structured_outputs.json"),
    ({"structured_outputs": {"grammar": 'root ::= "a" | '}}, "structured_outputs.grammar"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "structured_outputs"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
])
def test_invalid_specs_are_400(client: openai.OpenAI, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Answer:", max_tokens=4, extra_body=extra)
    assert e.value.status_code == 400
    assert param in e.value.body["message"], e.value.body


def test_batched_chat_completions_one_choice_per_conversation(server: ServerHandle,
                                                              client: openai.OpenAI) -> None:
    # vLLM's /v1/chat/completions/batch: messages is a list of conversations, structured
    # output applies to each. Oracle: each conversation sent alone to /v1/chat/completions.
    import httpx

    convs = [ASK, [{"role": "user", "content": "Describe Paris as JSON."}]]
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    r = httpx.post(f"{server.base_url}/v1/chat/completions/batch", timeout=120, json={
        "model": MODEL, "messages": convs, "max_tokens": 40, "temperature": 0,
        "response_format": fmt})
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["object"] == "chat.completion"
    assert [c["index"] for c in data["choices"]] == [0, 1]
    n_prompt = n_gen = 0
    for conv, choice in zip(convs, data["choices"], strict=True):
        alone = client.chat.completions.create(model=MODEL, messages=conv, max_tokens=40,
                                               temperature=0, response_format=fmt)
        assert choice["message"]["content"] == alone.choices[0].message.content
        assert choice["finish_reason"] == alone.choices[0].finish_reason
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
        n_prompt += alone.usage.prompt_tokens
        n_gen += alone.usage.completion_tokens
    assert (data["usage"]["prompt_tokens"], data["usage"]["completion_tokens"]) == \
        (n_prompt, n_gen)
    # What vLLM refuses there: a stream, n > 1, a conversation that is not a list.
    for bad, param in (({"stream": True}, "stream"), ({"n": 2}, "n"),
                       ({"messages": [ASK, "hi"]}, "messages")):
        r = httpx.post(f"{server.base_url}/v1/chat/completions/batch", timeout=60,
                       json={"messages": convs, "max_tokens": 2, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
