"""OpenAI ``logprobs`` objects from a CompletionOutput's per-token logprobs."""

from __future__ import annotations

import math

from forerun.outputs import Logprob, PositionLogprobs
from forerun.server.responses import (
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
)

# JSON has no -inf (a banned token): report a very unlikely value instead, as vLLM does.
_FLOOR = -9999.0


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) else _FLOOR


def _text(lp: Logprob) -> str:
    return lp.decoded_token or ""


def _top(pos: PositionLogprobs, n: int) -> list[tuple[int, Logprob]]:
    """The top-n entries by rank (the chosen token is listed first only when outside it)."""
    ranked = sorted(((t, lp) for t, lp in pos.items() if lp.rank is not None),
                    key=lambda e: e[1].rank or 0)
    return ranked[:n]


def completion_logprobs(token_ids: list[int], logprobs: list[PositionLogprobs], n: int,
                        offset: int) -> CompletionLogprobs:
    """``tokens``/``token_logprobs``/``top_logprobs``/``text_offset``; offsets start at offset."""
    out = CompletionLogprobs([], [], [], [])
    for tid, pos in zip(token_ids, logprobs, strict=False):
        chosen = pos[tid]
        text = _text(chosen)
        out.tokens.append(text)
        out.token_logprobs.append(_finite(chosen.logprob))
        out.top_logprobs.append({_text(lp): _finite(lp.logprob) for _, lp in _top(pos, n)}
                                if n > 0 else None)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(token_ids: list[int], logprobs: list[PositionLogprobs], n: int
                  ) -> ChatLogprobs:
    content = []
    for tid, pos in zip(token_ids, logprobs, strict=False):
        chosen = pos[tid]
        top = [ChatTopLogprob(_text(lp), _finite(lp.logprob), _bytes(_text(lp)))
               for _, lp in _top(pos, n)]
        content.append(ChatTokenLogprob(_text(chosen), _finite(chosen.logprob),
                                        _bytes(_text(chosen)), top))
    return ChatLogprobs(content)
