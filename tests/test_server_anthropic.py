"""``POST /v1/messages`` (Anthropic's Messages API) through the real server and the
official ``anthropic`` client, unmodified.

Oracles: the offline engine's greedy text for the same chat; the client's own models
(``Message``, and its stream helper, which rebuilds a message from the events); the
tokenizer's chat template for token counts; ``jsonschema`` for structured output and tool
input. The shared default server serves all but the API-key test, which uses
test_server.py's keyed server.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from forerun import SamplingParams
from tests.server_harness import DEFAULT, MODEL, ServerArgs, ServerHandle

pytestmark = pytest.mark.slow

API_KEY = "sk-forerun-test"  # test_server.py's keyed server
KEYED = ServerArgs(("--api-key", API_KEY, "--max-model-len", "512"))
SYSTEM = "You are a helpful assistant."
QUESTION = "What is the capital of France?"
GREEDY = {"temperature": 0.0}
WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def servers() -> dict[str, ServerHandle]:
    main = DEFAULT.start()  # the session's shared default server
    keyed = KEYED.start()
    main.wait_healthy()
    return {"main": main, "keyed": keyed}


@pytest.fixture(scope="module")
def client(servers: dict[str, ServerHandle]) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=servers["main"].base_url, api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def http(servers: dict[str, ServerHandle]) -> httpx.Client:
    with httpx.Client(base_url=servers["main"].base_url, timeout=120) as c:
        yield c


def _text(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def ref(llm_cache: Any) -> Any:
    """The offline engine's greedy answer to SYSTEM + QUESTION (12 tokens)."""
    return llm_cache().chat([{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": QUESTION}],
                            SamplingParams(max_tokens=12, temperature=0.0),
                            use_tqdm=False)[0]


def test_greedy_text_is_the_offline_engines_for_the_same_chat(
        client: anthropic.Anthropic, ref: Any) -> None:
    msg = client.messages.create(model=MODEL, max_tokens=12, system=SYSTEM,
                                 messages=_user(QUESTION), extra_body=GREEDY,
                                 metadata={"user_id": "u-1"})
    (c,) = ref.outputs
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert _text(msg) == c.text and len(msg.content) == 1
    assert msg.stop_reason == ("max_tokens" if c.finish_reason == "length" else "end_turn")
    usage = msg.usage
    assert usage.output_tokens == len(c.token_ids)
    assert usage.input_tokens + usage.cache_read_input_tokens == len(ref.prompt_token_ids)


def test_a_last_assistant_turn_is_continued(client: anthropic.Anthropic, llm_cache: Any,
                                            smollm2_tokenizer: Any) -> None:
    # Anthropic's prefill: the reply continues the assistant's text. Oracle: the offline
    # engine on the template rendered with continue_final_message.
    turns = [{"role": "user", "content": QUESTION},
             {"role": "assistant", "content": "The capital of France is"}]
    text = smollm2_tokenizer.apply_chat_template(turns, continue_final_message=True,
                                                 tokenize=False)
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    ref = llm_cache().generate([{"prompt_token_ids": ids}],
                               SamplingParams(max_tokens=6, temperature=0.0),
                               use_tqdm=False)[0].outputs[0]
    msg = client.messages.create(model=MODEL, max_tokens=6, messages=turns,
                                 extra_body=GREEDY)
    assert _text(msg) == ref.text
    assert client.messages.count_tokens(model=MODEL, messages=turns).input_tokens == len(ids)


def test_stream_rebuilds_the_same_message(client: anthropic.Anthropic,
                                          http: httpx.Client) -> None:
    # system as text blocks is the same system prompt as the string.
    kw: dict[str, Any] = dict(model=MODEL, max_tokens=8, messages=_user(QUESTION),
                              system=[{"type": "text", "text": "You are a helpful "},
                                      {"type": "text", "text": "assistant."}],
                              extra_body=GREEDY)
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert final.model_dump(exclude={"id", "usage"}) == whole.model_dump(
        exclude={"id", "usage"})
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    # On the wire: each data's type is its event: line, in Anthropic's order.
    body = {"model": MODEL, "max_tokens": 8, "messages": _user(QUESTION),
            "system": SYSTEM, "stream": True, **GREEDY}
    events, name = [], None
    with http.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name
                events.append(data)
    wire = [e["type"] for e in events]
    n = wire.count("content_block_delta")
    assert n >= 1 and wire == ["message_start", "ping", "content_block_start",
                               *["content_block_delta"] * n, "content_block_stop",
                               "message_delta", "message_stop"]
    assert "".join(e["delta"]["text"] for e in events[3:3 + n]) == _text(whole)
    assert events[-2]["delta"]["stop_reason"] == whole.stop_reason
    assert [k for k in kinds if k not in ("text", "ping")][0] == "message_start"


def test_tool_use_then_tool_result_then_an_answer(client: anthropic.Anthropic) -> None:
    ask = _user("What is the weather in Paris?")
    msg = client.messages.create(model=MODEL, max_tokens=30, messages=ask, tools=[WEATHER],
                                 tool_choice={"type": "tool", "name": "get_weather"},
                                 extra_body=GREEDY)
    assert msg.stop_reason == "tool_use"
    (call,) = [b for b in msg.content if b.type == "tool_use"]
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER["input_schema"])
    # "any", streamed: the helper rebuilds the tool_use block from input_json_delta.
    with client.messages.stream(model=MODEL, max_tokens=40, messages=ask, tools=[WEATHER],
                                tool_choice={"type": "any"}, extra_body=GREEDY) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    calls = [b for b in final.content if b.type == "tool_use"]
    assert calls and all(b.name == "get_weather" for b in calls)
    jsonschema.validate(calls[0].input, WEATHER["input_schema"])
    # The call and its result go back; with tool_choice none the model answers in text.
    answer = client.messages.create(
        model=MODEL, max_tokens=8, tools=[WEATHER], tool_choice={"type": "none"},
        messages=[*ask, {"role": "assistant", "content": msg.content},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": call.id,
                       "content": [{"type": "text", "text": "sunny, 24C"}]},
                      {"type": "text", "text": "So, what is it like?"}]}], extra_body=GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in answer.content] == ["text"] and _text(answer)


