"""Incremental detokenization: token ids in, text deltas out."""

from __future__ import annotations

import logging
from typing import Any

from tokenizers import Tokenizer

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21 has no streaming decoder
    DecodeStream = None

logger = logging.getLogger(__name__)

# Prompt tokens decoded together with the first output tokens, so that decoders which
# strip or add a leading space (Metaspace, Strip) treat the first output token as a
# continuation rather than the start of the text.
_PROMPT_CONTEXT_TOKENS = 5

_REPLACEMENT_CHAR = "\ufffd"


def _backend_of(tokenizer: Any) -> Tokenizer | None:
    """The Rust `tokenizers.Tokenizer` behind a fast tokenizer, or None for slow ones."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


class IncrementalDetokenizer:
    """Turns output token ids, arriving a few at a time, into text deltas.

    A window starting a few tokens before the last emitted point is decoded together with
    the new tokens and the two strings are diffed (prefix-offset / read-offset), so each
    call costs O(new tokens), not O(output). Text ending in an incomplete UTF-8 sequence
    (U+FFFD at the end of the window) is held back until a later token completes it.

    The output text is what the output tokens add to the prompt's text, so a leading
    space that a SentencePiece-style decoder would strip at the start of a text is kept.
    For byte-level BPE tokenizers it equals `tokenizer.decode(token_ids)`.
    `clean_up_tokenization_spaces` is never applied: it cannot be done incrementally.
    As in transformers, only slow tokenizers honour `spaces_between_special_tokens`.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._spaces_between_special_tokens = spaces_between_special_tokens
        self._backend = _backend_of(tokenizer)

        context = self._prompt_context(prompt_token_ids)
        # Context tokens followed by all output tokens; only the tail is ever decoded.
        self._ids: list[int] = list(context)
        self._output_ids: list[int] = []
        # ids[prefix_offset:read_offset] were decoded into the text already emitted; ids
        # from read_offset on are not reflected in the output text yet.
        self._prefix_offset = 0
        self._read_offset = len(context)

        self._stream: Any = None
        if self._backend is not None and DecodeStream is not None:
            self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)

        # Deltas are joined lazily so update() never copies the whole text.
        self._parts: list[str] = []

    @property
    def token_ids(self) -> list[int]:
        """All output token ids received so far (do not mutate)."""
        return self._output_ids

    @property
    def output_text(self) -> str:
        """All output text emitted so far (the concatenation of the deltas)."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def update(self, new_token_ids: list[int]) -> str:
        """Add newly generated token ids; return the text they complete (maybe "")."""
        deltas: list[str] = []
        # One token at a time so complete text in a chunk is not held back behind an
        # incomplete character at the chunk's end.
        for token_id in new_token_ids:
            self._ids.append(token_id)
            self._output_ids.append(token_id)
            delta = self._step_stream(token_id) if self._stream is not None else self._step()
            if delta:
                deltas.append(delta)
        text = "".join(deltas)
        if text:
            self._parts.append(text)
        return text

    def _step_stream(self, token_id: int) -> str:
        try:
            delta = self._stream.step(self._backend, token_id)
        except Exception as exc:
            # DecodeStream refuses when the window's text stops being a prefix of the
            # longer window's text; the Python path just diffs by length instead.
            logger.debug("DecodeStream failed (%s); decoding in Python from now on", exc)
            self._stream = None
            return self._step()
        if delta is None:
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return delta

    def _step(self) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full_text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)
        return self._tokenizer.decode(
            ids,
            skip_special_tokens=self._skip_special_tokens,
            spaces_between_special_tokens=self._spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _prompt_context(self, prompt_token_ids: list[int]) -> list[int]:
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        # A prompt ending inside a character has no stable text to diff against.
        if context and self._decode(context).endswith(_REPLACEMENT_CHAR):
            return []
        return context
