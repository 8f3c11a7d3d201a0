# mypy: disable-error-code="no-untyped-def,untyped-decorator,no-untyped-call"
# (Triton kernels take untyped tensor-like arguments by design; the launchers are typed.)
"""FP8 latent rows (deepinfer.backend.kv_formats_mla, FlashMLA's layout): the quantised store and
the loads the attention kernel dequantises in registers.

A row of bytes: [C e4m3 | C/T float32 scales | R bfloat16], T = min(128, C). The store computes
each tile's scale as the smallest power of two >= amax / 448 from the float32 bits (exact, as
fp4.pow2_ceil), multiplies by its exact inverse and rounds to nearest even (common.to_e4m3).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.backend.fp8 import AMAX_EPS, FP8_MAX
from deepinfer.backend.kv_formats_mla import fp8_row_bytes, fp8_tile
from deepinfer_cuda.kernels.common import IS_INTERPRET, next_pow2, to_dtype, to_e4m3

# The kernels write the format's constants as literals (Triton reads no non-constexpr globals):
# 448.0 is FP8_MAX, 1e-10 AMAX_EPS, as deepinfer.backend.fp8 defines.
assert (FP8_MAX, AMAX_EPS) == (448.0, 1e-10)


@triton.jit
def _write_fp8_rows_kernel(
    kv_ptr, cache_ptr, slot_ptr, stride_kv, stride_slot, stride_c, D_LAT, D_ROPE,
    TILE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """Program (t, j): tile j of row t (the rope part too, j == 0) into slot_ptr[t] (-1: none)."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    slot = tl.load(slot_ptr + t * stride_slot).to(tl.int64)
    if slot >= 0:
        src = kv_ptr + t * stride_kv
        dst = cache_ptr + slot * stride_c  # uint8 row
        cols = j * TILE + tl.arange(0, BLOCK_T)
        ok = cols < (j + 1) * TILE
        x = tl.load(src + cols, mask=ok, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-10)
        bits = tl.math.div_rn(amax, 448.0).to(tl.int32, bitcast=True)
        e = (bits >> 23) & 0xFF  # amax / 448 is a normal float32 (the 1e-10 floor keeps it so)
        e = tl.where((bits & 0x7FFFFF) != 0, e + 1, e)  # the smallest power of two >= it
        scale = (e << 23).to(tl.float32, bitcast=True)
        inv = ((254 - e) << 23).to(tl.float32, bitcast=True)  # 1 / scale, exact
        y = tl.minimum(tl.maximum(x * inv, -448.0), 448.0)
        tl.store(dst + cols, to_e4m3(y).to(tl.uint8, bitcast=True), mask=ok)
        tl.store((dst + D_LAT).to(tl.pointer_type(tl.float32)) + j, scale)
        if j == 0:
            r = tl.arange(0, BLOCK_R)
            rope = tl.load(src + D_LAT + r, mask=r < D_ROPE, other=0.0).to(tl.float32)
            rope_dst = (dst + D_LAT + 4 * (D_LAT // TILE)).to(tl.pointer_type(tl.bfloat16))
            tl.store(rope_dst + r, to_dtype(rope, tl.bfloat16), mask=r < D_ROPE)


def write_fp8_rows(
    cache: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor, latent_dim: int, rope_dim: int
) -> None:
    """cache (NB, BS, fp8_row_bytes) uint8 contiguous; kv (T, C + R) float (a strided view is
    fine); slot_mapping (T,) (-1 skips a row). One launch, no host sync."""
    t, d = kv.shape
    row = fp8_row_bytes(latent_dim, rope_dim)
    if d != latent_dim + rope_dim or cache.dtype != torch.uint8 or cache.shape[-1] != row:
        raise ValueError(
            f"write_fp8_rows: rows of width {d} ({latent_dim} + {rope_dim}) into a {cache.dtype} cache of "
            f"{cache.shape[-1]} bytes a row (FP8 rows take {row})"
        )
    if slot_mapping.shape != (t,):
        raise ValueError(f"write_fp8_rows: slot_mapping must be ({t},), got {tuple(slot_mapping.shape)}")
    if t == 0:
        return
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    tile = fp8_tile(latent_dim)
    _write_fp8_rows_kernel[(t, latent_dim // tile)](
        kv, cache, slot_mapping, kv.stride(0), slot_mapping.stride(0), cache.stride(1), latent_dim, rope_dim,
        TILE=tile, BLOCK_T=next_pow2(tile), BLOCK_R=max(1, next_pow2(rope_dim)), num_warps=1,
    )  # fmt: skip


@triton.jit
def load_fp8_latent(
    kv_row, n_valid, cols, width, D_LAT, TILE: tl.constexpr, dtype: tl.constexpr, TILES: tl.constexpr = 0
):  # fmt: skip
    """(BLOCK_N, len(cols)) latent columns `cols` (those < width; 0 elsewhere and in rows not
    n_valid) of the FP8 rows at kv_row (BLOCK_N,) uint8 pointers, dequantised in registers:
    e4m3 * the tile's power-of-two scale, exact in float32, then in `dtype` (bfloat16 and float16
    hold it exactly too: 4 significant bits). TILES > 0: cols is arange(0, TILES * TILE), the
    whole latent, and each row's TILES scales are loaded once and broadcast over their tiles
    (else one scale load per value, from the same few addresses). bfloat16: the product is taken
    in bfloat16, exact too (its 8 significant bits and float32's exponents hold e4m3 * 2^k: the
    same bits as in float32, packed multiplies); float16's exponents may not hold the scale. The
    interpreter multiplies bfloat16 wrongly (common.py): there the product is taken in float32."""
    m = n_valid[:, None] & (cols[None, :] < width)
    q8 = tl.load(kv_row[:, None] + cols[None, :], mask=m, other=0)
    if dtype == tl.bfloat16 and not IS_INTERPRET:  # by float16 (exact too): SM90 converts e4m3 pairs
        q = q8.to(tl.float8e4nv, bitcast=True).to(tl.float16).to(tl.bfloat16)  # to float16 pairs
    else:
        q = q8.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    scales = (kv_row + D_LAT).to(tl.pointer_type(tl.float32))
    if TILES:
        s = tl.load(scales[:, None] + tl.arange(0, TILES)[None, :], mask=n_valid[:, None], other=0.0)
        q3 = tl.reshape(q, (q.shape[0], TILES, TILE)) * s.to(q.dtype)[:, :, None]
        return tl.reshape(q3, (q.shape[0], TILES * TILE)).to(dtype)
    s = tl.load(scales[:, None] + (cols // TILE)[None, :], mask=m, other=0.0)
    return (q * s.to(q.dtype)).to(dtype)


@triton.jit
def load_fp8_rope(kv_row, n_valid, cols, D_LAT, D_ROPE, TILE: tl.constexpr, dtype: tl.constexpr):
    """(BLOCK_N, len(cols)) rope columns (bfloat16 in the row, after the scales) in `dtype`."""
    rope = (kv_row + D_LAT + 4 * (D_LAT // TILE)).to(tl.pointer_type(tl.bfloat16))
    m = n_valid[:, None] & (cols[None, :] < D_ROPE)
    return tl.load(rope[:, None] + cols[None, :], mask=m, other=0.0).to(dtype)
