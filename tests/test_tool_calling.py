"""Tool calling on /v1/chat/completions, and the chat-template extras.

The hermes parser is checked on crafted text, streamed split at every position; the rest
goes through one real server (``--enable-auto-tool-choice --tool-call-parser hermes`` and a
Hermes-style template that renders tools) with the ``openai`` client. Oracles: jsonschema
for the arguments, transformers' ``apply_chat_template`` for the prompt the server renders
(compared as token ids, via ``return_token_ids``), the whole response for the stream.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import openai
import pytest

from forerun.server.protocol import ChatCompletionRequest
from forerun.server.tool_calls import (
    ChoiceToolStream,
    ToolCallConfig,
    ToolPlan,
    plan_tools,
    tool_message,
)
from forerun.tool_parsers import (
    Hermes2ProToolParser,
    OpenAIToolParser,
    ToolParser,
    ToolParserManager,
)
from tests.server_harness import DEFAULT, MODEL, ServerArgs, ServerHandle

slow = pytest.mark.slow

TEMPLATE_PATH = Path(__file__).parent / "data" / "tool_chat_template_hermes.jinja"
TOOLS_SERVER = ServerArgs(("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                           "--chat-template", str(TEMPLATE_PATH)))
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False,
                   "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"type": "string",
                                           "enum": ["celsius", "fahrenheit"]}}}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                   "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

CRAFTED = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": '
           '{"city": "Paris \\"}\\" <tool_call>", "unit": "celsius"}}\n</tool_call>\n'
           '<tool_call>{"arguments": {"a": 1, "b": [2, {"c": "]"}]}, "name": "add"}'
           '</tool_call>')


# --- the hermes parser on crafted text -------------------------------------------------

def reassemble(deltas: list[Any]) -> tuple[str, list[tuple[str, str]]]:
    content, calls = "", {}  # type: ignore[var-annotated]
    for d in deltas:
        content += d.content or ""
        for c in d.tool_calls:
            if c.name is not None:
                assert c.index not in calls, "a call's name is sent once"
                calls[c.index] = [c.name, ""]
            calls[c.index][1] += c.arguments
    return content, [tuple(v) for v in calls.values()]  # type: ignore[misc]


def stream_pieces(parser: ToolParser, pieces: list[str]) -> list[Any]:
    deltas, text = [], ""
    for k, piece in enumerate(pieces):
        prev, text = text, text + piece
        d = parser.extract_tool_calls_streaming(prev, text, piece,
                                                finished=k == len(pieces) - 1)
        if d is not None:
            deltas.append(d)
    return deltas


def test_hermes_whole_text_splits_content_and_calls() -> None:
    info = Hermes2ProToolParser().extract_tool_calls(CRAFTED)
    assert info.tools_called and info.content == "Let me look. "
    assert [c.name for c in info.tool_calls] == ["get_weather", "add"]
    # The oracle: json's own reading of the crafted arguments.
    assert json.loads(info.tool_calls[0].arguments) == {"city": 'Paris "}" <tool_call>',
                                                       "unit": "celsius"}
    assert json.loads(info.tool_calls[1].arguments) == {"a": 1, "b": [2, {"c": "]"}]}


@pytest.mark.parametrize("text", [CRAFTED, "No tools needed, just text < and <tool"])
def test_hermes_stream_split_anywhere_reassembles_to_the_whole_response(text: str) -> None:
    whole = Hermes2ProToolParser().extract_tool_calls(text)
    expect = (whole.content or "", [(c.name, c.arguments) for c in whole.tool_calls])
    for cut in range(len(text) + 1):
        for cut2 in (cut, min(len(text), cut + 7)):
            pieces = [text[:cut], text[cut:cut2], text[cut2:]]
            assert reassemble(stream_pieces(Hermes2ProToolParser(), pieces)) == expect, cut
    assert reassemble(stream_pieces(Hermes2ProToolParser(), list(text))) == expect


def test_hermes_text_without_calls_is_content_and_malformed_calls_stay_text() -> None:
    plain = Hermes2ProToolParser().extract_tool_calls("Paris is sunny.")
    assert not plain.tools_called and plain.content == "Paris is sunny."
    bad = '<tool_call>{"arguments": {}}</tool_call>'  # no name: not a call
    info = Hermes2ProToolParser().extract_tool_calls(bad)
    assert not info.tools_called and info.content == bad


def test_hermes_stream_of_a_malformed_call_still_ends_with_all_the_text_as_content() -> None:
    # Known limit (as in vLLM): a call streamed before its JSON turned out broken stays sent.
    text = 'Broken <tool_call>{"name": "x", "arguments": {</tool_call>'
    assert Hermes2ProToolParser().extract_tool_calls(text).content == text
    for cut in range(len(text) + 1):
        content, _ = reassemble(stream_pieces(Hermes2ProToolParser(), [text[:cut], text[cut:]]))
        assert content == text


def test_hermes_keeps_special_tokens_only_where_its_tag_is_one() -> None:
    body = ChatCompletionRequest(messages=ASK)
    plain = Hermes2ProToolParser(SimpleNamespace(all_special_tokens=["<|im_end|>"]))
    assert plain.adjust_request(body).skip_special_tokens
    qwen = Hermes2ProToolParser(SimpleNamespace(all_special_tokens=["<tool_call>"]))
    assert not qwen.adjust_request(body).skip_special_tokens


def test_hermes_stream_holds_back_a_partial_tag_until_it_is_decided() -> None:
    p = Hermes2ProToolParser()
    d = p.extract_tool_calls_streaming("", "Hi <tool_c", "Hi <tool_c")
    assert d is not None and d.content == "Hi "
    assert p.extract_tool_calls_streaming("Hi <tool_c", "Hi <tool_cat", "at",
                                          finished=True).content == "<tool_cat"


# --- the harmony (gpt-oss) parser on crafted text ------------------------------------
# Shapes from OpenAI's harmony guide: a call is a commentary message addressed to
# functions.NAME (the recipient after the channel, or before it as gpt-oss's own chat
# template writes it), optionally <|constrain|>json, ending in <|call|>.

ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather. Use the tool.<|end|>"
# (text, expected content, expected [(name, arguments)]); content None: none.
HARMONY_CASES: list[tuple[str, str | None, list[tuple[str, str]]]] = [
    (ANALYSIS + "<|start|>assistant<|channel|>commentary to=functions.get_weather "
     '<|constrain|>json<|message|>{"city": "Paris", "unit": "celsius"}<|call|>',
     None, [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    # The recipient before the channel, right after the prompt's "<|start|>assistant".
    (' to=functions.add<|channel|>commentary json<|message|>{"a": 1, "b": 2}<|call|>',
     None, [("add", '{"a": 1, "b": 2}')]),
    (ANALYSIS + "<|start|>assistant to=functions.add<|channel|>commentary json"
     '<|message|>{"a": 1, "b": 2}<|call|>', None, [("add", '{"a": 1, "b": 2}')]),
    # No <|constrain|>, and no <|call|>: the output ends where gpt-oss stopped on it.
    (ANALYSIS + "<|start|>assistant<|channel|>commentary to=functions.add<|message|>"
     '{"a": 3, "b": 4}', None, [("add", '{"a": 3, "b": 4}')]),
    # A preamble (commentary, no recipient) is content; two calls in a row.
    (ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Checking both.<|end|>"
     "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
     '<|message|>{"city": "Oslo", "unit": "celsius"}<|call|>'
     "<|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json"
     '<|message|>{"a": 5, "b": 6}<|call|>', "Checking both.",
     [("get_weather", '{"city": "Oslo", "unit": "celsius"}'), ("add", '{"a": 5, "b": 6}')]),
    # No call: the final channel is the content, the analysis is not.
    (ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is 20 C in Paris."
     "<|return|>", "It is 20 C in Paris.", []),
    ("Plain text, no header at all < <|", "Plain text, no header at all < <|", []),
    # Arguments that are not JSON are passed on as written (vLLM keeps the text too).
    ("<|channel|>commentary to=functions.add <|constrain|>json<|message|>{a: 1,<|call|>",
     None, [("add", "{a: 1,")]),
    # A built-in tool's call (browser, python) is not a function call: dropped, as in vLLM.
    ("<|channel|>analysis to=browser.search code<|message|>{\"query\": \"x\"}<|call|>",
     None, []),
]


def harmony_result(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    info = OpenAIToolParser().extract_tool_calls(text)
    assert info.tools_called == bool(info.tool_calls)
    return info.content, [(c.name, c.arguments) for c in info.tool_calls]


@pytest.mark.parametrize(("text", "content", "calls"), HARMONY_CASES)
def test_harmony_whole_text_gives_the_calls_and_the_final_text(
        text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    assert harmony_result(text) == (content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), HARMONY_CASES)
def test_harmony_stream_split_anywhere_reassembles_to_the_whole_response(
        text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    expect = (content or "", calls)
    n = len(text)
    for i in range(n + 1):
        assert reassemble(stream_pieces(OpenAIToolParser(), [text[:i], text[i:]])) == expect
        for j in range(i, min(n, i + 12) + 1):  # every cut of every marker, twice
            pieces = [text[:i], text[i:j], text[j:]]
            assert reassemble(stream_pieces(OpenAIToolParser(), pieces)) == expect, (i, j)
    assert reassemble(stream_pieces(OpenAIToolParser(), list(text))) == expect


def test_harmony_stream_sends_a_call_once_its_header_is_whole() -> None:
    p = OpenAIToolParser()
    head = "<|channel|>commentary to=functions.add <|constrain|>json<|mess"
    assert p.extract_tool_calls_streaming("", head, head) is None  # not named yet
    d = p.extract_tool_calls_streaming(head, head + 'age|>{"a"', 'age|>{"a"')
    assert d is not None and [(c.index, c.name, c.arguments) for c in d.tool_calls] \
        == [(0, "add", '{"a"')]
    d = p.extract_tool_calls_streaming("", head + 'age|>{"a": 1}<|ca', "")
    assert d is not None and d.tool_calls[0].arguments == ": 1}"  # "<|ca" held back


def test_harmony_parser_is_registered_as_openai_and_keeps_special_tokens() -> None:
    assert ToolParserManager.get_tool_parser("openai") is OpenAIToolParser
    assert OpenAIToolParser.reads_whole_output and not Hermes2ProToolParser.reads_whole_output
    body = ChatCompletionRequest(messages=ASK)
    assert body.skip_special_tokens
    assert not OpenAIToolParser().adjust_request(body).skip_special_tokens
    plan = plan_tools(ToolCallConfig(True, "openai"),
                      SimpleNamespace(tools=TOOLS, tool_choice="auto", parallel_tool_calls=None))
    assert plan.reads_whole_output
    message, finish = tool_message(plan, "assistant", HARMONY_CASES[0][0], "stop")
    assert calls_of(message) == HARMONY_CASES[0][2] and message.content is None
    assert finish == "tool_calls"


def plan_for(tool_choice: Any, parallel: bool = True) -> ToolPlan:
    body = SimpleNamespace(tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=parallel)
    return plan_tools(ToolCallConfig(True, "hermes"), body)


REQUIRED_OUT = ('[{"name": "add", "parameters": {"a": 1, "b": 2}}, '
                '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}]')


def test_required_schema_takes_calls_to_the_tools_and_nothing_else() -> None:
    schema = plan_for("required").schema
    jsonschema.validate(json.loads(REQUIRED_OUT), schema)
    for bad in ([], [{"name": "add", "parameters": {"a": "1", "b": 2}}],
                [{"name": "sub", "parameters": {"a": 1, "b": 2}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(REQUIRED_OUT), plan_for("required", False).schema)


@pytest.mark.parametrize(("choice", "text"), [
    ("required", REQUIRED_OUT),
    ({"type": "function", "function": {"name": "add"}}, '{"a": 1, "b": 2}'),
    ("auto", CRAFTED)])
def test_forced_and_auto_streams_split_anywhere_give_the_whole_calls(choice: Any,
                                                                    text: str) -> None:
    plan = plan_for(choice)
    message, finish = tool_message(plan, "assistant", text, "stop")
    expect = [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert finish == ("stop" if isinstance(choice, dict) else "tool_calls")
    for cut in range(len(text) + 1):
        stream, got = ChoiceToolStream(plan), {}  # type: ignore[var-annotated]
        for piece, done in ((text[:cut], False), (text, True)):
            delta = stream.delta(piece, done)
            for tc in (delta.tool_calls if delta and delta.tool_calls else []):
                if tc.id:
                    got[tc.index] = [tc.function.name, ""]
                got[tc.index][1] += tc.function.arguments or ""
        assert [tuple(v) for v in got.values()] == expect, cut
        assert stream.finish_reason("stop") == finish


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    message, _ = tool_message(plan_for("auto", parallel=False), "assistant", CRAFTED, "stop")
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]


# --- through the server ---------------------------------------------------------------

@pytest.fixture(scope="module")
def server() -> ServerHandle:
    s = TOOLS_SERVER.start()
    s.wait_healthy()
    return s


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer: Any) -> Any:
    return smollm2_tokenizer  # the session's (conftest)


def hf_ids(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    text = tokenizer.apply_chat_template(messages, chat_template=TEMPLATE_PATH.read_text(),
                                         tokenize=False, **kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))


def chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", ASK)
    return client.chat.completions.create(model=MODEL, temperature=0, **kwargs)


def streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[str, list[tuple[str, str]],
                                                              str | None]:
    """(content, [(name, arguments)], finish_reason) reassembled from a stream."""
    content, calls, finish = "", {}, None  # type: ignore[var-annotated]
    for chunk in chat(client, stream=True, **kwargs):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                if tc.id is not None:
                    assert tc.id.startswith("chatcmpl-tool-") and tc.index not in calls
                    calls[tc.index] = [tc.function.name, ""]
                calls[tc.index][1] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return content, [tuple(v) for v in calls.values()], finish  # type: ignore[misc]


def calls_of(message: Any) -> list[tuple[str, str]]:
    for tc in message.tool_calls:
        assert tc.id.startswith("chatcmpl-tool-") and tc.type == "function"
    return [(tc.function.name, tc.function.arguments) for tc in message.tool_calls]


@slow
def test_named_function_arguments_follow_its_schema_and_stream_the_same(
        client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(client, tools=TOOLS, tool_choice=choice, max_tokens=60)
    calls = calls_of(r.choices[0].message)
    assert [name for name, _ in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0][1]), SCHEMAS["get_weather"])
    # OpenAI's and vLLM's rule: a named call ends with "stop", not "tool_calls".
    assert r.choices[0].finish_reason == "stop"
    assert streamed(client, tools=TOOLS, tool_choice=choice, max_tokens=60) == (
        "", calls, "stop")


@slow
def test_required_calls_follow_their_schemas_and_stream_the_same(
        client: openai.OpenAI) -> None:
    kwargs = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
              "max_tokens": 60}
    r = chat(client, **kwargs)
    calls = calls_of(r.choices[0].message)
    assert len(calls) == 1 and r.choices[0].finish_reason == "tool_calls"
    name, arguments = calls[0]
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    assert streamed(client, **kwargs) == ("", calls, "tool_calls")


@slow
def test_auto_parses_hermes_calls_from_the_model_text(client: openai.OpenAI) -> None:
    # A choice constraint makes the tiny model write a hermes call, so the parser runs on
    # real server output.
    text = 'Adding.<tool_call>{"name":"add","arguments":{"a":2}}</tool_call>'
    kwargs = {"tools": TOOLS, "tool_choice": "auto", "max_tokens": 40,
              "extra_body": {"structured_outputs": {"choice": [text]}}}
    r = chat(client, **kwargs)
    calls = calls_of(r.choices[0].message)
    assert calls == [("add", '{"a":2}')]
    assert r.choices[0].message.content == "Adding."
    assert r.choices[0].finish_reason == "tool_calls"
    assert streamed(client, **kwargs) == ("Adding.", calls, "tool_calls")
    # No call: the text is the content, the end-of-turn token not in it.
    r = chat(client, tools=TOOLS, tool_choice="auto", max_tokens=8,
             extra_body={"structured_outputs": {"choice": ["Paris."]}})
    assert r.choices[0].message.content == "Paris." and r.choices[0].message.tool_calls == []
    assert r.choices[0].finish_reason == "stop"


@slow
def test_tool_choice_errors_are_400s(client: openai.OpenAI) -> None:
    bad = [{"tool_choice": {"type": "function", "function": {"name": "nope"}},
            "tools": TOOLS},
           {"tool_choice": "required"},
           {"tool_choice": "sometimes", "tools": TOOLS},
           {"tools": [{"type": "retrieval"}]},
           {"tool_choice": "required", "tools": TOOLS,
            "response_format": {"type": "json_object"}}]
    for kwargs in bad:
        with pytest.raises(openai.BadRequestError):
            chat(client, max_tokens=1, **kwargs)


@slow
def test_auto_without_the_server_flags_is_a_400() -> None:
    plain = DEFAULT.start()  # the default server (shared with test_server.py)
    plain.wait_healthy()
    c = openai.OpenAI(base_url=f"{plain.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
        chat(c, tools=TOOLS, tool_choice="auto", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
        chat(c, tools=TOOLS, max_tokens=1)  # with tools, the default choice is auto
    # "none" renders the tools and answers in text.
    r = chat(c, tools=TOOLS, tool_choice="none", max_tokens=2)
    assert r.choices[0].message.tool_calls == [] and r.choices[0].message.content


def prompt_ids(client: openai.OpenAI, **kwargs: Any) -> list[int]:
    r = chat(client, max_tokens=1, extra_body={"return_token_ids": True,
                                               **kwargs.pop("extra_body", {})}, **kwargs)
    return list(r.model_extra["prompt_token_ids"])


@slow
def test_tools_reach_the_template_as_transformers_renders_them(
        client: openai.OpenAI, tokenizer: Any) -> None:
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "chatcmpl-tool-1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "21 C"}]
    # Transformers gets the arguments as an object, as templates expect them.
    hf_history = json.loads(json.dumps(history))
    hf_history[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris",
                                                               "unit": "celsius"}
    hf_history[1]["content"] = ""
    expect = hf_ids(tokenizer, hf_history, tools=TOOLS, add_generation_prompt=True)
    assert prompt_ids(client, messages=history, tools=TOOLS, tool_choice="none") == expect
    assert prompt_ids(client, messages=ASK, tools=TOOLS, tool_choice="none") == hf_ids(
        tokenizer, ASK, tools=TOOLS, add_generation_prompt=True)


@slow
def test_template_kwargs_documents_and_custom_roles_match_transformers(
        client: openai.OpenAI, tokenizer: Any) -> None:
    got = prompt_ids(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert got == hf_ids(tokenizer, ASK, add_generation_prompt=True, enable_thinking=False)
    docs = [{"title": "Paris", "text": "Sunny all week."}]
    got = prompt_ids(client, tools=TOOLS, tool_choice="none", extra_body={"documents": docs})
    assert got == hf_ids(tokenizer, ASK, tools=TOOLS, documents=docs,
                         add_generation_prompt=True)
    critic = [*ASK, {"role": "critic", "content": "Be brief."}]
    assert prompt_ids(client, messages=critic) == hf_ids(tokenizer, critic,
                                                         add_generation_prompt=True)


@slow
def test_continue_final_message_continues_it_and_echo_returns_it(
        client: openai.OpenAI, tokenizer: Any) -> None:
    partial = [*ASK, {"role": "assistant", "content": "The weather in Paris is"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    plain = chat(client, messages=partial, max_tokens=3,
                 extra_body={**extra, "return_token_ids": True})
    assert plain.model_extra["prompt_token_ids"] == hf_ids(
        tokenizer, partial, continue_final_message=True, add_generation_prompt=False)
    echoed = chat(client, messages=partial, max_tokens=3, extra_body={**extra, "echo": True})
    assert echoed.choices[0].message.content == (
        "The weather in Paris is" + plain.choices[0].message.content)
    assert echoed.choices[0].message.role == "assistant"
    content, _, _ = streamed(client, messages=partial, max_tokens=3,
                             extra_body={**extra, "echo": True})
    assert content == echoed.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        chat(client, messages=partial, max_tokens=1,
             extra_body={"continue_final_message": True})
