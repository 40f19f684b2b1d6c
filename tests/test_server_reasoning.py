"""--reasoning-parser end to end, through the ``openai`` client: an in-process server
(engine core in a thread, the app through Starlette's TestClient) on the default model,
its output forced by a regex so that the thinking and the answer are known (with
``enable_in_reasoning``: a grammar otherwise starts only after the reasoning). The last
test lets the model think freely and checks that only its answer is constrained.

The raw text of each choice is decoded from its ``token_ids`` (vLLM's return_token_ids),
so every split is checked against the model's own output, not the parser's account of it.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.server_harness import MODEL

THINK_REGEX = "<think>[a-z ]{1,12}</think>[A-Za-z ]{2,12}"
ASK = [{"role": "user", "content": "Say hello."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
# A thought that mentions a call, then a real one: only the content's call counts.
CALL_TEXT = ('<think><tool_call>x</tool_call></think>'
             '<tool_call>{"name":"get_weather","arguments":{"city":"Rome"}}</tool_call>')
CALL_REGEX = re.sub(r"([{}])", r"\\\1", CALL_TEXT)  # the braces are its only metacharacters


class _TwoServers:
    """Two apps over one engine in one event loop (the engine's output handler is bound
    to it): ``/harmony/...`` goes to the second, everything else (lifespan included) to
    the first, so one engine serves both servers' configurations."""

    def __init__(self, main: Any, harmony: Any) -> None:
        self.main, self.harmony = main, harmony

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and path.startswith("/harmony/"):
            path = path[len("/harmony"):]
            scope = {**scope, "path": path, "raw_path": path.encode()}
            return await self.harmony(scope, receive, send)
        return await self.main(scope, receive, send)


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[Any, Any]]:
    """(http client, tokenizer): a deepseek_r1 + hermes server at ``/v1`` and an
    openai_gptoss + openai (harmony) server at ``/harmony/v1``, in this process."""
    from fastapi.testclient import TestClient

    from forerun.config import EngineConfig
    from forerun.engine.async_llm import AsyncLLM
    from forerun.server.api import build_app
    from forerun.server.config import ServerConfig

    # float32 as the other server tests; a short context keeps the KV cache small.
    engine = AsyncLLM(EngineConfig(dtype="float32", max_model_len=512,
                                   kv_cache_memory_bytes=64 << 20), engine_process=False)
    app = build_app(engine, MODEL, ServerConfig(
        reasoning_parser="deepseek_r1", enable_auto_tool_choice=True,
        tool_call_parser="hermes", log_requests=False))
    harmony = build_app(engine, MODEL, ServerConfig(
        reasoning_parser="openai_gptoss", enable_auto_tool_choice=True,
        tool_call_parser="openai", log_requests=False))
    try:
        with TestClient(_TwoServers(app, harmony)) as http:  # its lifespan shuts it down
            yield http, engine.tokenizer
            # Every request of the module is over: nothing may hold a KV block (a request
            # a stop string ended is aborted in the core a moment after its reply).
            deadline = time.monotonic() + 10
            while True:
                state = http.get("/forerun/engine").json()
                idle = (state["kv_cache_usage"], state["num_requests_running"],
                        state["num_requests_waiting"]) == (0, 0, 0)
                if idle or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert idle, state
    finally:
        engine.shutdown()  # a no-op after the lifespan; not if the app never started


def _client(http: Any, prefix: str = "") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://testserver{prefix}/v1", api_key="unused",
                         http_client=http, max_retries=0)


@pytest.fixture(scope="module")
def served(servers: tuple[Any, Any]) -> tuple[openai.OpenAI, Any]:
    """(client, tokenizer) of the deepseek_r1 + hermes server."""
    return _client(servers[0]), servers[1]


@pytest.fixture(scope="module")
def harmony_served(servers: tuple[Any, Any]) -> tuple[openai.OpenAI, Any]:
    """(client, tokenizer) of the openai_gptoss + openai (harmony tool calls) server."""
    return _client(servers[0], "/harmony"), servers[1]


def chat(client: openai.OpenAI, regex: str = THINK_REGEX, **kwargs: Any) -> Any:
    """A chat request whose whole output, thinking included, follows ``regex``."""
    extra = {"structured_outputs": {"regex": regex, "enable_in_reasoning": True},
             "return_token_ids": True,
             **kwargs.pop("extra_body", {})}
    kwargs.setdefault("max_tokens", 40)
    return client.chat.completions.create(model=MODEL, messages=ASK, extra_body=extra,
                                          **kwargs)


