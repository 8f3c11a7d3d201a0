"""The FP8 latent row of MLA caches (DeepSeek-V2 / V3; `kv_cache_dtype="fp8"`): FlashMLA's V3 FP8
layout, one row of bytes per cached token.

    [ C e4m3 latent values | C/T float32 scales | R bfloat16 rope values ]
    DeepSeek-V3 (C = kv_lora_rank = 512, R = 64, T = 128): 512 + 16 + 128 = 656 bytes (bf16: 1152)

- the latent is quantised per tile of T = min(128, C) values: scale = pow2_ceil(amax / 448), a
  power of two (FlashMLA's packing rounds it so), value = e4m3 * scale, exact in float32;
- C must be a multiple of 128, or one tile narrower than 128 (the tiny test configs' ranks) that is
  a multiple of 4; R must be even (so every row, and the scales in it, stay 4-byte aligned);
- the rope part is stored in bfloat16 whatever the model dtype.

Rounding (what tests budget for): a value x of a tile of amax A is stored with an error of at most
2^-4 |x| (e4m3's 3 mantissa bits, normal range) or 2^-10 * scale <= 2^-10 * 2A / 448 (its
subnormals); the rope values within bf16's 2^-8 |x|.

Backends and tests import these names; deepinfer.reference.memory stores and reads the rows
with quantize_mla_rows / dequantize_mla_rows.
"""

from __future__ import annotations

import torch

from deepinfer.backend import fp4
from deepinfer.backend.fp8 import AMAX_EPS, FP8_BLOCK, FP8_DTYPE, FP8_MAX

FP8_KV_FORMAT = "fp8"  # KVCacheSpec.kv_format of a cache of these rows ("auto": rows in spec.dtype)
KV_FORMATS = ("auto", FP8_KV_FORMAT)
ALIGN = 4  # latent bytes before the float32 scales


def fp8_tile(latent_dim: int) -> int:
    """Values per scale: 128, or the whole latent where it is narrower (ValueError for widths the
    format cannot hold)."""
    tile = min(FP8_BLOCK, latent_dim)
    if latent_dim <= 0 or latent_dim % tile or tile % ALIGN:
        raise ValueError(
            f"the fp8 KV cache needs kv_lora_rank (the latent width) to be a multiple of {FP8_BLOCK}, "
            f"or a multiple of {ALIGN} below {FP8_BLOCK}; got {latent_dim}"
        )
    return tile


def fp8_row_bytes(latent_dim: int, rope_dim: int) -> int:
    """Bytes of one token's row: C + 4 C/T + 2 R (656 for 512 + 64)."""
    if rope_dim % 2:
        raise ValueError(f"the fp8 KV cache needs an even qk_rope_head_dim; got {rope_dim}")
    return latent_dim + 4 * (latent_dim // fp8_tile(latent_dim)) + 2 * rope_dim


def quantize_mla_rows(x: torch.Tensor, latent_dim: int) -> torch.Tensor:
    """[..., C + R] float -> [..., fp8_row_bytes(C, R)] uint8 (the layout above)."""
    c, r = latent_dim, x.shape[-1] - latent_dim
    tile = fp8_tile(c)
    lead = x.shape[:-1]
    tiles = x[..., :c].float().reshape(*lead, c // tile, tile)
    amax = tiles.abs().amax(-1, keepdim=True).clamp(min=AMAX_EPS)
    scale = fp4.pow2_ceil(amax / FP8_MAX)
    q = (tiles / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8).reshape(*lead, c)
    scale_bytes = scale[..., 0].contiguous().view(torch.uint8)
    rope_bytes = x[..., c:].to(torch.bfloat16).contiguous().view(torch.uint8)
    assert rope_bytes.shape[-1] == 2 * r
    return torch.cat([q, scale_bytes, rope_bytes], dim=-1)


def dequantize_mla_rows(rows: torch.Tensor, latent_dim: int, rope_dim: int) -> torch.Tensor:
    """[..., fp8_row_bytes(C, R)] uint8 -> [..., C + R] float32 (exact: the inverse of
    quantize_mla_rows up to its rounding)."""
    c, tile = latent_dim, fp8_tile(latent_dim)
    n = c // tile
    q = rows[..., :c].contiguous().view(FP8_DTYPE).float()
    scale = rows[..., c : c + 4 * n].contiguous().view(torch.float32)
    latent = (q.reshape(*q.shape[:-1], n, tile) * scale[..., None]).reshape(q.shape)
    rope = rows[..., c + 4 * n : c + 4 * n + 2 * rope_dim].contiguous().view(torch.bfloat16).float()
    return torch.cat([latent, rope], dim=-1)
