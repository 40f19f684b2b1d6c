"""OpenAI ``logprobs`` objects, and vLLM's ``prompt_logprobs``, from the engine's logprobs."""

from __future__ import annotations

import math

from forerun.outputs import Logprob, PositionLogprobs
from forerun.server.bodies import (
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
)

# JSON has no -inf (a banned token): report a very unlikely value instead, as vLLM does.
_FLOOR = -9999.0


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) else _FLOOR


def token_str(token_id: int, decoded: str | None, as_ids: bool) -> str:
    """How a token is shown: its text, or vLLM's ``token_id:<id>`` (return_tokens_as_token_ids).

    The id form names tokens whose text alone is ambiguous (a partial UTF-8 sequence
    decodes to U+FFFD, several ids may share a text).
    """
    return f"token_id:{token_id}" if as_ids else (decoded or "")


def _top(pos: PositionLogprobs, n: int) -> list[tuple[int, Logprob]]:
    """The top-n entries by rank (the chosen token is listed first only when outside it)."""
    ranked = sorted(((t, lp) for t, lp in pos.items() if lp.rank is not None),
                    key=lambda e: e[1].rank or 0)
    return ranked if n < 0 else ranked[:n]  # -1: the whole vocabulary


def _completion_top(tid: int, pos: PositionLogprobs, n: int, as_ids: bool
                    ) -> dict[str, float]:
    """The chosen token, then the top n: vLLM's shape, so ``logprobs: 0`` still names the
    sampled token (OpenAI's legacy endpoint also lists it beside the top n)."""
    entries = [(tid, pos[tid])] + [(t, lp) for t, lp in _top(pos, n) if t != tid]
    return {token_str(t, lp.decoded_token, as_ids): _finite(lp.logprob) for t, lp in entries}


def completion_logprobs(token_ids: list[int], logprobs: list[PositionLogprobs], n: int,
                        offset: int, as_ids: bool = False) -> CompletionLogprobs:
    """``tokens``/``token_logprobs``/``top_logprobs``/``text_offset``; offsets start at offset."""
    out = CompletionLogprobs([], [], [], [])
    for tid, pos in zip(token_ids, logprobs, strict=False):
        chosen = pos[tid]
        out.tokens.append(token_str(tid, chosen.decoded_token, as_ids))
        out.token_logprobs.append(_finite(chosen.logprob))
        out.top_logprobs.append(_completion_top(tid, pos, n, as_ids))
        out.text_offset.append(offset)
        # Offsets count characters of the text, whatever form the tokens are shown in.
        offset += len(chosen.decoded_token or "")
    return out


def echo_logprobs(prompt_ids: list[int], prompt_logprobs: list[PositionLogprobs | None],
                  first_text: str, n: int, as_ids: bool = False) -> CompletionLogprobs:
    """The prompt's part of an echoed completion's ``logprobs``, offsets from 0.

    The first token has no logprob (nothing predicts it): null, as in OpenAI and vLLM.
    ``first_text`` is that token's text, which no logprob entry carries.
    """
    out = CompletionLogprobs([], [], [], [])
    offset = 0
    for i, (tid, pos) in enumerate(zip(prompt_ids, prompt_logprobs, strict=False)):
        if pos is None or tid not in pos:
            text = first_text if i == 0 else ""
            out.tokens.append(token_str(tid, text, as_ids))
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            text = pos[tid].decoded_token or ""
            out.tokens.append(token_str(tid, text, as_ids))
            out.token_logprobs.append(_finite(pos[tid].logprob))
            out.top_logprobs.append(_completion_top(tid, pos, n, as_ids))
        out.text_offset.append(offset)
        offset += len(text)
    return out


def join_logprobs(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(a.tokens + b.tokens, a.token_logprobs + b.token_logprobs,
                              a.top_logprobs + b.top_logprobs, a.text_offset + b.text_offset)


def prompt_logprobs_json(prompt_ids: list[int],
                         prompt_logprobs: list[PositionLogprobs | None], k: int
                         ) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: per position the prompt's token and the top k by rank.

    The engine may have computed more than k (echo with a larger ``logprobs``): only what
    this request asked for is shown. Keys are token ids, so ``decoded_token`` stays the
    token's text even with ``return_tokens_as_token_ids`` (as in vLLM).
    """
    out: PromptLogprobs = []
    for tid, pos in zip(prompt_ids, prompt_logprobs, strict=False):
        if pos is None:
            out.append(None)
            continue
        out.append({
            str(t): PromptLogprob(_finite(lp.logprob), lp.rank, lp.decoded_token)
            for t, lp in pos.items()
            if t == tid or (lp.rank is not None and (k < 0 or lp.rank <= k))})
    return out


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(token_ids: list[int], logprobs: list[PositionLogprobs], n: int,
                  as_ids: bool = False) -> ChatLogprobs:
    """Chat ``logprobs.content``: each token with its top n (OpenAI: exactly n, by rank)."""
    content = []
    for tid, pos in zip(token_ids, logprobs, strict=False):
        chosen = pos[tid]
        top = []
        for t, lp in _top(pos, n):
            s = token_str(t, lp.decoded_token, as_ids)
            top.append(ChatTopLogprob(s, _finite(lp.logprob), _bytes(s)))
        s = token_str(tid, chosen.decoded_token, as_ids)
        content.append(ChatTokenLogprob(s, _finite(chosen.logprob), _bytes(s), top))
    return ChatLogprobs(content)