def raw_text(tokenizer: Any, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def test_message_splits_the_thought_from_the_answer(served: tuple[openai.OpenAI, Any]
                                                    ) -> None:
    client, tok = served
    r = chat(client, n=2, temperature=1.0, seed=7, logprobs=True, top_logprobs=2)
    assert len(r.choices) == 2
    for c in r.choices:
        raw = raw_text(tok, c.token_ids)
        m = re.fullmatch("<think>(.*)</think>(.*)", raw, re.S)
        assert m is not None, raw
        assert c.message.reasoning_content == m.group(1)
        assert c.message.reasoning == m.group(1)  # vLLM's current name, same text
        assert c.message.content == m.group(2)
        assert len(c.logprobs.content) == len(c.token_ids)  # per token, as without
        assert c.finish_reason == "stop"


@pytest.fixture(scope="module")
def greedy(served: tuple[openai.OpenAI, Any]) -> Any:
    """The greedy non-streamed response the streamed ones are compared with."""
    return chat(served[0], temperature=0)


def test_stream_sends_reasoning_deltas_then_content(served: tuple[openai.OpenAI, Any],
                                                    greedy: Any) -> None:
    client, tok = served
    whole = greedy
    got: dict[int, dict[str, Any]] = {}
    for chunk in chat(client, temperature=0, stream=True, n=2, logprobs=True):
        for ch in chunk.choices:
            g = got.setdefault(ch.index, {"r": "", "c": "", "order": [], "ids": [],
                                          "lps": 0})
            d = ch.delta
            r, c = getattr(d, "reasoning_content", None), d.content
            assert getattr(d, "reasoning", None) == r
            if r:
                g["r"] += r
                g["order"].append("r")
            if c:
                g["c"] += c
                g["order"].append("c")
            g["ids"] += getattr(ch, "token_ids", None) or []  # none on the role chunk
            g["lps"] += len(ch.logprobs.content) if ch.logprobs else 0
    assert sorted(got) == [0, 1]
    for g in got.values():  # greedy: both choices are the non-streamed one
        assert (g["r"], g["c"]) == (whole.choices[0].message.reasoning_content,
                                    whole.choices[0].message.content)
        assert g["ids"] == whole.choices[0].token_ids and g["lps"] == len(g["ids"])
        # All the thinking first, then the answer; the tags split over several tokens.
        assert g["order"] == sorted(g["order"], key="rc".index) and "r" in g["order"]
        assert raw_text(tok, g["ids"]) == f"<think>{g['r']}</think>{g['c']}"


def test_include_reasoning_false_drops_it(served: tuple[openai.OpenAI, Any],
                                          greedy: Any) -> None:
    client, _ = served
    keep = greedy
    drop = chat(client, temperature=0, extra_body={"include_reasoning": False})
    assert keep.choices[0].message.reasoning_content
    assert drop.choices[0].message.reasoning_content is None
    assert drop.choices[0].message.content == keep.choices[0].message.content
    pieces = [ch.delta for chunk in chat(client, temperature=0, stream=True,
                                         extra_body={"include_reasoning": False})
              for ch in chunk.choices]
    assert not any(getattr(d, "reasoning_content", None) for d in pieces)
    assert "".join(d.content or "" for d in pieces) == keep.choices[0].message.content


def test_tool_calls_come_from_the_content_only(served: tuple[openai.OpenAI, Any]) -> None:
    client, tok = served
    regex = CALL_REGEX
    r = chat(client, regex=regex, temperature=0, tools=[WEATHER], max_tokens=200)
    c = r.choices[0]
    assert raw_text(tok, c.token_ids) == CALL_TEXT
    assert c.message.reasoning_content == "<tool_call>x</tool_call>"
    assert [(t.function.name, json.loads(t.function.arguments))
            for t in c.message.tool_calls] == [("get_weather", {"city": "Rome"})]
    assert not c.message.content and c.finish_reason == "tool_calls"
    reasoning, calls, finish = "", {}, None
    for chunk in chat(client, regex=regex, temperature=0, tools=[WEATHER], max_tokens=200,
                      stream=True):
        for ch in chunk.choices:
            reasoning += getattr(ch.delta, "reasoning_content", None) or ""
            assert not ch.delta.content
            for tc in ch.delta.tool_calls or []:
                if tc.function.name:
                    calls[tc.index] = [tc.function.name, ""]
                calls[tc.index][1] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    assert reasoning == c.message.reasoning_content
    assert [(n, json.loads(a)) for n, a in calls.values()] == [("get_weather",
                                                                {"city": "Rome"})]
    assert finish == "tool_calls"


# --- gpt-oss's harmony: --reasoning-parser openai_gptoss --tool-call-parser openai -------
# SmolLM2 spells harmony's markers in plain tokens; the regex makes it write a gpt-oss
# turn: its thinking, then a call whose city the model picks. The stop string ends the
# text before <|call|>, as gpt-oss's detokenized text may. (No budget closing: the forced
# text is long in SmolLM2's tokens, and the closing steps cost time for nothing here.)

def _regex_escape(text: str) -> str:
    return re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\1", text)


HARMONY_THINKING = "Hm."
HARMONY_CALL_REGEX = (
    _regex_escape(f"<|channel|>analysis<|message|>{HARMONY_THINKING}<|end|><|start|>assistant"
                  "<|channel|>commentary to=functions.get_weather <|constrain|>json"
                  '<|message|>{"city":"') + '[A-Z][a-z]{2,8}' + _regex_escape('"}<|call|>'))


HARMONY_KWARGS: dict[str, Any] = {
    "temperature": 0, "tools": [WEATHER], "max_tokens": 160, "stop": ["<|call|>"],
    "extra_body": {"structured_outputs": {"regex": HARMONY_CALL_REGEX,
                                          "disable_budget_closing": True,
                                          "enable_in_reasoning": True}}}


@pytest.fixture(scope="module")
def harmony_call(harmony_served: tuple[openai.OpenAI, Any]) -> Any:
    """The non-streamed forced harmony call the streamed one is compared with."""
    return chat(harmony_served[0], **HARMONY_KWARGS)


def test_harmony_tool_call_through_the_server(harmony_served: tuple[openai.OpenAI, Any],
                                              harmony_call: Any) -> None:
    _, tok = harmony_served
    c = harmony_call.choices[0]
    raw = tok.decode(c.token_ids, skip_special_tokens=False)
    city = re.search(r'\{"city":"([A-Za-z]+)"\}', raw)
    assert city is not None, raw
    assert c.message.reasoning_content == c.message.reasoning == HARMONY_THINKING
    assert [(t.type, t.function.name, json.loads(t.function.arguments))
            for t in c.message.tool_calls] == [("function", "get_weather",
                                                {"city": city.group(1)})]
    assert c.message.content is None and c.finish_reason == "tool_calls"


def test_harmony_tool_call_streamed(harmony_served: tuple[openai.OpenAI, Any],
                                    harmony_call: Any) -> None:
    client, _ = harmony_served
    reasoning, calls, content, finish = "", {}, "", None
    for chunk in chat(client, stream=True, **HARMONY_KWARGS):
        for ch in chunk.choices:
            reasoning += getattr(ch.delta, "reasoning_content", None) or ""
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                if tc.function.name:
                    calls[tc.index] = [tc.function.name, ""]
                calls[tc.index][1] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    assert (reasoning, content, finish) == (HARMONY_THINKING, "", "tool_calls")
    assert [(n, a) for n, a in calls.values()] == [
        (t.function.name, t.function.arguments) for t in harmony_call.choices[0].message
        .tool_calls]


# --- structured output after the reasoning ----------------------------------------------
# SmolLM2 continues a pattern of thoughts and JSON answers on its own (greedy): the thought
# is the model's, unconstrained; only the answer after </think> follows the schema.
COUNT = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
         "additionalProperties": False}
