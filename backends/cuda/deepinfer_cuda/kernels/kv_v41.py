# mypy: disable-error-code="no-untyped-def,untyped-decorator,no-untyped-call"
# (Triton kernels take untyped tensor-like arguments by design; the launchers are typed.)
"""DeepSeek-V4.1's KV rows (deepinfer.backend.kv_formats_v41) quantised in registers: the fused
quantise + store of each row format (write_kv_rows: one launch, no torch quantiser, no host
sync), and the MXFP4 rounding of the FP4 indexer's queries (kernels/v4.py's score kernels).

Bit for bit the reference quantisers: a power-of-two scale (fp8, mxfp4) is the smallest one >=
amax / top, read from the float32 bits of the IEEE quotient (div_rn: `/` is approximate on the
GPU) with its inverse written into the exponent bits (exact); an fp4 row's e4m3 scale is amax / 6
(IEEE) rounded to e4m3, and its values are divided by it in IEEE arithmetic; e2m1 values round
to the nearest magnitude, ties to the even code, and e4m3 ones through common.to_e4m3.

Row layouts (W values): fp8 [W e4m3 | W/32 UE8M0]; fp4 [W/2 e2m1 pairs, the even index in the
low nibble | W/16 e4m3]; mxfp4 [W/2 pairs | W/32 UE8M0]. A program stores one row: its values
as (groups, group size) tiles, the e2m1 formats as an even and an odd tile, so that a pair's two
codes meet in one byte without a shuffle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.backend import fp4
from deepinfer.backend.kv_formats_v41 import E4M3_MAX, RowFormat, row_bytes
from deepinfer_cuda.kernels.common import to_e4m3

# The kernels write the formats' constants as literals (Triton reads no non-constexpr globals):
# the fp8 and mxfp4 scales' floors are 2^-126 times the format's top (448, 6), as the reference
# clamps amax (the quotients stay normal float32).
assert (E4M3_MAX, fp4.E2M1_MAX) == (448.0, 6.0)
FP8_AMAX_MIN = 2.0**-126 * 448.0
MXFP4_AMAX_MIN = 2.0**-126 * 6.0
assert (FP8_AMAX_MIN, MXFP4_AMAX_MIN) == (5.266214691683848e-36, 7.052966104933725e-38)


@triton.jit
def pow2_scale(amax, top: tl.constexpr):
    """amax (float32, >= 2^-126 top) -> (the smallest power of two >= amax / top, its inverse
    (exact), its UE8M0 byte (the exponent field) as int32)."""
    bits = tl.math.div_rn(amax, top).to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF
    e = tl.where((bits & 0x7FFFFF) != 0, e + 1, e)
    return (e << 23).to(tl.float32, bitcast=True), ((254 - e) << 23).to(tl.float32, bitcast=True), e


@triton.jit
def e2m1_nearest(a):
    """Magnitudes a >= 0 (at most 6, or an ulp past it) -> the nearest e2m1 magnitude (0, 0.5, 1,
    1.5, 2, 3, 4, 6), ties to the even code: the multiples of 0.5 below 2, of 1 below 4, of 2
    from 4 on, rounded half to even (a times the step's inverse is exact)."""
    step = tl.where(a < 2.0, 0.5, tl.where(a < 4.0, 1.0, 2.0))
    y = a * tl.where(a < 2.0, 2.0, tl.where(a < 4.0, 1.0, 0.5))
    f = tl.floor(y)
    d = y - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    r = tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)
    return tl.minimum(r * step, 6.0)


@triton.jit
def e2m1_code(y):
    """float32 y (|y| <= 6, scaled) -> its 4-bit e2m1 code (int32): the nearest magnitude's code
    (0, 0.5, 1, 1.5 -> 0..3; 2, 3 -> 4, 5; 4, 6 -> 6, 7), sign in bit 3 (never on a zero)."""
    m = e2m1_nearest(tl.abs(y))
    code = tl.where(m < 2.0, 2.0 * m, tl.where(m < 4.0, m + 2.0, 0.5 * m + 4.0)).to(tl.int32)
    return tl.where((y < 0) & (code > 0), code | 8, code)


