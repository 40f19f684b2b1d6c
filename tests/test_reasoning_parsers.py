"""--reasoning-parser's parsers on text and on real token streams: deepseek_r1 and qwen3
(``<think>`` tags) and openai_gptoss (harmony channels); the registry and the server flag;
gpt-oss's built-in harmony template and its GGUF stop tokens.

Expected splits are written out by hand from each format's definition; the streaming
checks compare every split of the text (every cut of a tag across two chunks, and the
model tokenizer's own token-by-token decode) with the whole-text result.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import msgspec
import pytest

from forerun.reasoning import (
    DeepSeekR1ReasoningParser,
    GptOssReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    ReasoningParserManager,
)
from forerun.server.bodies import ChatDelta, ChatMessage
from forerun.server.config import ServerConfig

HARMONY_MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>",
                   "<|call|>", "<|constrain|>"]

# (parser, text, expected reasoning, expected content) -- None: no such part.
CASES: list[tuple[type[ReasoningParser], str, str | None, str | None]] = [
    (DeepSeekR1ReasoningParser, "Two plus two.\nFour.</think>\n\nThe answer is 4.",
     "Two plus two.\nFour.", "\n\nThe answer is 4."),
    (DeepSeekR1ReasoningParser, "<think>Hmm, 4.</think>4", "Hmm, 4.", "4"),
    # No end tag: the model never stopped thinking (cut by max_tokens).
    (DeepSeekR1ReasoningParser, "still thinking <thi", "still thinking <thi", None),
    (DeepSeekR1ReasoningParser, "</think>Only an answer.", None, "Only an answer."),
    # Past the thought, tags are text of the answer.
    (DeepSeekR1ReasoningParser, "a</think>b</think>c<think>", "a", "b</think>c<think>"),
    (Qwen3ReasoningParser, "<think>\nLet me see.\n</think>\n\nParis.",
     "\nLet me see.\n", "\n\nParis."),
    (Qwen3ReasoningParser, "Paris, no thinking.", None, "Paris, no thinking."),
    (Qwen3ReasoningParser, "Well <think>x</think> y", "x", "Well  y"),
    (Qwen3ReasoningParser, "<think>cut off", "cut off", None),
    (Qwen3ReasoningParser, "a </think> b", None, "a </think> b"),
    (GptOssReasoningParser,
     "<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>",
     "User asks 2+2. Easy.", "2 + 2 = 4."),
    (GptOssReasoningParser,
     "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
     "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
     '{"city":"Paris"}<|call|>', "Need the weather.", '{"city":"Paris"}'),
    (GptOssReasoningParser, "<|channel|>analysis<|message|>cut", "cut", None),
    (GptOssReasoningParser, "<|channel|>final<|message|>Hi.", None, "Hi."),
    (GptOssReasoningParser, "no header at all", None, "no header at all"),
    # A header cut off before <|message|> says nothing.
    (GptOssReasoningParser, "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|cha",
     "a", None),
]
IDS = [f"{c[0].__name__}-{i}" for i, c in enumerate(CASES)]


def stream(parser_cls: type[ReasoningParser], chunks: list[str]) -> tuple[str, str]:
    """(reasoning, content) reassembled from a stream of ``chunks``, the last finishing."""
    p = parser_cls()
    reasoning = content = text = ""
    for k, piece in enumerate(chunks):
        text += piece
        d = p.extract_reasoning_streaming(text, finished=k == len(chunks) - 1)
        reasoning += d.reasoning or ""
        content += d.content or ""
        assert d.content_so_far == content
    return reasoning, content


@pytest.mark.parametrize(("parser_cls", "text", "reasoning", "content"), CASES, ids=IDS)
def test_whole_text_splits_as_the_format_says(parser_cls: type[ReasoningParser], text: str,
                                              reasoning: str | None,
                                              content: str | None) -> None:
    assert parser_cls().extract_reasoning(text) == (reasoning, content)


@pytest.mark.parametrize(("parser_cls", "text", "reasoning", "content"), CASES, ids=IDS)
def test_segments_reassemble_the_raw_text(parser_cls: type[ReasoningParser], text: str,
                                          reasoning: str | None, content: str | None) -> None:
    split = parser_cls().split(text, finished=True)
    assert split.text == text
    # Whatever is neither reasoning nor content is the format's markup, nothing else.
    markup = "".join(s.text for s in split.segments if s.kind == "markup")
    assert len(split.reasoning) + len(split.content) + len(markup) == len(text)


@pytest.mark.parametrize(("parser_cls", "text", "reasoning", "content"), CASES, ids=IDS)
def test_every_two_and_three_chunk_stream_gives_the_whole_result(
        parser_cls: type[ReasoningParser], text: str, reasoning: str | None,
        content: str | None) -> None:
    want = (reasoning or "", content or "")
    n = len(text)
    for i in range(n + 1):
        assert stream(parser_cls, [text[:i], text[i:]]) == want, i
        for j in range(i, min(n, i + 12) + 1):  # every cut of every tag, twice
            assert stream(parser_cls, [text[:i], text[i:j], text[j:]]) == want, (i, j)
    assert stream(parser_cls, list(text)) == want  # one character at a time


def token_chunks(tokenizer: Any, text: str, skip_special_tokens: bool) -> list[str]:
    """The text as a server streams it: the decode of each longer token prefix, less the
    previous one (a character a token spans in part waits for the token that ends it)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    chunks, prev = [], ""
    for k in range(1, len(ids) + 1):
        now = tokenizer.decode(ids[:k], skip_special_tokens=skip_special_tokens)
        if now.endswith("\ufffd"):
            continue
        chunks.append(now[len(prev):])
        prev = now
    chunks.append(tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)[len(prev):])
    return chunks


