"""V4.1 KV-cache row formats: the real bytes each cached entry occupies.

All V4.1 entries are 512 wide, RoPE dims quantised too (no bf16 part):
- "fp8" window ring row: 512 e4m3 + 16 UE8M0 scales (one per 32) = 528 B;
- "fp4" main compressed KV row: 256 B e2m1 (two per byte, even index in the
  low nibble) + 32 e4m3 scales (one per 16) = 288 B;
- "fp4" index key (128 wide): 64 B e2m1 + 4 UE8M0 scales (one per 32) = 68 B.
"bf16" keeps every kind at 2 bytes per value.
"""

from __future__ import annotations

from typing import Literal

import torch

CacheKind = Literal["window", "main", "index"]
KV_CACHE_DTYPES_V41 = ("auto", "bf16", "fp8", "fp4")


def bytes_per_entry_v41(kind: CacheKind, width: int, kv_cache_dtype: str) -> int:
    """Bytes of one cached entry of `kind` with `width` values under `kv_cache_dtype`.

    "auto" is V4.1's published default: fp8 window rings, fp4 main KV and index keys.
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES_V41:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not supported by V4.1; choose one of {KV_CACHE_DTYPES_V41}"
        )
    if kv_cache_dtype == "bf16":
        return 2 * width
    if kind == "window" or (kind == "main" and kv_cache_dtype == "fp8"):
        if width % 32:
            raise ValueError(f"fp8 rows need a width divisible by 32, got {width}")
        return width + width // 32
    if kind == "main":
        if width % 16:
            raise ValueError(f"fp4 main rows need a width divisible by 16, got {width}")
        return width // 2 + width // 16
    if width % 32:
        raise ValueError(f"fp4 index keys need a width divisible by 32, got {width}")
    return width // 2 + width // 32


def quantize_fp8_rows_v41(x: torch.Tensor) -> torch.Tensor:
    """[..., W] float -> [..., W + W/32] uint8: W e4m3 bytes, then W/32 UE8M0 scales.

    Each scale is the power of two 2^ceil(log2(amax / 448)) of its 32 values.
    """
    w = x.shape[-1]
    blocks = x.float().reshape(*x.shape[:-1], w // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    exp = torch.ceil(torch.log2(amax / 448.0)).clamp(-127, 127)
    q = (blocks / torch.exp2(exp)).to(torch.float8_e4m3fn).view(torch.uint8)
    scales = (exp.squeeze(-1) + 127).to(torch.uint8)
    return torch.cat([q.reshape(*x.shape[:-1], w), scales], dim=-1)


def dequantize_fp8_rows_v41(rows: torch.Tensor) -> torch.Tensor:
    """[..., W + W/32] uint8 -> [..., W] float32 (inverse of quantize_fp8_rows_v41)."""
    w = rows.shape[-1] * 32 // 33
    q = rows[..., :w].contiguous().view(torch.float8_e4m3fn).float()
    exp = rows[..., w:].float() - 127.0
    blocks = q.reshape(*q.shape[:-1], w // 32, 32) * torch.exp2(exp).unsqueeze(-1)
    return blocks.reshape(*q.shape[:-1], w)


_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def quantize_fp4_rows_v41(x: torch.Tensor) -> torch.Tensor:
    """[..., W] float -> [..., W/2 + W/16] uint8: e2m1 pairs (even index in the low
    nibble), then W/16 e4m3 scales, each amax/6 of its 16 values."""
    w = x.shape[-1]
    blocks = x.float().reshape(*x.shape[:-1], w // 16, 16)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = (amax / 6.0).to(torch.float8_e4m3fn)
    s = scale.float()
    y = torch.where(s > 0, blocks / torch.where(s > 0, s, 1.0), 0.0).clamp(-6.0, 6.0)
    grid = torch.tensor(_E2M1)
    code = (y.abs().unsqueeze(-1) - grid).abs().argmin(-1).to(torch.uint8)
    code = code | ((y < 0).to(torch.uint8) << 3)
    code = code.reshape(*x.shape[:-1], w // 2, 2)
    packed = code[..., 0] | (code[..., 1] << 4)
    scales = scale.squeeze(-1).view(torch.uint8)
    return torch.cat([packed, scales], dim=-1)


def dequantize_fp4_rows_v41(rows: torch.Tensor) -> torch.Tensor:
    """[..., W/2 + W/16] uint8 -> [..., W] float32 (inverse of quantize_fp4_rows_v41)."""
    w = rows.shape[-1] * 16 // 9
    packed = rows[..., : w // 2]
    code = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(*rows.shape[:-1], w)
    mag = torch.tensor(_E2M1)[(code & 7).long()]
    val = torch.where(code >= 8, -mag, mag)
    s = rows[..., w // 2 :].contiguous().view(torch.float8_e4m3fn).float()
    return (val.reshape(*val.shape[:-1], w // 16, 16) * s.unsqueeze(-1)).reshape(val.shape)


def quantize_fp4_index_keys_v41(k: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> [..., D/2 + D/32] uint8: e2m1 pairs (even index in the low
    nibble), then D/32 UE8M0 scales, each 2^ceil(log2(amax / 6)) of its 32 values."""
    d = k.shape[-1]
    blocks = k.float().reshape(*k.shape[:-1], d // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    y = (blocks / torch.exp2(exp)).clamp(-6.0, 6.0)
    grid = torch.tensor(_E2M1)
    code = (y.abs().unsqueeze(-1) - grid).abs().argmin(-1).to(torch.uint8)
    code = (code | ((y < 0).to(torch.uint8) << 3)).reshape(*k.shape[:-1], d // 2, 2)
    packed = code[..., 0] | (code[..., 1] << 4)
    return torch.cat([packed, (exp.squeeze(-1) + 127).to(torch.uint8)], dim=-1)


def dequantize_fp4_index_keys_v41(rows: torch.Tensor) -> torch.Tensor:
    """[..., D/2 + D/32] uint8 -> [..., D] float32 (inverse of quantize_fp4_index_keys_v41)."""
    d = rows.shape[-1] * 32 // 17
    packed = rows[..., : d // 2]
    code = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(*rows.shape[:-1], d)
    mag = torch.tensor(_E2M1)[(code & 7).long()]
    val = torch.where(code >= 8, -mag, mag)
    s = torch.exp2(rows[..., d // 2 :].float() - 127.0)
    return (val.reshape(*val.shape[:-1], d // 32, 32) * s.unsqueeze(-1)).reshape(val.shape)
