"""Verifying drafts in one step: which are accepted, and the token sampled after them.

A request with ``d`` drafts has ``d + 1`` logits rows; row ``j`` is the distribution of the
token at draft position ``j`` (row ``d`` follows the last draft). Each row has the settings
and uniforms of the output index it samples, so a row's distribution is exactly the one the
request would see there without drafting, given that the drafts before it were accepted.

* Greedy rows accept a draft while it equals the row's argmax; the first row that differs
  (or row ``d``) gives its argmax. The output is the greedy output, token for token.
* Random rows treat a draft as a proposal ``q`` that is one-hot on the draft ``x``: accept
  with probability ``min(1, p(x) / q(x)) = p(x)``, from an acceptance uniform independent of
  the sampling one; on rejection sample from the residual ``max(p - q, 0)``, which is ``p``
  without ``x``, renormalised. Then ``P(x) = p(x)`` and ``P(y) = (1 - p(x)) p(y) / (1 - p(x))
  = p(y)``: the output has the target distribution exactly (Leviathan et al. 2023; Chen et
  al. 2023). Row ``d`` samples as a plain step does. Every uniform is a function of the
  request's key and the output index, so a seeded request is reproducible.

``p`` is the distribution the sampler draws from: processed logits, then temperature,
min-p, top-k and top-p.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from forerun.worker.sampler import (
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_top_k_top_p,
)


@dataclass(slots=True)
class Verification:
    """Per request, the accepted drafts followed by the sampled token; and, per request,
    the logits rows those tokens were chosen from (for logprobs)."""

    token_ids: list[list[int]]
    rows: list[list[int]]


def final_probs(logits: torch.Tensor, meta: SamplingMetadata, rows: torch.Tensor
                ) -> torch.Tensor:
    """float64 probabilities the sampler draws from, for the given (random) rows."""
    x = logits.index_select(0, rows).float() / meta.temperature.index_select(0, rows)[:, None]
    if meta.min_p is not None:
        x = apply_min_p(x, meta.min_p.index_select(0, rows))
    x = apply_top_k_top_p(
        x, meta.top_k.index_select(0, rows) if meta.top_k is not None else None,
        meta.top_p.index_select(0, rows) if meta.top_p is not None else None)
    return x.softmax(dim=-1, dtype=torch.float64)


def verify(sampler: Sampler, logits: torch.Tensor, meta: SamplingMetadata,
           drafts: list[list[int]], accept_uniforms: np.ndarray | None) -> Verification:
    """Accept or reject every request's drafts; ``logits`` already processed (masks, bias).

    ``drafts[i]`` are request ``i``'s drafts, its rows following request ``i - 1``'s;
    ``accept_uniforms`` has one entry per row (None when every row is greedy).
    """
    target = sampler.choose(logits, meta).tolist()
    greedy = _greedy_rows(meta, logits.shape[0])
    draft_rows: list[int] = []
    draft_ids: list[int] = []
    row = 0
    for d in drafts:
        for j, x in enumerate(d):
            if not greedy[row + j]:
                draft_rows.append(row + j)
                draft_ids.append(x)
        row += len(d) + 1
    # Random rows with a draft: accepted?, and the residual sample if not.
    decided: dict[int, tuple[bool, int]] = {}
    if draft_rows:
        assert accept_uniforms is not None and meta.uniforms is not None
        rows_t = torch.tensor(draft_rows, dtype=torch.long, device=logits.device)
        probs = final_probs(logits, meta, rows_t).cpu()
        ids_t = torch.tensor(draft_ids, dtype=torch.long)
        p_draft = probs.gather(1, ids_t[:, None]).squeeze(1).numpy()
        accepted = accept_uniforms[draft_rows] < p_draft
        residual = probs.scatter_(1, ids_t[:, None], 0.0)
        cdf = residual.cumsum_(dim=1)
        u = meta.uniforms.index_select(0, rows_t.cpu()).to(torch.float64)
        resampled = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
        resampled = resampled.squeeze(1).clamp_(max=logits.shape[1] - 1).tolist()
        for i, r in enumerate(draft_rows):
            decided[r] = (bool(accepted[i]), resampled[i])
    out_ids: list[list[int]] = []
    out_rows: list[list[int]] = []
    row = 0
    for d in drafts:
        ids: list[int] = []
        used: list[int] = []
        for j in range(len(d) + 1):
            r = row + j
            used.append(r)
            if j == len(d):
                ids.append(target[r])
                break
            if greedy[r]:
                if target[r] == d[j]:
                    ids.append(d[j])
                    continue
                ids.append(target[r])
                break
            ok, other = decided[r]
            if ok:
                ids.append(d[j])
                continue
            ids.append(other)
            break
        out_ids.append(ids)
        out_rows.append(used)
        row += len(d) + 1
    return Verification(out_ids, out_rows)


def _greedy_rows(meta: SamplingMetadata, num_rows: int) -> list[bool]:
    if meta.all_greedy:
        return [True] * num_rows
    if meta.all_random or meta.greedy_mask is None:
        return [False] * num_rows
    return meta.greedy_mask.tolist()
