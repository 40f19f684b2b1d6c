"""Ollama's native API (``/api/*``) through the official ``ollama`` client, unmodified,
against the session's shared default server (SmolLM2-135M-Instruct). Oracles: the offline
engine's greedy text for the same chat template, jsonschema for structured output, and the
server's /metrics for "every KV block is free" after bad requests."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import ollama
import pytest

from forerun import SamplingParams
from tests.server_harness import MODEL, ServerHandle, start_server
from tests.test_server_validation import assert_all_blocks_free

pytestmark = pytest.mark.slow


CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "Hello, my name is"
N = 8
GREEDY = {"temperature": 0, "num_predict": N}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "description": "The weather in a city",
                                           "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def env(llm_cache: Any) -> dict[str, Any]:
    server = start_server()  # the shared default server: boots while the reference runs
    llm = llm_cache()
    greedy = SamplingParams(max_tokens=N, temperature=0.0)
    ref_chat = llm.chat(CHAT, greedy, use_tqdm=False)[0].outputs[0]
    ref_raw = llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0]
    server.wait_healthy()
    return {"server": server, "ref_chat": ref_chat, "ref_raw": ref_raw}


@pytest.fixture(scope="module")
def server(env: dict[str, Any]) -> ServerHandle:
    return env["server"]


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> ollama.Client:
    return ollama.Client(host=server.base_url, timeout=120)


def check_final(r: Any, n_gen: int, reason: str) -> None:
    """The done chunk's counts, and durations measured in nanoseconds that add up."""
    assert r.done is True and r.done_reason == reason
    assert r.eval_count == n_gen and r.prompt_eval_count > 0
    parts = (r.load_duration, r.prompt_eval_duration, r.eval_duration)
    assert all(p >= 0 for p in parts) and r.prompt_eval_duration > 0
    assert sum(parts) <= r.total_duration < 600 * 10**9


