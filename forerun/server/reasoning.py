"""``--reasoning-parser`` on /v1/chat/completions: the model's thinking in ``reasoning``
and ``reasoning_content`` (vLLM's current and former names), its answer in ``content``.
/v1/responses (a ``reasoning`` item), Ollama's ``/api/chat`` / ``/api/generate``
(``thinking``) and Anthropic's /v1/messages (a ``thinking`` block) split it with the same
plan and streams.

The split comes first: tool calls are parsed from the content part only, so a model that
thinks about a ``<tool_call>`` does not call it (a parser that ``reads_whole_output``,
harmony's, takes the whole text and skips the reasoning itself). Logprobs and token ids
stay per token, as without a parser. A request's ``include_reasoning: false`` drops the
reasoning (the fields are null and no reasoning deltas are streamed).

Structured output (``response_format``, ``structured_outputs``, ``guided_*``, forced tool
calls) constrains only the answer: the engine starts the grammar at the first token after
the reasoning ends (``forerun/structured/reasoning_gate.py``), as vLLM does, unless the
request's ``structured_outputs`` says ``enable_in_reasoning: true`` or the server was
started with ``--structured-outputs-config '{"enable_in_reasoning": true}'``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from forerun.reasoning import ReasoningDelta, ReasoningParser, ReasoningParserManager
from forerun.server.bodies import ChatDelta, ChatMessage


@dataclass(slots=True)
class ReasoningPlan:
    """How one request's outputs are split: the server's parser and the request's choice."""

    parser_cls: type[ReasoningParser]
    tokenizer: Any
    include: bool = True
    name: str = ""  # the parser's registered name, which the engine's grammar gate takes
    # --structured-outputs-config's enable_in_reasoning: grammars constrain the reasoning.
    grammar_in_reasoning: bool = False

    def new_parser(self) -> ReasoningParser:
        return self.parser_cls(self.tokenizer)

    def adjust_request(self, body: Any, forced_calls: bool = False) -> Any:
        """The body to run: the parser's tweaks, and its structured output (if any) put
        after the reasoning. ``forced_calls``: that structured output is a forced tool
        call, which waits only where the parser's answer can hold one."""
        body = self.new_parser().adjust_request(body)
        if self.grammar_in_reasoning or (
                forced_calls and not self.parser_cls.forced_calls_after_reasoning):
            return body
        return body.with_grammar_after_reasoning(self.name)

    def split_whole(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a whole response; the content "" when there is none,
        as the tool-call stage takes text."""
        reasoning, content = self.new_parser().extract_reasoning(text)
        return reasoning, content or ""

    def reasoning_first(self, text: str, finished: bool = True) -> bool:
        """Whether the reasoning in ``text`` begins before its content (the order the
        Responses API lists their output items in); True when either is missing."""
        parsed = self.new_parser().split(text, finished)
        kinds = [s.kind for s in parsed.segments if s.kind != "markup"]
        return not kinds or kinds[0] == "reasoning"

    def reasoning_ended(self, text: str) -> bool:
        """Whether ``text`` (an output so far) holds the marker that ends the reasoning."""
        return self.new_parser().answer_start(text) is not None

    def reasoning_token_count(self, token_ids: Sequence[int], reasoning: str | None,
                              skip_special_tokens: bool = True) -> int:
        """How many output tokens the reasoning took, the marker that ends it included (the
        count the engine's grammar gate keeps): none without reasoning, all of them when
        the reasoning never ended. The end is found by bisecting the token prefixes'
        texts, which works because once a text holds the end of the reasoning every
        longer one holds it at the same place (``answer_start``'s contract)."""
        if not reasoning or not token_ids:
            return 0
        parser = self.new_parser()

        def ended(k: int) -> bool:
            text = self.tokenizer.decode(list(token_ids[:k]),
                                         skip_special_tokens=skip_special_tokens)
            return parser.answer_start(text) is not None

        lo, hi = 1, len(token_ids)
        if not ended(hi):
            return hi
        while lo < hi:  # the fewest tokens whose text ends the reasoning
            mid = (lo + hi) // 2
            if ended(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def annotate(self, message: ChatMessage, reasoning: str | None) -> None:
        """Put the reasoning on ``message``, where vLLM puts it (null when there is none
        or the request asked for none); an empty answer is a null content, as there."""
        shown = reasoning if self.include else None
        message.reasoning = message.reasoning_content = shown
        if message.content == "":
            message.content = None


def plan_reasoning(parser_name: str | None, body: Any, tokenizer: Any,
                   grammar_in_reasoning: bool = False) -> ReasoningPlan | None:
    """The request's plan, or None when the server has no reasoning parser."""
    if parser_name is None:
        return None
    return ReasoningPlan(ReasoningParserManager.get_reasoning_parser(parser_name), tokenizer,
                         include=getattr(body, "include_reasoning", True) is not False,
                         name=parser_name, grammar_in_reasoning=grammar_in_reasoning)


def thinking_fields(ctx: Any, think: bool | str | None) -> dict[str, Any]:
    """The chat request's fields for a request's thinking switch under a reasoning parser
    (Ollama's ``think``, Anthropic's ``thinking``; ``ctx`` the ServingContext). As in
    Ollama, an absent switch is on for a thinking model; off, the thinking is left out of
    the reply, and a template that takes ``enable_thinking`` (Qwen3's) is told, as Ollama's
    templates are (the model then answers without thinking). A level is the template's
    ``reasoning_effort`` (gpt-oss's harmony template writes it in its system message)."""
    on = think is not False
    fields: dict[str, Any] = {"include_reasoning": on}
    template = ctx.chat_template or getattr(ctx.engine.tokenizer, "chat_template", None)
    if "enable_thinking" in str(template or ""):
        fields["chat_template_kwargs"] = {"enable_thinking": on}
    if isinstance(think, str):
        fields["reasoning_effort"] = think
    return fields


class ChoiceReasoningStream:
    """Splits one streamed choice's text as it grows; one per choice (``n`` > 1)."""

    def __init__(self, plan: ReasoningPlan) -> None:
        self.parser = plan.new_parser()
        self.include = plan.include

    def step(self, current_text: str, finished: bool) -> ReasoningDelta:
        """What ``current_text`` (the choice's whole text so far) adds."""
        d = self.parser.extract_reasoning_streaming(current_text, finished)
        if not self.include:
            d.reasoning = None
        return d


def put_reasoning(delta: ChatDelta, reasoning: str | None) -> None:
    """A reasoning piece on a streamed delta, under both names."""
    if reasoning is not None:
        delta.reasoning = delta.reasoning_content = reasoning
