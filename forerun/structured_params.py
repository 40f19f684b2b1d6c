"""What a structured-output request constrains its output to, with vLLM's field names."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

# The fields that choose the constraint; exactly one is set.
KINDS = ("json", "regex", "choice", "grammar", "json_object")
# Fields that tune how a constraint is compiled rather than choosing one.
OPTIONS = ("disable_any_whitespace", "disable_budget_closing", "reasoning_parser",
           "enable_in_reasoning")


@dataclass(slots=True)
class StructuredOutputsParams:
    """Exactly one constraint: a JSON schema, a regex, a list of choices, an EBNF grammar,
    or ``json_object=True`` (any JSON object).

    ``json`` may be a schema as a dict or as a JSON string. Only the shape is checked here;
    whether the schema, regex or grammar itself is valid is checked by
    :func:`forerun.structured.backend.validate_structured_outputs` in the frontend.

    ``disable_any_whitespace`` is vLLM's name with vLLM's meaning when set: ``True`` allows
    no whitespace in JSON but the one space after ``,`` and ``:``, ``False`` allows any
    whitespace JSON allows. Unset (``None``), forerun compiles ``json`` and ``json_object``
    like ``True``: with any whitespace a small model's greedy decoding can run away in
    newlines the grammar allows until ``max_tokens`` cuts the JSON (vLLM's default is
    ``False``). It has no effect on regex, choice and grammar constraints.

    ``disable_budget_closing`` (forerun's, in vLLM's style; default unset = ``False``): a
    ``json`` or ``json_object`` output near the end of ``max_tokens`` is steered to close
    its open strings, arrays and objects so that it ends as complete JSON within
    ``max_tokens`` (:mod:`forerun.structured.closing`), and a ``choice`` or ``regex``
    output to end as a whole choice or a full match (:mod:`forerun.structured.closing_text`)
    when the budget allows any; its ``finish_reason`` is then ``length``. ``True`` turns
    this off: the output is cut where ``max_tokens`` falls.

    ``reasoning_parser`` (forerun's, per request; vLLM sets it for the engine with
    ``--reasoning-parser``): the name of a reasoning parser (``deepseek_r1``, ``qwen3``,
    ``openai_gptoss``); the constraint then applies only to the answer after the model's
    reasoning, from the first token after the marker that ends it (``</think>``; harmony's
    ``<|channel|>final...<|message|>``), and neither masks nor advances before. A reasoning
    that never ends leaves the whole output unconstrained. The server sets it on chat
    requests from its own ``--reasoning-parser``. ``enable_in_reasoning`` (vLLM's
    ``--structured-outputs-config`` key, here also per request): ``True`` constrains the
    whole output, reasoning included, as without a parser.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_budget_closing: bool | None = None
    reasoning_parser: str | None = None
    enable_in_reasoning: bool | None = None

    def __post_init__(self) -> None:
        chosen = [k for k in KINDS if self._is_set(k)]
        if len(chosen) != 1:
            got = ", ".join(chosen) if chosen else "none"
            raise ValueError(
                "structured_outputs: exactly one of json, regex, choice, grammar, json_object "
                f"must be set, got {got}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(
                f"structured_outputs.json: must be a dict or a JSON string, got "
                f"{type(self.json).__name__}")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("structured_outputs.regex: must be a string")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError("structured_outputs.grammar: must be a string")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice: must be a list of strings")
            if not self.choice or any(c == "" for c in self.choice):
                raise ValueError("structured_outputs.choice: must be non-empty strings, "
                                 "at least one")
            self.choice = list(self.choice)
        for name in ("disable_any_whitespace", "disable_budget_closing", "enable_in_reasoning"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"structured_outputs.{name}: must be a boolean, got "
                                 f"{type(value).__name__}")
        if self.reasoning_parser is not None and not isinstance(self.reasoning_parser, str):
            raise ValueError("structured_outputs.reasoning_parser: must be a string, got "
                             f"{type(self.reasoning_parser).__name__}")

    @property
    def any_whitespace(self) -> bool:
        """Whether a JSON constraint compiles to a grammar that allows any whitespace."""
        return self.disable_any_whitespace is False

    @property
    def after_reasoning(self) -> str | None:
        """The reasoning parser whose reasoning the constraint waits out, or None: the
        constraint applies from the first token."""
        return None if self.enable_in_reasoning else self.reasoning_parser

    @property
    def budget_closing(self) -> bool:
        """Whether the output is steered to end inside its language within ``max_tokens``
        (JSON, choice and regex constraints; not EBNF grammars)."""
        return (self.kind in ("json", "json_object", "choice", "regex")
                and self.disable_budget_closing is not True)

    def _is_set(self, name: str) -> bool:
        value = getattr(self, name)
        if name in OPTIONS:
            return value is not None
        # json_object=False means "not this kind", like vLLM.
        return bool(value) if name == "json_object" else value is not None

    @property
    def kind(self) -> str:
        """The field that is set: ``json``, ``regex``, ``choice``, ``grammar`` or ``json_object``."""
        return next(k for k in KINDS if self._is_set(k))

    def to_dict(self) -> dict[str, Any]:
        """Only the field that is set; a dict of plain values, to cross process boundaries."""
        return {f.name: getattr(self, f.name) for f in fields(self) if self._is_set(f.name)}

    @classmethod
    def from_any(cls, value: Any) -> StructuredOutputsParams:
        """Accept an instance or a dict with the same keys (what arrives over HTTP)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(KINDS) - set(OPTIONS))
            if unknown:
                raise ValueError(f"structured_outputs: unknown field(s) {', '.join(unknown)}")
            return cls(**value)
        raise ValueError(
            "structured_outputs: must be a StructuredOutputsParams or a dict, got "
            f"{type(value).__name__}")
