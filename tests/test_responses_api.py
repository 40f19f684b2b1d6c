"""``POST /v1/responses`` (OpenAI's Responses API) through the real server and client.

Oracles: the openai package's own pydantic models (``Response``, ``ResponseStreamEvent``)
validate every body and event strictly; the chat completion of the same conversation
(greedy, same server) gives the expected text; the tokenizer's chat template gives the
input token count; ``jsonschema`` checks structured output and tool arguments.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.server_harness import MODEL, ServerHandle, start_server

pytestmark = pytest.mark.slow


EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}


@pytest.fixture(scope="module")
def server() -> ServerHandle:
    handle = start_server()  # the session's shared default server
    handle.wait_healthy()
    return handle


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer: Any) -> Any:
    return smollm2_tokenizer  # the session's (conftest)


@pytest.fixture(scope="module")
def http(server: ServerHandle) -> httpx.Client:
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


def _create(http: httpx.Client, body: dict[str, Any], **headers: str) -> dict[str, Any]:
    r = http.post("/v1/responses", json={"model": MODEL, **body}, headers=headers)
    assert r.status_code == 200, r.text
    raw = r.json()
    Response.model_validate(raw)  # every field the SDK's type declares, strictly
    return raw


def _text(raw: dict[str, Any]) -> str:
    return "".join(p["text"] for item in raw["output"] if item["type"] == "message"
                   for p in item["content"] if p["type"] == "output_text")


def test_string_input_is_the_chat_completion_of_one_user_message(
        http: httpx.Client, client: openai.OpenAI) -> None:
    raw = _create(http, {"input": "Name a colour.", "max_output_tokens": 6,
                         "temperature": 0})
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=6, temperature=0)
    assert raw["object"] == "response" and raw["id"].startswith("resp_")
    (item,) = raw["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    assert item["content"][0]["annotations"] == []
    assert _text(raw) == chat.choices[0].message.content
    usage = raw["usage"]
    assert usage["input_tokens"] == chat.usage.prompt_tokens
    assert usage["output_tokens"] == chat.usage.completion_tokens
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    if chat.choices[0].finish_reason == "length":
        assert raw["status"] == "incomplete"
        assert raw["incomplete_details"] == {"reason": "max_output_tokens"}
    else:
        assert raw["status"] == "completed" and raw["incomplete_details"] is None


def test_message_list_with_instructions_and_text_parts(
        http: httpx.Client, client: openai.OpenAI, tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi"},
                {"role": "user", "content": "Sky colour?"}]
    raw = _create(http, {
        "instructions": "Answer in one word.", "max_output_tokens": 6, "temperature": 0,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
                  {"type": "message", "role": "assistant",
                   "content": [{"type": "output_text", "text": "Hi"}]},
                  {"role": "user", "content": "Sky colour?"}]})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = tokenizer.encode(text, add_special_tokens=False)
    assert raw["usage"]["input_tokens"] == len(expected)
    assert raw["instructions"] == "Answer in one word."
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                          temperature=0)
    assert _text(raw) == chat.choices[0].message.content


def test_include_output_text_logprobs_with_top_logprobs(
        http: httpx.Client, client: openai.OpenAI) -> None:
    # vLLM's include=["message.output_text.logprobs"] + top_logprobs. Oracle: the chat
    # completion of the same message with logprobs (same server, greedy).
    body = {"input": "Name a colour.", "max_output_tokens": 4, "temperature": 0,
            "include": ["message.output_text.logprobs"], "top_logprobs": 3}
    raw = _create(http, body)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=3)
    want = chat.choices[0].logprobs.content
    got = raw["output"][0]["content"][0]["logprobs"]
    assert [e["token"] for e in got] == [e.token for e in want]
    for g, w in zip(got, want, strict=True):
        assert abs(g["logprob"] - w.logprob) < 1e-3 and g["bytes"] == w.bytes
        assert [t["token"] for t in g["top_logprobs"]] == [t.token for t in w.top_logprobs]
        assert len(g["top_logprobs"]) == 3
    # Streamed: each text delta carries its tokens' logprobs, adding up to the same list.
    with http.stream("POST", "/v1/responses", json={"model": MODEL, **body,
                                                     "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    for e in events:
        EVENTS.validate_python(e)
    streamed = [x["token"] for e in events if e["type"] == "response.output_text.delta"
                for x in e["logprobs"]]
    assert streamed == [e["token"] for e in got]
    done = events[-1]["response"]["output"][0]["content"][0]["logprobs"]
    assert [e["token"] for e in done] == streamed
    # Without include there are none; another include value is a 400 naming it.
    plain = {k: v for k, v in body.items() if k not in ("include", "top_logprobs")}
    assert _create(http, plain)["output"][0]["content"][0]["logprobs"] == []
    r = http.post("/v1/responses", json={**body, "include": ["file_search_call.results"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "include"


def test_max_output_tokens_makes_it_incomplete(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="Write a long story about a dragon.",
                                max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output_text


def test_stream_sends_openai_events_in_order(http: httpx.Client,
                                             client: openai.OpenAI) -> None:
    body = {"input": "Count from one to five.", "max_output_tokens": 6, "temperature": 0}
    whole = _create(http, body)
    events = []
    with http.stream("POST", "/v1/responses", json={"model": MODEL, "stream": True,
                                                     **body}) as r:
        assert r.status_code == 200
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name  # the SSE event name is the event's type
                EVENTS.validate_python(data)
                events.append(data)
    kinds = [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas):] == [
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    text = "".join(deltas)
    assert text == _text(whole) and events[-4]["text"] == text
    final = events[-1]["response"]
    assert _text(final) == text and final["status"] == whole["status"]
    assert final["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
    # The SDK reads the same stream.
    got = [e.type for e in client.responses.create(model=MODEL, stream=True, **body)]
    assert got == kinds


def test_text_format_json_schema_is_structured_output(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=MODEL, input="Describe a person as JSON.", max_output_tokens=40,
        temperature=0, text={"format": {"type": "json_schema", "name": "person",
                                        "schema": PERSON}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema"


@pytest.mark.parametrize("stream", [False, True])
def test_function_tools_named_and_required(http: httpx.Client, client: openai.OpenAI,
                                           stream: bool) -> None:
    choice: Any = {"type": "function", "name": "get_weather"} if stream else "required"
    kw: dict[str, Any] = dict(model=MODEL, input="What is the weather in Paris?",
                              max_output_tokens=30, temperature=0, tools=[WEATHER],
                              tool_choice=choice)
    if stream:
        events = list(client.responses.create(stream=True, **kw))
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert len(done) == 1 and done[0].name == "get_weather"
        final = events[-1].response
        assert events[-1].type == "response.completed"
    else:
        final = client.responses.create(**kw)
    calls = [o for o in final.output if o.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), WEATHER["parameters"])
    # The call and its output go back as input items, and the model answers.
    call = calls[0]
    raw = _create(http, {"input": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        "tools": [WEATHER], "tool_choice": "none", "max_output_tokens": 8})
    assert raw["output"][0]["type"] == "message"


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 5000}, "max_output_tokens"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0].type"),
    ({"input": []}, "input"),
    ({"input": [{"type": "reasoning"}]}, "input"),  # earlier thinking is dropped
    ({"input": [{"type": "file_search_call"}]}, "input[0].type"),
    ({"input": "x", "reasoning": {"effort": "max"}}, "reasoning.effort"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": 5}}}},
     "text.format.schema"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
    ({"input": "x" * 20000}, "input"),
])
def test_bad_requests_are_400_naming_the_field(http: httpx.Client, body: dict[str, Any],
                                               param: str) -> None:
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_x_request_id_names_the_response(http: httpx.Client) -> None:
    # vLLM: the client's X-Request-Id is the response id; a reused one still runs.
    results: list[dict[str, Any]] = []

    def one() -> None:
        results.append(_create(http, {"input": "Hi", "max_output_tokens": 4},
                               **{"X-Request-Id": "abc123"}))

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r["id"] for r in results] == ["resp_abc123", "resp_abc123"]
    r = http.post("/v1/chat/completions", headers={"X-Request-Id": "xyz"}, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.json()["id"] == "chatcmpl-xyz"
    r = http.post("/v1/completions", headers={"X-Request-Id": "xyz"},
                  json={"prompt": "Hi", "max_tokens": 2})
    assert r.json()["id"] == "cmpl-xyz"


def test_all_blocks_free_afterwards(server: ServerHandle) -> None:
    from tests.test_server import wait_idle

    m = wait_idle(server)
    assert m["forerun:kv_cache_usage_perc"] == 0.0
    assert m["forerun:num_requests_running"] == 0


# --- --reasoning-parser: the builders on scripted token streams (no model, no server) ---
# Each case: a parser, the model's text in tokens, how the engine ended it, and the oracle
# written out by hand: the text cut at its markers into (thinking, answer), and the tokens
# up to the marker that ends the thinking (all of them when it never ends).

THOUGHTS = [
    ("deepseek_r1", ["<think>", "Two", " and", " two", "</", "think", ">", "Four", "."],
     "stop", "Two and two", "Four.", 7),
    # The template opened the thought: the output starts inside it.
    ("deepseek_r1", ["Hm", "m", "</think>", "\n", "Yes"], "stop", "Hmm", "\nYes", 3),
    # Cut by max_output_tokens inside the thought: all thinking, an empty answer.
    ("deepseek_r1", ["<think>", "still", " going"], "length", "still going", "", 3),
    ("qwen3", ["Just", " an", " answer"], "stop", None, "Just an answer", 0),
    # Text before the thought: the message item comes first.
    ("qwen3", ["Hi", " <th", "ink>", "x", "</think>", "y"], "stop", "x", "Hi y", 5),
    ("openai_gptoss", ["<|channel|>", "analysis", "<|message|>", "Think", "<|end|>",
                       "<|start|>assistant", "<|channel|>final", "<|message|>", "Done",
                       "<|return|>"], "stop", "Think", "Done", 8),
    # No reasoning parser: the tags stay in the text, as before.
    (None, ["<think>", "a", "</think>", "b"], "stop", None, "<think>a</think>b", 0),
]


def _scripted_run(parser: str | None, pieces: list[str], tools: Any = None) -> tuple:
    """(run, chat request, tool plan, reasoning plan) for a scripted response."""
    from types import SimpleNamespace

    from forerun.server.reasoning import plan_reasoning
    from forerun.server.responses_api import _Run
    from forerun.server.responses_protocol import ResponsesRequest
    from forerun.server.tool_calls import ToolCallConfig, plan_tools
    from tests.scripted_outputs import PieceTokenizer

    tok = PieceTokenizer(pieces)
    body = ResponsesRequest(input="x", tools=tools)
    chat = body.to_chat()
    plan = plan_tools(ToolCallConfig(True, "hermes"), chat, tok)
    rplan = plan_reasoning(parser, chat, tok)
    if rplan is not None:
        chat = rplan.adjust_request(chat)
    config = SimpleNamespace(enable_prefix_caching=False, block_size=16)
    ctx = SimpleNamespace(model_name=MODEL, engine=SimpleNamespace(config=config))
    return _Run(ctx, body, "resp_1", 0), chat, plan, rplan  # type: ignore[arg-type]


def _scripted_events(parser: str | None, pieces: list[str], finish: str,
                     tools: Any = None) -> tuple[list[dict[str, Any]], list[Any]]:
    """(the stream's events, validated; the non-streamed output's items as JSON)."""
    import asyncio

    import msgspec

    from forerun.server.responses_api import _output_items, _status, _stream
    from tests.scripted_outputs import ScriptedStream, collect

    run, chat, plan, rplan = _scripted_run(parser, pieces, tools)
    script = ScriptedStream(pieces, finish)
    raw = asyncio.run(collect(_stream(run, chat, script, plan, rplan)))
    events = [json.loads(chunk.split(b"\ndata: ", 1)[1]) for chunk in raw]
    for e in events:
        EVENTS.validate_python(e)
    assert script.aborted and [e["sequence_number"] for e in events] == list(
        range(len(events)))
    Response.model_validate(events[-1]["response"])
    c = script.outputs()[-1].outputs[0]
    whole = _output_items(plan, rplan, c.text, finish, _status(finish))
    return events, msgspec.to_builtins(whole)


def _without_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


@pytest.mark.parametrize("parser, pieces, finish, thought, answer, n_thought", THOUGHTS)
def test_reasoning_item_streamed_and_whole_agree(
        parser: str | None, pieces: list[str], finish: str, thought: str | None,
        answer: str, n_thought: int) -> None:
    events, whole = _scripted_events(parser, pieces, finish)
    final = events[-1]["response"]
    # The non-streamed items, whatever their ids.
    assert _without_ids(final["output"]) == _without_ids(whole)
    kinds = [item["type"] for item in final["output"]]
    assert sorted(kinds) == (["message"] if thought is None else ["message", "reasoning"])
    message = next(i for i in final["output"] if i["type"] == "message")
    assert message["content"][0]["text"] == answer
    if thought is not None:
        item = next(i for i in final["output"] if i["type"] == "reasoning")
        assert item["summary"] == [] and item["content"] == [
            {"type": "reasoning_text", "text": thought}]
        assert item["status"] == ("completed" if finish == "stop" or answer
                                  else "incomplete")
    # The deltas add up to each item, under its id and output_index.
    for i, item in enumerate(final["output"]):
        kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
        mine = [e for e in events if e.get("item_id") == item["id"]]
        assert {e["output_index"] for e in mine} == {i}
        text = item["content"][0]["text"]
        assert "".join(e["delta"] for e in mine if e["type"] == f"response.{kind}.delta") \
            == text
        assert [e["text"] for e in mine if e["type"] == f"response.{kind}.done"] == [text]
    added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert added == [i["id"] for i in final["output"]] and len(done) == len(added)
    assert sorted(_without_ids(done), key=str) == sorted(_without_ids(whole), key=str)
    # usage counts the thinking's tokens, its end marker included.
    usage = final["usage"]
    assert usage["output_tokens"] == len(pieces)
    assert usage["output_tokens_details"]["reasoning_tokens"] == n_thought


def test_reasoning_item_before_tool_calls_read_from_the_answer() -> None:
    # With tools the items are sent whole once parsed; a call the model only thinks about
    # is not made.
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    pieces = ["<think>", "<tool_call>x</tool_call>", "</think>", call]
    events, whole = _scripted_events("deepseek_r1", pieces, "stop", tools=[WEATHER])
    final = events[-1]["response"]
    assert _without_ids(final["output"]) == _without_ids(whole)
    assert [i["type"] for i in final["output"]] == ["reasoning", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "<tool_call>x</tool_call>"
    assert (final["output"][1]["name"], json.loads(final["output"][1]["arguments"])) == (
        "get_weather", {"city": "Rome"})
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 3


def test_reasoning_input_items_and_effort_map_onto_chat() -> None:
    from forerun.server.responses_protocol import ResponsesRequest

    # A client sends the earlier output back whole; the earlier thinking is left out, as
    # chat templates leave it out of the prompt.
    body = ResponsesRequest(input=[
        {"role": "user", "content": "Hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "greet back"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Hello"}]},
        {"role": "user", "content": "Bye"}], reasoning={"effort": "low", "summary": "auto"})
    chat = body.to_chat()
    assert [m["content"] for m in chat.messages] == ["Hi", "Hello", "Bye"]
    assert chat.reasoning_effort == "low"