@pytest.fixture(scope="module")
def harmony_tokenizer(smollm2_tokenizer: Any) -> Any:
    """The default model's tokenizer with harmony's markers as special tokens, as they are
    in gpt-oss's (a copy: the session's tokenizer is shared)."""
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": HARMONY_MARKERS})
    return tok


@pytest.mark.parametrize(("parser_cls", "text", "reasoning", "content"),
                         [c for c in CASES if c[0] is not GptOssReasoningParser],
                         ids=[i for i, c in zip(IDS, CASES, strict=True)
                              if c[0] is not GptOssReasoningParser])
def test_think_tags_streamed_token_by_token(smollm2_tokenizer: Any,
                                            parser_cls: type[ReasoningParser], text: str,
                                            reasoning: str | None,
                                            content: str | None) -> None:
    chunks = token_chunks(smollm2_tokenizer, text, skip_special_tokens=True)
    assert "".join(chunks) == text
    # SmolLM2 spells the tags in several tokens: the stream does split them.
    assert not any(c == "</think>" for c in chunks)
    assert stream(parser_cls, chunks) == (reasoning or "", content or "")


@pytest.mark.parametrize(("text", "reasoning", "content"),
                         [c[1:] for c in CASES if c[0] is GptOssReasoningParser])
def test_harmony_streamed_token_by_token(harmony_tokenizer: Any, text: str,
                                         reasoning: str | None, content: str | None) -> None:
    chunks = token_chunks(harmony_tokenizer, text, skip_special_tokens=False)
    assert "".join(chunks) == text
    assert stream(GptOssReasoningParser, chunks) == (reasoning or "", content or "")
    # Skipping special tokens erases the channels, which is why the parser keeps them.
    if "<|channel|>" in text:
        bare = harmony_tokenizer.decode(harmony_tokenizer.encode(text, add_special_tokens=False),
                                        skip_special_tokens=True)
        assert "<|channel|>" not in bare


def test_harmony_parser_keeps_special_tokens_in_the_output() -> None:
    from forerun.server.protocol import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert body.skip_special_tokens is True
    assert GptOssReasoningParser().adjust_request(body).skip_special_tokens is False
    # <think> is a plain token of SmolLM2's tokenizer: nothing to change there.
    assert Qwen3ReasoningParser().adjust_request(body).skip_special_tokens is True


def test_registry_names_are_vllms_and_unknown_ones_list_the_choices() -> None:
    known = ReasoningParserManager.reasoning_parsers
    assert known["deepseek_r1"] is DeepSeekR1ReasoningParser
    assert known["qwen3"] is Qwen3ReasoningParser
    assert known["openai_gptoss"] is GptOssReasoningParser
    with pytest.raises(KeyError, match="deepseek_r1, openai_gptoss, qwen3"):
        ReasoningParserManager.get_reasoning_parser("deepseek")
    with pytest.raises(ValueError, match=r"'deepseek_r1', 'openai_gptoss', 'qwen3'"):
        ServerConfig(reasoning_parser="deepseek")
    assert ServerConfig(reasoning_parser="qwen3").reasoning_parser == "qwen3"