def test_output_config_json_schema_is_structured_output(client: anthropic.Anthropic) -> None:
    msg = client.messages.create(
        model=MODEL, max_tokens=40, messages=_user("Describe a person as JSON."),
        output_config={"format": {"type": "json_schema", "schema": PERSON}},
        extra_body=GREEDY)
    assert msg.stop_reason == "end_turn"
    jsonschema.validate(json.loads(_text(msg)), PERSON)


def test_count_tokens_is_the_rendered_templates_length(
        client: anthropic.Anthropic, smollm2_tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "Hello"},
                {"role": "assistant", "content": [{"type": "text", "text": "Hi"}]},
                {"role": "user", "content": QUESTION}]
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=messages,
                                           tools=[WEATHER])
    fn = {"name": WEATHER["name"], "description": WEATHER["description"],
          "parameters": WEATHER["input_schema"]}
    text = smollm2_tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello"},
         {"role": "assistant", "content": "Hi"}, {"role": "user", "content": QUESTION}],
        tools=[{"type": "function", "function": fn}], add_generation_prompt=True,
        tokenize=False)
    assert counted.input_tokens == len(smollm2_tokenizer.encode(text,
                                                                add_special_tokens=False))
    msg = client.messages.create(model=MODEL, max_tokens=1, system=SYSTEM,
                                 messages=messages, tools=[WEATHER],
                                 tool_choice={"type": "none"})
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == counted.input_tokens


def test_stop_sequences_end_with_stop_sequence(client: anthropic.Anthropic,
                                               ref: Any) -> None:
    free = ref.outputs[0].text  # the same chat's greedy text without a stop sequence
    words = free.split()
    assert len(words) >= 3, free
    stop = " " + words[2]
    msg = client.messages.create(model=MODEL, max_tokens=12, system=SYSTEM,
                                 messages=_user(QUESTION), stop_sequences=[stop],
                                 extra_body=GREEDY)
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert _text(msg) == free[:free.index(stop)]


