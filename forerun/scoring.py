"""Scores from embeddings: which texts pair up (vLLM's rules) and their cosine similarity.

Used by ``LLM.score`` and the server's ``/score`` and ``/rerank`` routes alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def as_text_list(name: str, value: Any) -> list[str]:
    """A string or a non-empty list of strings as a list; ValueError naming ``name``."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError(f"{name} must be a string or a non-empty list of strings")
    for i, t in enumerate(items):
        if not isinstance(t, str):
            raise ValueError(f"{name}[{i}] must be a string, got {type(t).__name__}")
    return list(items)


def pair_texts(text_1: Any, text_2: Any) -> list[tuple[str, str]]:
    """vLLM's pairing: one ``text_1`` against every ``text_2``, or lists of one length
    pairwise."""
    a, b = as_text_list("text_1", text_1), as_text_list("text_2", text_2)
    if len(a) == 1:
        a = a * len(b)
    elif len(a) != len(b):
        raise ValueError(f"text_2: got {len(b)} texts for {len(a)} in text_1; give one "
                         "text_1, or as many as text_2")
    return list(zip(a, b, strict=True))


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine similarity (0.0 when either vector is zero)."""
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    na = math.sqrt(math.fsum(x * x for x in a))
    nb = math.sqrt(math.fsum(y * y for y in b))
    return dot / (na * nb) if na > 0 and nb > 0 else 0.0
