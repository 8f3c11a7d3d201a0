# mypy: disable-error-code="no-untyped-def,untyped-decorator,no-untyped-call"
# (Triton kernels take untyped tensor-like arguments by design; the launchers are typed.)
"""MLA's absorbed query in one launch: [q_nope @ W_UK^T per head | rope(q_pe)] (AttentionOps.mla_query).

Symbols: T tokens, H heads, N nope width (the product's K), C latent width, R rope width.
It replaces the rope kernel, the bmm (and the copy of its transposed operand) and the concat.
Each program owns BLOCK_T rows of one head and reduces N for them in BLOCK_N steps, in order,
with a float32 accumulator from zero: a row's bits depend on the tile (BLOCK_T, BLOCK_C,
BLOCK_N, warps), never on which rows share it, so one fixed tile makes it batch-invariant.
With a CacheWrite the same launch also stores the step's latent cache rows
(AttentionOps.mla_query_and_cache): at decode sizes that is one launch a layer fewer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer_cuda.kernels.common import (
    launch_dependents,
    mma,
    next_pow2,
    pdl_enabled,
    to_dtype,
    wait_for_previous,
)
from deepinfer_cuda.kernels.small import (
    CAST_DTYPES,
    check_mla_kv_write,
    mla_kv_row_inputs,
    rope_rows,
    write_mla_kv,
    write_mla_kv_row,
    write_mla_kv_row_from,
)


@dataclass(frozen=True)
class QueryTile:
    block_t: int  # rows per program (tl.dot needs >= 16: decode rows are padded, masked)
    block_c: int  # latent columns per program
    num_warps: int = 4


# Decode sizes: 16-row tiles and 64 columns, so that T = 1 still spreads W_UK's reads (H x C x N,
# 2 MiB for V2-Lite's 16 heads) over H x 9 programs; up to 128 rows too (a 128-token prefill
# chunk, batch 128), where the 64 x 128 tiles left 160 programs and a cache-write launch after
# them; larger steps: 64 x 128 tiles reuse each weight tile for more rows. Batch-invariant mode:
# the decode tile for every T.
DECODE_TILE = QueryTile(block_t=16, block_c=64)
PREFILL_TILE = QueryTile(block_t=64, block_c=128)
DECODE_MAX_T = 128


def query_tile(t: int, batch_invariant: bool, decode_max_t: int = DECODE_MAX_T) -> QueryTile:
    """The tile for T rows (batch-invariant: one tile for every T)."""
    return DECODE_TILE if batch_invariant or t <= decode_max_t else PREFILL_TILE


@triton.jit
def _mla_query_kernel(
    qn_ptr, qp_ptr, w_ptr, pos_ptr, cs_ptr, out_ptr, T, N, C, HALF,
    stride_qnt, stride_qnh, stride_qpt, stride_qph, stride_wh, stride_wc, stride_wn,
    stride_pos, stride_cs, stride_ot, stride_oh,
    kv_ptr, kvw_ptr, slot_ptr, cache_ptr, eps, stride_kv, stride_slot, D,
    INTERLEAVED: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    WRITE: tl.constexpr, BLOCK_KC: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Rows [t0, t0 + BLOCK_T) of head h (grid axes 0, 1). Axis 2: program c < cdiv(C, BLOCK_C)
    writes out[rows, h, c-th BLOCK_C columns] = q_nope[rows, h] @ w[h, cols]^T; the one after
    them (the tail) writes out[rows, h, C:] = rope(q_pe[rows, h]) at each row's position, and
    WRITE: the cache rows of the tile's tokens h, h + H, ... (small.write_mla_kv_row: kv's
    latent normed by kvw, its rope part rotated at the same positions; D = C + R). PDL: the first
    W_UK tile is loaded before waiting for the previous kernel (common.pdl_enabled); EARLY (the
    positions and slots were written before the forward's first kernel: mla_query, early_inputs)
    the tail also loads them, their cos / sin and the norm weight before it waits, so that after
    the wait it only reads q_pe and kv: the tail is the launch's longest chain of loads."""
    launch_dependents(PDL)
    pid_t = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    pid_c = tl.program_id(2)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    rows64 = rows.to(tl.int64)
    out_rows = out_ptr + rows64[:, None] * stride_ot + h * stride_oh  # (BLOCK_T, 1)
    if pid_c * BLOCK_C < C:
        cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        rk = tl.arange(0, BLOCK_N)
        a_rows = qn_ptr + rows64[:, None] * stride_qnt + h * stride_qnh  # (BLOCK_T, 1)
        b_cols = w_ptr + h * stride_wh + cols[None, :].to(tl.int64) * stride_wc  # (1, BLOCK_C): W^T tiles
        acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
        # each step's W_UK tile is loaded one step ahead (the first before the wait); past the
        # end the load is fully masked
        b = tl.load(b_cols + rk[:, None] * stride_wn, mask=(cols[None, :] < C) & (rk[:, None] < N), other=0.0)
        wait_for_previous(PDL)
        for k0 in range(0, N, BLOCK_N):
            a = tl.load(a_rows + (k0 + rk)[None, :], mask=rmask[:, None] & (rk < N - k0)[None, :], other=0.0)
            acc = mma(a, b, acc, IEEE)
            k1 = k0 + BLOCK_N
            b_mask = (cols[None, :] < C) & (rk < N - k1)[:, None]
            b = tl.load(b_cols + (k1 + rk)[:, None] * stride_wn, mask=b_mask, other=0.0)
        omask = rmask[:, None] & (cols[None, :] < C)
        tl.store(out_rows + cols[None, :], to_dtype(acc, out_ptr.dtype.element_ty), mask=omask)
    else:
        if not EARLY:
            wait_for_previous(PDL)
        i = tl.arange(0, BLOCK_R)
        pos = tl.load(pos_ptr + rows64 * stride_pos, mask=rmask, other=0).to(tl.int64)
        cs = cs_ptr + pos[:, None] * stride_cs + i[None, :]
        cmask = rmask[:, None] & (i[None, :] < HALF)
        cos = tl.load(cs, mask=cmask, other=0.0).to(tl.float32)
        sin = tl.load(cs + HALF, mask=cmask, other=0.0).to(tl.float32)
        # the first token this program writes (WRITE): token h of the row tile, if there is one
        first = tl.minimum(pid_t * BLOCK_T + h, T - 1)
        slot, kvw, kcos, ksin = mla_kv_row_inputs(
            kvw_ptr, pos_ptr, cs_ptr, slot_ptr, first, C, HALF, stride_pos, stride_cs, stride_slot,
            BLOCK_KC, BLOCK_R, WRITE,
        )  # fmt: skip
        if EARLY:
            wait_for_previous(PDL)
        q_rows = qp_ptr + rows64[:, None] * stride_qpt + h * stride_qph
        rope_rows(q_rows, out_rows + C, rmask[:, None], cos, sin, HALF, INTERLEAVED, BLOCK_R)
        if WRITE:
            if pid_t * BLOCK_T + h < T:
                write_mla_kv_row_from(
                    kv_ptr, cache_ptr, first, C, HALF, eps, stride_kv, D, slot, kvw, kcos, ksin,
                    INTERLEAVED, BLOCK_KC, BLOCK_R, True,
                )  # fmt: skip
            for i in range(h + tl.num_programs(1), BLOCK_T, tl.num_programs(1)):
                t = pid_t * BLOCK_T + i
                if t < T:
                    write_mla_kv_row(
                        kv_ptr, kvw_ptr, pos_ptr, cs_ptr, slot_ptr, cache_ptr, t.to(tl.int64), C, HALF, eps,
                        stride_kv, stride_pos, stride_cs, stride_slot, D, INTERLEAVED, BLOCK_KC, BLOCK_R,
                        True,  # R = 0: every rope load and store is masked off (HALF = 0)
                    )  # fmt: skip