@pytest.mark.parametrize("body, status, kind, field", [
    ({"messages": _user("x")}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, 400,
     "invalid_request_error", "messages.0.role"),
    ({"max_tokens": 4, "messages": _user("x"),
      "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400,
     "invalid_request_error", "thinking"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]}, 400,
     "invalid_request_error", "messages.0.content.0.type"),
    ({"max_tokens": 4, "messages": _user("x"), "temperature": 1.5}, 400,
     "invalid_request_error", "temperature"),
    ({"max_tokens": 4, "messages": _user("x"), "tools": [WEATHER]}, 400,
     "invalid_request_error", "tool_choice"),
    ({"max_tokens": 5000, "messages": _user("x")}, 400, "invalid_request_error",
     "max_tokens"),
    ({"max_tokens": 4, "messages": _user("x"), "tools": [WEATHER],
      "tool_choice": {"type": "any"},
      "output_config": {"format": {"type": "json_schema", "schema": PERSON}}}, 400,
     "invalid_request_error", "output_config.format"),
    ({"max_tokens": 4, "messages": _user("x"),
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "invalid_request_error", "tools.0.type"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]}]},
     400, "invalid_request_error", "messages.0.content.0.content.0.type"),
    ({"max_tokens": 4, "messages": _user("x"), "model": "no-such-model"}, 404,
     "not_found_error", "model"),
])
def test_bad_requests_answer_in_anthropics_error_shape(
        http: httpx.Client, body: dict[str, Any], status: int, kind: str,
        field: str) -> None:
    r = http.post("/v1/messages", json={"model": MODEL, **body})
    assert r.status_code == status, r.text
    got = r.json()
    assert got["type"] == "error" and got["error"]["type"] == kind, got
    assert field in got["error"]["message"], got


def test_client_raises_the_matching_errors(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=4, messages=_user("x"),
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert e.value.body["error"]["message"].startswith("thinking:")
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="no-such-model", messages=_user("x"))


def test_api_key_as_x_api_key_or_bearer(servers: dict[str, ServerHandle]) -> None:
    keyed = servers["keyed"]
    keyed.wait_healthy()
    body = {"model": MODEL, "max_tokens": 2, "messages": _user("Hi")}
    r = httpx.post(f"{keyed.base_url}/v1/messages", json=body,
                   headers={"x-api-key": "wrong", "anthropic-version": "2023-06-01"})
    assert r.status_code == 401
    assert r.json() == {"type": "error", "error": {
        "type": "authentication_error", "message": "Incorrect API key provided."}}
    r = httpx.post(f"{keyed.base_url}/v1/messages", json=body, timeout=60,
                   headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"})
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 2
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=keyed.base_url, api_key="wrong",
                            max_retries=0).messages.create(**body)
    good = anthropic.Anthropic(base_url=keyed.base_url, api_key=API_KEY, max_retries=0)
    assert good.messages.create(**body).usage.output_tokens == 2


