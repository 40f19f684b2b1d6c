"""Batched sampling: greedy, temperature, top-k, top-p, and per-request seeds."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling settings of one step, as device tensors."""

    all_greedy: bool
    all_random: bool
    temperature: torch.Tensor  # [S] float32, 1.0 on greedy rows (never divided by 0)
    greedy_mask: torch.Tensor | None  # [S] bool, None when all rows agree
    top_p: torch.Tensor | None  # [S] float32, None when no row uses it
    top_k: torch.Tensor | None  # [S] int64 (vocab size = off), None when no row uses it
    generators: dict[int, torch.Generator]  # row -> its request's own generator


class Sampler:
    """Turns logits into one token id per row, with no Python loop over unseeded rows.

    Random rows sample by the exponential race (argmax of p / q with q ~ Exp(1)), which
    needs no cumulative sum and lets a seeded row draw its noise from its own generator, so
    its tokens do not depend on what else is in the batch.
    """

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)
        if meta.all_greedy:
            return greedy
        logits = logits / meta.temperature.unsqueeze(1)
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        probs = logits.softmax(dim=-1)
        q = torch.empty_like(probs)
        if len(meta.generators) < probs.shape[0]:
            q.exponential_()
        for row, gen in meta.generators.items():
            q[row].exponential_(generator=gen)
        sampled = probs.div_(q).argmax(dim=-1)
        if meta.all_random or meta.greedy_mask is None:
            return sampled
        return torch.where(meta.greedy_mask, greedy, sampled)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus (top-p) with -inf."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        # Ascending order: the k-th largest sits at index vocab - k.
        kth = sorted_logits.gather(1, (vocab - top_k.clamp(1, vocab)).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cum = probs.cumsum(dim=-1)
        drop = cum <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)
