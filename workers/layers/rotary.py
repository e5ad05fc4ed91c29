"""Rotary position embeddings (the "rotate half" layout HF checkpoints use).

A ``partial_rotary_factor`` below 1 (Qwen3-Next, Qwen3.5: 0.25) rotates only the first
``int(head_dim * factor)`` dimensions of each head and passes the rest through; the
frequencies are those of a head that wide, as transformers computes them.

``RotaryTable`` precomputes cos/sin per position once; each step looks up the
rows of the step's positions once and every layer of that rope kind reuses them.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from pocketllm.errors import UnsupportedFeatureError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rotary_dim(head_dim: int, params: dict) -> int:
    """How many leading dimensions of a head rotate (all but a partial rotary's rest)."""
    factor = float(params.get("partial_rotary_factor", 1.0))
    dim = int(head_dim * factor)
    if not 0.0 < factor <= 1.0 or dim < 2 or dim % 2:
        raise UnsupportedFeatureError(
            f"partial_rotary_factor={factor} of head_dim={head_dim} rotates {dim} dimensions; "
            "an even count from 2 to head_dim is needed")
    return dim


def rope_inv_freq(head_dim: int, params: dict, max_position_embeddings: int
                  ) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale for one rope parameter set (HF semantics):
    ``head_dim // 2`` of them, or fewer under a partial rotary (``rotary_dim``)."""
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedFeatureError(
            f"rope type {rope_type!r} is not supported; PocketLLM implements "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    head_dim = rotary_dim(head_dim, params)
    base = float(params["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (base ** exponents)
    if rope_type == "default":
        return inv_freq, 1.0
    factor = float(params["factor"]) if params.get("factor") is not None else None
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    original = int(params.get("original_max_position_embeddings") or max_position_embeddings)
    if rope_type == "llama3":
        return _llama3(inv_freq, factor, float(params["low_freq_factor"]),
                       float(params["high_freq_factor"]), original), 1.0
    return _yarn(head_dim, base, params, factor, original, max_position_embeddings)


def _llama3(inv_freq: torch.Tensor, factor: float, low_ff: float, high_ff: float,
            original: int) -> torch.Tensor:
    # Long wavelengths are divided by factor, short ones kept, the middle band interpolated.
    low_wavelen, high_wavelen = original / low_ff, original / high_ff
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    middle = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(middle, smoothed, scaled)


def _yarn(dim: int, base: float, params: dict, factor: Optional[float], original: int,
          max_pos: int) -> tuple[torch.Tensor, float]:
    if factor is None:
        factor = max_pos / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryTable:
    """cos/sin of every position up to a length that grows on demand."""

    def __init__(self, head_dim: int, params: dict, max_position_embeddings: int,
                 device: torch.device, dtype: torch.dtype):
        self.inv_freq, self.scale = rope_inv_freq(head_dim, params, max_position_embeddings)
        self.device, self.dtype = device, dtype
        self.cos = self.sin = torch.empty(0)
        self._grow(min(max_position_embeddings, 4096))

    def _grow(self, length: int) -> None:
        freqs = torch.outer(torch.arange(length, dtype=torch.float32), self.inv_freq)
        # Computed in float32 then cast, as HF does.
        self.cos = (freqs.cos() * self.scale).to(self.device, self.dtype)
        self.sin = (freqs.sin() * self.scale).to(self.device, self.dtype)

    def lookup(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, head_dim/2]; ``max_position`` is known on the host."""
        if max_position >= self.cos.shape[0]:
            self._grow(max(max_position + 1, 2 * self.cos.shape[0]))
        return (self.cos.index_select(0, positions).unsqueeze(1),
                self.sin.index_select(0, positions).unsqueeze(1))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; rotates the two halves of the head dimension (of its first
    ``2 * cos.shape[-1]`` dimensions under a partial rotary; the rest pass through)."""
    half = cos.shape[-1]
    if 2 * half < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :2 * half], cos, sin), x[..., 2 * half:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
