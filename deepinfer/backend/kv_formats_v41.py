"""V4.1 KV-cache row formats (reference deepseek-v4.1.md, section 1.13): the bytes each cached
entry occupies, and the reference packing of each row.

Every V4.1 entry is quantised whole, RoPE dims included (no bf16 part):
- "fp8" row (window rings; the main KV when FP4 is off): W e4m3 + W/32 UE8M0 scales
  (one per 32 values) -> 528 B for W = 512;
- "fp4" main compressed KV row: W/2 B e2m1 (two per byte, even index in the low nibble)
  + W/16 e4m3 scales (one per 16 values) -> 288 B for W = 512;
- "fp4" index key: D/2 B e2m1 + D/32 UE8M0 scales, MXFP4's layout -> 68 B for D = 128.
"bf16" keeps every kind unquantised, in the model dtype (2 bytes a value in bfloat16). The e2m1
and UE8M0 codings are deepinfer.backend.fp4's.

Row formats (RowFormat) name these byte layouts for the contract's quantised KV ops
(KVCacheOps.write_kv_rows / read_kv_rows, AttentionOps.quantized_attention /
quantized_indexer_topk): "fp8" (e4m3 + UE8M0 per 32), "fp4" (e2m1 + e4m3 per 16), "mxfp4"
(e2m1 + UE8M0 per 32, the index keys); None: rows in the cache's own float dtype. The quantisers
here are the formats' definitions; they run on any device without a host sync or a host tensor
(graph steps capture them).

The FP4 indexer (reference section 1.4) rounds its queries as its keys: with MXFP4 index keys
each query head's Di values are MXFP4 too (round_index_queries) before the scores.
"""

from __future__ import annotations

from typing import Literal

import torch

from deepinfer.backend import fp4

CacheKind = Literal["window", "main", "index"]
RowFormat = Literal["fp8", "fp4", "mxfp4"]
KV_CACHE_DTYPES_V41 = ("auto", "bf16", "fp8", "fp4")
E4M3_MAX = 448.0


def check_kv_cache_dtype_v41(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES_V41:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not supported by V4.1; choose one of {KV_CACHE_DTYPES_V41}"
        )


def row_formats_v41(kv_cache_dtype: str) -> dict[CacheKind, RowFormat | None]:
    """The row format of each cache kind: "auto" / "fp4" fp8 window rings, fp4 main entries,
    mxfp4 index keys (the published default); "fp8" the same with fp8 main entries; "bf16"
    none quantised."""
    check_kv_cache_dtype_v41(kv_cache_dtype)
    if kv_cache_dtype == "bf16":
        return {"window": None, "main": None, "index": None}
    return {"window": "fp8", "main": "fp8" if kv_cache_dtype == "fp8" else "fp4", "index": "mxfp4"}


def row_bytes(fmt: RowFormat, width: int) -> int:
    """Bytes of one row of `width` values in `fmt`."""
    kind: CacheKind = "window" if fmt == "fp8" else "main" if fmt == "fp4" else "index"
    return bytes_per_entry_v41(kind, width, "auto")