def test_edge_refusals_on_messages_routes_take_anthropics_shape() -> None:
    # In process, no engine: EdgeGuard's 401 and 413 before any body is read.
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from fastapi.testclient import TestClient

    from forerun.server.anthropic import anthropic_error
    from forerun.server.edge import EdgeGuard, set_error_shape

    app = FastAPI()
    set_error_shape(app, "/v1/messages", anthropic_error)
    app.add_middleware(EdgeGuard, api_key=API_KEY, max_body_bytes=64)
    for path in ("/v1/messages", "/v1/messages/count_tokens", "/v1/chat/completions"):
        app.post(path)(lambda: JSONResponse({"ok": True}))
    with TestClient(app) as c:
        r = c.post("/v1/messages/count_tokens", json={}, headers={"x-api-key": "no"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = c.post("/v1/messages", content=b"x" * 65, headers={"x-api-key": API_KEY})
        assert r.status_code == 413 and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "request_too_large"
        # The OpenAI routes keep OpenAI's shape, and take either header too.
        r = c.post("/v1/chat/completions", json={})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        for auth in ({"x-api-key": API_KEY}, {"Authorization": f"Bearer {API_KEY}"}):
            assert c.post("/v1/messages", json={}, headers=auth).json() == {"ok": True}


# --- thinking with --reasoning-parser: the reply builders on scripted token streams -----
THOUGHT = ["<think>", "Two", " and", " two", "</", "think", ">", "Four", "."]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'


def _messages_body(extra: dict[str, Any] | None = None, reasoning: bool = True) -> Any:
    from forerun.server.anthropic_protocol import MessagesRequest

    body = {"model": MODEL, "max_tokens": 2048, "messages": _user(QUESTION), **(extra or {})}
    return MessagesRequest.model_validate_json(json.dumps(body),
                                               context={"reasoning": reasoning})


def _replies(pieces: list[str], thinking: dict[str, Any] | None,
             tools: list[dict[str, Any]] | None = None) -> tuple[dict[str, Any],
                                                                 list[dict[str, Any]]]:
    """(the whole message, the stream's events) of a scripted deepseek_r1 reply, both
    validated by the anthropic package's models."""
    import asyncio
    from types import SimpleNamespace

    from pydantic import TypeAdapter

    from forerun.server.anthropic import Message, _blocks, _stop, _stream, _usage
    from forerun.server.bodies import encode
    from forerun.server.reasoning import plan_reasoning, thinking_fields
    from forerun.server.tool_calls import ToolCallConfig, plan_tools
    from tests.scripted_outputs import PieceTokenizer, ScriptedStream, collect

    tok = PieceTokenizer(pieces)
    ctx = SimpleNamespace(model_name=MODEL, chat_template=None,
                          engine=SimpleNamespace(tokenizer=tok))
    body = _messages_body({"thinking": thinking, "tools": tools})
    chat = body.to_chat(thinking_fields(ctx, body.thinking_switch()))
    plan = plan_tools(ToolCallConfig(True, "hermes"), chat, tok)
    rplan = plan_reasoning("deepseek_r1", chat, tok)
    (out,) = ScriptedStream(pieces).outputs()[-1:]
    (c,) = out.outputs
    blocks = _blocks(plan, c.text, c.finish_reason, rplan)
    whole = Message("msg_1", MODEL, blocks, _usage(out, 3, len(c.token_ids)),
                    *_stop(blocks, c.finish_reason, c.stop_reason))
    whole_json = json.loads(encode(whole))
    anthropic.types.Message.model_validate(whole_json)
    raw = asyncio.run(collect(_stream(ctx, "msg_1", ScriptedStream(pieces), plan, rplan)))
    events = [json.loads(chunk.split(b"\ndata: ")[1]) for chunk in raw]
    check = TypeAdapter(anthropic.types.RawMessageStreamEvent)
    for e in events:
        if e["type"] != "ping":  # not among the package's stream events
            check.validate_python(e)
    return whole_json, events


def _rebuilt(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The content blocks a client rebuilds from the events (tool ids left out)."""
    blocks: list[dict[str, Any]] = []
    for e in events:
        if e["type"] == "content_block_start":
            assert e["index"] == len(blocks)
            blocks.append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            b, d = blocks[e["index"]], e["delta"]
            if d["type"] == "thinking_delta":
                b["thinking"] += d["thinking"]
            elif d["type"] == "text_delta":
                b["text"] += d["text"]
            else:
                b["input"] = json.loads(d["partial_json"])
    return [{k: v for k, v in b.items() if k != "id"} for b in blocks]


@pytest.mark.parametrize("thinking", [None, {"type": "enabled", "budget_tokens": 1024},
                                      {"type": "disabled"}])
def test_thinking_block_streamed_and_whole_alike(thinking: dict[str, Any] | None) -> None:
    whole, events = _replies(THOUGHT, thinking)
    # Oracle: the raw text cut at its markers; disabled drops the thinking.
    raw = "".join(THOUGHT)
    thought, answer = raw.removeprefix("<think>").split("</think>")
    want: list[dict[str, Any]] = [{"type": "text", "text": answer, "citations": None}]
    if thinking != {"type": "disabled"}:
        want.insert(0, {"type": "thinking", "thinking": thought, "signature": ""})
    assert whole["content"] == want and _rebuilt(events) == want
    assert whole["stop_reason"] == "end_turn" and events[-2]["delta"]["stop_reason"] == \
        "end_turn"
    assert whole["usage"]["output_tokens"] == events[-2]["usage"]["output_tokens"] == \
        len(THOUGHT)
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == [b["type"] for b in want]


def test_thinking_tool_calls_come_from_the_answer_only() -> None:
    pieces = ["<think>", "<tool_call>x</tool_call>", "</think>", CALL]
    whole, events = _replies(pieces, None, [WEATHER])
    want = [{"type": "thinking", "thinking": "<tool_call>x</tool_call>", "signature": ""},
            {"type": "tool_use", "name": "get_weather", "input": {"city": "Rome"}}]
    assert [{k: v for k, v in b.items() if k != "id"} for b in whole["content"]] == want
    assert _rebuilt(events) == want and whole["stop_reason"] == "tool_use"


@pytest.mark.parametrize("thinking, max_tokens, says", [
    ({"type": "enabled", "budget_tokens": 1023}, 2048, "greater than or equal to 1024"),
    ({"type": "enabled", "budget_tokens": "2000"}, 4096, "valid integer"),
    ({"type": "enabled", "budget_tokens": 1500.0}, 4096, "valid integer"),
    ({"type": "enabled"}, 2048, "Field required"),
    ({"type": "enabled", "budget_tokens": 2048}, 2048, "less than max_tokens"),
    ({"type": "adaptive"}, 2048, "'enabled' or 'disabled'"),
    ("on", 2048, "valid dictionary"),
])
def test_thinking_budget_tokens_is_checked_as_anthropic_does(
        thinking: Any, max_tokens: int, says: str) -> None:
    from forerun.server.anthropic import _parse
    from forerun.server.errors import APIError

    raw = json.dumps({"model": MODEL, "max_tokens": max_tokens, "messages": _user("x"),
                      "thinking": thinking}).encode()
    with pytest.raises((APIError, ValueError)) as err:
        from forerun.server.anthropic_protocol import MessagesRequest
        _parse(MessagesRequest, raw, True).to_chat()
    message = err.value.message if isinstance(err.value, APIError) else str(err.value)
    assert message.startswith(("thinking.budget_tokens: ", "thinking.type: ", "thinking: "))
    assert says in message, message


def test_thinking_without_a_reasoning_parser_is_refused_as_before() -> None:
    from forerun.server.anthropic import _parse
    from forerun.server.anthropic_protocol import MessagesRequest
    from forerun.server.errors import APIError

    on = {"model": MODEL, "max_tokens": 2048, "messages": _user("x"),
          "thinking": {"type": "enabled", "budget_tokens": 1024}}
    with pytest.raises(APIError) as err:
        _parse(MessagesRequest, json.dumps(on).encode())
    assert err.value.status == 400 and err.value.message.startswith(
        "thinking: extended thinking is not supported")
    off = _parse(MessagesRequest, json.dumps({**on, "thinking": {"type": "disabled"}}).encode())
    assert off.thinking_switch() is None  # ignored, as before
    replay = [{"role": "assistant", "content": [{"type": "thinking", "thinking": "hm",
                                                 "signature": "s"}]}]
    with pytest.raises(ValueError, match="messages.0.content.0.type"):
        _messages_body({"messages": replay}, reasoning=False).chat_messages()


def test_thinking_switch_and_replayed_thinking_blocks() -> None:
    from types import SimpleNamespace

    from forerun.server.anthropic import _thinking_chat_fields

    qwen3 = SimpleNamespace(reasoning_parser="qwen3", chat_template="{{ enable_thinking }}")
    fields = _thinking_chat_fields(qwen3, _messages_body({"thinking": {"type": "disabled"}}))
    assert fields == {"include_reasoning": False,
                      "chat_template_kwargs": {"enable_thinking": False}}
    assert _messages_body().thinking_switch() is None
    assert _messages_body({"thinking": {"type": "enabled", "budget_tokens": 1024}}
                          ).thinking_switch() is True
    # A client replays its earlier reply's thinking: accepted and dropped.
    replay = [{"role": "user", "content": "Hi"},
              {"role": "assistant", "content": [
                  {"type": "thinking", "thinking": "They greet.", "signature": ""},
                  {"type": "redacted_thinking", "data": "xyz"},
                  {"type": "text", "text": "Hello!"}]},
              {"role": "user", "content": "Bye"}]
    assert _messages_body({"messages": replay}).chat_messages() == [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"}]


def test_all_blocks_free_afterwards(servers: dict[str, ServerHandle]) -> None:
    from tests.test_server import wait_idle

    m = wait_idle(servers["main"])
    assert m["forerun:kv_cache_usage_perc"] == 0.0
    assert m["forerun:num_requests_running"] == 0