SHOTS = "".join(f'<think>n < {k}!</think>\n{{"n": {k}}}\n' for k in range(1, 5))


def test_json_schema_constrains_the_answer_not_the_thought(
        served: tuple[openai.OpenAI, Any]) -> None:
    client, tok = served
    r = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=30,
        messages=[{"role": "user", "content": "Continue the pattern."},
                  {"role": "assistant", "content": SHOTS + "<think>"}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "count", "schema": COUNT}},
        extra_body={"continue_final_message": True, "add_generation_prompt": False,
                    "return_token_ids": True})
    c = r.choices[0]
    # The thought holds what the schema forbids ("<", "!", bare letters): it was free; had
    # the grammar started at the first token, there would be no </think> and no content.
    assert re.search("[<!]", c.message.reasoning_content), c.message.reasoning_content
    jsonschema.validate(json.loads(c.message.content), COUNT)
    assert raw_text(tok, c.token_ids) == (f"{c.message.reasoning_content}</think>"
                                          f"{c.message.content}")
    assert c.finish_reason == "stop"


# --- the same split on /v1/responses and Ollama's /api/chat ------------------------------
# The pattern as earlier turns of the conversation: SmolLM2 (greedy) answers the next one
# the same way, thinking on its own and then answering in the schema (a bare integer: the
# fewest tokens to decode).
COUNT_TURNS = [m for k in (1, 2, 3) for m in (
    {"role": "user", "content": f"Count {k}."},
    {"role": "assistant", "content": f"<think>{k}!</think>{k}"})] + [
    {"role": "user", "content": "Count 4."}]
