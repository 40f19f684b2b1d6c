"""Verification of drafts keeps the target distribution exactly.

Oracle: the processed distribution written out in float64 by its definitions
(``tests.test_sampler_distribution.exact_distribution``). Each of 24k seeded requests has
one draft (two logits rows): the first delivered token must follow row 0's distribution
whatever the draft, and, when the draft was accepted, the second must follow row 1's.
Chi-square on both; greedy rows must give the argmax prefix.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from forerun.worker import rng
from forerun.worker.rejection_sampler import verify
from forerun.worker.sampler import Sampler, SamplingMetadata
from tests.test_sampler_distribution import exact_distribution

VOCAB = 12
REQUESTS = 24_000
SETTINGS = {
    "temperature 1.0": dict(temperature=1.0),
    "temperature 0.6": dict(temperature=0.6),
    "top_k 5": dict(temperature=1.0, top_k=5),
    "top_p 0.9 + min_p 0.02": dict(temperature=2.0, top_p=0.9, min_p=0.02),
}


def _rows() -> tuple[np.ndarray, np.ndarray]:
    g = np.random.default_rng(20261201)
    return ((g.standard_normal(VOCAB) * 1.5).astype(np.float32),
            (g.standard_normal(VOCAB) * 1.5).astype(np.float32))


def _meta(rows: int, keys: list[int], counters: list[int], temperature: float,
          top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> SamplingMetadata:
    return SamplingMetadata(
        all_greedy=False, all_random=True,
        temperature=torch.full((rows,), temperature), greedy_mask=None,
        top_p=torch.full((rows,), top_p) if top_p < 1.0 else None,
        top_k=torch.full((rows,), top_k, dtype=torch.int64) if top_k else None,
        min_p=torch.full((rows,), min_p) if min_p > 0 else None,
        uniforms=torch.from_numpy(rng.uniforms(keys, counters)))


def _chi2(tokens: np.ndarray, p: np.ndarray) -> float:
    counts = np.bincount(tokens, minlength=VOCAB)
    support = p > 0
    assert counts[~support].sum() == 0, "a token outside the support was delivered"
    exp = p[support] * len(tokens)
    obs = counts[support]
    order = np.argsort(exp)
    obs, exp = obs[order], exp[order]
    cut = np.searchsorted(np.cumsum(exp), 5.0)  # pool rare tokens: expected >= 5
    obs = np.concatenate([[obs[: cut + 1].sum()], obs[cut + 1:]])
    exp = np.concatenate([[exp[: cut + 1].sum()], exp[cut + 1:]])
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


@pytest.mark.parametrize("draft_rank", [0, 2, VOCAB - 1])  # likely, middling, outside top-k
@pytest.mark.parametrize("name", list(SETTINGS))
def test_first_and_second_tokens_follow_the_target_distribution(name: str, draft_rank: int):
    kw = SETTINGS[name]
    row0, row1 = _rows()
    p0, p1 = exact_distribution(row0, **kw), exact_distribution(row1, **kw)
    assert (p0 > 0).sum() >= 3 and (p1 > 0).sum() >= 3, "each setting must leave a choice"
    draft = int(np.argsort(-row0, kind="stable")[draft_rank])
    logits = torch.from_numpy(np.tile(np.stack([row0, row1]), (REQUESTS, 1))).contiguous()
    keys = [k for k in range(REQUESTS) for _ in range(2)]
    counters = [5, 6] * REQUESTS  # output indices 5 and 6 of each request
    meta = _meta(2 * REQUESTS, keys, counters, **kw)
    accept_u = rng.acceptance_uniforms(keys, counters)
    result = verify(Sampler(), logits, meta, [[draft]] * REQUESTS, accept_u)
    first = np.array([ids[0] for ids in result.token_ids])
    assert _chi2(first, p0) > 1e-3, (name, draft_rank)
    accepted = [ids for ids in result.token_ids if len(ids) == 2]
    assert all(ids[0] == draft for ids in accepted)
    assert len(accepted) == int((first == draft).sum())
    # Acceptance happens with probability p0(draft) (a binomial; 5 sigma).
    n, q = REQUESTS, p0[draft]
    assert abs(len(accepted) - n * q) <= 5 * np.sqrt(n * q * (1 - q)) + 1
    if len(accepted) >= 2000:
        assert _chi2(np.array([ids[1] for ids in accepted]), p1) > 1e-3, (name, draft_rank)


def test_seeded_verification_is_reproducible_and_independent_of_the_batch():
    row0, row1 = _rows()
    kw = SETTINGS["temperature 1.0"]

    def run(n: int) -> list[list[int]]:
        logits = torch.from_numpy(np.tile(np.stack([row0, row1]), (n, 1))).contiguous()
        keys = [1000 + k for k in range(n) for _ in range(2)]
        counters = [0, 1] * n
        meta = _meta(2 * n, keys, counters, **kw)
        return verify(Sampler(), logits, meta, [[3]] * n,
                      rng.acceptance_uniforms(keys, counters)).token_ids

    assert run(50)[:10] == run(10)


def test_greedy_rows_accept_the_matching_prefix_then_take_the_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 50, generator=g)
    argmax = logits.argmax(dim=1).tolist()
    # Request A: 3 drafts (rows 0-3), the third wrong; request B: 2 drafts (rows 4-6),
    # both right; request C: no drafts (row 7).
    logits = torch.randn(8, 50, generator=g)
    argmax = logits.argmax(dim=1).tolist()
    drafts = [[argmax[0], argmax[1], (argmax[2] + 1) % 50], [argmax[4], argmax[5]], []]
    meta = SamplingMetadata(all_greedy=True, all_random=False,
                            temperature=torch.ones(8), greedy_mask=None, top_p=None,
                            top_k=None)
    result = verify(Sampler(), logits, meta, drafts, None)
    assert result.token_ids[0] == argmax[0:3]
    assert result.token_ids[1] == [argmax[4], argmax[5], argmax[6]]
    assert result.token_ids[2] == [argmax[7]]
    assert result.rows == [[0, 1, 2], [4, 5, 6], [7]]
