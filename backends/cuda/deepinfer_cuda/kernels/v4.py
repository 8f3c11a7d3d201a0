# mypy: disable-error-code="no-untyped-def,untyped-decorator,no-untyped-call"
# (Triton kernels take untyped tensor-like arguments by design; the launchers are typed.)
"""DeepSeek-V4's ops: the mHC hyper-connection weights and mixes, the lightning indexer's top-k
and attention over a sliding window plus compressed entries. Semantics: deepinfer.reference.v4.

mHC (hc_pre, hc_head): two launches. The mix m = rms(flatten(streams)) @ fn^T reads fn
((2+N)N x N*Dm float32: 1.5 MB for V4-Flash) once per tile of BLOCK_T tokens, which one program
cannot pull fast (a decode step has one tile). So the K axis (N*Dm) is cut into SPLITS parts of
SPLIT_K columns, one program each, grid (token tiles, SPLITS), each writing its partial products
and sum of squares to a workspace. The finish, grid (tokens, Dm blocks), sums a token's
partials (a tree of fixed shape), computes the rms, the sigmoids, the softmax and the Sinkhorn
iterations on (N, N) register tiles and collapses its block of channels. SPLITS depends on N*Dm
only, so a row's bits never depend on the batch. (A single launch whose last-arriving split did
the finish ran it in one program: 41 us a call at decode, mostly the serial collapse loop.)
hc_mixes: hc_pre's two launches, the finish storing pre instead of collapsing (one program a
token). hc_collapse: one program per (token, Dm block), the N streams added in order.
hc_post: one program per (token, Dm block), the N output streams of that block at once.

Indexer (indexer_topk): two launches. Scores: program (query token, request, split) walks its
share of the token's visible entries in tiles of BLOCK_N, S = q (Hi, Di) @ k^T (Di, BLOCK_N),
score = scale * sum_h w_h relu(S_h), into a (T, Cmax) float32 buffer. Select: one program per
query token; with no more visible entries than top-k it lists them all, else a radix select on
the scores' order-preserving uint32 keys (four passes of 8-bit digits, tl.histogram), then one
pass writes the ids above the threshold and the lowest-id ties at it.

Compressed attention: one program per (query token, BLOCK_M heads, split) walks a virtual key
list: the token's window rows [p - window + 1, p] of the token cache in tiles of BLOCK_N, then
the compressed entries (the top-k ids listed for the token, or every visible entry), gathered
through the entry block tables. A top-k id listed twice counts once (a pairwise check against
the earlier list positions); ids < 0 or past the visible entries are masked. Online softmax in
float32 (exp2), K = V. Splits as in kernels/attention.py (adaptive: each program cuts its own
tile range; batch-invariant: a fixed number of tiles per split); the combine kernel there adds
the sinks. Decode and prefill share the kernel (a prefill token is a program of its own).

DeepSeek-V4.1's candidate blocks (indexer_candidate_blocks, indexer_topk_in_blocks): the
indexer's scores, their per-block maxima (_block_max_kernel) and those maxima's top
(_listed_select_kernel); the second stage scores only the listed blocks' entries
(_listed_scores_kernel), then takes their top.

DeepSeek-V4.1's quantised rows (kv_formats_v41): the attention kernel and both indexer score
kernels read uint8 caches of FP8 / FP4 / MXFP4 rows (FMT constexprs, one per cache) and
dequantise each tile in registers (_load_rows: e4m3 and e2m1 codes decoded arithmetically, their
scales applied) before the products; SM90 has no FP4 tensor cores, so the products run in q's
dtype, in which every dequantised value is exact (a code of at most 4 significant bits times an
e4m3 or power-of-two scale: at most 7 significant bits, bfloat16's 8). Beside MXFP4 keys the
score kernels round the queries to MXFP4 in registers too (the FP4 indexer: kv_v41.round_mxfp4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import triton
import triton.language as tl

from deepinfer.backend.kv_formats_v41 import RowFormat, row_bytes
from deepinfer.backend.types import AttentionMetadata
from deepinfer_cuda.kernels import attention as attn_k
from deepinfer_cuda.kernels.common import IS_INTERPRET, mma, next_pow2, num_sms, to_dtype
from deepinfer_cuda.kernels.kv_v41 import round_mxfp4

LOG2E = 1.4426950408889634

# --------------------------------------------------------------------------- mHC

# K columns (of N*Dm) per step of the mix product; SPLIT_K is a multiple of it.
HC_BLOCK_K = 64
# At most this many K splits per token tile (V4-Flash: 16384 columns -> 64 splits of 256): a
# decode step's one tile then pulls fn through 64 programs (16 took 14 us a call on an H200, 2026-12-03).
# The workspace holds SPLITS x MIXP float32 partials a token (8 KiB for V4-Flash's hc_pre).
HC_MAX_SPLITS = 64
# Tokens per tile: 16 (4 warps) for decode and batch-invariant mode (one tiling for every
# batch); 32 (8 warps) from HC_WIDE_FROM tokens on, where fn is re-read once per tile (prefill of
# 8192 tokens: 256 x 1.5 MB from L2). 64 spills registers on SM90 (ptxas).
HC_BLOCK_T = 16
HC_WIDE_BLOCK_T = 32
HC_WIDE_FROM = 256
# Channels per program of the finish (Sinkhorn + collapse): small blocks for decode-sized steps
# (up to HC_DECODE_ROWS tokens; V4-Flash: 16 programs a token), where the programs are few and
# each one's latency is the step's; large ones for prefill, where the per-program Sinkhorn repeats.
HC_DECODE_BLOCK_D = 256
HC_PREFILL_BLOCK_D = 2048
HC_DECODE_ROWS = 64


@triton.jit
def _dot_f32(a, b, acc):
    """acc + a @ b for float32 operands to float32 accuracy: three TF32 products on the GPU
    (tensor cores), IEEE in the interpreter."""
    if IS_INTERPRET:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision="tf32x3")


@triton.jit
def _hc_mix_kernel(
    s_ptr, fn_ptr, part_ptr, ssq_ptr, T, K,
    SPLITS: tl.constexpr, SPLIT_K: tl.constexpr, MIX: tl.constexpr, MIXP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Program (token tile, split): the split's partial mix products of streams (T, K) with fn
    (MIX, K) float32 and the partial sums of squares, to part (T, SPLITS, MIXP) / ssq (T, SPLITS)."""
    tb = tl.program_id(0)
    split = tl.program_id(1)
    rows = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    s_rows = s_ptr + rows.to(tl.int64) * K  # (BLOCK_T,) row starts
    cols = tl.arange(0, MIXP)
    acc = tl.zeros([BLOCK_T, MIXP], tl.float32)
    ssq = tl.zeros([BLOCK_T], tl.float32)
    k_end = tl.minimum(split * SPLIT_K + SPLIT_K, K)
    for k0 in range(split * SPLIT_K, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < k_end
        x = tl.load(s_rows[:, None] + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        x = x.to(tl.float32)
        ssq += tl.sum(x * x, axis=1)
        w = tl.load(
            fn_ptr + cols[None, :] * K + ks[:, None], mask=(cols[None, :] < MIX) & kmask[:, None], other=0.0
        )  # (BLOCK_K, MIXP): fn^T
        acc = _dot_f32(x, w, acc)
    slot = rows.to(tl.int64) * SPLITS + split  # (BLOCK_T,)
    tl.store(part_ptr + slot[:, None] * MIXP + cols[None, :], acc, mask=rmask[:, None])
    tl.store(ssq_ptr + slot, ssq, mask=rmask)


@triton.jit
def _hc_finish_kernel(
    s_ptr, base_ptr, scale_ptr, part_ptr, ssq_ptr, out_ptr, post_ptr, comb_ptr, pre_ptr,
    DM, norm_eps, hc_eps, iters,
    N: tl.constexpr, HEAD: tl.constexpr, SPLITS: tl.constexpr, SPLITSP: tl.constexpr,
    NP: tl.constexpr, MIXP: tl.constexpr, BLOCK_D: tl.constexpr, COLLAPSE: tl.constexpr = True,
):  # fmt: skip
    """Program (token, Dm block): the token's mix summed over its splits (one tree of fixed shape:
    the bits do not depend on the batch), the rms, the sigmoids, the softmax and the Sinkhorn
    iterations on (N, N) tiles in registers (every Dm block of the token computes them: no
    program waits for another), then the block's collapse. Dm block 0 stores post and comb.
    COLLAPSE False (hc_mixes, one Dm block a token): stores pre (T, N) instead of collapsing."""
    t = tl.program_id(0).to(tl.int64)
    db = tl.program_id(1)
    K = N * DM
    sp = tl.arange(0, SPLITSP)
    smask = sp < SPLITS
    prow = part_ptr + (t * SPLITS + sp) * MIXP  # (SPLITSP,) the token's partials
    ss = tl.sum(tl.load(ssq_ptr + t * SPLITS + sp, mask=smask, other=0.0), axis=0)
    rstd = 1.0 / tl.sqrt(ss / K + norm_eps)  # the unweighted rms of the flat row
    n = tl.arange(0, NP)
    nmask = n < N
    pm = smask[:, None] & nmask[None, :]
    pre_w = tl.sum(tl.load(prow[:, None] + n[None, :], mask=pm, other=0.0), axis=0)  # (NP,)
    pre_b = tl.load(base_ptr + n, mask=nmask, other=0.0)
    pre = tl.sigmoid(pre_w * rstd * tl.load(scale_ptr) + pre_b) + hc_eps
    pre = tl.where(nmask, pre, 0.0)
    if not HEAD:  # noqa: SIM102 (nested: the compiler prunes the outer constexpr branch first)
        if db == 0:
            post_w = tl.sum(tl.load(prow[:, None] + N + n[None, :], mask=pm, other=0.0), axis=0)
            post_b = tl.load(base_ptr + N + n, mask=nmask, other=0.0)
            post = 2.0 * tl.sigmoid(post_w * rstd * tl.load(scale_ptr + 1) + post_b)
            tl.store(post_ptr + t * N + n, post, mask=nmask)
            # comb (N, N): softmax over each row i (along j), then Sinkhorn, columns first
            i2 = n[:, None]
            j2 = n[None, :]
            valid = (i2 < N) & (j2 < N)
            c2 = 2 * N + i2 * N + j2
            mix = tl.sum(
                tl.load(prow[:, None, None] + c2[None, :, :], mask=smask[:, None, None] & valid[None, :, :],
                        other=0.0),
                axis=0,
            )  # fmt: skip
            logits = mix * rstd * tl.load(scale_ptr + 2) + tl.load(base_ptr + c2, mask=valid, other=0.0)
            logits = tl.where(valid, logits, float("-inf"))
            top = tl.max(logits, axis=1)
            top = tl.where(top == float("-inf"), 0.0, top)  # padding rows (i >= N): no finite entry
            e = tl.exp(logits - top[:, None])
            total = tl.sum(e, axis=1)
            comb = tl.where(valid, e / tl.where(total > 0, total, 1.0)[:, None] + hc_eps, 0.0)
            comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)  # padding stays 0: 0 / eps
            for _ in range(iters - 1):
                comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
                comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
            tl.store(comb_ptr + t * (N * N) + i2 * N + j2, comb, mask=valid)

    if COLLAPSE:
        # out[t, d] = sum_n pre[n] * streams[t, n, d] over this block's channels
        d = db * BLOCK_D + tl.arange(0, BLOCK_D)
        dmask = d < DM
        x = tl.load(
            s_ptr + t * K + n[:, None] * DM + d[None, :], mask=nmask[:, None] & dmask[None, :], other=0.0
        ).to(tl.float32)
        y = tl.sum(pre[:, None] * x, axis=0)  # (BLOCK_D,)
        tl.store(out_ptr + t * DM + d, to_dtype(y, out_ptr.dtype.element_ty), mask=dmask)
    else:
        tl.store(pre_ptr + t * N + n, pre, mask=nmask)


def hc_splits(k: int) -> tuple[int, int]:
    """(SPLITS, SPLIT_K) for a mix over k = N*Dm columns: at most HC_MAX_SPLITS parts of whole
    HC_BLOCK_K steps. A function of k alone (batch invariance)."""
    split_k = max(HC_BLOCK_K, triton.cdiv(triton.cdiv(k, HC_MAX_SPLITS), HC_BLOCK_K) * HC_BLOCK_K)
    return triton.cdiv(k, split_k), split_k


def _hc(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    iters: int,
    head: bool,
    batch_invariant: bool,
    block_t: int | None = None,
    mixes: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hc_pre / hc_head: (collapsed (T, Dm), post, comb); mixes (hc_mixes): (pre (T, N), post, comb)."""
    name = "hc_head" if head else "hc_mixes" if mixes else "hc_pre"
    if streams.dim() != 3:
        raise ValueError(f"{name} takes streams (T, N, Dm), got {tuple(streams.shape)}")
    t, n, dm = streams.shape
    mix = n if head else (2 + n) * n
    if fn.shape != (mix, n * dm) or base.shape != (mix,) or scale.numel() < (1 if head else 3):
        raise ValueError(
            f"{name}: fn {tuple(fn.shape)}, base {tuple(base.shape)}, scale {tuple(scale.shape)} do not fit "
            f"{n} streams of width {dm} (fn must be ({mix}, {n * dm}))"
        )
    dev = streams.device
    # out: the collapse (T, Dm) in streams' dtype, or hc_mixes' pre (T, N) float32
    out_shape, out_dtype = ((t, n), torch.float32) if mixes else ((t, dm), streams.dtype)
    out = torch.empty(out_shape, dtype=out_dtype, device=dev)
    post = torch.empty((t, n), dtype=torch.float32, device=dev)
    comb = torch.empty((t, n, n), dtype=torch.float32, device=dev)
    if t == 0 or n == 0 or dm == 0:
        return out.zero_(), post.zero_(), comb.zero_()
    s = streams.contiguous()
    bt = block_t or (HC_WIDE_BLOCK_T if t >= HC_WIDE_FROM and not batch_invariant else HC_BLOCK_T)
    splits, split_k = hc_splits(n * dm)
    mixp = next_pow2(mix)
    part = torch.empty((t, splits, mixp), dtype=torch.float32, device=dev)
    ssq = torch.empty((t, splits), dtype=torch.float32, device=dev)
    _hc_mix_kernel[(triton.cdiv(t, bt), splits)](
        s, fn.float().contiguous(), part, ssq, t, n * dm,
        SPLITS=splits, SPLIT_K=split_k, MIX=mix, MIXP=mixp, BLOCK_T=bt, BLOCK_K=HC_BLOCK_K,
        num_warps=4 if bt <= HC_BLOCK_T else 8,
    )  # fmt: skip
    block_d = min(next_pow2(dm), HC_DECODE_BLOCK_D if t <= HC_DECODE_ROWS else HC_PREFILL_BLOCK_D)
    d_blocks = 1 if mixes else triton.cdiv(dm, block_d)  # hc_mixes: no channels, one program a token
    _hc_finish_kernel[(t, d_blocks)](
        s, base.float().contiguous(), scale.float().contiguous(), part, ssq, out, post, comb, out,
        dm, norm_eps, hc_eps, iters,
        N=n, HEAD=head, SPLITS=splits, SPLITSP=next_pow2(splits, 1), NP=next_pow2(n, 1), MIXP=mixp,
        BLOCK_D=block_d, COLLAPSE=not mixes, num_warps=4,
    )  # fmt: skip
    return out, post, comb


def hc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    batch_invariant: bool = False,
    block_t: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams (T, N, Dm) -> (collapsed (T, Dm) in streams' dtype, post (T, N), comb (T, N, N))
    float32; fn ((2+N)N, N*Dm), base ((2+N)N,), scale (3,) float32. One launch."""
    return _hc(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, False, batch_invariant, block_t)


def hc_head(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    batch_invariant: bool = False,
    block_t: int | None = None,
) -> torch.Tensor:
    """streams (T, N, Dm) -> (T, Dm): the final collapse, fn (N, N*Dm), base (N,), scale (1,).
    One launch."""
    return _hc(streams, fn, base, scale, norm_eps, hc_eps, 0, True, batch_invariant, block_t)[0]


def hc_mixes(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    batch_invariant: bool = False,
    block_t: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams (T, N, Dm) -> (pre (T, N), post (T, N), comb (T, N, N)) float32: hc_pre's launches
    with the collapse left out: the same bits of post and comb as hc_pre's, and the pre mix
    hc_pre collapses with."""
    iters = sinkhorn_iters
    return _hc(streams, fn, base, scale, norm_eps, hc_eps, iters, False, batch_invariant, block_t, mixes=True)


@triton.jit
def _hc_collapse_kernel(
    s_ptr, pre_ptr, out_ptr, DM,
    N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program (token, Dm block): out[t, d] = sum_n pre[t, n] * streams[t, n, d] in float32,
    adding stream n = 0, 1, ... in order. streams (T, N, DM) contiguous, pre (T, N) float32."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < DM
    acc = tl.zeros([BLOCK_D], tl.float32)
    for j in tl.static_range(N):
        p = tl.load(pre_ptr + t * N + j)
        s = tl.load(s_ptr + (t * N + j) * DM + d, mask=dmask, other=0.0).to(tl.float32)
        acc += p * s
    tl.store(out_ptr + t * DM + d, to_dtype(acc, out_ptr.dtype.element_ty), mask=dmask)


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """streams (T, N, Dm), pre (T, N) -> (T, Dm) in streams' dtype, float32 sums. One launch."""
    if streams.dim() != 3 or pre.shape != streams.shape[:2]:
        raise ValueError(
            f"hc_collapse: pre {tuple(pre.shape)} does not fit streams {tuple(streams.shape)} "
            "(streams (T, N, Dm), pre (T, N))"
        )
    t, n, dm = streams.shape
    out = torch.empty((t, dm), dtype=streams.dtype, device=streams.device)
    if out.numel() == 0:
        return out
    if n == 0:
        return out.zero_()
    block_d = min(1024, next_pow2(dm))
    _hc_collapse_kernel[(t, triton.cdiv(dm, block_d))](
        streams.contiguous(), pre.float().contiguous(), out, dm, N=n, BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip
    return out


@triton.jit
def _hc_post_kernel(
    y_ptr, s_ptr, post_ptr, comb_ptr, out_ptr, DM, stride_y,
    N: tl.constexpr, NP: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """out[t, k, d] = post[t, k] * y[t, d] + sum_j comb[t, j, k] * streams[t, j, d], adding
    stream j = 0, 1, ... in order as the reference does. streams / out (T, N, DM) contiguous."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < DM
    k = tl.arange(0, NP)
    kmask = k < N
    post = tl.load(post_ptr + t * N + k, mask=kmask, other=0.0)
    y = tl.load(y_ptr + t * stride_y + d, mask=dmask, other=0.0).to(tl.float32)
    acc = post[:, None] * y[None, :]  # (NP, BLOCK_D)
    for j in tl.static_range(N):
        c = tl.load(comb_ptr + t * N * N + j * N + k, mask=kmask, other=0.0)
        s = tl.load(s_ptr + (t * N + j) * DM + d, mask=dmask, other=0.0).to(tl.float32)
        acc += c[:, None] * s[None, :]
    tl.store(
        out_ptr + (t * N + k)[:, None] * DM + d[None, :],
        to_dtype(acc, out_ptr.dtype.element_ty),
        mask=kmask[:, None] & dmask[None, :],
    )


def hc_post(y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """y (T, Dm), streams (T, N, Dm), post (T, N), comb (T, N, N) -> (T, N, Dm) in streams' dtype."""
    t, n, dm = streams.shape
    if y.shape != (t, dm) or post.shape != (t, n) or comb.shape != (t, n, n):
        raise ValueError(
            f"hc_post: y {tuple(y.shape)}, post {tuple(post.shape)}, comb {tuple(comb.shape)} do not fit "
            f"streams {tuple(streams.shape)}"
        )
    out = torch.empty((t, n, dm), dtype=streams.dtype, device=streams.device)
    if out.numel() == 0:
        return out
    s = streams.contiguous()
    y = y if y.stride(-1) == 1 else y.contiguous()
    block_d = min(1024, next_pow2(dm))
    _hc_post_kernel[(t, triton.cdiv(dm, block_d))](
        y, s, post.float().contiguous(), comb.float().contiguous(), out, dm, y.stride(0),
        N=n, NP=next_pow2(n, 1), BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip
    return out


# --------------------------------------------------------------------------- compressed entries


@triton.jit
def _entries_kernel(
    seq_ptr, slot_ptr, bt_ptr, et_ptr, kt_ptr, state_ptr, present_ptr, out_ptr, pos_ptr, key_ptr,
    T, MB, MBE, MBK, stride_bt, stride_et, stride_kt, Q, K, RATIO, BS, S,
    OVERLAP: tl.constexpr, HAS_KEYS: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """Candidate e = b * K + j of request b (its j-th of K = ceil(Q / RATIO)): entry
    w = (end - Q) // RATIO + j, whether it closes, its S pooled slots and its rows."""
    e = tl.program_id(0).to(tl.int64)
    b = e // K
    end = tl.load(seq_ptr + b).to(tl.int64)
    start = end - Q  # the request's first position this step (>= 0)
    w = start // RATIO + e % K
    row = tl.minimum(tl.maximum(b * Q + (w + 1) * RATIO - 1 - start, 0), T - 1)
    closed = end // RATIO  # entries closed once the step is done
    closes = (w < closed) & (tl.load(slot_ptr + row) >= 0)
    w = tl.minimum(w, tl.maximum(closed - 1, 0))  # a candidate that does not close: rows it owns
    s = tl.arange(0, BLOCK_S)
    live = s < S
    if OVERLAP:
        p = (w - 1) * RATIO + s
    else:
        p = w * RATIO + s
    present = p >= 0
    p = tl.minimum(tl.maximum(p, 0), end - 1)
    col = tl.minimum(p // BS, MB - 1)
    block = tl.load(bt_ptr + b * stride_bt + col, mask=live, other=0).to(tl.int64)
    tl.store(state_ptr + e * S + s, block * BS + p % BS, mask=live)
    tl.store(present_ptr + e * S + s, present.to(tl.uint8), mask=live)
    entry = tl.load(et_ptr + b * stride_et + tl.minimum(w // BS, MBE - 1)).to(tl.int64) * BS + w % BS
    out = tl.where(closes, entry, -1)
    tl.store(out_ptr + e, out)
    tl.store(pos_ptr + e, w * RATIO)
    if HAS_KEYS:
        key = tl.load(kt_ptr + b * stride_kt + tl.minimum(w // BS, MBK - 1)).to(tl.int64) * BS + w % BS
        tl.store(key_ptr + e, tl.where(closes, key, -1))


def compressed_entries(
    seq_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    entry_tables: torch.Tensor,
    key_tables: torch.Tensor | None,
    query_len: int,
    ratio: int,
    overlap: bool,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """KVCacheOps.compressed_entries of a step whose B requests each compute query_len tokens,
    in one launch (one program per candidate): (state_slots (W, S), present (W, S) bool,
    out_slots, positions, key_slots (W,)), W = B * ceil(query_len / ratio)."""
    b, k = seq_lens.shape[0], -(-query_len // ratio)
    span = 2 * ratio if overlap else ratio
    dev = slot_mapping.device
    state = torch.empty((b * k, span), dtype=torch.int64, device=dev)
    present = torch.empty((b * k, span), dtype=torch.bool, device=dev)
    out, pos = (torch.empty((b * k,), dtype=torch.int64, device=dev) for _ in range(2))
    keys = out if key_tables is None else torch.empty_like(out)
    if b * k == 0:
        return state, present, out, pos, keys

    def rows(t: torch.Tensor) -> torch.Tensor:  # the kernel reads a table's row with unit stride
        return t if t.stride(-1) == 1 else t.contiguous()

    block_tables, entry_tables = rows(block_tables), rows(entry_tables)
    kt = entry_tables if key_tables is None else rows(key_tables)
    seq_lens, slot_mapping = seq_lens.contiguous(), slot_mapping.contiguous()
    _entries_kernel[(b * k,)](
        seq_lens, slot_mapping, block_tables, entry_tables, kt, state, present.view(torch.uint8), out, pos,
        keys, slot_mapping.shape[0], block_tables.shape[1], entry_tables.shape[1], kt.shape[1],
        block_tables.stride(0), entry_tables.stride(0), kt.stride(0), query_len, k, ratio, block_size, span,
        OVERLAP=overlap, HAS_KEYS=key_tables is not None, BLOCK_S=next_pow2(span, 1), num_warps=1,
    )  # fmt: skip
    return state, present, out, pos, keys


# --------------------------------------------------------------------------- lightning indexer

# Entries per scoring tile; entries scanned per step of the select kernel.
INDEXER_BLOCK_N = 64
SELECT_BLOCK = 1024
# Fewest tiles per split of a row's entries (adaptive splits, as attention's).
INDEXER_MIN_SPLIT_TILES = 4
# Bytes of (rows, entries) float32 scores one launch may hold: a step that needs more (long
# prefill chunks over a long context: 8192 rows x 262144 entries would be 8 GiB) runs its
# requests in groups under it (one request at least).
SCORES_BUDGET_BYTES = 1 << 29


# row formats of the kernels' caches (FMT constexprs): the cache's own float dtype, or V4.1's
ROW_FORMATS = {None: 0, "fp8": 1, "fp4": 2, "mxfp4": 3}


def row_format_code(fmt: str | None) -> int:
    if fmt not in ROW_FORMATS:
        raise ValueError(f"unknown KV row format {fmt!r}; known: {list(ROW_FORMATS)}")
    return ROW_FORMATS[fmt]


@triton.jit
def _e8m0(b):
    """UE8M0 bytes -> float32 2^(b - 127) (the exponent field; byte 0, never written, reads 0)."""
    return (b.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3(b):
    """e4m3fn bytes -> float32: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
    subnormal (m 2^-9). The NaN code is never written."""
    x = b.to(tl.int32)
    e = (x >> 3) & 15
    m = (x & 7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * tl.exp2((e - 10).to(tl.float32)))
    return tl.where((x & 128) != 0, -mag, mag)


@triton.jit
def _e2m1(c):
    """4-bit e2m1 codes -> float32: sign bit 3, 2 exponent bits (bias 1), 1 mantissa bit."""
    e = (c >> 1) & 3
    m = (c & 1).to(tl.float32)
    mag = tl.where(e == 0, m * 0.5, (2.0 + m) * tl.exp2((e - 2).to(tl.float32)))
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def _load_rows(rows, offs_d, valid, D, FMT: tl.constexpr):
    """Values [:D] of the rows at `rows` (BLOCK_N,) pointers, (BLOCK_N, BLOCK_D) float32, 0 where
    masked: FMT 0 the cache's own values (exact in float32); else from uint8 rows: 1 fp8 (D
    e4m3, D/32 UE8M0), 2 fp4 (D/2 bytes of e2m1 pairs, low nibble first, then D/16 e4m3 scales),
    3 mxfp4 (the pairs, then D/32 UE8M0). Masked bytes are never read, so rows no request reaches
    may hold anything."""
    m = valid[:, None] & (offs_d[None, :] < D)
    at = rows[:, None]
    if FMT == 0:
        out = tl.load(at + offs_d[None, :], mask=m, other=0.0).to(tl.float32)  # one type for all
    elif FMT == 1:
        v = _e4m3(tl.load(at + offs_d[None, :], mask=m, other=0))
        out = v * _e8m0(tl.load(at + D + offs_d[None, :] // 32, mask=m, other=127))
    else:
        pair = tl.load(at + offs_d[None, :] // 2, mask=m, other=0).to(tl.int32)
        v = _e2m1(tl.where(offs_d[None, :] % 2 == 0, pair & 15, pair >> 4))
        if FMT == 2:
            s = _e4m3(tl.load(at + D // 2 + offs_d[None, :] // 16, mask=m, other=0))
        else:
            s = _e8m0(tl.load(at + D // 2 + offs_d[None, :] // 32, mask=m, other=127))
        out = v * s
    return out


@triton.jit
def _index_queries(q_ptr, t, stride_qt, stride_qh, h, d, HI, DI, BLOCK_H: tl.constexpr,
                   BLOCK_D: tl.constexpr, MXFP4: tl.constexpr):  # fmt: skip
    """Row t's (BLOCK_H, BLOCK_D) index queries in q's dtype, 0 past (HI, DI); MXFP4: each head's
    runs of 32 values rounded to MXFP4 first (kv_formats_v41.round_index_queries: the FP4
    indexer's queries beside MXFP4 keys), exact in bfloat16 and float32 (a 2-bit significand
    times a power of two)."""
    q = tl.load(
        q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :],
        mask=(h[:, None] < HI) & (d[None, :] < DI),
        other=0.0,
    )
    if MXFP4:
        q = round_mxfp4(q.to(tl.float32), BLOCK_H, BLOCK_D).to(q.dtype)
    return q


@triton.jit(do_not_specialize=["page", "ratio", "max_splits", "row0"])
def _indexer_scores_kernel(
    q_ptr, w_ptr, k_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, score_ptr,
    stride_qt, stride_qh, stride_wt, stride_kb, stride_kt, stride_bt, stride_st,
    HI, DI, page, ratio, scale, max_splits, row0,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    K_FMT: tl.constexpr = 0, Q_MXFP4: tl.constexpr = False,
):  # fmt: skip
    """Row t's scores over its visible entries (one split of their tiles). Q_MXFP4: the queries
    rounded to MXFP4 in registers first (the FP4 indexer, _index_queries)."""
    i = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if i >= q_len:
        return
    pos = tl.load(seq_lens_ptr + b) - q_len + i
    n_vis = (pos + 1) // ratio
    n_tiles = tl.cdiv(n_vis, BLOCK_N)
    per = tl.cdiv(n_tiles, max_splits)
    tile0 = split * per
    tile1 = tl.minimum(n_tiles, tile0 + per)
    if tile0 >= tile1:
        return
    t = (q_start + i).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    q = _index_queries(q_ptr, t, stride_qt, stride_qh, h, d, HI, DI, BLOCK_H, BLOCK_D, Q_MXFP4)
    w = tl.load(w_ptr + t * stride_wt + h, mask=h < HI, other=0.0).to(tl.float32) * scale
    offs_n = tl.arange(0, BLOCK_N)
    for tile in range(tile0, tile1):
        e = tile * BLOCK_N + offs_n
        valid = e < n_vis
        blk = tl.load(bt_ptr + b * stride_bt + e // page, mask=valid, other=0)
        krow = k_ptr + blk.to(tl.int64) * stride_kb + (e % page) * stride_kt
        k = _load_rows(krow, d, valid, DI, K_FMT).to(q.dtype)
        s = mma(q, tl.trans(k), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), IEEE)  # (BLOCK_H, BLOCK_N)
        score = tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0)
        tl.store(score_ptr + (t - row0) * stride_st + e, score, mask=valid)


@triton.jit
def _order_key(x):
    """float32 -> uint32 in the same order (larger float, larger key): flip the sign bit of
    non-negatives, every bit of negatives."""
    u = x.to(tl.uint32, bitcast=True)
    return tl.where((u >> 31) != 0, u ^ 0xFFFFFFFF, u | 0x80000000)


@triton.jit(do_not_specialize=["ratio", "topk", "row0"])
def _indexer_select_kernel(
    score_ptr, seq_lens_ptr, qsl_ptr, out_ptr, stride_st, stride_ot, ratio, topk, row0,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Row t's ids: every visible entry when they are at most topk, else the topk best (ties at the
    threshold: the lowest ids). Writes all topk columns (-1 where unused). Scores of row t at
    score row t - row0."""
    i = tl.program_id(0)
    b = tl.program_id(1)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if i >= q_len:
        return
    pos = tl.load(seq_lens_ptr + b) - q_len + i
    n_vis = (pos + 1) // ratio
    t = (q_start + i).to(tl.int64)
    row = score_ptr + (t - row0) * stride_st
    out_row = out_ptr + t * stride_ot
    offs = tl.arange(0, BLOCK)
    if n_vis <= topk:
        for j0 in range(0, topk, BLOCK):
            j = j0 + offs
            tl.store(out_row + j, tl.where(j < n_vis, j, -1), mask=j < topk)
        return

    # radix select: the key of the topk-th largest score, 8 bits a pass from the top
    bins = tl.arange(0, 256)
    prefix = tl.zeros([], tl.uint32)
    rem = topk  # how many of the keys matching `prefix` are still to take
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = tl.zeros([256], tl.int32)
        for c0 in range(0, n_vis, BLOCK):
            e = c0 + offs
            m = e < n_vis
            key = _order_key(tl.load(row + e, mask=m, other=0.0))
            if p > 0:
                m = m & ((key >> (shift + 8)) == prefix)
            hist += tl.histogram(((key >> shift) & 0xFF).to(tl.int32), 256, mask=m)
        at_least = tl.cumsum(hist, 0, reverse=True)  # keys whose digit is >= each bin
        digit = tl.max(tl.where(at_least >= rem, bins, -1), axis=0)
        rem -= tl.sum(tl.where(bins == digit, at_least - hist, 0), axis=0)  # those above it: taken
        prefix = (prefix << 8) | digit.to(tl.uint32)

    # every key above the threshold, and the first `rem` equal to it
    taken = tl.zeros([], tl.int32)
    ties = tl.zeros([], tl.int32)
    for c0 in range(0, n_vis, BLOCK):
        e = c0 + offs
        m = e < n_vis
        key = _order_key(tl.load(row + e, mask=m, other=0.0))
        eq = m & (key == prefix)
        take = (m & (key > prefix)) | (eq & (ties + tl.cumsum(eq.to(tl.int32), 0) <= rem))
        at = taken + tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(out_row + at, e, mask=take)
        taken += tl.sum(take.to(tl.int32), axis=0)
        ties += tl.sum(eq.to(tl.int32), axis=0)


def _check_indexer(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    meta: AttentionMetadata,
    ratio: int,
    topk: int,
    op: str,
    key_format: str | None = None,
) -> None:
    t, hi, di = q.shape
    if weights.shape != (t, hi):
        raise ValueError(f"{op}: weights {tuple(weights.shape)} must be ({t}, {hi})")
    _check_rows(f"{op} keys", keys, di, key_format)
    if ratio < 1 or topk < 0:
        raise ValueError(f"{op}: ratio {ratio} must be >= 1 and topk {topk} >= 0")
    if sum(meta.query_lens_host) != t:
        raise ValueError(
            f"q has {t} rows but the metadata describes {sum(meta.query_lens_host)} query tokens"
        )


@dataclass
class _Group:
    """Requests [b0, b1) of a step, their query rows from row0 on, the launch grid (max_q, batch)
    and their device lengths; cmax: the most entries (columns) a row of theirs scores."""

    row0: int
    rows: int
    cmax: int
    grid: tuple[int, int]
    tables: torch.Tensor
    seq_lens: torch.Tensor
    qsl: torch.Tensor


def _groups(meta: AttentionMetadata, ratio: int, budget: int, width: int | None = None) -> list[_Group]:
    """The step's requests in groups whose (rows, entries) float32 scores fit `budget` bytes
    (width: a fixed number of columns, else each group's most visible entries)."""
    seq = meta.seq_lens_host if width is None else (width * ratio,) * meta.num_requests
    out = []
    for b0, b1 in _score_groups(seq, meta.query_lens_host, ratio, budget):
        rows, row0 = sum(meta.query_lens_host[b0:b1]), sum(meta.query_lens_host[:b0])
        if rows:
            grid = (max(meta.query_lens_host[b0:b1]), b1 - b0)
            out.append(
                _Group(
                    row0, rows, max(seq[b0:b1]) // ratio, grid, meta.block_tables[b0:b1],
                    meta.seq_lens[b0:b1], meta.query_start_loc[b0 : b1 + 1],
                )
            )  # fmt: skip
    return out


def _scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    g: _Group,
    ratio: int,
    scale: float,
    block_n: int,
    key_format: str | None,
) -> torch.Tensor:
    """Group g's (rows, cmax) scores of its rows' visible entries (the rest unwritten); keys in
    key_format (a V4.1 row format, None: values)."""
    _, hi, di = q.shape
    scores = torch.empty((g.rows, g.cmax), dtype=torch.float32, device=q.device)
    tiles = triton.cdiv(g.cmax, block_n)
    want = max(1, 2 * num_sms(q.device) // (g.grid[0] * g.grid[1]))
    splits = max(1, min(want, tiles // INDEXER_MIN_SPLIT_TILES))
    _indexer_scores_kernel[(*g.grid, splits)](
        q, weights, keys, g.tables, g.seq_lens, g.qsl, scores,
        q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), keys.stride(1), g.tables.stride(0),
        scores.stride(0), hi, di, keys.shape[1], ratio, scale, splits, g.row0,
        BLOCK_H=next_pow2(hi), BLOCK_D=next_pow2(di), BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
        K_FMT=row_format_code(key_format), Q_MXFP4=key_format == "mxfp4", num_warps=4,
    )  # fmt: skip
    return scores


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    meta: AttentionMetadata,
    *,
    ratio: int,
    topk: int,
    scale: float,
    block_n: int = INDEXER_BLOCK_N,
    select_block: int = SELECT_BLOCK,
    scores_budget: int = SCORES_BUDGET_BYTES,
    key_format: str | None = None,
) -> torch.Tensor:
    """q (T, Hi, Di), weights (T, Hi) float32, keys (NBc, BS, >= Di) paged by meta.block_tables
    -> (T, topk) int32 entry ids, -1 unused. The scores buffer and the grid come from the host
    lengths (upper bounds in a replayed graph); each program reads its own from the device.
    key_format: the keys' V4.1 row format (uint8 rows of row_bytes(key_format, Di) bytes; "mxfp4":
    the queries rounded to MXFP4 as well, kv_formats_v41.round_index_queries)."""
    _check_indexer(q, weights, keys, meta, ratio, topk, "indexer_topk", key_format)
    out = torch.empty((q.shape[0], topk), dtype=torch.int32, device=q.device)
    if q.shape[0] == 0 or topk == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    for g in _groups(meta, ratio, scores_budget):
        if g.cmax == 0:
            out[g.row0 : g.row0 + g.rows].fill_(-1)
            continue
        scores = _scores(q, weights, keys, g, ratio, scale, block_n, key_format)
        _indexer_select_kernel[g.grid](
            scores, g.seq_lens, g.qsl, out, scores.stride(0), out.stride(0), ratio, topk, g.row0,
            BLOCK=select_block, num_warps=4,
        )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["ratio", "bs", "nb_max", "row0"])
def _block_max_kernel(
    score_ptr, seq_lens_ptr, qsl_ptr, out_ptr, stride_st, stride_ot, ratio, bs, nb_max, row0,
    BLOCK_B: tl.constexpr, BS: tl.constexpr,
):  # fmt: skip
    """Row t's block scores (nb_max,): the best visible entry of each block of bs entries, +inf
    for the block of the newest visible entry, -inf past the visible blocks."""
    i = tl.program_id(0)
    b = tl.program_id(1)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if i >= q_len:
        return
    n_vis = (tl.load(seq_lens_ptr + b) - q_len + i + 1) // ratio
    nb = tl.cdiv(n_vis, bs)
    t = (q_start + i).to(tl.int64)
    row = score_ptr + (t - row0) * stride_st
    c = tl.arange(0, BS)
    for j0 in range(0, nb_max, BLOCK_B):
        j = j0 + tl.arange(0, BLOCK_B)
        e = j[:, None] * bs + c[None, :]
        x = tl.load(row + e, mask=(c[None, :] < bs) & (e < n_vis), other=float("-inf"))
        best = tl.max(x, axis=1)
        best = tl.where(j == nb - 1, float("inf"), best)
        tl.store(out_ptr + (t - row0) * stride_ot + j, best, mask=j < nb_max)


@triton.jit(do_not_specialize=["page", "ratio", "bs", "width", "kb", "row0"])
def _listed_scores_kernel(
    q_ptr, w_ptr, k_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, blocks_ptr, score_ptr,
    stride_qt, stride_qh, stride_wt, stride_kb, stride_kt, stride_bt, stride_lt, stride_st,
    HI, DI, page, ratio, scale, bs, width, kb, row0,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    K_FMT: tl.constexpr = 0, Q_MXFP4: tl.constexpr = False,
):  # fmt: skip
    """Row t's scores over its width = kb * bs candidate slots: slot s is entry
    blocks[t, s // bs] * bs + s % bs (the listed blocks in ascending order), -inf where that
    block is unused or the entry is not visible. K_FMT: the keys' row format (_load_rows);
    Q_MXFP4: as _indexer_scores_kernel's."""
    i = tl.program_id(0)
    b = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if i >= q_len:
        return
    n_vis = (tl.load(seq_lens_ptr + b) - q_len + i + 1) // ratio
    t = (q_start + i).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    q = _index_queries(q_ptr, t, stride_qt, stride_qh, h, d, HI, DI, BLOCK_H, BLOCK_D, Q_MXFP4)
    w = tl.load(w_ptr + t * stride_wt + h, mask=h < HI, other=0.0).to(tl.float32) * scale
    s = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    blk = tl.load(blocks_ptr + t * stride_lt + s // bs, mask=s < width, other=-1)
    ok = (blk >= 0) & (blk <= (n_vis - 1) // bs) & (s < width)
    e = tl.where(ok, blk, 0) * bs + s % bs
    valid = ok & (e < n_vis)
    pg = tl.load(bt_ptr + b * stride_bt + e // page, mask=valid, other=0)
    krow = k_ptr + pg.to(tl.int64) * stride_kb + (e % page) * stride_kt
    k = _load_rows(krow, d, valid, DI, K_FMT).to(q.dtype)
    acc = mma(q, tl.trans(k), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), IEEE)  # (BLOCK_H, BLOCK_N)
    score = tl.where(valid, tl.sum(tl.maximum(acc, 0.0) * w[:, None], axis=0), float("-inf"))
    tl.store(score_ptr + (t - row0) * stride_st + s, score, mask=s < width)


@triton.jit(do_not_specialize=["width", "bs", "topk", "row0"])
def _listed_select_kernel(
    score_ptr, blocks_ptr, qsl_ptr, out_ptr, stride_st, stride_lt, stride_ot, width, bs, topk, row0,
    LISTED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Row t's topk best of its `width` scores, -inf meaning no candidate (+inf allowed), ties to
    the lower column; writes ids (LISTED: the column's entry blocks[t, s // bs] * bs + s % bs,
    else the column itself) and -1 in the unused columns."""
    i = tl.program_id(0)
    b = tl.program_id(1)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if i >= q_len:
        return
    t = (q_start + i).to(tl.int64)
    row = score_ptr + (t - row0) * stride_st
    out_row = out_ptr + t * stride_ot
    offs = tl.arange(0, BLOCK)
    count = tl.zeros([], tl.int32)
    for c0 in range(0, width, BLOCK):
        x = tl.load(row + c0 + offs, mask=c0 + offs < width, other=float("-inf"))
        count += tl.sum((x > float("-inf")).to(tl.int32), axis=0)
    # every candidate when they are at most topk: threshold 0 is below every key, no ties taken
    prefix = tl.zeros([], tl.uint32)
    rem = tl.where(count > topk, topk, 0)  # how many of the keys matching `prefix` are still to take
    if count > topk:  # radix select as _indexer_select_kernel, over the candidates
        bins = tl.arange(0, 256)
        for p in tl.static_range(4):
            shift = 24 - 8 * p
            hist = tl.zeros([256], tl.int32)
            for c0 in range(0, width, BLOCK):
                e = c0 + offs
                x = tl.load(row + e, mask=e < width, other=float("-inf"))
                m = (e < width) & (x > float("-inf"))
                key = _order_key(x)
                if p > 0:
                    m = m & ((key >> (shift + 8)) == prefix)
                hist += tl.histogram(((key >> shift) & 0xFF).to(tl.int32), 256, mask=m)
            at_least = tl.cumsum(hist, 0, reverse=True)
            digit = tl.max(tl.where(at_least >= rem, bins, -1), axis=0)
            rem -= tl.sum(tl.where(bins == digit, at_least - hist, 0), axis=0)
            prefix = (prefix << 8) | digit.to(tl.uint32)
    taken = tl.zeros([], tl.int32)
    ties = tl.zeros([], tl.int32)
    for c0 in range(0, width, BLOCK):
        e = c0 + offs
        x = tl.load(row + e, mask=e < width, other=float("-inf"))
        m = (e < width) & (x > float("-inf"))
        key = _order_key(x)
        eq = m & (key == prefix)
        take = (m & (key > prefix)) | (eq & (ties + tl.cumsum(eq.to(tl.int32), 0) <= rem))
        at = taken + tl.cumsum(take.to(tl.int32), 0) - 1
        ident = e
        if LISTED:
            blk = tl.load(blocks_ptr + t * stride_lt + e // bs, mask=take, other=0)
            ident = blk * bs + e % bs
        tl.store(out_row + at, ident, mask=take)
        taken += tl.sum(take.to(tl.int32), axis=0)
        ties += tl.sum(eq.to(tl.int32), axis=0)
    for j0 in range(0, topk, BLOCK):
        j = j0 + offs
        tl.store(out_row + j, -1, mask=(j >= taken) & (j < topk))


def indexer_candidate_blocks(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    meta: AttentionMetadata,
    *,
    ratio: int,
    topk: int,
    scale: float,
    block_size: int,
    topk_blocks: int,
    block_n: int = INDEXER_BLOCK_N,
    select_block: int = SELECT_BLOCK,
    scores_budget: int = SCORES_BUDGET_BYTES,
    key_format: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """indexer_topk's ids (T, topk) and the candidate blocks (T, topk_blocks) int32 from the
    same scores: per-block maxima (the newest visible entry's block +inf), then their top.
    key_format: as indexer_topk's."""
    _check_indexer(q, weights, keys, meta, ratio, topk, "indexer_candidate_blocks", key_format)
    if not 0 < block_size <= 16 or topk_blocks < 1:
        raise ValueError(
            f"indexer_candidate_blocks: block_size {block_size} (1..16), topk_blocks {topk_blocks}"
        )
    t = q.shape[0]
    ids = torch.empty((t, topk), dtype=torch.int32, device=q.device)
    blocks = torch.empty((t, topk_blocks), dtype=torch.int32, device=q.device)
    q = q if q.stride(-1) == 1 else q.contiguous()
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    for g in _groups(meta, ratio, scores_budget):
        if g.cmax == 0:
            ids[g.row0 : g.row0 + g.rows].fill_(-1)
            blocks[g.row0 : g.row0 + g.rows].fill_(-1)
            continue
        scores = _scores(q, weights, keys, g, ratio, scale, block_n, key_format)
        if topk:
            _indexer_select_kernel[g.grid](
                scores, g.seq_lens, g.qsl, ids, scores.stride(0), ids.stride(0), ratio, topk, g.row0,
                BLOCK=select_block, num_warps=4,
            )  # fmt: skip
        nb_max = triton.cdiv(g.cmax, block_size)
        best = torch.empty((g.rows, nb_max), dtype=torch.float32, device=q.device)
        _block_max_kernel[g.grid](
            scores, g.seq_lens, g.qsl, best, scores.stride(0), best.stride(0), ratio, block_size, nb_max,
            g.row0, BLOCK_B=64, BS=next_pow2(block_size, 2), num_warps=4,
        )  # fmt: skip
        _listed_select_kernel[g.grid](
            best, blocks, g.qsl, blocks, best.stride(0), 0, blocks.stride(0), nb_max, 1, topk_blocks,
            g.row0, LISTED=False, BLOCK=select_block, num_warps=4,
        )  # fmt: skip
    return ids, blocks


def indexer_topk_in_blocks(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    meta: AttentionMetadata,
    blocks: torch.Tensor,
    *,
    ratio: int,
    topk: int,
    scale: float,
    block_size: int,
    block_n: int = INDEXER_BLOCK_N,
    select_block: int = SELECT_BLOCK,
    scores_budget: int = SCORES_BUDGET_BYTES,
    key_format: str | None = None,
) -> torch.Tensor:
    """The top-k among the entries of each row's candidate blocks (T, Kb) int32 (distinct ids,
    -1 unused): scores over the Kb * block_size candidate slots only, the blocks sorted first
    so that ties go to the lower entry id. key_format: as indexer_topk's."""
    _check_indexer(q, weights, keys, meta, ratio, topk, "indexer_topk_in_blocks", key_format)
    t, hi, di = q.shape
    if blocks.dim() != 2 or blocks.shape[0] != t or not 0 < block_size <= 16:
        raise ValueError(
            f"indexer_topk_in_blocks: blocks {tuple(blocks.shape)} must be ({t}, Kb), block_size "
            f"{block_size} in 1..16"
        )
    out = torch.empty((t, topk), dtype=torch.int32, device=q.device)
    if t == 0 or topk == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    unused = torch.iinfo(torch.int32).max  # sorts last; past every visible block
    listed = torch.where(blocks < 0, unused, blocks.to(torch.int32)).sort(dim=1).values
    width = listed.shape[1] * block_size
    for g in _groups(meta, 1, scores_budget, width):
        scores = torch.empty((g.rows, width), dtype=torch.float32, device=q.device)
        tables = g.tables
        _listed_scores_kernel[(*g.grid, triton.cdiv(width, block_n))](
            q, weights, keys, tables, g.seq_lens, g.qsl, listed, scores,
            q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), keys.stride(1), tables.stride(0),
            listed.stride(0), scores.stride(0), hi, di, keys.shape[1], ratio, scale, block_size, width,
            listed.shape[1], g.row0,
            BLOCK_H=next_pow2(hi), BLOCK_D=next_pow2(di), BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
            K_FMT=row_format_code(key_format), Q_MXFP4=key_format == "mxfp4", num_warps=4,
        )  # fmt: skip
        _listed_select_kernel[g.grid](
            scores, listed, g.qsl, out, scores.stride(0), listed.stride(0), out.stride(0), width,
            block_size, topk, g.row0, LISTED=True, BLOCK=select_block, num_warps=4,
        )  # fmt: skip
    return out


def _check_rows(what: str, cache: torch.Tensor, width: int, fmt: str | None) -> None:
    """ValueError unless the cache's rows hold `width` values: at least that many in a float
    dtype, or exactly row_bytes(fmt, width) uint8 bytes in a V4.1 row format."""
    if fmt is None:
        if cache.shape[-1] < width:
            raise ValueError(f"{what}: rows of width {cache.shape[-1]} are narrower than q's {width}")
        return
    need = row_bytes(cast(RowFormat, fmt), width)
    if cache.dtype != torch.uint8 or cache.shape[-1] != need:
        raise ValueError(
            f"{what}: {fmt} rows of {width} values are {need} uint8 bytes; the cache holds "
            f"{cache.shape[-1]} of {cache.dtype}"
        )


def _score_groups(
    seq_lens: tuple[int, ...], query_lens: tuple[int, ...], ratio: int, budget: int
) -> list[tuple[int, int]]:
    """Consecutive request ranges [b0, b1) whose (rows, max entries) float32 scores fit `budget`
    bytes, each holding one request at least."""
    groups: list[tuple[int, int]] = []
    b0, rows, cmax = 0, 0, 0
    for b, (n, q) in enumerate(zip(seq_lens, query_lens)):
        if b > b0 and (rows + q) * max(cmax, n // ratio) * 4 > budget:
            groups.append((b0, b))
            b0, rows, cmax = b, 0, 0
        rows, cmax = rows + q, max(cmax, n // ratio)
    return [*groups, (b0, len(seq_lens))] if seq_lens else groups


# --------------------------------------------------------------------------- compressed attention

# Tiles per split in batch-invariant mode (1024 keys at BLOCK_N 64).
INVARIANT_SPLIT_TILES = 16
# Fewest tiles per split (adaptive mode): one decode row's keys (128 window + 512 top-k = 10
# tiles) over a few programs.
MIN_SPLIT_TILES = 2
# With small_grid (DEEPINFER_CUDA_V4_SMALL_GRID=1; off until timed on a GPU, which
# bench/bench_v4_attention.py does), a grid of fewer than SMALL_GRID_PROGRAMS programs of whole
# head tiles (V4-Flash's 64 heads are one tile, so at batch 1 an HCA row's 3 tiles are one
# program: the 4-layer step's four calls took 0.107 ms on an H200,
# bench/results/2026-12-03_H200_v4_step_profile) takes head tiles of SMALL_BLOCK_M rows and splits
# down to SMALL_MIN_SPLIT_TILES tiles (adaptive mode only: batch-invariant tiles never depend on
# the batch).
SMALL_GRID_PROGRAMS = 64
SMALL_BLOCK_M = 16
SMALL_MIN_SPLIT_TILES = 1


@triton.jit
def _listed_before(row_ptr, ids, li, first, KT, BLOCK_N: tl.constexpr):
    """(BLOCK_N,) bool: ids[x] (at list position li[x]) also sits at an earlier position of the row's
    list row_ptr[0:KT]; `first` = li[0]."""
    dup = tl.zeros([BLOCK_N], tl.int32)
    for c0 in range(0, first + BLOCK_N, BLOCK_N):
        pl = c0 + tl.arange(0, BLOCK_N)
        prev = tl.load(row_ptr + pl, mask=pl < KT, other=-1)
        same = (ids[:, None] == prev[None, :]) & (pl[None, :] < li[:, None])
        dup = tl.maximum(dup, tl.max(same.to(tl.int32), axis=1))
    return dup != 0


@triton.jit(
    do_not_specialize=[
        "H", "page", "cpage", "window", "ratio", "KT", "min_split_tiles", "split_tiles", "max_splits",
        "stride_tk",
    ]
)  # fmt: skip
def _compressed_attention_kernel(
    q_ptr, kv_ptr, ckv_ptr, bt_ptr, cbt_ptr, seq_lens_ptr, qsl_ptr, sinks_ptr, topk_ptr,
    out_ptr, part_ptr, lse_ptr,
    stride_qt, stride_qh, stride_kvb, stride_kvt, stride_ckb, stride_ckt, stride_bt, stride_cbt,
    stride_ot, stride_oh, stride_tk,
    H, page, cpage, qk_scale, window, ratio, KT, min_split_tiles, split_tiles, max_splits, D,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_TOPK: tl.constexpr, HAS_SINKS: tl.constexpr,
    DIRECT: tl.constexpr, IEEE: tl.constexpr, KV_FMT: tl.constexpr = 0, CKV_FMT: tl.constexpr = 0,
):  # fmt: skip
    head_tiles = tl.cdiv(H, BLOCK_M)
    i = tl.program_id(0) // head_tiles
    b = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if i >= q_len:
        return
    pos = tl.load(seq_lens_ptr + b) - q_len + i  # the query's absolute position
    t = (q_start + i).to(tl.int64)
    if HAS_WINDOW:
        lo = tl.maximum(pos - window + 1, 0)
    else:
        lo = tl.zeros_like(pos)
    n_vis = (pos + 1) // ratio  # entries closed at or before the query
    if HAS_TOPK:
        n_list = KT
    else:
        n_list = n_vis
    # the key list: window tiles [0, win_tiles), then entry tiles
    win_tiles = tl.cdiv(pos + 1 - lo, BLOCK_N)
    n_tiles = win_tiles + tl.cdiv(n_list, BLOCK_N)
    if split_tiles > 0:  # fixed (batch-invariant): whole splits of split_tiles tiles
        per = split_tiles
    else:  # adaptive: the row's tiles in max_splits parts of >= min_split_tiles tiles
        per = tl.maximum(min_split_tiles, tl.cdiv(n_tiles, max_splits))
    tile0 = split * per
    tile1 = tl.minimum(n_tiles, tile0 + per)
    heads = (tl.program_id(0) % head_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    hmask = heads < H
    row_g = (t * H + heads) * max_splits + split  # (BLOCK_M,) partial rows
    if not DIRECT:  # noqa: SIM102 (nested: the compiler prunes the outer constexpr branch first)
        if tile0 >= tile1:  # an empty split: an empty partial
            tl.store(lse_ptr + row_g, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=hmask)
            return

    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    q = tl.load(
        q_ptr + t * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=hmask[:, None] & dmask[None, :],
        other=0.0,
    )
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for tile in range(tile0, tile1):
        if tile < win_tiles:  # token rows lo + ... of the token cache
            j = lo + tile * BLOCK_N + offs_n
            valid = j <= pos
            tblk = tl.load(bt_ptr + b * stride_bt + j // page, mask=valid, other=0).to(tl.int64)
            rows = kv_ptr + tblk * stride_kvb + (j % page) * stride_kvt
            k = _load_rows(rows, offs_d, valid, D, KV_FMT).to(q.dtype)  # both branches: q's dtype
        else:  # compressed entries: list positions li
            first = (tile - win_tiles) * BLOCK_N
            li = first + offs_n
            if HAS_TOPK:
                ids = tl.load(topk_ptr + t * stride_tk + li, mask=li < KT, other=-1)
                valid = (ids >= 0) & (ids < n_vis)
                valid = valid & ~_listed_before(topk_ptr + t * stride_tk, ids, li, first, KT, BLOCK_N)
            else:
                ids = li
                valid = li < n_vis
            ids = tl.where(valid, ids, 0)
            cblk = tl.load(cbt_ptr + b * stride_cbt + ids // cpage, mask=valid, other=0).to(tl.int64)
            rows = ckv_ptr + cblk * stride_ckb + (ids % cpage) * stride_ckt
            k = _load_rows(rows, offs_d, valid, D, CKV_FMT).to(q.dtype)
        s = mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), IEEE) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = mma(p.to(k.dtype), k, acc * alpha[:, None], IEEE)  # V = K
        m_i = m_new

    omask = hmask[:, None] & dmask[None, :]
    if DIRECT:
        denom = l_i
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + heads, mask=hmask, other=0.0) * 1.4426950408889634
            denom += tl.exp2(sink - tl.where(m_i == float("-inf"), 0.0, m_i))
        o = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
        out_row = out_ptr + t * stride_ot + heads * stride_oh
        tl.store(out_row[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + row_g, lse, mask=hmask)
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(part_ptr + row_g[:, None] * BLOCK_D + offs_d[None, :], o, mask=omask)


def _compressed_config(h: int, dtype: torch.dtype) -> attn_k.AttentionConfig:
    if dtype == torch.float32:
        return attn_k.FP32_CONFIG
    block_m = min(64, next_pow2(h))
    return attn_k.AttentionConfig(block_m=block_m, block_n=64, num_warps=8 if block_m == 64 else 4)


def compressed_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    ckv: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    ratio: int,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    topk_indices: torch.Tensor | None = None,
    compressed_block_tables: torch.Tensor | None = None,
    batch_invariant: bool = False,
    config: attn_k.AttentionConfig | None = None,
    split_tiles: int | None = None,
    pdl: bool = True,
    kv_format: str | None = None,
    ckv_format: str | None = None,
    small_grid: bool = False,
) -> torch.Tensor:
    """q (T, H, D) -> (T, H, D) in q's dtype: one softmax over each query's window rows of the
    token cache kv (NB, BS, >= D) and its compressed entries in ckv (NBc, BSc, >= D) (all visible,
    or those of topk_indices (T, Kt)), sinks (H,) float32 in the denominator. K = V.
    split_tiles: tiles per split (None: batch-invariant mode INVARIANT_SPLIT_TILES, else adaptive).
    The grid comes from the host lengths (upper bounds in a replayed graph). pdl: the split
    merge's launch (attention.combine_splits). kv_format / ckv_format: V4.1 row formats of the
    caches (uint8 rows of row_bytes(format, D) bytes; None: values in q's dtype family).
    small_grid: a grid of fewer than SMALL_GRID_PROGRAMS programs takes the small-grid tiling
    (DEEPINFER_CUDA_V4_SMALL_GRID; adaptive mode and the default config only)."""
    t, h, d = q.shape
    _check_rows("compressed_attention token cache", kv, d, kv_format)
    _check_rows("compressed_attention entry cache", ckv, d, ckv_format)
    if kv_format is None and ckv_format is None and kv.dtype != ckv.dtype:
        raise ValueError(f"compressed_attention: token cache {kv.dtype} and entry cache {ckv.dtype} differ")
    if ratio < 1 or (window is not None and window < 1):
        raise ValueError(f"compressed_attention: ratio {ratio} and window {window} must be >= 1")
    for b, (kv_len, n) in enumerate(zip(meta.seq_lens_host, meta.query_lens_host)):
        if n > kv_len:
            raise ValueError(f"request {b}: query length {n} exceeds its KV length {kv_len}")
    if sum(meta.query_lens_host) != t:
        raise ValueError(
            f"q has {t} rows but the metadata describes {sum(meta.query_lens_host)} query tokens"
        )
    if topk_indices is not None and topk_indices.shape[0] != t:
        raise ValueError(f"topk_indices has {topk_indices.shape[0]} rows; the step has {t} query tokens")
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    if t == 0 or h == 0 or d == 0:
        return out.zero_()
    q = q if q.stride(-1) == 1 else q.contiguous()
    topk = None
    if topk_indices is not None:
        topk = topk_indices if topk_indices.stride(-1) == 1 else topk_indices.contiguous()
    cbt = meta.block_tables if compressed_block_tables is None else compressed_block_tables
    batch, max_q, max_len = meta.num_requests, max(meta.query_lens_host), max(meta.seq_lens_host)

    cfg = config or _compressed_config(h, q.dtype)
    min_tiles = MIN_SPLIT_TILES
    small = small_grid and batch * max_q * triton.cdiv(h, cfg.block_m) < SMALL_GRID_PROGRAMS
    if config is None and small and not batch_invariant and split_tiles is None and q.dtype != torch.float32:
        block_m = min(SMALL_BLOCK_M, cfg.block_m)
        cfg = attn_k.AttentionConfig(block_m=block_m, block_n=cfg.block_n, num_warps=4)
        min_tiles = SMALL_MIN_SPLIT_TILES
    bn = cfg.block_n
    list_len = topk.shape[1] if topk is not None else max_len // ratio
    max_tiles = triton.cdiv(min(window or max_len, max_len), bn) + triton.cdiv(list_len, bn)
    head_tiles = triton.cdiv(h, cfg.block_m)
    if split_tiles is None and batch_invariant:
        split_tiles = INVARIANT_SPLIT_TILES
    if split_tiles:
        max_splits = triton.cdiv(max_tiles, split_tiles)
    else:
        want = max(1, 2 * num_sms(q.device) // (batch * max_q * head_tiles))
        max_splits = max(1, min(want, max_tiles // min_tiles))
    direct = max_splits == 1 and not batch_invariant
    block_d = next_pow2(d)
    if direct:
        part = lse = out  # unused
    else:
        part = torch.empty((t * h * max_splits, block_d), dtype=torch.float32, device=q.device)
        lse = torch.empty((t * h * max_splits,), dtype=torch.float32, device=q.device)
    _compressed_attention_kernel[(max_q * head_tiles, batch, max_splits)](
        q, kv, ckv, meta.block_tables, cbt, meta.seq_lens, meta.query_start_loc,
        sinks if sinks is not None else q, topk if topk is not None else q, out, part, lse,
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), ckv.stride(0), ckv.stride(1),
        meta.block_tables.stride(0), cbt.stride(0), out.stride(0), out.stride(1),
        topk.stride(0) if topk is not None else 0,
        h, kv.shape[1], ckv.shape[1], scale * LOG2E, window or 0, ratio,
        topk.shape[1] if topk is not None else 0, min_tiles, split_tiles or 0, max_splits, d,
        BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=bn, HAS_WINDOW=window is not None,
        HAS_TOPK=topk is not None, HAS_SINKS=sinks is not None, DIRECT=direct,
        IEEE=q.dtype == torch.float32, KV_FMT=row_format_code(kv_format), CKV_FMT=row_format_code(ckv_format),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if not direct:
        attn_k.combine_splits(part, lse, sinks, out, h, max_splits, d, pdl=pdl)
    return out
