"""Counter-based uniforms: one per sampled token, a pure function of (key, position).

A request's key is its seed (or, unseeded, a number drawn from torch's global generator
when the worker first sees it); the counter is the index of the output token being drawn.
The uniform is SplitMix64 (Steele, Lea and Flood, 2014) seeded with the mixed key and
advanced to that index, so a seeded request draws the same numbers whatever its batch,
queue depth, or preemptions (a resumed request continues at its output count), and no
generator object is kept per request.
"""

from __future__ import annotations

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_KEY_SALT = np.uint64(0xD1B54A32D192ED03)
_MASK64 = (1 << 64) - 1


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def key_from_seed(seed: int) -> int:
    """A request's key from its seed (any Python int; taken modulo 2**64)."""
    return seed & _MASK64


def random_key() -> int:
    """A key for an unseeded request, from torch's global generator (so an engine's
    ``seed`` makes unseeded runs repeatable too)."""
    return int(torch.randint(0, 1 << 62, (1,)).item())


def uniforms(keys: list[int], counters: list[int]) -> np.ndarray:
    """float64 uniforms in [0, 1), one per (key, counter) pair."""
    k = np.array(keys, dtype=np.uint64)
    n = np.array(counters, dtype=np.uint64)
    state = _mix(k ^ _KEY_SALT)
    z = _mix(state + (n + np.uint64(1)) * _GOLDEN)
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


# A second stream per key: the draws that accept or reject a draft must be independent of
# the draw that samples the same position.
_ACCEPT_SALT = 0x6A09E667F3BCC909


def acceptance_uniforms(keys: list[int], counters: list[int]) -> np.ndarray:
    """float64 uniforms in [0, 1) for speculative acceptance, one per (key, counter)."""
    return uniforms([k ^ _ACCEPT_SALT for k in keys], counters)