def test_serve_flag_reaches_the_config_and_an_unknown_name_fails_at_startup(
        caplog: pytest.LogCaptureFixture) -> None:
    import argparse

    from forerun.server.cli_serve import add_serve_parser, run_serve, server_config_from_args

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--reasoning-parser", "deepseek_r1"])
    assert server_config_from_args(args).reasoning_parser == "deepseek_r1"
    assert server_config_from_args(parser.parse_args(["serve"])).reasoning_parser is None
    bad = parser.parse_args(["serve", "--reasoning-parser", "nope"])
    assert run_serve(bad) == 1  # before any model is loaded
    assert "'nope' is not one of ['deepseek_r1', 'openai_gptoss', 'qwen3']" in caplog.text


def test_without_a_parser_no_reasoning_field_is_encoded() -> None:
    assert "reasoning" not in msgspec.json.decode(msgspec.json.encode(
        ChatMessage("assistant", "<think>x</think>y")))
    assert msgspec.json.decode(msgspec.json.encode(ChatDelta(content="x"))) == {"content": "x"}


# --- gpt-oss's harmony chat template ---------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "The city"},
        "unit": {"type": "string", "enum": ["c", "f"]}}}}}

# Written out from the harmony format's description (OpenAI's harmony guide).
EXPECTED_TOOLS_CHAT = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\nCurrent date: 2025-06-28\n\nReasoning: high\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every "
    "message.\nCalls to these tools must go to the commentary channel: 'functions'.<|end|>"
    "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n"
    "namespace functions {\n\n// Weather in a city\ntype get_weather = (_: {\n// The city\n"
    'city: string,\nunit?: "c" | "f",\n}) => any;\n\n} // namespace functions<|end|>'
    "<|start|>user<|message|>Hi<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello!<|end|>"
    "<|start|>user<|message|>Weather in Paris?<|end|>"
    "<|start|>assistant<|channel|>analysis<|message|>Use the tool.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
    "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>20 C<|end|>"
    "<|start|>assistant")


def test_harmony_template_renders_a_tool_conversation(harmony_tokenizer: Any) -> None:
    from forerun.engine.chat import render_chat
    from forerun.model.harmony_template import HARMONY_CHAT_TEMPLATE

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "Use the tool.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "20 C"},
    ]
    text = render_chat(harmony_tokenizer, messages, chat_template=HARMONY_CHAT_TEMPLATE,
                       tools=[WEATHER], current_date="2025-06-28", reasoning_effort="high")
    assert text == EXPECTED_TOOLS_CHAT
    ids = harmony_tokenizer.encode(text, add_special_tokens=False)
    end = harmony_tokenizer.convert_tokens_to_ids("<|end|>")
    assert ids.count(end) == 7  # each marker is one special token


# Two calls in one turn, with a preamble, answered out of order: each result is rendered
# as from the function its tool_call_id names (harmony: <|start|>functions.NAME
# to=assistant<|channel|>commentary<|message|>RESULT<|end|>); written out by hand.
EXPECTED_TWO_CALLS_TAIL = (
    "<|start|>user<|message|>Weather in Paris and Oslo?<|end|>"
    "<|start|>assistant<|channel|>analysis<|message|>Two cities, two calls.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Looking both up.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
    "<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json"
    '<|message|>{"city": "Oslo"}<|call|>'
    "<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>09:00<|end|>"
    "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>20 C<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Paris: 20 C; Oslo: 09:00.<|end|>"
    "<|start|>user<|message|>Thanks<|end|>"
    "<|start|>assistant")