def supported(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> bool:
    """Whether the kernel takes these dtypes: one float dtype it rounds like torch, for all three."""
    return q_nope.dtype in CAST_DTYPES and q_pe.dtype == q_nope.dtype and w_uk.dtype == q_nope.dtype


@dataclass(frozen=True)
class CacheWrite:
    """This step's latent cache rows, written by mla_query's launch (small.write_mla_kv's
    arguments): cache (NB, BS, C + R) contiguous, kv (T, C + R) the raw KV down-projection
    (a strided view is fine), norm_weight (C,), slot_mapping (T,) (-1: skip the row)."""

    cache: torch.Tensor
    kv: torch.Tensor
    norm_weight: torch.Tensor
    eps: float
    slot_mapping: torch.Tensor


def mla_query(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    w_uk: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    interleaved: bool,
    batch_invariant: bool = False,
    tile: QueryTile | None = None,
    write: CacheWrite | None = None,
    early_inputs: bool = False,
    decode_max_t: int = DECODE_MAX_T,
    pdl: bool = True,
) -> torch.Tensor:
    """q_nope (T, H, N), q_pe (T, H, R) (strided views are fine), w_uk (H, C, N), positions (T,),
    cos_sin_cache (P, R) rows [cos | sin] -> (T, H, C + R) in q_nope's dtype, one launch, no host
    sync. `write`: the same launch also stores the step's latent cache rows, as
    small.write_mla_kv does at the same positions (its tail programs: the rope program of head h
    writes tokens h, h + H, ... of its row tile). `tile` (tests) overrides query_tile's choice.
    early_inputs: the caller promises that positions and the write's slot mapping were written
    before the forward's first kernel (a model's step inputs): under programmatic dependent
    launch the tail programs read them while the previous kernel still runs. decode_max_t: the
    most rows that take the decode tile (query_tile). pdl: launch with PDL where the device has it
    (common.pdl_enabled)."""
    if q_nope.dim() != 3 or q_pe.dim() != 3 or w_uk.dim() != 3:
        raise ValueError(
            f"mla_query: q_nope (T, H, N), q_pe (T, H, R), w_uk (H, C, N), got {tuple(q_nope.shape)}, "
            f"{tuple(q_pe.shape)}, {tuple(w_uk.shape)}"
        )
    t, h, n = q_nope.shape
    r = q_pe.shape[2]
    c = w_uk.shape[1]
    if q_pe.shape[:2] != (t, h) or w_uk.shape[0] != h or w_uk.shape[2] != n:
        raise ValueError(
            f"mla_query: q_pe {tuple(q_pe.shape)} and w_uk {tuple(w_uk.shape)} do not match q_nope "
            f"{tuple(q_nope.shape)}: expected ({t}, {h}, R) and ({h}, C, {n})"
        )
    if r % 2 or (r and cos_sin_cache.shape[-1] != r):
        raise ValueError(f"mla_query: an even rope width R = {r} equal to the cos_sin_cache width "
                         f"{cos_sin_cache.shape[-1]}")  # fmt: skip
    if positions.shape != (t,):
        raise ValueError(f"mla_query: positions must be ({t},), got {tuple(positions.shape)}")
    if not supported(q_nope, q_pe, w_uk):
        raise ValueError(f"mla_query: one dtype of {CAST_DTYPES} for q_nope, q_pe and w_uk, got "
                         f"{q_nope.dtype}, {q_pe.dtype}, {w_uk.dtype}")  # fmt: skip
    if write is not None:
        check_mla_kv_write(
            write.cache, write.kv, c, write.norm_weight, positions, cos_sin_cache, write.slot_mapping
        )
    out = torch.empty((t, h, c + r), dtype=q_nope.dtype, device=q_nope.device)
    if t == 0 or h == 0 or c + r == 0:
        if write is not None:
            write_mla_kv(
                write.cache, write.kv, c, write.norm_weight, write.eps, positions, cos_sin_cache,
                interleaved, write.slot_mapping, pdl,
            )  # fmt: skip
        return out
    qn = q_nope if q_nope.stride(-1) == 1 else q_nope.contiguous()
    qp = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    cs = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    cfg = tile or query_tile(t, batch_invariant, decode_max_t)
    grid = (triton.cdiv(t, cfg.block_t), h, triton.cdiv(c, cfg.block_c) + (1 if r or write else 0))
    pdl = pdl_enabled(q_nope.device, pdl)
    if write is not None:
        kv = write.kv if write.kv.stride(-1) == 1 else write.kv.contiguous()
        cache, kvw, slots, eps = write.cache, write.norm_weight.contiguous(), write.slot_mapping, write.eps
    else:  # unused
        kv = cache = kvw = slots = out
        eps = 0.0
    _mla_query_kernel[grid](
        qn, qp, w_uk, positions, cs, out, t, n, c, r // 2,
        qn.stride(0), qn.stride(1), qp.stride(0), qp.stride(1), *w_uk.stride(),
        positions.stride(0), cs.stride(0), out.stride(0), out.stride(1),
        kv, kvw, slots, cache, eps, kv.stride(0), slots.stride(0), c + r,
        INTERLEAVED=interleaved, IEEE=q_nope.dtype == torch.float32, BLOCK_T=cfg.block_t,
        BLOCK_C=cfg.block_c, BLOCK_N=min(128, next_pow2(n)), BLOCK_R=next_pow2(r // 2, 1),
        WRITE=write is not None, BLOCK_KC=next_pow2(c), EARLY=early_inputs, PDL=pdl, num_warps=cfg.num_warps,
        launch_pdl=pdl,
    )  # fmt: skip
    return out
