"""Structured output after the reasoning: a grammar held back until the model's thinking ends.

vLLM starts a request's grammar only once its reasoning parser says the reasoning is over;
so does forerun when a constraint names a ``reasoning_parser``. The gate reads each
delivered output token's text and asks the parser (``answer_start``) whether the marker
that ends the reasoning (``</think>``; harmony's ``<|channel|>final...<|message|>``) has
appeared. Until then the grammar neither masks nor advances; from the next token on it
does both, as if the output began there. The tokens fed here are the delivered ones, in
order, on the scheduler's side, so the gate opens at the same token in synchronous and
async scheduling (a step's mask is built only after every earlier token was applied).

The markers are special tokens in the models these parsers are for, so the answer's first
token is the one after the marker's last. Where a token carries text past the marker (a
plain-text marker in a tokenizer that merges across it), that text stays unconstrained.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from forerun.reasoning import ReasoningParser, ReasoningParserManager

logger = logging.getLogger(__name__)

# Enough of the output's tail to hold any end marker with its header (harmony's longest is
# ``<|channel|>final <|constrain|>json<|message|>``); earlier text can no longer end it.
WINDOW_CHARS = 256


@dataclass(slots=True)
class ReasoningGate:
    """One request's reasoning, as far as structured output cares: over or not."""

    parser: ReasoningParser
    # The tail of the output's text while the model reasons.
    text: str = ""
    # Output tokens before the answer (the marker's included); None while reasoning.
    num_reasoning_tokens: int | None = None

    @classmethod
    def for_parser(cls, name: str) -> ReasoningGate:
        return cls(ReasoningParserManager.get_reasoning_parser(name)())

    @property
    def is_open(self) -> bool:
        """Whether the grammar applies now (the reasoning is over)."""
        return self.num_reasoning_tokens is not None

    def start(self, prompt_text: str, num_output_tokens: int) -> None:
        """Before the first output token: the prompt may have closed the reasoning."""
        if self.parser.reasoning_ended_in_prompt(prompt_text):
            self.num_reasoning_tokens = num_output_tokens

    def feed(self, token_text: str, num_output_tokens: int) -> bool:
        """One more delivered output token (``num_output_tokens`` came before it); True
        when the reasoning ended with it, so the grammar starts at the next token."""
        assert not self.is_open
        self.text += token_text
        end = self.parser.answer_start(self.text)
        if end is None:
            self.text = self.text[-WINDOW_CHARS:]
            return False
        if end < len(self.text):
            logger.debug("the token that ended the reasoning carries %d more characters; "
                         "they are not constrained", len(self.text) - end)
        self.num_reasoning_tokens = num_output_tokens + 1
        self.text = ""
        return True
