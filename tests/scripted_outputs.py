"""Scripted engine outputs for the server's response builders: a model's text given token by
token, as the engine's ``RequestStream`` yields it, with a tokenizer that knows just those
tokens. The builders can then be run on exactly the splits a test wants (a tag cut across
tokens, a thought cut by max_tokens) in milliseconds, without a model."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from forerun.outputs import CompletionOutput, RequestOutput

PROMPT_IDS = [1, 2, 3]


class PieceTokenizer:
    """A tokenizer whose token ``i`` is ``pieces[i]``: decoding joins the pieces."""

    all_special_tokens: list[str] = []
    chat_template: str | None = None

    def __init__(self, pieces: Sequence[str]) -> None:
        self.pieces = list(pieces)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids)


class ScriptedStream:
    """A ``RequestStream`` stand-in: one output per token, the last one finished."""

    def __init__(self, pieces: Sequence[str], finish_reason: str = "stop") -> None:
        self.pieces, self.finish_reason = list(pieces), finish_reason
        self.prompt_token_ids = PROMPT_IDS
        self.aborted = False

    def outputs(self) -> list[RequestOutput]:
        n = len(self.pieces)
        return [RequestOutput(
            "req-1", None, PROMPT_IDS,
            [CompletionOutput(0, "".join(self.pieces[:k]), list(range(k)),
                              finish_reason=self.finish_reason if k == n else None)],
            finished=k == n) for k in range(1, n + 1)]

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        for out in self.outputs():
            yield out

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    def abort(self) -> None:
        self.aborted = True


async def collect(chunks: AsyncIterator[Any]) -> list[Any]:
    return [c async for c in chunks]
