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
