"""Structured output on the worker: masking a step's logits with the grammars' bitmask."""

from __future__ import annotations

import torch


def apply_grammar_bitmask(logits: torch.Tensor, row_req_ids: list[str],
                          bitmask: object) -> torch.Tensor:
    """``logits`` with the tokens each row's grammar forbids masked out.

    ``bitmask`` is what the scheduler sent (forerun.structured.bitmask.GrammarBitmask);
    the worker relies on its ``apply`` only.
    """
    apply = getattr(bitmask, "apply", None)
    if apply is None:
        raise TypeError(f"unsupported grammar bitmask {type(bitmask).__name__}")
    return apply(logits, row_req_ids)
