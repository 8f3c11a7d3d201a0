# mypy: disable-error-code="no-untyped-def,untyped-decorator,no-untyped-call"
# (Triton kernels take untyped tensor-like arguments by design; the launchers are typed.)
"""Paged latent attention (MLA absorbed form) for decode and ragged chunked prefill.

One kernel serves both. A program owns BLOCK_M "rows" of one request, where a row is a
(query token, head) pair, token-major: in decode a tile is BLOCK_M heads of one token; in
prefill with few heads it holds several tokens. All heads share the single latent KV head, so
one K tile loaded from the paged cache feeds every row of the program:

    S = Q_lat @ K_lat^T + Q_rope @ K_rope^T        (BLOCK_M, BLOCK_N), float32
    O += softmax_online(S) @ K[:, :Dv]             V is a prefix of K: the loaded tile is reused

Split-KV: each split writes a normalised partial output and its log-sum-exp, and a combine
kernel merges them in split order. The launch fixes the number of splits (grid axis 2, from the
host lengths, which may be upper bounds in a replayed graph); where the KV axis is cut depends on
the mode:
  * adaptive (the default): a program cuts ITS OWN key range, read from the device lengths, into
    that many parts of whole BLOCK_N tiles (at least min_split_tiles each). A graph captured with
    max_model_len as the host length still spreads a short row over several programs; splits
    past the end of the range store an empty partial (log-sum-exp -inf) and exit.
  * fixed: ABSOLUTE positions s * split_size (batch-invariant mode, or an explicit split_size).
    A row's bits then depend only on its own length, which is what batch-invariant mode needs.
KV tiles are aligned to BLOCK_N multiples of absolute position in both, so fully-masked tiles
(another row's range) leave a row's accumulators unchanged.

Masks: causal (key j <= the row's position), sliding window (position - j < window), top-k (a
(T, L) byte mask built from the index lists, i.e. top-k is applied by masking: the kernel still
walks the causal/window range densely). Sinks add exp(sink) to the softmax denominator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer.backend.kv_formats_mla import fp8_row_bytes
from deepinfer.backend.kv_formats_mla import fp8_tile as fp8_tile_of
from deepinfer.backend.types import AttentionMetadata
from deepinfer_cuda.kernels.common import (
    is_sm90,
    launch_dependents,
    mma,
    next_pow2,
    num_sms,
    pdl_enabled,
    tma_supported,
    wait_for_previous,
)
from deepinfer_cuda.kernels.kv_fp8 import (
    fp8_row_scales,
    fp8_to_half,
    half_query_rows,
    load_fp8_latent,
    load_fp8_latent_half,
    load_fp8_rope,
    pow2_floor,
)

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class AttentionConfig:
    """Tile sizes of the attention kernel. BLOCK_N must divide every split size used."""

    block_m: int = 64
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2
    tma: bool = True  # whole-page tiles by TMA where the cache layout allows (see mla_attention)


# Many rows per tile (>= 64 heads x tokens): the best of eight tilings on an H200 (H=128 decode).
WIDE_CONFIG = AttentionConfig(block_m=64, block_n=64, num_warps=8, num_stages=2)
# FP8 latent rows with many rows per tile: 32-key tiles. The rows come by pointer loads (no TMA)
# and are dequantised in registers, so a tile's keys are held twice (bytes, then q's dtype);
# WIDE_CONFIG's 64-key tiles with a scale load per value needed 319488 bytes of shared memory on
# an H200 (over the SM90 limit of 232448); these need at most 196608 (tests/test_cuda_compile.py).
FP8_WIDE_CONFIG = AttentionConfig(block_m=64, block_n=32, num_warps=8, num_stages=2, tma=False)
# FP8 latent rows with fewer rows a request (16 or 32 heads): the tiles, block_m raised to the
# rows' next power of two where it is smaller (bench/bench_cuda.py --only decode_fp8 sweeps them).
FP8_NARROW_CONFIG = AttentionConfig(block_m=16, block_n=32, num_warps=4, num_stages=2, tma=False)
# float32 operands (IEEE products on the CUDA cores) take twice the shared memory: small tiles
# (WIDE_CONFIG would need 295 KB of shared memory there, over the SM90 limit of 227 KB).
FP32_CONFIG = AttentionConfig(block_m=16, block_n=32, num_warps=4, num_stages=2)
# Batch-invariant mode: one fixed configuration (per dtype) and split size for every batch.
INVARIANT_SPLIT = 1024
# 32-key tiles (a row's order of sums), as the default takes at decode sizes: with 64-key tiles
# a batch-32 V2-Lite decode step's attention took twice the default's on an H200 (0.60 ms
# against 0.30) for the same splits. Eight warps hold a 64-row tile's (64, 512) accumulator.
INVARIANT_CONFIG = AttentionConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)
# Rows merged side by side per program of the combine kernel in batch-invariant mode (every
# launch of that mode: a row's bits do not depend on its lane). A prefill's many rows at one row
# per program took 21 ms of a 108 ms batch-32 V2-Lite prefill on an H200 (latency-bound rows).
INVARIANT_COMBINE_ROWS = 4
# Given the longest sequence the engine runs: splits of max_model_len / INVARIANT_SPLITS keys
# (a power of two from INVARIANT_MIN_SPLIT to INVARIANT_SPLIT), so that short sequences still
# spread a decode row over several programs (one program walking a request's 192 keys took
# 34 us a layer at batch 32 on an H200) while a prefill's partials stay within 16 per row.
INVARIANT_SPLITS = 16
INVARIANT_MIN_SPLIT = 64


def invariant_split(max_model_len: int | None) -> int:
    """The batch-invariant split size (keys at absolute positions) for an engine whose sequences
    never exceed max_model_len (None: INVARIANT_SPLIT). A multiple of every config's block_n."""
    if max_model_len is None:
        return INVARIANT_SPLIT
    want = next_pow2(triton.cdiv(max_model_len, INVARIANT_SPLITS))
    return min(INVARIANT_SPLIT, max(INVARIANT_MIN_SPLIT, want))