def test_harmony_template_maps_each_tool_result_to_its_call(harmony_tokenizer: Any) -> None:
    from forerun.engine.chat import render_chat
    from forerun.model.harmony_template import HARMONY_CHAT_TEMPLATE

    clock = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    messages = [
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": "Looking both up.",
         "reasoning_content": "Two cities, two calls.", "tool_calls": [
             {"id": "w", "type": "function", "function": {
                 "name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "t", "type": "function", "function": {
                 "name": "get_time", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "t", "content": "09:00"},
        {"role": "tool", "tool_call_id": "w", "content": "20 C"},
        # An earlier answer's reasoning is not rendered (harmony drops it once answered).
        {"role": "assistant", "content": "Paris: 20 C; Oslo: 09:00.",
         "reasoning_content": "Both known."},
        {"role": "user", "content": "Thanks"},
    ]
    text = render_chat(harmony_tokenizer, messages, chat_template=HARMONY_CHAT_TEMPLATE,
                       tools=[WEATHER, clock], current_date="2025-06-28")
    # The tools as a TypeScript-like namespace in the developer message.
    assert ("<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {"
            "\n\n// Weather in a city\ntype get_weather = (_: {\n// The city\ncity: string,"
            '\nunit?: "c" | "f",\n}) => any;\n\ntype get_time = (_: {\ncity?: string,\n})'
            " => any;\n\n} // namespace functions<|end|>") in text
    assert text.endswith(EXPECTED_TWO_CALLS_TAIL)
    assert text.index("<|start|>developer") < text.index(EXPECTED_TWO_CALLS_TAIL)


def test_harmony_template_plain_chat_and_default_effort(harmony_tokenizer: Any) -> None:
    from forerun.engine.chat import render_chat
    from forerun.model.harmony_template import HARMONY_CHAT_TEMPLATE

    text = render_chat(harmony_tokenizer, [{"role": "user", "content": "2+2?"}],
                       chat_template=HARMONY_CHAT_TEMPLATE, current_date="2025-01-02")
    assert text == (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by "
        "OpenAI.\nKnowledge cutoff: 2024-06\nCurrent date: 2025-01-02\n\nReasoning: medium"
        "\n\n# Valid channels: analysis, commentary, final. Channel must be included for "
        "every message.<|end|><|start|>user<|message|>2+2?<|end|><|start|>assistant")


def test_harmony_template_is_the_default_of_gpt_oss_only() -> None:
    from forerun.model.harmony_template import HARMONY_CHAT_TEMPLATE, with_default_chat_template

    class Tok:
        chat_template: str | None = None

    assert with_default_chat_template(Tok(), "GptOssForCausalLM").chat_template \
        == HARMONY_CHAT_TEMPLATE
    assert with_default_chat_template(Tok(), "LlamaForCausalLM").chat_template is None
    own = Tok()
    own.chat_template = "{{ messages }}"
    assert with_default_chat_template(own, "GptOssForCausalLM").chat_template \
        == "{{ messages }}"


def test_gpt_oss_gguf_stops_on_return_and_call_not_on_end(tmp_path: Path) -> None:
    import gguf
    from gguf.gguf_reader import GGUFReader

    from forerun.model.gguf_file import _stop_token_ids

    tokens = ["a", "b", "<|endoftext|>", "<|return|>", "<|end|>", "<|call|>", "<|start|>"]
    control, normal = int(gguf.TokenType.CONTROL), int(gguf.TokenType.NORMAL)
    path = tmp_path / "vocab.gguf"
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([normal, normal] + [control] * 5)
    w.add_eos_token_id(3)
    w.add_eot_token_id(4)  # as a converter may name <|end|>
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert sorted(_stop_token_ids(GGUFReader(str(path)), "gpt-oss")) == [2, 3, 5]


# --- where the answer starts, for structured output after the reasoning -----------------

@pytest.mark.parametrize(("parser_cls", "text", "start"), [
    (DeepSeekR1ReasoningParser, "Hmm, 4.</think>4", len("Hmm, 4.</think>")),
    (DeepSeekR1ReasoningParser, "still thinking </thi", None),
    (DeepSeekR1ReasoningParser, "a</think>b</think>c", len("a</think>")),  # the first
    (Qwen3ReasoningParser, "<think>x</think>\n\n{", len("<think>x</think>")),
    (Qwen3ReasoningParser, "<think>x", None),
    (GptOssReasoningParser, "<|channel|>analysis<|message|>x<|end|><|start|>assistant"
     "<|channel|>final<|message|>{", len("<|channel|>analysis<|message|>x<|end|>"
                                         "<|start|>assistant<|channel|>final<|message|>")),
    (GptOssReasoningParser, "<|channel|>final <|constrain|>json<|message|>",
     len("<|channel|>final <|constrain|>json<|message|>")),
    (GptOssReasoningParser, "<|channel|>final <|constr", None),  # header not whole yet
    # Only the final channel: not commentary (a call), not another name starting "final".
    (GptOssReasoningParser, "<|channel|>commentary to=functions.f<|message|>{}<|call|>",
     None),
    (GptOssReasoningParser, "<|channel|>finalize<|message|>x<|end|><|channel|>final"
     "<|message|>", len("<|channel|>finalize<|message|>x<|end|><|channel|>final<|message|>")),
    (GptOssReasoningParser, "<|channel|>analysis<|message|>say <|channel|>final then<|end|>",
     None),
])
def test_answer_start_is_just_past_the_marker_that_ends_the_reasoning(
        parser_cls: type[ReasoningParser], text: str, start: int | None) -> None:
    parser = parser_cls()
    assert parser.answer_start(text) == start
    if start is not None:  # more text never moves it
        assert parser.answer_start(text + "</think><|channel|>final<|message|>") == start


def test_only_qwen3_reads_a_closed_thought_in_the_prompt() -> None:
    off = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # enable_thinking: false
    assert Qwen3ReasoningParser().reasoning_ended_in_prompt(off)
    assert not Qwen3ReasoningParser().reasoning_ended_in_prompt("<|im_start|>assistant\n")
    assert not Qwen3ReasoningParser().reasoning_ended_in_prompt("</think> then <think>")
    # deepseek_r1 reads every output as starting inside a thought, whatever the prompt.
    assert not DeepSeekR1ReasoningParser().reasoning_ended_in_prompt(off)


def test_server_puts_chat_grammars_after_the_reasoning_unless_asked_not_to() -> None:
    from forerun.server.protocol import ChatCompletionRequest
    from forerun.server.reasoning import plan_reasoning

    def so_of(extra: dict[str, Any], parser: str = "qwen3", forced: bool = False,
              in_reasoning: bool = False) -> Any:
        body = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi"}], **extra})
        plan = plan_reasoning(parser, body, None, in_reasoning)
        assert plan is not None
        return plan.adjust_request(body, forced_calls=forced).sampling_params(
            8).structured_outputs

    schema = {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}
    assert so_of({"response_format": schema}).after_reasoning == "qwen3"
    assert so_of({"guided_regex": "a+"}, "openai_gptoss").after_reasoning == "openai_gptoss"
    assert so_of({}) is None  # nothing to constrain
    # The request's own switch (beside response_format, or in a constraint), the server's.
    assert so_of({"response_format": schema,
                  "structured_outputs": {"enable_in_reasoning": True}}).after_reasoning \
        is None
    assert so_of({"structured_outputs": {"regex": "a", "enable_in_reasoning": True}}) \
        .after_reasoning is None
    assert so_of({"guided_regex": "a+"}, in_reasoning=True).after_reasoning is None
    # Forced calls wait for the reasoning, except gpt-oss's (it calls on commentary).
    assert so_of({"guided_json": {"type": "object"}}, forced=True).after_reasoning == "qwen3"
    assert so_of({"guided_json": {"type": "object"}}, "openai_gptoss",
                 forced=True).after_reasoning is None
    with pytest.raises(ValueError, match="structured_outputs.reasoning_parser: not a request"):
        so_of({"structured_outputs": {"regex": "a", "reasoning_parser": "qwen3"}})


def test_structured_outputs_config_takes_enable_in_reasoning() -> None:
    import argparse

    from forerun.server.cli_serve import add_serve_parser, server_config_from_args
    from forerun.server.config import parse_structured_outputs_config

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--structured-outputs-config",
                              '{"enable_in_reasoning": true, "disable_any_whitespace": false}'])
    config = server_config_from_args(args)
    assert config.structured_outputs_enable_in_reasoning is True
    assert config.structured_outputs_disable_any_whitespace is False
    assert not server_config_from_args(parser.parse_args(["serve"])) \
        .structured_outputs_enable_in_reasoning

    assert parse_structured_outputs_config('{"enable_in_reasoning": true}') \
        == {"enable_in_reasoning": True}
    with pytest.raises(ValueError, match="enable_in_reasoning must be a boolean"):
        parse_structured_outputs_config('{"enable_in_reasoning": 1}')