def quantize_rows(x: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    """[..., W] float -> [..., row_bytes(fmt, W)] uint8."""
    if fmt == "fp8":
        return quantize_fp8_rows_v41(x)
    if fmt == "fp4":
        return quantize_fp4_rows_v41(x)
    return quantize_fp4_index_keys_v41(x)


def dequantize_rows(rows: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    """[..., row_bytes(fmt, W)] uint8 -> [..., W] float32 (inverse of quantize_rows)."""
    if fmt == "fp8":
        return dequantize_fp8_rows_v41(rows)
    if fmt == "fp4":
        return dequantize_fp4_rows_v41(rows)
    return dequantize_fp4_index_keys_v41(rows)


def round_index_queries(q: torch.Tensor, key_format: RowFormat | None) -> torch.Tensor:
    """The indexer's queries as the scores read them: key_format "mxfp4" (V4.1's FP4 index keys)
    rounds each row of q (..., Di) to MXFP4 as quantize_fp4_index_keys_v41 rounds a key (one
    power-of-two scale per 32 values) -> float32; any other key format keeps q as it is."""
    if key_format != "mxfp4":
        return q
    return dequantize_fp4_index_keys_v41(quantize_fp4_index_keys_v41(q))


def _e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """fp4.e2m1_codes' codes (nearest e2m1 magnitude, ties to the even code, sign in bit 3) by
    arithmetic alone, so that graph capture sees no host tensor: |y| <= 6 rounds on e2m1's grid
    (steps 0.5 below 2, then 1, then 2; round() halves to even, the even code), and a magnitude
    q = m 2^e (m in [0.5, 1)) >= 1 has code 2e + 2 (q / 2^(e-1)) - 2."""
    a = y.abs()
    _, e = torch.frexp(a)  # a = m 2^e: floor(log2 a) = e - 1
    step = torch.exp2((torch.clamp(e - 1, min=0) - 1).to(a.dtype))
    q = torch.round(a / step) * step
    _, eq = torch.frexp(q)
    code = torch.where(q < 1, 2 * q, 2 * eq + 2 * q / torch.exp2((eq - 1).to(q.dtype)) - 2).long()
    return code | ((y < 0) & (code > 0)).long() << 3


def _e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """Positive normal float32 powers of two -> their UE8M0 bytes (the exponent field; no check,
    so no host sync: the callers' scales are powers of two by construction)."""
    return (scale.float().contiguous().view(torch.int32) >> 23).to(torch.uint8)


def bytes_per_entry_v41(kind: CacheKind, width: int, kv_cache_dtype: str) -> int:
    """Bytes of one cached entry of `kind` with `width` values under `kv_cache_dtype`.

    "auto" is V4.1's published default: fp8 window rings, fp4 main KV and index keys.
    """
    check_kv_cache_dtype_v41(kv_cache_dtype)
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
    """[..., W] float -> [..., W + W/32] uint8: W e4m3 bytes, then W/32 UE8M0 scales, each the
    smallest power of two that maps its 32 values' amax within e4m3's 448 (nothing clips)."""
    w = x.shape[-1]
    blocks = x.float().reshape(*x.shape[:-1], w // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True).clamp(min=2.0**-126 * E4M3_MAX)
    scale = fp4.pow2_ceil(amax / E4M3_MAX)
    q = (blocks / scale).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([q.reshape(*x.shape[:-1], w), _e8m0_bytes(scale[..., 0])], dim=-1)


def dequantize_fp8_rows_v41(rows: torch.Tensor) -> torch.Tensor:
    """[..., W + W/32] uint8 -> [..., W] float32 (inverse of quantize_fp8_rows_v41)."""
    w = rows.shape[-1] * 32 // 33
    q = rows[..., :w].contiguous().view(torch.float8_e4m3fn).float()
    scale = fp4.e8m0_to_float(rows[..., w:].contiguous())
    return (q.reshape(*q.shape[:-1], w // 32, 32) * scale[..., None]).reshape(q.shape)


def quantize_fp4_rows_v41(x: torch.Tensor) -> torch.Tensor:
    """[..., W] float -> [..., W/2 + W/16] uint8: e2m1 pairs, then W/16 e4m3 scales, each
    amax/6 of its 16 values rounded to e4m3 (a rounded-down scale clips at +-6)."""
    w = x.shape[-1]
    blocks = x.float().reshape(*x.shape[:-1], w // 16, 16)
    scale = (blocks.abs().amax(-1, keepdim=True) / fp4.E2M1_MAX).to(torch.float8_e4m3fn)
    s = scale.float()
    y = torch.where(s > 0, blocks / torch.where(s > 0, s, 1.0), 0.0).clamp(-fp4.E2M1_MAX, fp4.E2M1_MAX)
    packed = fp4.pack_e2m1(_e2m1_codes(y.reshape(x.shape)))
    return torch.cat([packed, scale[..., 0].view(torch.uint8)], dim=-1)


def dequantize_fp4_rows_v41(rows: torch.Tensor) -> torch.Tensor:
    """[..., W/2 + W/16] uint8 -> [..., W] float32 (inverse of quantize_fp4_rows_v41)."""
    w = rows.shape[-1] * 16 // 9
    val = fp4.unpack_e2m1(rows[..., : w // 2])
    s = rows[..., w // 2 :].contiguous().view(torch.float8_e4m3fn).float()
    return (val.reshape(*val.shape[:-1], w // 16, 16) * s[..., None]).reshape(val.shape)


def quantize_fp4_index_keys_v41(k: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> [..., D/2 + D/32] uint8: MXFP4 (e2m1 pairs, one UE8M0 scale per 32, the
    smallest power of two that maps its 32 values' amax within +-6, so nothing clips), as
    fp4.quantize_weight codes weights."""
    d = k.shape[-1]
    blocks = k.float().reshape(*k.shape[:-1], d // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True).clamp(min=2.0**-126 * fp4.E2M1_MAX)
    scale = fp4.pow2_ceil(amax / fp4.E2M1_MAX)
    packed = fp4.pack_e2m1(_e2m1_codes((blocks / scale).reshape(k.shape)))
    return torch.cat([packed, _e8m0_bytes(scale[..., 0])], dim=-1)


def dequantize_fp4_index_keys_v41(rows: torch.Tensor) -> torch.Tensor:
    """[..., D/2 + D/32] uint8 -> [..., D] float32 (inverse of quantize_fp4_index_keys_v41)."""
    d = rows.shape[-1] * 32 // 17
    return fp4.dequantize_weight(rows[..., : d // 2], rows[..., d // 2 :].contiguous())