def _invariant_config(rows: int, device: torch.device) -> AttentionConfig:
    """Batch-invariant tiles: a row's bits depend on BLOCK_N and the split size (the order of its
    sums), not on how many query rows share a tile, where the MMA gives each row the same bits in
    any tile height: checked on SM90 for the GEMMs (bench/bench_invariant_tiles.py --bits) and by
    the conformance suite's batch-invariance cases. There, decode-sized launches (fewer than 64
    rows per request) take 16- or 32-row tiles; elsewhere INVARIANT_CONFIG serves every launch."""
    if not is_sm90(device) or rows >= 64:
        return INVARIANT_CONFIG
    return AttentionConfig(block_m=max(16, next_pow2(rows)), block_n=INVARIANT_CONFIG.block_n, num_warps=4)


# Below this many KV positions per split, splitting costs more than it gains once the grid
# fills at least half the SMs without splitting.
MIN_SPLIT = 512
# With fewer tiles than that (small-batch decode: one tile per request), splits go down to this
# many BLOCK_N tiles: at batch 1 a single program walking a 192-token span was 17 us on an H200.
FEW_TILES_MIN_SPLIT_TILES = 2
# Decode over a short span (at most SHORT_SPAN keys) of at most SHORT_SPAN_TILES requests (one tile
# of rows each): 16-key tiles and splits of one tile. H200, 16 heads, 160 keys in a graph
# captured with the bound 192: 8.5 us per call against 11.7 us with 32-key tiles in two-tile
# splits (bench/bench_cuda.py --only decode_short, bench/results/2026-12-01_H200_prefill_graphs).
SHORT_SPAN = 1024
SHORT_SPAN_TILES = 4
SHORT_SPAN_BLOCK_N = 16
# Splits merged per step of the combine kernel (one vector load of their log-sum-exps).
COMBINE_SPLITS = 16
# Output columns per combine program: the row's columns are merged by several programs.
COMBINE_COLS = 128


