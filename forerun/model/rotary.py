"""Rotary position embedding in the Hugging Face ``rotate_half`` layout."""

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


def compute_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    """Inverse frequencies (float32, CPU) for ``head_dim // 2`` rotation pairs.

    ``scaling`` is a Hugging Face ``rope_scaling`` dict, optionally with ``freq_factors``:
    ``head_dim // 2`` numbers that divide the inverse frequencies (what a GGUF stores).
    """
    # Explicit CPU device: models are constructed under ``torch.device("meta")``.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type", "default")
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
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        self.head_dim = head_dim
        self._inv_freq_cpu = compute_inv_freq(head_dim, theta, scaling)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def _inv_freq_on(self, device: torch.device) -> torch.Tensor:
        inv = self._inv_freq.get(device)
        if inv is None:
            inv = self._inv_freq_cpu.to(device)
            self._inv_freq[device] = inv
        return inv

    def tables(self, positions: torch.Tensor) -> RotaryTables:
        """The angles for positions ``[T]``."""
        # Angles in float32 regardless of the model dtype: bf16 positions lose precision fast.
        freqs = positions.float()[:, None] * self._inv_freq_on(positions.device)[None, :]
        return RotaryTables(freqs.cos(), freqs.sin())


def apply_rotary(x: torch.Tensor, tables: RotaryTables) -> torch.Tensor:
    """Rotate ``x`` of shape ``[T, heads, head_dim]`` by the per-token angles.

    May rotate ``x`` in place (the C kernel does, for heads contiguous within a row).
    """
    if (x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]
            and cpu_kernels.supports(x.dtype, x.device)):
        cpu_kernels.rotary_(x, tables.cos_half, tables.sin_half)
        return x
    cos, sin = tables.full(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
