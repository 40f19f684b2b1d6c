"""Prompt sets for ``forerun bench serve``: random tokens, or ShareGPT conversations."""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SampleRequest:
    """One benchmark request: the prompt as text or token ids, and its lengths."""

    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int


def _special_ids(tokenizer: Any) -> set[int]:
    return set(getattr(tokenizer, "all_special_ids", []) or [])


def random_requests(tokenizer: Any, num_prompts: int, input_len: int, output_len: int,
                    seed: int, as_token_ids: bool = True) -> list[SampleRequest]:
    """Prompts of random (non-special) token ids.

    As token ids the input length is exact; as text it is what the ids decode to, which
    re-tokenises to roughly ``input_len`` tokens.
    """
    rng = random.Random(seed)
    special = _special_ids(tokenizer)
    vocab = [t for t in range(len(tokenizer)) if t not in special]
    out = []
    for _ in range(num_prompts):
        ids = [rng.choice(vocab) for _ in range(input_len)]
        if as_token_ids:
            out.append(SampleRequest(ids, input_len, output_len))
        else:
            text = tokenizer.decode(ids)
            n = len(tokenizer.encode(text, add_special_tokens=False))
            out.append(SampleRequest(text, n, output_len))
    return out


def sharegpt_requests(tokenizer: Any, path: str, num_prompts: int, seed: int,
                      output_len: int | None = None, max_prompt_len: int = 1024,
                      max_total_len: int = 2048) -> list[SampleRequest]:
    """First human turn as the prompt; the reply's length as the output length."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    convs = [d["conversations"] for d in data
             if isinstance(d, dict) and len(d.get("conversations", [])) >= 2]
    random.Random(seed).shuffle(convs)
    out: list[SampleRequest] = []
    for conv in convs:
        if len(out) == num_prompts:
            break
        prompt, reply = conv[0].get("value", ""), conv[1].get("value", "")
        p_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        o_len = output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if p_len < 4 or o_len < 4 or p_len > max_prompt_len or p_len + o_len > max_total_len:
            continue
        out.append(SampleRequest(prompt, p_len, o_len))
    if len(out) < num_prompts:
        logger.warning("ShareGPT file %s gave %d usable prompts of %d requested", path,
                       len(out), num_prompts)
    return out