INTEGER = {"type": "integer"}


def test_responses_reasoning_item_streamed_before_a_schema_answer(
        servers: tuple[Any, Any]) -> None:
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    http, _ = servers
    body = {"model": MODEL, "input": COUNT_TURNS, "temperature": 0, "max_output_tokens": 30,
            "stream": True, "text": {"format": {"type": "json_schema", "name": "count",
                                                "schema": INTEGER}}}
    with http.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ")]
    check = TypeAdapter(ResponseStreamEvent)
    for e in events:
        check.validate_python(e)
    final = events[-1]["response"]
    Response.model_validate(final)
    thought, message = final["output"]
    assert (thought["type"], message["type"]) == ("reasoning", "message")
    reasoning = thought["content"][0]["text"]
    # The thought was free (the schema allows no "<" or "!"); the answer follows the schema.
    assert re.search("[<!]", reasoning), reasoning
    jsonschema.validate(json.loads(message["content"][0]["text"]), INTEGER)
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert deltas == reasoning and final["status"] == "completed"
    usage = final["usage"]
    assert 0 < usage["output_tokens_details"]["reasoning_tokens"] < usage["output_tokens"]


def test_ollama_think_returns_thinking_beside_a_format_answer(
        servers: tuple[Any, Any]) -> None:
    http, _ = servers
    assert "thinking" in http.post("/api/show", json={"model": MODEL}).json()["capabilities"]
    r = http.post("/api/chat", json={
        "model": MODEL, "messages": COUNT_TURNS, "think": True, "stream": False,
        "format": INTEGER, "options": {"temperature": 0, "num_predict": 30}})
    assert r.status_code == 200, r.text
    message = r.json()["message"]
    assert re.search("[<!]", message["thinking"]), message
    jsonschema.validate(json.loads(message["content"]), INTEGER)
    assert "</think>" not in message["content"] + message["thinking"]


def test_messages_thinking_block_streamed_before_a_schema_answer(
        servers: tuple[Any, Any]) -> None:
    import anthropic

    http, _ = servers
    client = anthropic.Anthropic(base_url="http://testserver", api_key="unused",
                                 http_client=http, max_retries=0)
    # The same prompt as above (its prefix cached); a replayed thinking block is dropped.
    turns = [*COUNT_TURNS[:-2], {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "counting", "signature": ""},
        {"type": "text", "text": COUNT_TURNS[-2]["content"]}]}, COUNT_TURNS[-1]]
    with client.messages.stream(
            model=MODEL, max_tokens=30, messages=turns,
            extra_body={"temperature": 0, "output_config": {"format": {
                "type": "json_schema", "schema": INTEGER}}}) as stream:
        kinds = [e.type for e in stream]
        message = stream.get_final_message()
    thought, answer = message.content
    assert (thought.type, answer.type) == ("thinking", "text")
    assert re.search("[<!]", thought.thinking), thought  # free; the answer follows the schema
    jsonschema.validate(json.loads(answer.text), INTEGER)
    assert "</think>" not in thought.thinking + answer.text
    assert "thinking" in kinds and message.stop_reason == "end_turn"
