"""Rotary position embedding in the Hugging Face ``rotate_half`` layout, with every rope
scaling type transformers defines for decoders (linear, dynamic NTK, yarn, llama3,
longrope; docs/architectures.md says where forerun's choices differ) and partial rotary."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from forerun.model import cpu_kernels
from forerun.model.errors import ModelLoadError


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency rescaling: stretch long wavelengths, keep short ones, blend between."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, blended, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, theta: float,
                   scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: interpolate (divide by ``factor``) the slow pairs, keep the fast ones, ramp
    linearly between the pairs that turn ``beta_slow`` and ``beta_fast`` times over the
    original context (transformers' ``_compute_yarn_parameters``)."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def pair_of(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_of(beta_fast), pair_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low)
            / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1 for the fast pairs (extrapolated), 0 for the slow (interpolated)
    return (inv_freq / factor) * (1 - keep) + inv_freq * keep


def attention_factor(scaling: dict[str, Any] | None, max_position_embeddings: int) -> float:
    """The factor yarn and longrope scale cos and sin by (so q·k by its square): the
    config's ``attention_factor`` if given, else the one each method's paper derives."""
    rope_type = (scaling or {}).get("rope_type")
    if rope_type not in ("yarn", "longrope"):
        return 1.0
    assert scaling is not None
    given = scaling.get("attention_factor")
    if given is not None:
        return float(given)
    original = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    # Phi-3 states no factor: its context is stretched from the original to the full one.
    factor = float(factor) if factor is not None else max_position_embeddings / original
    if rope_type == "longrope":
        return math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return mscale(factor, float(m)) / mscale(factor, float(m_all))
    return mscale(factor)


def dynamic_ntk_base(theta: float, dim: int, factor: float, original: int,
                     seq_len: torch.Tensor) -> torch.Tensor:
    """Dynamic NTK: the rope base for sequences of ``seq_len`` (float32, any shape);
    lengths up to ``original`` keep ``theta`` (transformers' formula, in float32 as it
    computes it)."""
    length = torch.clamp(seq_len.float(), min=float(original))
    return theta * ((factor * length / original) - (factor - 1)) ** (dim / (dim - 2))


def compute_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None,
    long_factors: bool = False,
) -> torch.Tensor:
    """Inverse frequencies (float32, CPU) for ``head_dim // 2`` rotation pairs (pass the
    rotary dimension as ``head_dim`` for partial rotary).

    ``scaling`` is a Hugging Face ``rope_scaling`` dict, optionally with ``freq_factors``:
    ``head_dim // 2`` numbers that divide the inverse frequencies (what a GGUF stores).
    ``long_factors`` picks longrope's long factor set over its short one. Dynamic NTK's
    frequencies depend on the position; these are those of the original context (see
    :class:`RotaryEmbedding`).
    """
    # Explicit CPU device: models are constructed under ``torch.device("meta")``.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "longrope":
        ext = scaling["long_factor" if long_factors else "short_factor"]
        ext = torch.tensor([float(v) for v in ext], dtype=torch.float32, device="cpu")
        if ext.numel() != head_dim // 2:
            raise ModelLoadError(f"longrope factors have {ext.numel()} entries; rotary "
                                 f"dimension {head_dim} needs {head_dim // 2}")
        return 1.0 / (ext * theta**exponents)
    factors = scaling.get("freq_factors")
    if factors is not None:
        # Per-pair divisors shipped with the weights (a GGUF's ``rope_freqs.weight``).
        # llama.cpp divides each pair's angle by its factor, on top of any linear scale;
        # for llama3 scaling the factors are that whole rescaling, already computed, so they
        # are used as they are rather than recomputed from parameters the file lacks.
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32, device="cpu")
        if rope_type in ("default", "llama3"):
            return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    if rope_type == "dynamic":
        return inv_freq
    raise ModelLoadError(f"unsupported rope scaling type {rope_type!r}")


@dataclass(slots=True)
class RotaryTables:
    """One step's rotation angles, in the two forms the two implementations want."""

    # [T, head_dim / 2] float32: the C kernel rotates in float32.
    cos_half: torch.Tensor
    sin_half: torch.Tensor
    # [T, 1, head_dim] in the model dtype, built on first use by the torch path.
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None

    def full(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cos is None or self.sin is None or self.cos.dtype != dtype:
            self.cos = torch.cat((self.cos_half, self.cos_half), dim=-1)[:, None, :].to(dtype)
            self.sin = torch.cat((self.sin_half, self.sin_half), dim=-1)[:, None, :].to(dtype)
        return self.cos, self.sin


class RotaryEmbedding:
    """Produces per-token cos/sin tables; one instance per model, applied in every layer.

    Not an ``nn.Module`` on purpose: ``inv_freq`` is derived from the config, never loaded,
    and must survive models built on the meta device.

    Dynamic NTK (``rope_type: dynamic``) rescales the base by the sequence's length once it
    passes ``max_position_embeddings``. transformers recomputes it per forward from the
    longest position in the batch, so with its KV cache each token is rotated by the
    frequencies of the length the sequence had when that token was computed. Here a token
    at position ``p`` always gets those of length ``p + 1``: the same for every decode
    step, and independent of chunking, batching and prefix caching (a prompt longer than
    the original context, prefilled in one forward by transformers, would use the prompt's
    length for all its tokens there).
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None,
                 rotary_dim: int | None = None, max_position_embeddings: int = 2048,
                 long_factors: bool = False) -> None:
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.theta = theta
        self._inv_freq_cpu = compute_inv_freq(self.rotary_dim, theta, scaling, long_factors)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}
        # yarn / longrope scale cos and sin (1.0 for the others: no multiply).
        self.attention_factor = attention_factor(scaling, max_position_embeddings)
        self._dynamic: tuple[float, int] | None = None
        if (scaling or {}).get("rope_type") == "dynamic":
            assert scaling is not None
            self._dynamic = (float(scaling["factor"]), max_position_embeddings)

    def _inv_freq_on(self, device: torch.device) -> torch.Tensor:
        inv = self._inv_freq.get(device)
        if inv is None:
            inv = self._inv_freq_cpu.to(device)
            self._inv_freq[device] = inv
        return inv

    def _dynamic_angles(self, positions: torch.Tensor) -> torch.Tensor:
        assert self._dynamic is not None
        factor, original = self._dynamic
        dim = self.rotary_dim
        base = dynamic_ntk_base(self.theta, dim, factor, original, positions + 1)
        exponents = torch.arange(0, dim, 2, dtype=torch.int64,
                                 device=positions.device).float() / dim
        inv = 1.0 / (base[:, None] ** exponents[None, :])
        # Within the original context exactly the unscaled frequencies, as transformers.
        inside = (positions + 1 <= original)[:, None]
        inv = torch.where(inside, self._inv_freq_on(positions.device)[None, :], inv)
        return positions.float()[:, None] * inv

    def tables(self, positions: torch.Tensor) -> RotaryTables:
        """The angles for positions ``[T]``."""
        # Angles in float32 regardless of the model dtype: bf16 positions lose precision fast.
        if self._dynamic is not None:
            freqs = self._dynamic_angles(positions)
        else:
            freqs = positions.float()[:, None] * self._inv_freq_on(positions.device)[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return RotaryTables(cos, sin)


def apply_rotary(x: torch.Tensor, tables: RotaryTables) -> torch.Tensor:
    """Rotate ``x`` of shape ``[T, heads, head_dim]`` by the per-token angles.

    May rotate ``x`` in place (the C kernel does, for heads contiguous within a row).
    With tables narrower than the head (partial rotary) only the leading dimensions
    turn, in place, and the rest pass through.
    """
    rot = 2 * tables.cos_half.shape[-1]
    if rot < x.shape[-1]:
        x[..., :rot] = _rotate_torch(x[..., :rot], tables)
        return x
    if (x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]
            and cpu_kernels.supports(x.dtype, x.device)):
        cpu_kernels.rotary_(x, tables.cos_half, tables.sin_half)
        return x
    return _rotate_torch(x, tables)


def _rotate_torch(x: torch.Tensor, tables: RotaryTables) -> torch.Tensor:
    cos, sin = tables.full(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
