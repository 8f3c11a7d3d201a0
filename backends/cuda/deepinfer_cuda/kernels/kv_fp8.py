# mypy: disable-error-code="no-untyped-def,untyped-decorator,no-untyped-call"
# (Triton kernels take untyped tensor-like arguments by design; the launchers are typed.)
"""FP8 latent rows (deepinfer.backend.kv_formats_mla, FlashMLA's layout): the quantised store and
the loads the attention kernel dequantises in registers.

Two reads. load_fp8_latent: e4m3 * scale in q's dtype (any latent width, float32 queries too).
The float16 read (fp8_to_half, with half_queries): SM90 converts e4m3 pairs to float16
in one instruction, where bfloat16 takes three more (each float16 widened to float32, then packed:
the conversions, not the MMAs, bounded the bfloat16 read). Float16 cannot hold every scale, so
the values are taken relative to a power-of-two reference, the largest scale the program has met
(a running maximum, like the softmax's), and the query rows are scaled by powers of two into
float16's range; the scores and the output take both factors back, exactly.

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
from deepinfer_cuda.kernels.common import (
    IS_INTERPRET,
    launch_dependents,
    next_pow2,
    to_dtype,
    to_e4m3,
    wait_for_previous,
)

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
def fp8_row_scales(kv_row, n_valid, D_LAT, TILES: tl.constexpr):
    """(BLOCK_N, TILES) float32: the tile scales of the FP8 rows at kv_row (0 in rows not n_valid)."""
    scales = (kv_row + D_LAT).to(tl.pointer_type(tl.float32))
    return tl.load(scales[:, None] + tl.arange(0, TILES)[None, :], mask=n_valid[:, None], other=0.0)


@triton.jit
def pow2_floor(x):
    """(x's power of two: x with its mantissa cleared, 0 for 0, x >= 0 float32; its inverse, exact)."""
    bits = x.to(tl.int32, bitcast=True) & 0x7F800000
    return bits.to(tl.float32, bitcast=True), ((254 << 23) - bits).to(tl.float32, bitcast=True)


@triton.jit
def fp8_to_half(q8, ratio, TILE: tl.constexpr, TILES: tl.constexpr):
    """(BLOCK_N, TILES * TILE) float16: q8 (BLOCK_N, TILES * TILE) e4m3 bytes (a whole latent),
    each tile's values times ratio (BLOCK_N, TILES) float32, a power of two < 2 (the tile's scale
    over the caller's reference). Exact while ratio >= 2^-15 (e4m3's 2^-9 step times it stays on
    float16's grid); smaller ratios round in float16's subnormals, an error below 2^-24 of the
    reference. The interpreter (no float16 product there) multiplies in float32: the same values."""
    if IS_INTERPRET:
        q = q8.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        r = ratio
    else:
        q = q8.to(tl.float8e4nv, bitcast=True).to(tl.float16)  # SM90: cvt.rn.f16x2.e4m3x2, a pair each
        r = ratio.to(tl.float16)
    q3 = tl.reshape(q, (q.shape[0], TILES, TILE)) * r[:, :, None]
    return tl.reshape(q3, (q.shape[0], TILES * TILE)).to(tl.float16)


@triton.jit
def load_fp8_latent_half(kv_row, n_valid, ratio, TILE: tl.constexpr, TILES: tl.constexpr):
    """fp8_to_half of the whole latent of the FP8 rows at kv_row (BLOCK_N,) (0 in rows not n_valid)."""
    q8 = tl.load(kv_row[:, None] + tl.arange(0, TILES * TILE)[None, :], mask=n_valid[:, None], other=0)
    return fp8_to_half(q8, ratio, TILE, TILES)


@triton.jit
def half_queries(q):
    """(BLOCK_M, K) query rows (bfloat16 / float16) -> (the rows in float16, each times a power of
    two that brings its largest |value| into [2^14, 2^15); (BLOCK_M,) float32 the inverse powers).
    Exact for every value above 2^-28 of its row's largest (bfloat16's 8 significant bits fit
    float16's 11); an all-zero row keeps zeros."""
    amax = tl.max(tl.abs(q.to(tl.float32)), axis=1)
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent: amax in [2^(e-127), 2^(e-126))
    fe = tl.minimum(tl.maximum(268 - e, 1), 253)  # 2^(fe - 127) = 2^(14 - (e - 127))
    f = (fe << 23).to(tl.float32, bitcast=True)
    inv = ((254 - fe) << 23).to(tl.float32, bitcast=True)
    return (q.to(tl.float32) * f[:, None]).to(tl.float16), inv


@triton.jit
def _half_queries_kernel(
    q_ptr, out_ptr, inv_ptr, R, H, C, stride_qt, stride_qh,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Rows [r0, r0 + BLOCK_R) of the (token, head) rows r = t * H + h: half_queries of q[t, h, :C]
    into out (R, BLOCK_C) (zeros past C) and inv (R,)."""
    launch_dependents(PDL)
    wait_for_previous(PDL)  # q comes from the previous kernel
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < R
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    src = q_ptr + (rows64 // H) * stride_qt + (rows64 % H) * stride_qh
    q = tl.load(src[:, None] + cols[None, :], mask=ok[:, None] & (cols[None, :] < C), other=0.0)
    qh, inv = half_queries(q)
    tl.store(out_ptr + rows64[:, None] * BLOCK_C + cols[None, :], qh, mask=ok[:, None])
    tl.store(inv_ptr + rows64, inv, mask=ok)


def half_query_rows(q: torch.Tensor, latent_dim: int, pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q (T, H, >= C) bfloat16 / float16 (row stride 1) -> its latent columns as half_queries
    keeps them, (T*H, next_pow2(C)) float16 (zeros past C), and their inverse powers (T*H,)
    float32: the float16 read's queries, one launch."""
    t, h = q.shape[:2]
    width = next_pow2(latent_dim)
    out = torch.empty((t * h, width), dtype=torch.float16, device=q.device)
    inv = torch.empty((t * h,), dtype=torch.float32, device=q.device)
    if t * h:
        rows = max(1, min(16, 8192 // width))
        _half_queries_kernel[(triton.cdiv(t * h, rows),)](
            q, out, inv, t * h, h, latent_dim, q.stride(0), q.stride(1),
            BLOCK_R=rows, BLOCK_C=width, PDL=pdl, num_warps=4, launch_pdl=pdl,
        )  # fmt: skip
    return out, inv


@triton.jit
def load_fp8_rope(kv_row, n_valid, cols, D_LAT, D_ROPE, TILE: tl.constexpr, dtype: tl.constexpr):
    """(BLOCK_N, len(cols)) rope columns (bfloat16 in the row, after the scales) in `dtype`."""
    rope = (kv_row + D_LAT + 4 * (D_LAT // TILE)).to(tl.pointer_type(tl.bfloat16))
    m = n_valid[:, None] & (cols[None, :] < D_ROPE)
    return tl.load(rope[:, None] + cols[None, :], mask=m, other=0.0).to(dtype)
