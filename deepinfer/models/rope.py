"""Rotary-embedding tables for MLA's rope part (default and DeepSeek's YaRN)."""

from __future__ import annotations

import math

import torch

from deepinfer.models.config import RopeConfig


def _correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    """The rope dimension whose wavelength makes `num_rotations` turns over `max_pos` positions."""
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """(dim/2,) float32 inverse frequencies (YaRN: blend of extrapolated and factor-interpolated)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    extrapolation = 1.0 / (rope.theta**exponents)
    if rope.kind != "yarn":
        return extrapolation
    interpolation = extrapolation / rope.factor
    orig = rope.original_max_position_embeddings
    low: float = max(math.floor(_correction_dim(rope.beta_fast, dim, rope.theta, orig)), 0)
    high: float = min(math.ceil(_correction_dim(rope.beta_slow, dim, rope.theta, orig)), dim - 1)
    if low == high:
        high += 0.001  # avoids a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # 1 for high frequencies (kept), 0 for low ones (interpolated)
    return interpolation * (1 - keep) + extrapolation * keep


def cos_sin_cache(rope: RopeConfig, dim: int, max_positions: int, device: torch.device) -> torch.Tensor:
    """(max_positions, dim) float32 rows [cos(p f) | sin(p f)] * YaRN's cos/sin factor (the contract's
    rope table)."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq(rope, dim).double())
    factor = rope.cos_sin_factor
    table = torch.cat([freqs.cos() * factor, freqs.sin() * factor], dim=-1)  # (P, dim)
    return table.to(device=device, dtype=torch.float32)
