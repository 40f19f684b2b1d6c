"""The sampler draws from exactly the processed distribution, on both of its paths.

Oracle: the distribution written out here in float64 by sorting the vocabulary (softmax at
the temperature, then min_p, top-k and top-p by their definitions); ≥ 20k draws per setting
with fixed keys, compared by chi-square. The C kernel and the torch path are also compared
with each other token for token on a full-size vocabulary.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from forerun.model import cpu_kernels
from forerun.worker import rng
from forerun.worker.sampler import Sampler, SamplingMetadata

VOCAB = 64
DRAWS = 24_000
SETTINGS = {
    "temperature 1.0": dict(temperature=1.0),
    "temperature 0.7": dict(temperature=0.7),
    "temperature 1.8": dict(temperature=1.8),
    "top_k 10": dict(temperature=1.0, top_k=10),
    "top_p 0.8": dict(temperature=1.0, top_p=0.8),
    "top_p 0.6, temperature 0.9": dict(temperature=0.9, top_p=0.6),
    "min_p 0.05": dict(temperature=1.0, min_p=0.05),
    "top_k 20 + top_p 0.9 + min_p 0.02": dict(temperature=1.3, top_k=20, top_p=0.9,
                                              min_p=0.02),
}


def exact_distribution(logits: np.ndarray, temperature: float, top_k: int = 0,
                       top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """The processed distribution of one row, by the definitions, in float64."""
    x = logits.astype(np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    if 0 < top_k < len(x):
        kth = np.sort(x)[-top_k]
        keep &= x >= kth
    p = np.where(keep, p, 0.0)
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")  # probability, then lower id
        above = np.concatenate([[0.0], np.cumsum(p[order])[:-1]])
        nucleus = np.zeros_like(keep)
        nucleus[order[above < top_p]] = True
        p = np.where(nucleus, p, 0.0)
        p /= p.sum()
    return p


def _meta(rows: int, temperature: float, top_k: int = 0, top_p: float = 1.0,
          min_p: float = 0.0, key: int = 7) -> SamplingMetadata:
    return SamplingMetadata(
        all_greedy=False, all_random=True,
        temperature=torch.full((rows,), temperature),
        greedy_mask=None,
        top_p=torch.full((rows,), top_p) if top_p < 1.0 else None,
        top_k=torch.full((rows,), top_k if top_k else 1 << 30, dtype=torch.int64)
        if top_k else None,
        min_p=torch.full((rows,), min_p) if min_p > 0 else None,
        uniforms=torch.from_numpy(rng.uniforms([key] * rows, list(range(rows)))),
    )


PATHS = ["torch"] + (["c"] if cpu_kernels.supports(torch.float32, torch.device("cpu"))
                     else [])


def _draw(path: str, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    if path == "c":
        return Sampler._sample_cpu(logits, meta)
    return Sampler._sample_torch(logits, meta)


@pytest.fixture(scope="module")
def row() -> np.ndarray:
    g = np.random.default_rng(20261130)
    return (g.standard_normal(VOCAB) * 1.5).astype(np.float32)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", list(SETTINGS))
def test_draws_match_the_processed_distribution(row: np.ndarray, path: str, name: str) -> None:
    kw = SETTINGS[name]
    p = exact_distribution(row, **kw)
    logits = torch.from_numpy(row).expand(DRAWS, VOCAB).contiguous()
    tokens = _draw(path, logits, _meta(DRAWS, **kw)).numpy()
    counts = np.bincount(tokens, minlength=VOCAB)
    support = p > 0
    assert counts[~support].sum() == 0, f"tokens outside the support: {np.flatnonzero(counts * ~support)}"
    assert support.sum() >= 3, "a setting this test uses must leave a choice"
    expected = p[support] * DRAWS
    # Pool the rare tokens so that every expected count is at least 5.
    order = np.argsort(expected)
    obs, exp = counts[support][order], expected[order]
    cut = np.searchsorted(np.cumsum(exp), 5.0)
    obs = np.concatenate([[obs[: cut + 1].sum()], obs[cut + 1:]])
    exp = np.concatenate([[exp[: cut + 1].sum()], exp[cut + 1:]])
    result = chisquare(obs, exp * obs.sum() / exp.sum())
    assert result.pvalue > 1e-3, (name, path, result)


@pytest.mark.skipif("c" not in PATHS, reason="no C kernels on this machine")
@pytest.mark.parametrize("name", list(SETTINGS))
def test_c_kernel_and_torch_path_pick_the_same_tokens(name: str) -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(48, 49152, generator=g) * 3
    meta = _meta(48, **SETTINGS[name], key=11)
    assert torch.equal(_draw("c", logits, meta), _draw("torch", logits, meta))


@pytest.mark.parametrize("path", PATHS)
def test_greedy_rows_in_a_random_batch_take_the_argmax(path: str) -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 300, generator=g)
    meta = _meta(6, temperature=1.0, top_p=0.9)
    meta.all_random = False
    meta.greedy_mask = torch.tensor([True, False, True, False, False, True])
    out = _draw(path, logits, meta)
    assert torch.equal(out[meta.greedy_mask], logits.argmax(-1)[meta.greedy_mask])


@pytest.mark.parametrize("path", PATHS)
def test_a_row_with_every_token_masked_but_one_returns_it(path: str) -> None:
    logits = torch.full((3, 100), float("-inf"))
    logits[:, 42] = 0.5
    assert _draw(path, logits, _meta(3, temperature=0.9, top_k=5, top_p=0.7)).tolist() == [42] * 3


def test_uniforms_depend_only_on_key_and_counter() -> None:
    a = rng.uniforms([5, 9, 5], [0, 3, 1])
    b = rng.uniforms([9, 5], [3, 1])
    assert a[1] == b[0] and a[2] == b[1]
    assert rng.uniforms([2**64 - 1], [0])[0] == rng.uniforms([rng.key_from_seed(-1)], [0])[0]
    u = rng.uniforms([1] * 200_000, list(range(200_000)))
    assert 0.0 <= u.min() and u.max() < 1.0
    # Uniform on [0, 1): the ten deciles hold equal shares (chi-square, 9 dof).
    assert chisquare(np.bincount((u * 10).astype(int), minlength=10)).pvalue > 1e-3


@pytest.mark.skipif("c" not in PATHS, reason="no C kernels on this machine")
@pytest.mark.parametrize("top_p", [0.3, 0.5, 0.75])
def test_c_kernel_breaks_top_p_ties_by_lower_token_id(top_p: float) -> None:
    # Four equal logits straddle each nucleus edge: the lower ids among them are kept.
    row = np.array([2.0] * 4 + [1.0] * 4 + [0.0] * 8, dtype=np.float32)
    p = exact_distribution(row, temperature=1.0, top_p=top_p)
    logits = torch.from_numpy(row).expand(DRAWS, len(row)).contiguous()
    tokens = _draw("c", logits, _meta(DRAWS, temperature=1.0, top_p=top_p)).numpy()
    counts = np.bincount(tokens, minlength=len(row))
    support = p > 0
    assert counts[~support].sum() == 0 and support.sum() >= 2
    assert chisquare(counts[support], p[support] / p[support].sum() * DRAWS).pvalue > 1e-3