def test_chat_matches_offline_whole_and_streamed(env: dict[str, Any],
                                                 client: ollama.Client) -> None:
    ref = env["ref_chat"]
    r = client.chat(model=MODEL, messages=CHAT, options=GREEDY, stream=False)
    assert r.message.role == "assistant" and r.message.content == ref.text
    assert r.model == MODEL
    check_final(r, len(ref.token_ids), ref.finish_reason)
    chunks = list(client.chat(model=f"{MODEL}:latest", messages=CHAT, options=GREEDY,
                              stream=True))
    assert [c.done for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert "".join(c.message.content for c in chunks) == ref.text
    check_final(chunks[-1], len(ref.token_ids), ref.finish_reason)


def test_generate_templated_raw_and_context(env: dict[str, Any], client: ollama.Client) -> None:
    # Not raw: the prompt goes through the chat template as a user message.
    r = client.generate(model=MODEL, prompt=CHAT[0]["content"], options=GREEDY)
    assert r.response == env["ref_chat"].text
    assert len(r.context) == r.prompt_eval_count + r.eval_count
    ref = env["ref_raw"]
    raw = list(client.generate(model=MODEL, prompt=PROMPT, raw=True, options=GREEDY,
                               stream=True))
    assert "".join(c.response for c in raw) == ref.text
    check_final(raw[-1], len(ref.token_ids), ref.finish_reason)
    assert raw[-1].context[-len(ref.token_ids):] == list(ref.token_ids)
    short = client.generate(model=MODEL, prompt=PROMPT, raw=True,
                            options={"temperature": 0, "num_predict": 3})
    check_final(short, 3, "length")
    # Empty prompt: Ollama's "load the model" request, answered at once.
    assert client.generate(model=MODEL, prompt="").done_reason == "load"


def test_tool_call_round_trip(client: ollama.Client) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    opts = {"temperature": 0, "num_predict": 40}
    r = client.chat(model=MODEL, messages=messages, tools=TOOLS, options=opts)
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(call.function.arguments, dict)
    jsonschema.validate(call.function.arguments, WEATHER)
    assert r.done_reason == "stop" and not r.message.content
    # Cut short before the call is whole: no call, the text written so far, "length".
    cut = client.chat(model=MODEL, messages=messages, tools=TOOLS,
                      options={"temperature": 0, "num_predict": 2})
    assert cut.done_reason == "length" and not cut.message.tool_calls
    assert cut.message.content and cut.message.content.startswith("{")
    # The call's result goes back as a tool message; the model answers it in text.
    messages += [r.message, {"role": "tool", "content": "Sunny, 22 C",
                             "tool_name": "get_weather"}]
    r2 = client.chat(model=MODEL, messages=messages, tools=TOOLS,
                     options={"temperature": 0, "num_predict": 4})
    assert r2.message.content and not r2.message.tool_calls


def test_streamed_tool_calls_from_several_tools(client: ollama.Client) -> None:
    clock = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
    chunks = list(client.chat(model=MODEL, messages=[
        {"role": "user", "content": "What is the weather in Paris?"}], tools=[*TOOLS, clock],
        options={"temperature": 0, "num_predict": 60}, stream=True))
    calls = [t for c in chunks for t in c.message.tool_calls or []]
    assert calls and all(not c.message.content for c in chunks)
    for t in calls:  # each a whole call, arguments an object valid for its tool
        schema = WEATHER if t.function.name == "get_weather" else clock["function"]["parameters"]
        jsonschema.validate(t.function.arguments, schema)
    assert chunks[-1].done and chunks[-1].done_reason == "stop"


def test_format_schema_output_validates(client: ollama.Client) -> None:
    schema = {"type": "object", "properties": {"capital": {"type": "string"}},
              "required": ["capital"], "additionalProperties": False}
    r = client.chat(model=MODEL, messages=CHAT, format=schema,
                    options={"temperature": 0, "num_predict": 40})
    assert r.done_reason == "stop"
    jsonschema.validate(json.loads(r.message.content), schema)


def test_tags_show_ps_version(server: ServerHandle, client: ollama.Client) -> None:
    (m,) = client.list().models
    assert m.model == f"{MODEL}:latest" and m.details.family == "llama"
    assert m.details.parameter_size == "134.52M" and m.details.quantization_level == "F32"
    show = client.show(MODEL)
    assert show.capabilities == ["completion", "tools"]
    assert "im_start" in show.template  # the model's own chat template text
    info = show.modelinfo
    assert info["general.architecture"] == "llama" and info["llama.block_count"] == 30
    assert info["llama.context_length"] == 8192 and info["general.parameter_count"] > 10**8
    (p,) = client.ps().models
    assert p.model == f"{MODEL}:latest" and p.context_length == 2048
    assert httpx.get(f"{server.base_url}/api/version").json()["version"]


# (path, body, status, what the error must say: the field it names)
BAD: list[tuple[str, dict[str, Any], int, str]] = [
    ("/api/generate", {"model": "nope", "prompt": "x"}, 404, "model 'nope' not found"),
    ("/api/chat", {"messages": CHAT}, 400, "model is required"),
    ("/api/generate", {"model": MODEL, "prompt": "x", "options": {"num_ctx": 4096}}, 400,
     "options.num_ctx"),
    ("/api/generate", {"model": MODEL, "prompt": "x", "options": {"temperature": "hot"}}, 400,
     "options.temperature"),
    ("/api/generate", {"model": MODEL, "prompt": "x", "options": {"top_p": 7}}, 400,
     "options.top_p"),
    ("/api/generate", {"model": MODEL, "prompt": "x", "options": {"repeat_penalty": -1}}, 400,
     "options.repeat_penalty"),
    ("/api/generate", {"model": MODEL, "prompt": 5}, 400, "prompt"),
    ("/api/generate", {"model": MODEL, "prompt": "x", "format": "xml"}, 400, "format"),
    ("/api/generate", {"model": MODEL, "prompt": "x", "images": ["aGk="]}, 400, "images"),
    ("/api/generate", {"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/api/generate", {"model": MODEL, "prompt": "x", "think": True}, 400,
     "does not support thinking"),
    ("/api/chat", {"model": MODEL, "messages": CHAT, "think": "low"}, 400,
     "does not support thinking"),  # without --reasoning-parser
    ("/api/chat", {"model": MODEL, "messages": CHAT, "think": "max"}, 400,
     'invalid think value: "max"'),
    ("/api/generate", {"model": MODEL, "prompt": "x", "raw": True, "system": "s"}, 400,
     "raw mode"),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "x",
                                                 "images": ["aGk="]}]}, 400,
     "messages[0].images"),
    ("/api/chat", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("/api/pull", {"model": "llama3"}, 501, "serves only the model"),
    ("/api/embed", {"model": MODEL, "input": ""}, 400, "input"),
    ("/api/embed", {"model": MODEL, "input": "x", "dimensions": 0}, 400, "dimensions"),
]


def test_bad_input_is_ollama_error_naming_field_and_frees_blocks(
        server: ServerHandle, client: ollama.Client) -> None:
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        for path, body, status, says in BAD:
            r = http.post(path, json=body)
            assert (r.status_code, list(r.json())) == (status, ["error"]), (body, r.text)
            assert says in r.json()["error"], (body, r.text)
        # Unknown options are ignored, as Ollama ignores them; think=false is fine.
        ok = http.post("/api/generate", json={"model": MODEL, "prompt": PROMPT, "raw": True,
                                              "stream": False, "think": False,
                                              "keep_alive": "5m",
                                              "options": {"num_predict": 2, "mirostat": 2}})
        assert ok.status_code == 200 and ok.json()["eval_count"] == 2
        assert_all_blocks_free(http)
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="missing", messages=CHAT)
    assert err.value.status_code == 404 and err.value.error == "model 'missing' not found"


@pytest.mark.parametrize("path", ["/api/chat", "/api/generate", "/v1/models"])
def test_api_key_guards_ollama_routes_too(path: str) -> None:
    import asyncio

    from forerun.server.edge import EdgeGuard

    reached: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope["path"])

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    guard = EdgeGuard(app, api_key="k", max_body_bytes=1 << 20)
    scope = {"type": "http", "path": path, "headers": []}
    asyncio.run(guard(scope, receive, send))
    assert not reached and sent[0]["status"] == 401
    asyncio.run(guard({**scope, "headers": [(b"authorization", b"Bearer k")]}, receive, send))
    assert reached == [path]