@triton.jit
def _attend_tile(
    n0, end, b, pos, lo_r, t_glob, row_valid, q_lat, q_rope, m_i, l_i, acc,
    kv_ptr, bt_ptr, allow_ptr, stride_kvb, stride_kvt, stride_bt, stride_allow,
    page_size, qk_scale, D_LAT, D_ROPE, DV,
    BLOCK_DL: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_ROPE: tl.constexpr, V_IS_LAT: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_ALLOW: tl.constexpr, IEEE: tl.constexpr, k_desc, kr_desc, TMA: tl.constexpr,
    FP8_TILE: tl.constexpr = 0, FP8_TILES: tl.constexpr = 0, ref=1.0, q_scale=None,
    FP8_HALF: tl.constexpr = False,
):  # fmt: skip
    """One KV tile [n0, n0 + BLOCK_N) of the online softmax; returns the updated (m, l, acc, ref).
    TMA: the tile lies inside one page and below the KV length (every row written), so it is two
    bulk copies (latent, rope) from the (blocks * page, D) view of the cache, with no masks.
    FP8_TILE > 0: the cache holds FP8 latent rows (kernels/kv_fp8.py) of that tile, dequantised
    here, in registers, to q's dtype (never TMA). FP8_HALF (V the whole latent of FP8_TILES
    tiles): the float16 read instead, q_lat from kv_fp8.half_queries and q_scale its inverse
    powers; ref (a power of two, 0 before the first tile) is the largest scale seen so far, acc
    is held in units of it (the caller multiplies it back), and rises here as the tiles need."""
    offs_dl = tl.arange(0, BLOCK_DL)
    offs_dr = tl.arange(0, BLOCK_DR)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_valid = offs_n < end
    if TMA and FP8_HALF:  # the latent bytes by TMA ((rows, parts, C / parts) view), the rest by pointers
        row0 = tl.load(bt_ptr + b * stride_bt + n0 // page_size) * page_size + n0 % page_size
        kv_row = kv_ptr + (row0 + tl.arange(0, BLOCK_N)).to(tl.int64) * stride_kvt
        scales = fp8_row_scales(kv_row, n_valid, D_LAT, FP8_TILES)  # (BLOCK_N, tiles)
        ref_old = ref
        ref, inv_ref = pow2_floor(tl.maximum(ref_old, tl.max(tl.max(scales, axis=1), axis=0)))
        q8 = tl.reshape(k_desc.load([row0, 0, 0]), (BLOCK_N, BLOCK_DL))
        k = fp8_to_half(q8, scales * inv_ref, FP8_TILE, FP8_TILES)
        kr = k
        if HAS_ROPE:
            kr = load_fp8_rope(kv_row, n_valid, offs_dr, D_LAT, D_ROPE, FP8_TILE, q_rope.dtype)
        m_i, l_i, acc = _attend_loaded(
            k, kr, n0, end, pos, lo_r, t_glob, row_valid, q_lat, q_rope, m_i, l_i, acc,
            allow_ptr, stride_allow, qk_scale, HAS_ROPE, BLOCK_N, HAS_ALLOW, IEEE, k, q_scale * ref,
            ref_old * inv_ref,
        )  # fmt: skip
        return m_i, l_i, acc, ref
    elif TMA:
        row0 = tl.load(bt_ptr + b * stride_bt + n0 // page_size) * page_size + n0 % page_size
        k = k_desc.load([row0, 0])
        kr = kr_desc.load([row0, D_LAT]) if HAS_ROPE else k
        if not V_IS_LAT:  # v, the latent's first DV columns, by pointers (below)
            kv_row = kv_ptr + (row0 + tl.arange(0, BLOCK_N)).to(tl.int64) * stride_kvt
    else:
        blk = tl.load(bt_ptr + b * stride_bt + offs_n // page_size, mask=n_valid, other=0)
        kv_row = kv_ptr + blk.to(tl.int64) * stride_kvb + (offs_n % page_size) * stride_kvt  # (BLOCK_N,)
        if FP8_HALF:
            scales = fp8_row_scales(kv_row, n_valid, D_LAT, FP8_TILES)  # (BLOCK_N, tiles)
            ref_old = ref
            ref, inv_ref = pow2_floor(tl.maximum(ref_old, tl.max(tl.max(scales, axis=1), axis=0)))
            k = load_fp8_latent_half(kv_row, n_valid, scales * inv_ref, FP8_TILE, FP8_TILES)
        elif FP8_TILE:
            k = load_fp8_latent(kv_row, n_valid, offs_dl, D_LAT, D_LAT, FP8_TILE, q_lat.dtype, FP8_TILES)
        else:
            k = tl.load(
                kv_row[:, None] + offs_dl[None, :],
                mask=n_valid[:, None] & (offs_dl[None, :] < D_LAT),
                other=0.0,
            )
        kr = k  # unused without a rope part
        if HAS_ROPE:
            if FP8_TILE:
                kr = load_fp8_rope(kv_row, n_valid, offs_dr, D_LAT, D_ROPE, FP8_TILE, q_rope.dtype)
            else:
                kr = tl.load(
                    kv_row[:, None] + D_LAT + offs_dr[None, :],
                    mask=n_valid[:, None] & (offs_dr[None, :] < D_ROPE),
                    other=0.0,
                )
    if FP8_HALF:  # the scores' latent part and the output in units of ref; acc rescaled as ref rose
        m_i, l_i, acc = _attend_loaded(
            k, kr, n0, end, pos, lo_r, t_glob, row_valid, q_lat, q_rope, m_i, l_i, acc,
            allow_ptr, stride_allow, qk_scale, HAS_ROPE, BLOCK_N, HAS_ALLOW, IEEE, k, q_scale * ref,
            ref_old * inv_ref,
        )  # fmt: skip
        return m_i, l_i, acc, ref
    if V_IS_LAT:
        v = k
    elif FP8_TILE:
        v = load_fp8_latent(kv_row, n_valid, offs_dv, DV, D_LAT, FP8_TILE, q_lat.dtype)
    else:
        v = tl.load(
            kv_row[:, None] + offs_dv[None, :], mask=n_valid[:, None] & (offs_dv[None, :] < DV), other=0.0
        )
    m_i, l_i, acc = _attend_loaded(
        k, kr, n0, end, pos, lo_r, t_glob, row_valid, q_lat, q_rope, m_i, l_i, acc,
        allow_ptr, stride_allow, qk_scale, HAS_ROPE, BLOCK_N, HAS_ALLOW, IEEE, v,
    )  # fmt: skip
    return m_i, l_i, acc, ref


@triton.jit
def _attend_loaded(
    k, kr, n0, end, pos, lo_r, t_glob, row_valid, q_lat, q_rope, m_i, l_i, acc,
    allow_ptr, stride_allow, qk_scale,
    HAS_ROPE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ALLOW: tl.constexpr, IEEE: tl.constexpr, v=None,
    lat_scale=None, acc_ratio=1.0,
):  # fmt: skip
    """_attend_tile's online-softmax step on a loaded tile: k (BLOCK_N, BLOCK_DL) latent keys,
    kr their rope part, v the values (None: the latent, k itself). lat_scale (BLOCK_M,): a factor
    of each row's latent scores (before the rope part joins them); acc_ratio: a factor of acc
    besides the softmax's (the FP8 float16 read's change of units)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_valid = offs_n < end
    s = mma(q_lat, tl.trans(k), tl.zeros([q_lat.shape[0], BLOCK_N], tl.float32), IEEE)
    if lat_scale is not None:
        s = s * lat_scale[:, None]
    if HAS_ROPE:
        s = mma(q_rope, tl.trans(kr), s, IEEE)
    s = s * qk_scale
    vis = (offs_n[None, :] <= pos[:, None]) & (offs_n[None, :] >= lo_r[:, None]) & n_valid[None, :]
    if HAS_ALLOW:
        allowed = tl.load(
            allow_ptr + t_glob[:, None] * stride_allow + offs_n[None, :],
            mask=row_valid[:, None] & n_valid[None, :],
            other=0,
        )
        vis = vis & (allowed != 0)
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if v is None:
        v = k
    acc = mma(p.to(v.dtype), v, acc * (alpha * acc_ratio)[:, None], IEEE)
    return m_new, l_i, acc


@triton.jit(
    do_not_specialize=[
        "H",
        "page_size",
        "window",
        "split_size",
        "min_split_tiles",
        "max_splits",
        "stride_allow",
    ]
)
def _mla_attention_kernel(
    q_ptr, kv_ptr, k_desc, kr_desc, bt_ptr, seq_lens_ptr, qsl_ptr, sinks_ptr, allow_ptr,
    out_ptr, part_ptr, lse_ptr, qh_ptr, qs_ptr,
    stride_qt, stride_qh, stride_kvb, stride_kvt, stride_bt, stride_ot, stride_oh, stride_allow,
    H, page_size, qk_scale, window, split_size, min_split_tiles, max_splits, D_LAT, D_ROPE, DV,
    BLOCK_DL: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_ROPE: tl.constexpr, V_IS_LAT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_ALLOW: tl.constexpr,
    DIRECT: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr,
    FP8_TILE: tl.constexpr, FP8_TILES: tl.constexpr, FP8_HALF: tl.constexpr = False,
):  # fmt: skip
    """FP8_TILE > 0: kv_ptr holds FP8 latent rows (uint8, kernels/kv_fp8.py; not TMA, not EARLY);
    FP8_TILES > 0: the latent is that many whole tiles (kv_fp8.load_fp8_latent's broadcast scales);
    FP8_HALF (FP8_TILES > 0, V the latent, bfloat16 / float16 q): kv_fp8's float16 read, the
    latent queries from qh_ptr (T*H, BLOCK_DL) float16, their inverse powers from qs_ptr (T*H,).
    EARLY (TMA, V_IS_LAT): the lengths, the block tables and every cache row before each
    request's new tokens were written before the forward's first kernel (mla_attention_partials,
    early_cache): the program reads them, and loads its first tile when no new row lies in it,
    before it waits for the previous kernel (the query kernel, which writes q and the new rows)."""
    launch_dependents(PDL)  # the combine (or W_UV's product) may start launching
    if not EARLY:
        wait_for_previous(PDL)  # q, the lengths and this step's cache rows come from earlier kernels
    pid_tile = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    kv_len = tl.load(seq_lens_ptr + b)
    if pid_tile * BLOCK_M >= q_len * H:
        return

    rows = pid_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) token-major (token, head) pairs
    row_valid = rows < q_len * H
    tok = rows // H
    head = rows % H
    pos = kv_len - q_len + tok  # absolute position of each row's query token
    t_glob = (q_start + tok).to(tl.int64)
    if HAS_WINDOW:
        lo_r = tl.maximum(pos - window + 1, 0)
    else:
        lo_r = tl.zeros_like(pos)
    lo = tl.min(tl.where(row_valid, lo_r, kv_len), axis=0)  # the program's key range [lo, hi)
    hi = tl.max(tl.where(row_valid, pos + 1, 0), axis=0)
    if split_size > 0:  # fixed: absolute positions [s * split_size, (s + 1) * split_size)
        start = tl.maximum(lo, split * split_size)
        end = tl.minimum(hi, split * split_size + split_size)
        start = (start // BLOCK_N) * BLOCK_N  # absolute tile alignment (split_size % BLOCK_N == 0)
    else:  # adaptive: the range's whole tiles in max_splits parts of >= min_split_tiles tiles
        base = (lo // BLOCK_N) * BLOCK_N
        n_tiles = (hi - base + BLOCK_N - 1) // BLOCK_N
        per = tl.maximum(min_split_tiles, (n_tiles + max_splits - 1) // max_splits) * BLOCK_N
        start = base + split * per
        end = tl.minimum(hi, start + per)
    if not DIRECT:  # noqa: SIM102 (nested: the compiler prunes the outer constexpr branch first)
        if start >= end:  # an empty split: nothing to attend, an empty partial
            if EARLY:
                wait_for_previous(PDL)  # nothing stored before it
            row_g = (t_glob * H + head) * max_splits + split
            tl.store(lse_ptr + row_g, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_valid)
            return
    if EARLY:  # the first tile, when whole and older than this step (every row: q_len new keys)
        first = start < tl.minimum(end, (kv_len // BLOCK_N) * BLOCK_N)
        first = first & (start + BLOCK_N <= kv_len - q_len)
        k_first = tl.zeros([BLOCK_N, BLOCK_DL], kv_ptr.dtype.element_ty)
        kr_first = tl.zeros([BLOCK_N, BLOCK_DR], kv_ptr.dtype.element_ty)
        if first:
            row0 = tl.load(bt_ptr + b * stride_bt + start // page_size) * page_size + start % page_size
            k_first = k_desc.load([row0, 0])
            if HAS_ROPE:
                kr_first = kr_desc.load([row0, D_LAT])
        wait_for_previous(PDL)

    offs_dl = tl.arange(0, BLOCK_DL)
    q_row = q_ptr + t_glob * stride_qt + head * stride_qh  # (BLOCK_M,) pointers
    q_scale = tl.full([BLOCK_M], 1.0, tl.float32)
    if FP8_HALF:  # the latent queries in float16 and their inverse powers (kv_fp8.half_query_rows)
        qh_row = t_glob * H + head
        qh = qh_ptr + qh_row[:, None] * BLOCK_DL + offs_dl[None, :]
        q_lat = tl.load(qh, mask=row_valid[:, None], other=0.0)
        q_scale = tl.load(qs_ptr + qh_row, mask=row_valid, other=1.0)
    else:
        q_lat = tl.load(
            q_row[:, None] + offs_dl[None, :], mask=row_valid[:, None] & (offs_dl[None, :] < D_LAT), other=0.0
        )
    offs_dr = tl.arange(0, BLOCK_DR)
    if HAS_ROPE:
        q_rope = tl.load(
            q_row[:, None] + D_LAT + offs_dr[None, :],
            mask=row_valid[:, None] & (offs_dr[None, :] < D_ROPE),
            other=0.0,
        )
    else:
        q_rope = q_lat
    ref = tl.zeros([], tl.float32)  # FP8_HALF: the largest scale seen (acc's unit); 0 before any
    offs_dv = tl.arange(0, BLOCK_DV)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    tail = start
    begin = start
    if EARLY:  # noqa: SIM102 (nested: the compiler prunes the outer constexpr branch first)
        if first:
            m_i, l_i, acc = _attend_loaded(
                k_first, kr_first, start, end, pos, lo_r, t_glob, row_valid, q_lat, q_rope, m_i, l_i, acc,
                allow_ptr, stride_allow, qk_scale, HAS_ROPE, BLOCK_N, HAS_ALLOW, IEEE,
            )  # fmt: skip
            begin = start + BLOCK_N
    if TMA:  # whole tiles below the KV length by TMA, then at most one partial tile with masks
        tail = tl.maximum(begin, tl.minimum(end, (kv_len // BLOCK_N) * BLOCK_N))
        for n0 in range(begin, tail, BLOCK_N):
            m_i, l_i, acc, ref = _attend_tile(
                n0, end, b, pos, lo_r, t_glob, row_valid, q_lat, q_rope, m_i, l_i, acc,
                kv_ptr, bt_ptr, allow_ptr, stride_kvb, stride_kvt, stride_bt, stride_allow,
                page_size, qk_scale, D_LAT, D_ROPE, DV, BLOCK_DL, BLOCK_DR, BLOCK_DV,
                HAS_ROPE, V_IS_LAT, BLOCK_N, HAS_ALLOW, IEEE, k_desc, kr_desc, True, FP8_TILE, FP8_TILES,
                ref, q_scale, FP8_HALF,
            )  # fmt: skip
    for n0 in range(tl.maximum(tail, begin), end, BLOCK_N):
        m_i, l_i, acc, ref = _attend_tile(
            n0, end, b, pos, lo_r, t_glob, row_valid, q_lat, q_rope, m_i, l_i, acc,
            kv_ptr, bt_ptr, allow_ptr, stride_kvb, stride_kvt, stride_bt, stride_allow,
            page_size, qk_scale, D_LAT, D_ROPE, DV, BLOCK_DL, BLOCK_DR, BLOCK_DV,
            HAS_ROPE, V_IS_LAT, BLOCK_N, HAS_ALLOW, IEEE, k_desc, kr_desc, False, FP8_TILE, FP8_TILES,
            ref, q_scale, FP8_HALF,
        )  # fmt: skip
    if FP8_HALF:
        acc = acc * ref  # from units of ref (exact: a power of two)

    dv_mask = row_valid[:, None] & (offs_dv[None, :] < DV)
    if DIRECT:
        denom = l_i
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0) * 1.4426950408889634
            denom += tl.exp2(sink - tl.where(m_i == float("-inf"), 0.0, m_i))
        o = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
        out_row = out_ptr + t_glob * stride_ot + head * stride_oh
        tl.store(out_row[:, None] + offs_dv[None, :], o.to(out_ptr.dtype.element_ty), mask=dv_mask)
    else:
        row_g = (t_glob * H + head) * max_splits + split  # (BLOCK_M,) int64
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + row_g, lse, mask=row_valid)
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(part_ptr + row_g[:, None] * BLOCK_DV + offs_dv[None, :], o, mask=dv_mask)


@triton.jit(do_not_specialize=["n_rows", "H", "max_splits"])
def _combine_kernel(
    part_ptr, lse_ptr, sinks_ptr, out_ptr,
    n_rows, H, max_splits, DV, stride_ot, stride_oh,
    HAS_SINKS: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
    ROWS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (r, c): columns [c * BLOCK_C, (c + 1) * BLOCK_C) of (token, head) rows
    [r * ROWS, (r + 1) * ROWS): one row (_combine_row), or ROWS rows side by side, each row's
    sums laid out alike in every lane (_combine_rows)."""
    launch_dependents(PDL)  # MLA's W_UV product (kernels/gemm.skinny_matmul) loads its weights
    wait_for_previous(PDL)
    if ROWS == 1:
        _combine_row(
            part_ptr, lse_ptr, sinks_ptr, out_ptr, tl.program_id(0).to(tl.int64), H, max_splits, DV,
            stride_ot, stride_oh, HAS_SINKS, BLOCK_DV, BLOCK_S, BLOCK_C,
        )  # fmt: skip
    else:
        _combine_rows(
            part_ptr, lse_ptr, sinks_ptr, out_ptr, n_rows, H, max_splits, DV, stride_ot, stride_oh,
            HAS_SINKS, BLOCK_DV, BLOCK_S, BLOCK_C, ROWS,
        )  # fmt: skip


@triton.jit
def _combine_rows(
    part_ptr, lse_ptr, sinks_ptr, out_ptr, n_rows, H, max_splits, DV, stride_ot, stride_oh,
    HAS_SINKS: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
    ROWS: tl.constexpr,
):  # fmt: skip
    """_combine_row's merge for ROWS rows at once, (ROWS, BLOCK_S, BLOCK_C) tiles."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    ok = rows < n_rows
    t = rows // H
    h = rows % H
    offs_s = tl.arange(0, BLOCK_S)
    lse_rows = lse_ptr + rows * max_splits  # (ROWS,)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    for s0 in range(0, max_splits, BLOCK_S):
        s = s0 + offs_s
        lse = tl.load(
            lse_rows[:, None] + s[None, :], mask=ok[:, None] & (s[None, :] < max_splits), other=float("-inf")
        )
        m = tl.maximum(m, tl.max(lse, axis=1))
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h, mask=ok, other=0.0) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    acc = tl.zeros([ROWS, BLOCK_C], tl.float32)
    den = tl.zeros([ROWS], tl.float32)
    for s0 in range(0, max_splits, BLOCK_S):
        s = s0 + offs_s
        lse = tl.load(
            lse_rows[:, None] + s[None, :], mask=ok[:, None] & (s[None, :] < max_splits), other=float("-inf")
        )  # (ROWS, BLOCK_S)
        full = lse > float("-inf")
        w = tl.where(full, tl.exp2(lse - m[:, None]), 0.0)
        slot = (rows[:, None] * max_splits + s[None, :]) * BLOCK_DV  # (ROWS, BLOCK_S)
        o = tl.load(
            part_ptr + slot[:, :, None] + offs_c[None, None, :],
            mask=full[:, :, None] & (offs_c[None, None, :] < BLOCK_DV),
            other=0.0,
        )  # (ROWS, BLOCK_S, BLOCK_C)
        acc += tl.sum(w[:, :, None] * o, axis=1)
        den += tl.sum(w, axis=1)
    if HAS_SINKS:
        den += tl.exp2(sink - m)
    out = acc / tl.where(den == 0.0, 1.0, den)[:, None]
    out_rows = out_ptr + t * stride_ot + h * stride_oh  # (ROWS,)
    tl.store(
        out_rows[:, None] + offs_c[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=ok[:, None] & (offs_c[None, :] < DV),
    )


@triton.jit
def _combine_row(
    part_ptr, lse_ptr, sinks_ptr, out_ptr, row, H, max_splits, DV, stride_ot, stride_oh,
    HAS_SINKS: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """One (token, head) row's columns [c * BLOCK_C, (c + 1) * BLOCK_C), c = program_id(1),
    merged over the splits BLOCK_S at a time in split order (a fixed reduction order: a split
    past a row's range adds exact zeros). Empty splits (log-sum-exp -inf) are never read: their
    partial may be unwritten memory."""
    t = row // H
    h = row % H
    offs_s = tl.arange(0, BLOCK_S)
    lse_row = lse_ptr + row * max_splits
    m = tl.full([], float("-inf"), tl.float32)
    for s0 in range(0, max_splits, BLOCK_S):
        lse = tl.load(lse_row + s0 + offs_s, mask=s0 + offs_s < max_splits, other=float("-inf"))
        m = tl.maximum(m, tl.max(lse, axis=0))
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    acc = tl.zeros([BLOCK_C], tl.float32)
    den = tl.zeros([], tl.float32)
    for s0 in range(0, max_splits, BLOCK_S):
        s = s0 + offs_s
        lse = tl.load(lse_row + s, mask=s < max_splits, other=float("-inf"))
        full = lse > float("-inf")
        w = tl.where(full, tl.exp2(lse - m), 0.0)  # (BLOCK_S,)
        o = tl.load(
            part_ptr + (row * max_splits + s)[:, None] * BLOCK_DV + offs_c[None, :],
            mask=full[:, None] & (offs_c[None, :] < BLOCK_DV),
            other=0.0,
        )  # (BLOCK_S, BLOCK_C)
        acc += tl.sum(w[:, None] * o, axis=0)
        den += tl.sum(w, axis=0)
    if HAS_SINKS:
        den += tl.exp2(sink - m)
    out = acc / tl.where(den == 0.0, 1.0, den)
    tl.store(
        out_ptr + t * stride_ot + h * stride_oh + offs_c, out.to(out_ptr.dtype.element_ty), mask=offs_c < DV
    )


def _allow_mask(topk_indices: torch.Tensor, num_tokens: int, max_seq_len: int) -> torch.Tensor:
    """(T, Kt) absolute positions (-1 unused) -> (T, L+1) int8 mask; column L absorbs invalid ids."""
    if topk_indices.shape[0] != num_tokens:
        raise ValueError(
            f"topk_indices has {topk_indices.shape[0]} rows; the step has {num_tokens} query tokens"
        )
    allow = torch.zeros((num_tokens, max_seq_len + 1), dtype=torch.int8, device=topk_indices.device)
    idx = topk_indices.long()
    idx = torch.where((idx >= 0) & (idx < max_seq_len), idx, max_seq_len)
    allow.scatter_(1, idx, 1)
    return allow


def _kv_descriptors(kv: torch.Tensor, latent_dim: int, cfg: AttentionConfig) -> tuple[object, object]:
    """TMA descriptors over the cache viewed as (blocks * page, D) rows: one for the latent
    columns, one for the rope columns; (None, None) where the layout does not allow it (widths not
    powers of two, pages not a multiple of block_n, rows not contiguous or 16-byte aligned)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    nb, page, d = kv.shape
    rope_dim = d - latent_dim
    row_bytes = kv.stride(1) * kv.element_size()
    if not (
        tma_supported(kv.device)
        and latent_dim == next_pow2(latent_dim)
        and rope_dim in (0, next_pow2(rope_dim))
        and page % cfg.block_n == 0
        and kv.stride(2) == 1
        and kv.stride(0) == page * kv.stride(1)
        and row_bytes % 16 == 0
        and kv.data_ptr() % 16 == 0
    ):
        return None, None
    shape, strides = [nb * page, d], [kv.stride(1), 1]
    k_desc = TensorDescriptor(kv, shape, strides, [cfg.block_n, latent_dim])
    kr_desc = TensorDescriptor(kv, shape, strides, [cfg.block_n, rope_dim]) if rope_dim else k_desc
    return k_desc, kr_desc


def _fp8_descriptor(kv: torch.Tensor, latent_dim: int, cfg: AttentionConfig) -> object:
    """A TMA descriptor over the latent bytes of FP8 rows (NB, BS, row bytes) uint8, viewed as
    (blocks * page, parts, C / parts) with parts of at most 256 bytes (TMA's box limit), tiles of
    (block_n, parts, C / parts); None where the layout does not allow it (as _kv_descriptors)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    nb, page, _ = kv.shape
    parts = max(1, latent_dim // 256)
    width = latent_dim // parts
    if not (
        tma_supported(kv.device)
        and width == next_pow2(width)
        and width * parts == latent_dim
        and page % cfg.block_n == 0
        and kv.stride(2) == 1
        and kv.stride(0) == page * kv.stride(1)
        and kv.stride(1) % 16 == 0
        and kv.data_ptr() % 16 == 0
    ):
        return None
    shape, strides = [nb * page, parts, width], [kv.stride(1), width, 1]
    return TensorDescriptor(kv, shape, strides, [cfg.block_n, parts, width])


# The float16 read loading the latent bytes of whole tiles by TMA (_fp8_descriptor; the scales and
# rope part by pointers); False: every byte by pointer loads. bench/bench_cuda.py --only
# decode_fp8 times both.
FP8_TMA = False


# FP8 latent rows whose width is a power of two: load each row's tile scales once and broadcast
# them (True), or load a scale per value (False); bench/bench_cuda.py --only decode_fp8 times both.
FP8_SCALE_TILES = True


# FP8 latent rows read in float16 (kv_fp8.fp8_to_half: one conversion a value pair) where the
# latent is whole power-of-two tiles, V is the latent and q is bfloat16 / float16; False: the
# bfloat16 read (e4m3 -> float16 -> float32 -> bfloat16, times the scale). Off until timed on a
# GPU: bench/bench_cuda.py --only decode_fp8 times both (its fp8_variants). The cuda backend turns
# it on with DEEPINFER_CUDA_FP8_HALF_READ=1 (its launches' fp8_half_read).
FP8_HALF_READ = False


# Programs per SM that _num_splits aims at over FP8 rows (2, as over bf16 rows, where TMA feeds
# each program): pointer loads of byte rows may want more programs in flight to hide their
# latency; bench/bench_cuda.py --only decode_fp8 times 4 at batch >= 32 (FP8_SPLIT_SWEEP).
FP8_PROGRAMS_PER_SM = 2


def _fp8_tiles(latent_dim: int, fp8_tile: int) -> int:
    """The kernel's FP8_TILES: tiles of the latent when they fill its power-of-two block, else 0."""
    if not (fp8_tile and FP8_SCALE_TILES and latent_dim == next_pow2(latent_dim)):
        return 0
    tiles = latent_dim // fp8_tile
    return tiles if tiles & (tiles - 1) == 0 else 0  # a power of two


def _fp8_half(fp8_tiles: int, dtype: torch.dtype, v_dim: int, latent_dim: int, wanted: bool = False) -> bool:
    """Whether the kernel reads FP8 rows in float16: wanted (the launch's fp8_half_read) or
    FP8_HALF_READ, and the rows and q allow it (FP8_HALF_READ's conditions)."""
    halves = dtype in (torch.bfloat16, torch.float16)
    return (wanted or FP8_HALF_READ) and fp8_tiles > 0 and v_dim == latent_dim and halves


def _num_splits(
    tiles: int,
    max_len: int,
    max_q: int,
    window: int | None,
    cfg: AttentionConfig,
    device: torch.device,
    few_tiles_min: int = FEW_TILES_MIN_SPLIT_TILES,
    per_sm: int = 2,
) -> int:
    """KV splits per tile of rows for `tiles` tiles over spans of up to `max_len` keys: about two
    programs per SM, rounded DOWN (programs just past a full wave each walk a whole split after
    the wave ends: H200 run 8, 16 heads x 32768 keys: batch 32 in 288 programs took 0.64 ms, 5.5x
    batch 8 in 264 programs for 4x the data), splits of at least MIN_SPLIT keys, or of
    `few_tiles_min` tiles when the tiles fill fewer than half the SMs. per_sm: programs per SM
    wanted (FP8_PROGRAMS_PER_SM over FP8 rows)."""
    sms = num_sms(device)
    span = max_len if window is None else min(max_len, window + max_q)
    want = max(1, per_sm * sms // tiles)
    min_split = MIN_SPLIT if 2 * tiles >= sms else few_tiles_min * cfg.block_n
    return max(1, min(want, span // min_split))


def launch_config(
    dtype: torch.dtype,
    rows: int,
    max_q: int,
    batch: int,
    span: int,
    batch_invariant: bool,
    fp8: bool,
    device: torch.device,
    config: AttentionConfig | None = None,
) -> tuple[AttentionConfig, int]:
    """mla_attention's tiles (config, where given, wins) and its few-tiles split minimum for `rows`
    (token, head) rows a request, `max_q` query tokens, `batch` requests over `span` keys; fp8: the
    cache holds FP8 latent rows (tests/test_cuda_compile.py lowers every choice for SM90)."""
    fp32 = dtype == torch.float32
    if batch_invariant:
        return config or (FP32_CONFIG if fp32 else _invariant_config(rows, device)), FEW_TILES_MIN_SPLIT_TILES
    short = config is None and not fp32 and max_q == 1 and rows < 64
    if short and batch <= SHORT_SPAN_TILES and span <= SHORT_SPAN:  # one tile of rows per request
        return AttentionConfig(block_m=next_pow2(rows), block_n=SHORT_SPAN_BLOCK_N), 1
    wide = FP8_WIDE_CONFIG if fp8 else WIDE_CONFIG
    narrow = AttentionConfig(block_m=next_pow2(rows))
    if fp8:
        n = FP8_NARROW_CONFIG
        block_m = max(n.block_m, next_pow2(rows))
        narrow = AttentionConfig(block_m, n.block_n, n.num_warps, n.num_stages, tma=False)
    default = FP32_CONFIG if fp32 else wide if rows >= 64 else narrow
    return config or default, FEW_TILES_MIN_SPLIT_TILES


@dataclass(frozen=True)
class SplitPartials:
    """mla_attention's split-KV partials before their merge: part (T*H*splits, next_pow2(v_dim))
    float32 normalised partial outputs and lse (T*H*splits,) their log2-sum-exps (-inf: an empty
    split, whose partial may be unwritten memory), row (t*H + h)*splits + split."""

    part: torch.Tensor
    lse: torch.Tensor
    splits: int


def mla_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    v_dim: int,
    latent_dim: int,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    topk_indices: torch.Tensor | None = None,
    batch_invariant: bool = False,
    config: AttentionConfig | None = None,
    split_size: int | None = None,
    pdl: bool = True,
    fp8_tile: int = 0,
    fp8_half_read: bool = False,
) -> torch.Tensor:
    """Ragged paged attention. q (T, H, D), kv (NB, BS, D) -> (T, H, v_dim) in q's dtype.
    fp8_tile > 0: kv (NB, BS, row bytes) uint8 holds FP8 latent rows with that tile
    (deepinfer.backend.kv_formats_mla), dequantised in the kernel's registers (fp8_half_read, or
    the module's FP8_HALF_READ: read in float16 where the rows allow it, kernels/kv_fp8.py).

    split_size: tokens per KV split at absolute positions (a multiple of the config's block_n);
    None: batch-invariant mode uses the fixed INVARIANT_SPLIT, otherwise the number of splits is
    picked here and each program cuts its own range (adaptive splits, module docstring). The
    launch grid comes from the host lengths in `meta` (max query and KV length): a CUDA graph
    captured with this op replays that grid, so capture with metadata whose maxima cover every
    step replayed. pdl: launch with PDL where the device has it (common.pdl_enabled)."""
    out = mla_attention_partials(
        q, kv, meta, scale=scale, v_dim=v_dim, latent_dim=latent_dim, window=window, sinks=sinks,
        topk_indices=topk_indices, batch_invariant=batch_invariant, config=config, split_size=split_size,
        pdl=pdl, fp8_tile=fp8_tile, fp8_half_read=fp8_half_read,
    )  # fmt: skip
    if isinstance(out, torch.Tensor):
        return out
    merged = torch.empty((q.shape[0], q.shape[1], v_dim), dtype=q.dtype, device=q.device)
    rows = INVARIANT_COMBINE_ROWS if batch_invariant else 1
    combine_splits(out.part, out.lse, sinks, merged, q.shape[1], out.splits, v_dim, rows, pdl)
    return merged


def mla_attention_partials(
    q: torch.Tensor,
    kv: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    v_dim: int,
    latent_dim: int,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    topk_indices: torch.Tensor | None = None,
    batch_invariant: bool = False,
    config: AttentionConfig | None = None,
    split_size: int | None = None,
    early_cache: bool = False,
    pdl: bool = True,
    fp8_tile: int = 0,
    fp8_half_read: bool = False,
) -> torch.Tensor | SplitPartials:
    """mla_attention without the merge of its splits: the output (T, H, v_dim) where one split
    serves every row (the kernel writes it), else the SplitPartials for combine_splits (or for a
    consumer that merges them as it reads them: gemm.skinny_merge_matmul). Sinks join the merge
    (combine_splits takes them).

    early_cache: the caller promises that meta's tensors (lengths, block tables) and each
    request's cache rows before its query tokens were written before the forward's first kernel
    (a model's decode step: the engine's step inputs, rows of earlier steps). Under programmatic
    dependent launch each program then loads them, and its first KV tile, while the previous
    kernel (the one writing q and the new rows) still runs (TMA tiles with V the latent)."""
    t, h, d = q.shape
    if fp8_tile:
        row = fp8_row_bytes(latent_dim, d - latent_dim)
        if kv.dtype != torch.uint8 or kv.shape[-1] != row or fp8_tile != fp8_tile_of(latent_dim):
            raise ValueError(
                f"q has width {d} ({latent_dim} latent): its FP8 rows take {row} bytes in tiles of "
                f"{fp8_tile_of(latent_dim)}; the cache holds {kv.dtype} rows of {kv.shape[-1]}"
            )
    elif kv.shape[-1] != d:
        raise ValueError(f"q has width {d} but the cache holds rows of width {kv.shape[-1]}")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    for b, (kv_len, n) in enumerate(zip(meta.seq_lens_host, meta.query_lens_host)):
        if n > kv_len:
            raise ValueError(f"request {b}: query length {n} exceeds its KV length {kv_len}")
    if sum(meta.query_lens_host) != t:
        raise ValueError(
            f"q has {t} rows but the metadata describes {sum(meta.query_lens_host)} query tokens"
        )
    if t == 0 or h == 0 or v_dim == 0:
        return torch.zeros((t, h, v_dim), dtype=q.dtype, device=q.device)
    q = q if q.stride(-1) == 1 else q.contiguous()
    batch = meta.num_requests
    max_q = max(meta.query_lens_host)
    max_len = max(meta.seq_lens_host)
    rope_dim = d - latent_dim

    span = max_len if window is None else min(max_len, window + max_q)
    cfg, few_tiles_min = launch_config(
        q.dtype, max_q * h, max_q, batch, span, batch_invariant, bool(fp8_tile), q.device, config
    )
    split = split_size or (INVARIANT_SPLIT if batch_invariant else 0)
    if split % cfg.block_n:
        raise ValueError(f"split_size {split} must be a multiple of block_n {cfg.block_n}")
    if split:
        max_splits = triton.cdiv(max_len, split)
    else:
        tiles = batch * triton.cdiv(max_q * h, cfg.block_m)
        per_sm = FP8_PROGRAMS_PER_SM if fp8_tile else 2
        max_splits = _num_splits(tiles, max_len, max_q, window, cfg, q.device, few_tiles_min, per_sm)
    direct = max_splits == 1 and not batch_invariant
    if direct:
        split = 0  # one adaptive split covers any length (a replayed graph may see longer rows)

    allow = _allow_mask(topk_indices, t, max_len) if topk_indices is not None else None
    fp8_tiles = _fp8_tiles(latent_dim, fp8_tile)
    fp8_half = _fp8_half(fp8_tiles, q.dtype, v_dim, latent_dim, fp8_half_read)
    qh, qs = half_query_rows(q, latent_dim, pdl_enabled(q.device, pdl)) if fp8_half else (q, q)
    if fp8_half and FP8_TMA:
        k_desc, kr_desc = _fp8_descriptor(kv, latent_dim, cfg), None
    else:
        k_desc, kr_desc = _kv_descriptors(kv, latent_dim, cfg) if cfg.tma and not fp8_tile else (None, None)
    block_dv = next_pow2(v_dim)
    if direct:
        out = torch.empty((t, h, v_dim), dtype=q.dtype, device=q.device)
        part = lse = out  # unused
    else:
        out = q  # unused: the partials are the result
        part = torch.empty((t * h * max_splits, block_dv), dtype=torch.float32, device=q.device)
        lse = torch.empty((t * h * max_splits,), dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(max_q * h, cfg.block_m), batch, max_splits)
    pdl = pdl_enabled(q.device, pdl)
    _mla_attention_kernel[grid](
        q, kv, k_desc, kr_desc, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        sinks if sinks is not None else q, allow if allow is not None else q,
        out, part, lse, qh, qs,
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), meta.block_tables.stride(0),
        out.stride(0), out.stride(1), allow.stride(0) if allow is not None else 0,
        h, kv.shape[1], scale * LOG2E, window or 0, split, few_tiles_min, max_splits,
        latent_dim, rope_dim, v_dim,
        BLOCK_DL=next_pow2(latent_dim), BLOCK_DR=next_pow2(rope_dim), BLOCK_DV=block_dv,
        HAS_ROPE=rope_dim > 0, V_IS_LAT=v_dim == latent_dim,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None, HAS_ALLOW=allow is not None,
        DIRECT=direct, IEEE=q.dtype == torch.float32, TMA=k_desc is not None,
        EARLY=early_cache and k_desc is not None and v_dim == latent_dim and not fp8_tile, PDL=pdl,
        FP8_TILE=fp8_tile,
        FP8_TILES=fp8_tiles, FP8_HALF=fp8_half,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl,
    )  # fmt: skip
    return out if direct else SplitPartials(part, lse, max_splits)


def combine_splits(
    part: torch.Tensor,
    lse: torch.Tensor,
    sinks: torch.Tensor | None,
    out: torch.Tensor,
    h: int,
    max_splits: int,
    v_dim: int,
    rows_per_program: int = 1,
    pdl: bool = True,
) -> None:
    """Merge split-KV partials into out (T, H, >= v_dim): part (T*H*max_splits, next_pow2(v_dim))
    normalised partial outputs and lse (T*H*max_splits,) their log2-sum-exps (-inf: empty), row
    (t*H + h)*max_splits + split; sinks (H,) float32 join each head's denominator.
    rows_per_program > 1: rows merged side by side (batch-invariant mode: always the same number,
    as a row's bits may depend on it, not on its lane)."""
    block_dv = part.shape[1]
    cols = min(COMBINE_COLS, block_dv)
    n_rows = out.shape[0] * h
    pdl = pdl_enabled(out.device, pdl)
    _combine_kernel[(triton.cdiv(n_rows, rows_per_program), triton.cdiv(v_dim, cols))](
        part, lse, sinks if sinks is not None else lse, out,
        n_rows, h, max_splits, v_dim, out.stride(0), out.stride(1),
        HAS_SINKS=sinks is not None, BLOCK_DV=block_dv, BLOCK_S=COMBINE_SPLITS, BLOCK_C=cols,
        ROWS=rows_per_program, PDL=pdl, num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