@triton.jit
def round_mxfp4(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """x (ROWS, COLS) float32 -> each run of 32 values of a row rounded to MXFP4 (the value the
    mxfp4 row stores), float32, exact: kv_formats_v41.round_index_queries in registers."""
    g = tl.reshape(x, (ROWS, COLS // 32, 32))
    amax = tl.maximum(tl.max(tl.abs(g), axis=2), 7.052966104933725e-38)
    scale, inv, _ = pow2_scale(amax, 6.0)
    m = e2m1_nearest(tl.abs(g) * inv[:, :, None]) * scale[:, :, None]
    return tl.reshape(tl.where(g < 0, -m, m), (ROWS, COLS))


@triton.jit
def _row_slot(slot_ptr, stride_slot, stride_c, cache_ptr):
    """This program's row t, its slot (< 0: no store) and the slot's row of bytes in the cache."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t * stride_slot).to(tl.int64)
    return t, slot, cache_ptr + slot * stride_c


@triton.jit
def _write_fp8_rows_kernel(
    x_ptr, cache_ptr, slot_ptr, stride_x, stride_slot, stride_c, W, BLOCK_G: tl.constexpr
):  # fmt: skip
    """Row t -> [W e4m3 | W/32 UE8M0] at slot_ptr[t] (-1: none); BLOCK_G >= W / 32 groups."""
    t, slot, dst = _row_slot(slot_ptr, stride_slot, stride_c, cache_ptr)
    if slot < 0:
        return
    g = tl.arange(0, BLOCK_G)
    cols = g[:, None] * 32 + tl.arange(0, 32)[None, :]
    ok = cols < W
    x = tl.load(x_ptr + t * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 5.266214691683848e-36)
    _, inv, e = pow2_scale(amax, 448.0)
    y = tl.minimum(tl.maximum(x * inv[:, None], -448.0), 448.0)
    # the sign bit set again: a negative value (or -0) rounding to zero keeps it, as torch's cast
    # (the interpreter's cast drops it)
    sign = ((y.to(tl.uint32, bitcast=True) >> 31) << 7).to(tl.uint8)
    tl.store(dst + cols, to_e4m3(y).to(tl.uint8, bitcast=True) | sign, mask=ok)
    tl.store(dst + W + g, e.to(tl.uint8), mask=g < W // 32)


@triton.jit
def _even_odd(x_ptr, t, stride_x, W, BLOCK_G: tl.constexpr, G: tl.constexpr):
    """Row t's values in groups of G: (even, odd) (BLOCK_G, G/2) float32 tiles (values 2j and
    2j + 1 of each group), the byte offset of each pair in the row, and the mask of real pairs."""
    g = tl.arange(0, BLOCK_G)
    pair = g[:, None] * (G // 2) + tl.arange(0, G // 2)[None, :]
    ok = 2 * pair < W
    src = x_ptr + t * stride_x + 2 * pair
    even = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    odd = tl.load(src + 1, mask=ok, other=0.0).to(tl.float32)
    return even, odd, pair, ok


@triton.jit
def _write_fp4_rows_kernel(
    x_ptr, cache_ptr, slot_ptr, stride_x, stride_slot, stride_c, W, BLOCK_G: tl.constexpr
):  # fmt: skip
    """Row t -> [W/2 e2m1 pairs | W/16 e4m3 scales] at slot_ptr[t] (-1: none); BLOCK_G >= W / 16.
    A block's scale is amax / 6 rounded to e4m3; its values, divided by it, clip at +-6 (a zero
    scale stores zeros)."""
    t, slot, dst = _row_slot(slot_ptr, stride_slot, stride_c, cache_ptr)
    if slot < 0:
        return
    even, odd, pair, ok = _even_odd(x_ptr, t, stride_x, W, BLOCK_G, 16)
    amax = tl.maximum(tl.max(tl.abs(even), axis=1), tl.max(tl.abs(odd), axis=1))
    s8 = to_e4m3(tl.math.div_rn(amax, 6.0))
    s = s8.to(tl.float32)[:, None]
    safe = tl.where(s > 0, s, 1.0)
    ye = tl.where(s > 0, tl.minimum(tl.maximum(tl.math.div_rn(even, safe), -6.0), 6.0), 0.0)
    yo = tl.where(s > 0, tl.minimum(tl.maximum(tl.math.div_rn(odd, safe), -6.0), 6.0), 0.0)
    tl.store(dst + pair, (e2m1_code(ye) | (e2m1_code(yo) << 4)).to(tl.uint8), mask=ok)
    g = tl.arange(0, BLOCK_G)
    tl.store(dst + W // 2 + g, s8.to(tl.uint8, bitcast=True), mask=g < W // 16)


@triton.jit
def _write_mxfp4_rows_kernel(
    x_ptr, cache_ptr, slot_ptr, stride_x, stride_slot, stride_c, W, BLOCK_G: tl.constexpr
):  # fmt: skip
    """Row t -> [W/2 e2m1 pairs | W/32 UE8M0] at slot_ptr[t] (-1: none); BLOCK_G >= W / 32.
    Nothing clips: the scale maps amax within 6."""
    t, slot, dst = _row_slot(slot_ptr, stride_slot, stride_c, cache_ptr)
    if slot < 0:
        return
    even, odd, pair, ok = _even_odd(x_ptr, t, stride_x, W, BLOCK_G, 32)
    amax = tl.maximum(tl.max(tl.abs(even), axis=1), tl.max(tl.abs(odd), axis=1))
    _, inv, e = pow2_scale(tl.maximum(amax, 7.052966104933725e-38), 6.0)
    codes = e2m1_code(even * inv[:, None]) | (e2m1_code(odd * inv[:, None]) << 4)
    tl.store(dst + pair, codes.to(tl.uint8), mask=ok)
    g = tl.arange(0, BLOCK_G)
    tl.store(dst + W // 2 + g, e.to(tl.uint8), mask=g < W // 32)


_KERNELS = {"fp8": (_write_fp8_rows_kernel, 32), "fp4": (_write_fp4_rows_kernel, 16),
            "mxfp4": (_write_mxfp4_rows_kernel, 32)}  # fmt: skip


def write_kv_rows(
    cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor, fmt: RowFormat
) -> None:
    """cache (NB, BS, row_bytes(fmt, W)) uint8 contiguous; rows (T, W) float (a strided view is
    fine); slot_mapping (T,) (slot = block * BS + offset, -1 skips a row) -> the bytes
    kv_formats_v41.quantize_rows(rows, fmt) gives, stored in place. One launch, no host sync."""
    if fmt not in _KERNELS:
        raise ValueError(f"write_kv_rows: unknown V4.1 row format {fmt!r}; known: {list(_KERNELS)}")
    t, w = rows.shape
    width = row_bytes(fmt, w)  # ValueError unless W holds whole scale blocks
    if cache.dtype != torch.uint8 or cache.dim() != 3 or cache.shape[-1] != width:
        raise ValueError(
            f"write_kv_rows: {fmt} rows of {w} values take {width} bytes; the cache is {cache.dtype} "
            f"{tuple(cache.shape)}"
        )
    if not cache.is_contiguous():
        raise ValueError("write_kv_rows: the cache tensor must be contiguous")
    if slot_mapping.shape != (t,):
        raise ValueError(f"write_kv_rows: slot_mapping must be ({t},), got {tuple(slot_mapping.shape)}")
    if t == 0:
        return
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    kernel, group = _KERNELS[fmt]
    kernel[(t,)](
        rows, cache, slot_mapping, rows.stride(0), slot_mapping.stride(0), cache.stride(1), w,
        BLOCK_G=max(2, triton.next_power_of_2(w // group)), num_warps=2 if w >= 256 else 1,
    )  # fmt: skip