# --- think with --reasoning-parser: the reply builder on scripted token streams ----------
THOUGHT = ["<think>", "Two", " and", " two", "</", "think", ">", "Four", "."]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'


def _replies(pieces: list[str], chat: bool, think: bool,
             tools: list[dict[str, Any]] | None = None) -> tuple[list[dict[str, Any]],
                                                                 dict[str, Any]]:
    """(the NDJSON lines, the one object) of a scripted deepseek_r1 reply."""
    import asyncio

    from forerun.server.ollama_protocol import OllamaEngineRequest
    from forerun.server.ollama_writer import ResponseWriter, Timing
    from forerun.server.reasoning import plan_reasoning
    from forerun.server.tool_calls import ToolCallConfig, plan_tools
    from tests.scripted_outputs import PieceTokenizer, ScriptedStream, collect

    tok = PieceTokenizer(pieces)
    req = OllamaEngineRequest.model_validate({"messages": CHAT, "include_reasoning": think,
                                              "tools": tools})
    plan = plan_tools(ToolCallConfig(True, "hermes"), req, tok)
    rplan = plan_reasoning("deepseek_r1", req, tok)

    def writer() -> ResponseWriter:
        return ResponseWriter(MODEL, chat, plan, Timing(0), rplan)

    lines = asyncio.run(collect(writer().lines(ScriptedStream(pieces))))
    whole = asyncio.run(writer().whole(ScriptedStream(pieces)))
    return [json.loads(line) for line in lines], whole


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("think", [True, False])
def test_think_splits_streamed_and_whole_alike(chat: bool, think: bool) -> None:
    lines, whole = _replies(THOUGHT, chat, think)
    # /api/chat: message.thinking beside message.content; /api/generate: thinking beside
    # response. Oracle: the text cut at </think>; think false drops the thinking.
    part = (lambda o: o["message"]) if chat else (lambda o: o)
    text_key = "content" if chat else "response"
    want = "Two and two" if think else None
    assert part(whole).get("thinking") == want and part(whole)[text_key] == "Four."
    streamed = "".join(part(o).get("thinking", "") for o in lines)
    assert (streamed or None) == want
    assert "".join(part(o)[text_key] for o in lines) == "Four."
    assert not any("thinking" in part(o) and part(o)[text_key] for o in lines)
    assert lines[-1]["done"] and lines[-1]["eval_count"] == whole["eval_count"] == len(THOUGHT)


def test_think_tool_calls_come_from_the_answer_only() -> None:
    pieces = ["<think>", "<tool_call>x</tool_call>", "</think>", CALL]
    lines, whole = _replies(pieces, True, True, TOOLS)
    for message in (whole["message"], lines[-2]["message"]):
        assert [(c["function"]["name"], c["function"]["arguments"])
                for c in message["tool_calls"]] == [("get_weather", {"city": "Rome"})]
    assert whole["message"]["thinking"] == "<tool_call>x</tool_call>"
    assert whole["message"]["content"] == ""
    assert "".join(o["message"].get("thinking", "") for o in lines) == "<tool_call>x</tool_call>"


def test_think_maps_onto_the_chat_request() -> None:
    from types import SimpleNamespace

    from forerun.server.ollama import _check_think
    from forerun.server.ollama_protocol import ChatRequest, OllamaError
    from forerun.server.reasoning import thinking_fields as _thinking_fields

    def ctx(parser: str | None, template: str = "") -> Any:
        tok = SimpleNamespace(chat_template=template)
        return SimpleNamespace(reasoning_parser=parser, chat_template=None,
                               engine=SimpleNamespace(tokenizer=tok))

    def body(think: Any) -> ChatRequest:
        return ChatRequest.model_validate({"model": MODEL, "messages": CHAT, "think": think})

    qwen3 = ctx("qwen3", "{%- if enable_thinking is defined and not enable_thinking %}")
    # Ollama: an absent think is on for a thinking model; a template that takes
    # enable_thinking (Qwen3's) is told either way.
    assert _thinking_fields(qwen3, None) == {
        "include_reasoning": True, "chat_template_kwargs": {"enable_thinking": True}}
    assert _thinking_fields(qwen3, False) == {
        "include_reasoning": False, "chat_template_kwargs": {"enable_thinking": False}}
    assert _thinking_fields(ctx("deepseek_r1"), False) == {"include_reasoning": False}
    harmony = ctx("openai_gptoss")
    _check_think(harmony, body("low"))
    assert _thinking_fields(harmony, "low") == {"include_reasoning": True,
                                                "reasoning_effort": "low"}
    for c, think, says in [(qwen3, "high", 'think value "high" is not supported'),
                           (harmony, "max", "invalid think value"),
                           (ctx(None), True, "does not support thinking")]:
        with pytest.raises(OllamaError) as err:
            _check_think(c, body(think))
        assert err.value.status == 400 and says in err.value.message
    _check_think(ctx(None), body(False))
