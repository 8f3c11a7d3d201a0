# mypy: disable-error-code="no-untyped-def,untyped-decorator,no-untyped-call"
# (Triton kernels take untyped tensor-like arguments by design; the launchers are typed.)
"""MoE routing and alignment kernels: the router in one launch, and the stable expert sort plus
the grouped GEMM's tile table in another (the torch compositions they replace are kept as the
oracle in tests/test_cuda_kernels.py and as the DEEPINFER_CUDA_UNFUSED=1 path).

Router (route): one program per token row. Scores (softmax / sigmoid / sqrtsoftplus) in float32,
the correction bias for selection only, group-limited selection, then top-k by iterated argmax
(ties to the lowest expert id; ids in descending selection score, as torch.topk returns them).
The row is held as a (groups, experts per group) tile padded to powers of two with -inf, so
E = 256 (DeepSeek-V3) is an 8 x 32 tile and E = 384 ungrouped a 1 x 512 one.
Scores and router in one launch (select_experts, decode sizes): router_logits' programs, one per
(token, 4 experts), write the logits; the last of a row's programs to finish (a ticket counter
per row, reset by that program) routes the row with the same code (_route_row): the same bits as
router_logits + route, one launch instead of two.

Alignment: one program does a counting sort of the T*K token copies by expert over blocks of
rows: a histogram pass, then per block each copy goes to its expert's next free sorted row plus
the number of earlier copies of the block with the same expert, so the order is stable in source
order like torch.sort(stable=True); the same program then writes the tile table. Shapes depend
on T, K and E only: no host sync, graph-safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer.backend.types import RouterConfig
from deepinfer_cuda.kernels.common import (
    INTERPRET,
    IS_INTERPRET,
    Semaphores,
    launch_dependents,
    log1p,
    mma,
    next_pow2,
    pdl_enabled,
    to_e4m3,
    wait_for_previous,
)
from deepinfer_cuda.kernels.gemm import TileTable, e2m1_pair, e8m0_scale, fp4_scales

SCORING = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}

# The one-launch sort (_align_kernel) gives each program one block of rows; every program reads
# all the ids for its offsets. When one program sorted every row (32 rows per step at about
# 0.8 us a step for 256 experts) an H200 took, in CUDA graphs, E = 256: 3.6 us at 8 rows, 28 us
# at 512, 55 us at 1024 against 51 us for the torch sort plus the one-launch tile table; and
# V2-Lite's 1024-row prefill (batch 1, 128 tokens) 43 us a layer. Above this many token copies
# the torch sort takes over; the tile table stays one launch either way.
ALIGN_MAX_ROWS = 1024


# --------------------------------------------------------------------------- router


@triton.jit
def _route_row(
    logits_row, bias_ptr, hash_row, w_row, ids_row, E, scaling,
    SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, HASH: tl.constexpr, RENORMALIZE: tl.constexpr,
    TOP_K: tl.constexpr, SHARED: tl.constexpr, GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
    TOP2_SUM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
    VOLATILE: tl.constexpr,
):  # fmt: skip
    """One token: logits (E,) at logits_row -> weights (K + S,) float32 at w_row and ids (K + S,)
    int32 at ids_row, the S shared experts (ids E .. E + S - 1, weight 1) after the K routed
    ones; hash_row: the token's K given experts (HASH). VOLATILE: the logits were written by
    other programs of this launch (no stale L1 lines)."""
    size = E // GROUPS
    gi = tl.arange(0, BLOCK_G)
    g = gi[:, None]
    j = tl.arange(0, BLOCK_S)[None, :]
    e = g * size + j  # (BLOCK_G, BLOCK_S) expert id
    valid = (g < GROUPS) & (j < size)
    neg = float("-inf")
    x = tl.load(logits_row + e, mask=valid, other=neg, volatile=VOLATILE).to(tl.float32)
    if SCORING == 0:  # softmax over the E experts (padding: exp(-inf) = 0)
        p = tl.exp(x - tl.max(tl.max(x, 1), 0))
        s = p / tl.sum(tl.sum(p, 1), 0)
    elif SCORING == 1:
        s = 1.0 / (1.0 + tl.exp(-x))
    else:  # sqrt(softplus(x)), torch's softplus: x above its threshold 20, else log1p(exp(x))
        s = tl.sqrt_rn(tl.where(x > 20.0, x, log1p(tl.exp(x))))
    s = tl.where(valid, s, 0.0)
    ks = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int32)
    if HASH:  # the experts are given; weights are the scores there
        for k in range(TOP_K):
            pick = tl.load(hash_row + k).to(tl.int32)
            w = tl.where(ks == k, tl.sum(tl.sum(tl.where(e == pick, s, 0.0), 1), 0), w)
            ids = tl.where(ks == k, pick, ids)
    else:
        sel = s
        if HAS_BIAS:
            sel += tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32)
        sel = tl.where(valid, sel, neg)
        if GROUPS > 1:
            if TOP2_SUM:  # the two best biased scores of each group (a tied best counts twice)
                m1 = tl.max(sel, 1)
                first = tl.min(tl.where(sel == m1[:, None], j, BLOCK_S), 1)
                group_score = m1 + tl.max(tl.where(j == first[:, None], neg, sel), 1)
            else:
                group_score = tl.max(sel, 1)
            group_score = tl.where(gi < GROUPS, group_score, neg)
            keep = gi < 0  # (BLOCK_G,) all False
            for _ in range(TOPK_GROUPS):  # iterated argmax over the groups, ties to the lowest
                cand = tl.where(keep, neg, group_score)
                best = tl.max(cand, 0)
                pick_g = tl.min(tl.where((cand == best) & ~keep & (gi < GROUPS), gi, BLOCK_G), 0)
                keep |= gi == pick_g
            sel = tl.where(keep[:, None], sel, neg)
        taken = e < 0  # all False
        for k in range(TOP_K):  # iterated argmax: descending selection score, ties to the lowest id
            cand = tl.where(taken, neg, sel)
            best = tl.max(tl.max(cand, 1), 0)
            pick = tl.min(tl.min(tl.where((cand == best) & ~taken & valid, e, E), 1), 0)
            pick = tl.minimum(pick, E - 1)  # never out of range (NaN scores match nothing)
            taken |= e == pick
            w = tl.where(ks == k, tl.sum(tl.sum(tl.where(e == pick, s, 0.0), 1), 0), w)
            ids = tl.where(ks == k, pick, ids)
    if RENORMALIZE:
        w = w / (tl.sum(w, 0) + 1e-20)
    shared = ks >= TOP_K
    w = tl.where(shared, 1.0, w * scaling)
    ids = tl.where(shared, E + ks - TOP_K, ids)
    kmask = ks < TOP_K + SHARED
    tl.store(w_row + ks, w, mask=kmask)
    tl.store(ids_row + ks, ids, mask=kmask)


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, hash_ptr, w_ptr, ids_ptr, E, stride_l, stride_h, scaling,
    SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, HASH: tl.constexpr, RENORMALIZE: tl.constexpr,
    TOP_K: tl.constexpr, SHARED: tl.constexpr, GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
    TOP2_SUM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One program per token row of logits (T, E)."""
    t = tl.program_id(0).to(tl.int64)
    _route_row(
        logits_ptr + t * stride_l, bias_ptr, hash_ptr + t * stride_h, w_ptr + t * (TOP_K + SHARED),
        ids_ptr + t * (TOP_K + SHARED), E, scaling, SCORING, HAS_BIAS, HASH, RENORMALIZE, TOP_K, SHARED,
        GROUPS, TOPK_GROUPS, TOP2_SUM, BLOCK_G, BLOCK_S, BLOCK_K, False,
    )  # fmt: skip


def _route_args(
    t: int,
    e: int,
    config: RouterConfig,
    correction_bias: torch.Tensor | None,
    hash_ids: torch.Tensor | None,
) -> dict[str, int | bool]:
    """Checks the router's arguments for T tokens and E experts -> _route_row's constexprs."""
    k, shared = config.top_k, config.shared_experts
    if config.scoring not in SCORING:
        raise ValueError(f"unknown router scoring {config.scoring!r}; expected one of {sorted(SCORING)}")
    if not 0 < k <= e:
        raise ValueError(f"route: top_k {k} must be in [1, {e}]")
    groups = config.num_groups if hash_ids is None else 1
    if groups > 1 and (e % groups or not 0 < config.topk_groups <= groups):
        raise ValueError(f"route: {e} experts in {groups} groups keeping {config.topk_groups}")
    if hash_ids is not None and hash_ids.shape != (t, k):
        raise ValueError(f"route: hash_ids must be ({t}, {k}), got {tuple(hash_ids.shape)}")
    if correction_bias is not None and correction_bias.shape != (e,):
        raise ValueError(f"route: correction_bias must be ({e},), got {tuple(correction_bias.shape)}")
    if shared < 0:
        raise ValueError(f"route: shared_experts must be >= 0, got {shared}")
    return dict(
        SCORING=SCORING[config.scoring], HAS_BIAS=correction_bias is not None, HASH=hash_ids is not None,
        RENORMALIZE=config.renormalize, TOP_K=k, SHARED=shared, GROUPS=groups,
        TOPK_GROUPS=config.topk_groups, TOP2_SUM=config.group_score == "top2_sum",
        BLOCK_G=next_pow2(groups, 2), BLOCK_S=next_pow2(e // groups), BLOCK_K=next_pow2(k + shared, 2),
    )  # fmt: skip


def _route_buffers(
    t: int,
    config: RouterConfig,
    device: torch.device,
    correction_bias: torch.Tensor | None,
    hash_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The router kernels' outputs, weights (T, K + S) float32 and ids (T, K + S) int32, and
    their optional inputs with unit stride along the last dim: (weights, ids, bias, hash_ids)."""
    n = config.top_k + config.shared_experts
    weights = torch.empty((t, n), dtype=torch.float32, device=device)
    ids = torch.empty((t, n), dtype=torch.int32, device=device)
    bias = correction_bias.contiguous() if correction_bias is not None else None
    hashed = hash_ids if hash_ids is None or hash_ids.stride(-1) == 1 else hash_ids.contiguous()
    return weights, ids, bias, hashed


def route(
    logits: torch.Tensor,
    config: RouterConfig,
    correction_bias: torch.Tensor | None = None,
    hash_ids: torch.Tensor | None = None,
    tile: RouterTile | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (T, E) -> (weights (T, K + S) float32, ids (T, K + S) int32) in one launch, S =
    config.shared_experts; the meaning is deepinfer.reference.moe.route's (RouterConfig). Its
    warps are the tile's (default router_tile(T)): a row's softmax sum is ordered by them."""
    t, e = logits.shape
    tile = tile or router_tile(t)
    consts = _route_args(t, e, config, correction_bias, hash_ids)
    weights, ids, bias, hashed = _route_buffers(t, config, logits.device, correction_bias, hash_ids)
    if t == 0:
        return weights, ids
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    _route_kernel[(t,)](
        logits, bias if bias is not None else logits, hashed if hashed is not None else ids, weights, ids,
        e, logits.stride(0), hashed.stride(0) if hashed is not None else 0, config.routed_scaling_factor,
        **consts, num_warps=tile.num_warps,
    )  # fmt: skip
    return weights, ids


# Up to this many tokens the router's scores come from router_logits' kernel (one launch reading
# x in its own dtype) rather than x.float() and a float32 cuBLAS GEMV (three launches), and
# select_experts is one launch (scores and routing).
ROUTER_GEMV_MAX_TOKENS = 64


@dataclass(frozen=True)
class RouterTile:
    """The router kernels' tile: each program reads block_e experts' gate rows, block_d columns
    per step, with num_warps warps. It orders a row's sums, so router_logits, route and
    select_experts take the same tile for the same T (the same bits either way)."""

    block_e: int
    block_d: int
    num_warps: int


# H200, a CUDA graph of 50 back-to-back select_experts calls with PDL (bench/bench_router.py
# --tiles, bench/results/2026-12-02_H200_pdl_decode_step): V2-Lite's router at T = 1 took 5.85 us with
# 4 x 512 x 4 warps and 3.93 with 1 x 2048 x 1 (V3: 9.90 and 8.26); at T = 8 V2-Lite 6.46 and
# 4.56, V3 14.78 and 15.28; at T = 64 4 x 512 x 4 wins by far (V2-Lite 8.33 against 11.77, V3 38
# against 70). One-warp programs per expert row serve up to ROUTER_FEW_TOKENS tokens; batch-
# invariant mode takes the cuBLAS scores and ROUTER_TILE's warps for every T.
ROUTER_TILE = RouterTile(block_e=4, block_d=512, num_warps=4)
ROUTER_FEW_TILE = RouterTile(block_e=1, block_d=2048, num_warps=1)
ROUTER_FEW_TOKENS = 4


def router_tile(t: int, batch_invariant: bool = False) -> RouterTile:
    """The router's tile for T tokens (batch-invariant: ROUTER_TILE for every T). The Triton
    interpreter (CPU CI) pays per program, not per byte: ROUTER_TILE there too (the kernel tests
    pass ROUTER_FEW_TILE explicitly)."""
    few = t <= ROUTER_FEW_TOKENS and not batch_invariant and not INTERPRET
    return ROUTER_FEW_TILE if few else ROUTER_TILE


@triton.jit
def _logits_block(
    x_ptr, w_ptr, out_ptr, t, pe, E, D, stride_x, stride_w, stride_o,
    BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr, SIGNAL_AFTER_WAIT: tl.constexpr,
):  # fmt: skip
    """Token t, experts [pe * BLOCK_E, (pe + 1) * BLOCK_E): out[t, e] = sum_d float32(x[t, d]) *
    w[e, d], float32 products summed per lane over BLOCK_D steps, then across the lanes. Each
    step's gate rows are loaded one step ahead, the first before waiting for the previous kernel
    (PDL: common.pdl_enabled); past the end the load is fully masked. SIGNAL_AFTER_WAIT: call
    launch_dependents right after that wait (the caller has not)."""
    re = pe * BLOCK_E + tl.arange(0, BLOCK_E)
    rd = tl.arange(0, BLOCK_D)
    w_rows = w_ptr + re[:, None].to(tl.int64) * stride_w + rd[None, :]
    e_ok = re[:, None] < E
    w = tl.load(w_rows, mask=e_ok & (rd < D)[None, :], other=0.0)
    wait_for_previous(PDL)
    if SIGNAL_AFTER_WAIT:
        launch_dependents(PDL)
    acc = tl.zeros([BLOCK_E, BLOCK_D], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        xv = tl.load(x_ptr + t * stride_x + d0 + rd, mask=rd < D - d0, other=0.0).to(tl.float32)
        acc += w * xv[None, :]
        d1 = d0 + BLOCK_D
        w = tl.load(w_rows + d1, mask=e_ok & (rd < D - d1)[None, :], other=0.0)
    tl.store(out_ptr + t * stride_o + re, tl.sum(acc, 1), mask=re < E)


@triton.jit
def _router_logits_kernel(
    x_ptr, w_ptr, out_ptr, E, D, stride_x, stride_w, stride_o,
    BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One program per (token, BLOCK_E experts)."""
    launch_dependents(PDL)
    t = tl.program_id(0).to(tl.int64)
    _logits_block(
        x_ptr, w_ptr, out_ptr, t, tl.program_id(1), E, D, stride_x, stride_w, stride_o, BLOCK_E, BLOCK_D, PDL,
        False,
    )  # fmt: skip


@triton.jit
def _select_experts_kernel(
    x_ptr, gate_ptr, logits_ptr, tickets_ptr, bias_ptr, hash_ptr, w_ptr, ids_ptr,
    E, D, stride_x, stride_w, stride_h, scaling,
    BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
    SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, HASH: tl.constexpr, RENORMALIZE: tl.constexpr,
    TOP_K: tl.constexpr, SHARED: tl.constexpr, GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
    TOP2_SUM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """_router_logits_kernel's programs, each then counting itself in on its token's ticket; the
    token's last program (whichever it is: the row's logits are whole by then) resets the ticket
    and routes the row as _route_kernel does. The expert kernels may start launching once every
    program has waited for the previous kernel (common.pdl_enabled): x is whole then, and the
    decode up kernel computes the shared experts' copies from it while the routing runs."""
    t = tl.program_id(0).to(tl.int64)
    _logits_block(
        x_ptr, gate_ptr, logits_ptr, t, tl.program_id(1), E, D, stride_x, stride_w, E, BLOCK_E, BLOCK_D, PDL,
        True,
    )  # fmt: skip
    tl.debug_barrier()  # every thread's logits are stored before the program counts itself in
    arrived = tl.atomic_add(tickets_ptr + t, 1, sem="acq_rel")
    if arrived < tl.num_programs(1) - 1:
        return
    tl.store(tickets_ptr + t, 0)  # the row's last program: ready for the next launch
    _route_row(
        logits_ptr + t * E, bias_ptr, hash_ptr + t * stride_h, w_ptr + t * (TOP_K + SHARED),
        ids_ptr + t * (TOP_K + SHARED), E, scaling, SCORING, HAS_BIAS, HASH, RENORMALIZE, TOP_K, SHARED,
        GROUPS, TOPK_GROUPS, TOP2_SUM, BLOCK_G, BLOCK_S, BLOCK_K, True,
    )  # fmt: skip


def _check_gate(x: torch.Tensor, weight: torch.Tensor, what: str) -> None:
    e, d = weight.shape[0], x.shape[-1]
    if x.dim() != 2 or weight.shape != (e, d) or weight.dtype != torch.float32:
        raise ValueError(
            f"{what}: x must be (T, D) and weight (E, D) float32, got {tuple(x.shape)} and "
            f"{tuple(weight.shape)} {weight.dtype}"
        )


def router_logits(
    x: torch.Tensor, weight: torch.Tensor, tile: RouterTile | None = None, pdl: bool = True
) -> torch.Tensor:
    """x (T, D) float, weight (E, D) float32 -> (T, E) float32 in one launch (decode sizes: each
    program reads the tile's block_e experts' rows, so even one token spreads over E / block_e
    programs); tile: default router_tile(T). pdl: launch with PDL where the device has it
    (common.pdl_enabled)."""
    _check_gate(x, weight, "router_logits")
    t, d = x.shape
    e = weight.shape[0]
    tile = tile or router_tile(t)
    out = torch.empty((t, e), dtype=torch.float32, device=x.device)
    if t == 0 or e == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    pdl = pdl_enabled(x.device, pdl) and weight.stride(-1) == 1  # a copy made here is no weight to prefetch
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    _router_logits_kernel[(t, triton.cdiv(e, tile.block_e))](
        x, weight, out, e, d, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_E=tile.block_e, BLOCK_D=min(tile.block_d, next_pow2(d)), PDL=pdl,
        num_warps=tile.num_warps, launch_pdl=pdl,
    )  # fmt: skip
    return out


# One int32 ticket per token row of select_experts (zero between launches).
_TICKETS = Semaphores()


def select_experts(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: RouterConfig,
    correction_bias: torch.Tensor | None = None,
    hash_ids: torch.Tensor | None = None,
    tile: RouterTile | None = None,
    pdl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """route(router_logits(x, weight), config, correction_bias, hash_ids) in ONE launch, the same
    bits for the same tile (default router_tile(T)): grid (T, E / block_e) of router_logits'
    programs writing the logits to a (T, E)
    scratch; the last program of each token row to finish (a per-row ticket, taken acq_rel)
    routes that row. Rows route in parallel, so T only adds programs. x (T, D) float, weight
    (E, D) float32 -> (weights (T, K + S) float32, ids (T, K + S) int32). pdl: as router_logits'."""
    _check_gate(x, weight, "select_experts")
    t, d = x.shape
    e = weight.shape[0]
    tile = tile or router_tile(t)
    consts = _route_args(t, e, config, correction_bias, hash_ids)
    weights, ids, bias, hashed = _route_buffers(t, config, x.device, correction_bias, hash_ids)
    if t == 0:
        return weights, ids
    x = x if x.stride(-1) == 1 else x.contiguous()
    pdl = pdl_enabled(x.device, pdl) and weight.stride(-1) == 1  # a copy made here is no weight to prefetch
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    logits = torch.empty((t, e), dtype=torch.float32, device=x.device)
    _select_experts_kernel[(t, triton.cdiv(e, tile.block_e))](
        x, weight, logits, _TICKETS.get(x.device, t), bias if bias is not None else logits,
        hashed if hashed is not None else ids, weights, ids, e, d, x.stride(0), weight.stride(0),
        hashed.stride(0) if hashed is not None else 0, config.routed_scaling_factor,
        BLOCK_E=tile.block_e, BLOCK_D=min(tile.block_d, next_pow2(d)), **consts, PDL=pdl,
        num_warps=tile.num_warps, launch_pdl=pdl,
    )  # fmt: skip
    return weights, ids


# --------------------------------------------------------------------------- alignment


@dataclass(frozen=True)
class Alignment:
    """Token copies (row s = t*K + k of ids (T, K)) sorted by expert, stable in source order.

    order      (T*K,) int64  sorted row -> source row s
    token      (T*K,) int64  sorted row -> source token s // K (the first GEMM's row gather)
    src_to_dst (T*K,) int64  source row -> sorted row
    counts     (E,)   int64  copies per expert
    tiles      the grouped GEMM's tile table for these counts, when asked for
    """

    order: torch.Tensor
    token: torch.Tensor
    src_to_dst: torch.Tensor
    counts: torch.Tensor
    tiles: TileTable | None


@triton.jit
def _tile_table_part(
    counts, ex, E, NUM_TILES, group_ptr, rows_ptr, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr
):  # fmt: skip
    """counts (BLOCK_E,) int32 (0 past E), ex = arange(BLOCK_E) -> the tile table exactly as
    gemm.tile_table computes it. Expert-major: step j writes every expert's j-th tile (as many
    steps as the busiest expert has tiles: one or two at decode sizes); then the spare tiles past
    the last used one, which gemm.tile_table gives to group E - 1 with an empty row range."""
    real = ex < E
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    first = tl.cumsum(tiles, 0) - tiles  # (BLOCK_E,) first tile of each expert
    row_off = tl.cumsum(counts, 0) - counts  # (BLOCK_E,) first sorted row of each expert
    for j in range(0, tl.max(tiles, 0)):
        has = real & (j < tiles)
        start = row_off + j * BLOCK_M
        tl.store(group_ptr + first + j, ex, mask=has)
        tl.store(rows_ptr + 2 * (first + j), start, mask=has)
        tl.store(rows_ptr + 2 * (first + j) + 1, tl.minimum(start + BLOCK_M, row_off + counts), mask=has)
    last = ex == E - 1
    last_off = tl.sum(tl.where(last, row_off, 0), 0)
    last_first = tl.sum(tl.where(last, first, 0), 0)
    for t0 in range(tl.sum(tiles, 0), NUM_TILES, BLOCK_T):
        tt = t0 + tl.arange(0, BLOCK_T)
        ok = tt < NUM_TILES
        start = last_off + (tt - last_first) * BLOCK_M
        tl.store(group_ptr + tt, tl.zeros_like(tt) + E - 1, mask=ok)
        tl.store(rows_ptr + 2 * tt, start, mask=ok)
        tl.store(rows_ptr + 2 * tt + 1, start, mask=ok)


@triton.jit
def _align_kernel(
    ids_ptr, order_ptr, token_ptr, s2d_ptr, counts_ptr, group_ptr, rows_ptr, M, E, K, NUM_TILES,
    TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_ALL: tl.constexpr,
):  # fmt: skip
    """Program p: stable counting sort of rows [p * BLOCK_R, (p + 1) * BLOCK_R) of the M = T*K
    flat ids by expert. Every program reads all M ids (BLOCK_ALL >= M, one load) for the
    histogram of the whole and of the rows before its block, so the programs need nothing from
    each other; program 0 also stores the counts and the tile table."""
    ex = tl.arange(0, BLOCK_E)
    r0 = tl.program_id(0) * BLOCK_R
    ra = tl.arange(0, BLOCK_ALL)
    all_ids = tl.load(ids_ptr + ra, mask=ra < M, other=0).to(tl.int32)
    counts = tl.histogram(all_ids, BLOCK_E, mask=ra < M)
    before = tl.histogram(all_ids, BLOCK_E, mask=ra < r0)
    if r0 == 0:
        tl.store(counts_ptr + ex, counts.to(tl.int64), mask=ex < E)
    # row r goes to (first sorted row of its expert) + (its expert's rows before the block) +
    # (earlier rows of the block with the same expert): stable in row order
    base = tl.cumsum(counts, 0) - counts + before  # (BLOCK_E,)
    ri = tl.arange(0, BLOCK_R)
    r = r0 + ri
    ok = r < M
    ids = tl.load(ids_ptr + r, mask=ok, other=0).to(tl.int32)
    earlier = (ids[:, None] == ids[None, :]) & (ri[None, :] < ri[:, None])  # (BLOCK_R, BLOCK_R)
    rank = tl.sum(earlier.to(tl.int32), 1)
    dst = tl.sum(tl.where(ids[:, None] == ex[None, :], base[None, :], 0), 1) + rank  # base[ids] + rank
    tl.store(s2d_ptr + r, dst.to(tl.int64), mask=ok)
    tl.store(order_ptr + dst, r.to(tl.int64), mask=ok)
    tl.store(token_ptr + dst, (r // K).to(tl.int64), mask=ok)
    if TILES:  # noqa: SIM102 (nested: the compiler prunes the outer constexpr branch first)
        if r0 == 0:
            _tile_table_part(counts, ex, E, NUM_TILES, group_ptr, rows_ptr, BLOCK_M, BLOCK_T)


@triton.jit
def _tile_table_kernel(
    counts_ptr, group_ptr, rows_ptr, E, NUM_TILES,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """One program: counts (E,) -> the tile table (the grouped GEMM's, without a sort)."""
    ex = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + ex, mask=ex < E, other=0).to(tl.int32)
    _tile_table_part(counts, ex, E, NUM_TILES, group_ptr, rows_ptr, BLOCK_M, BLOCK_T)


SPARE_TILES_BLOCK = 128  # spare tiles written per step (a 1-D block)


def _block_rows(block_e: int) -> int:
    """Rows per step of the sort: its (rows, BLOCK_E) one-hot tile holds about 8K elements, and at
    most 128 rows (the block of a 64-expert model; with 16 experts, 512-row blocks kept Triton's
    LLVM lowering of this kernel busy for over a minute on the H200)."""
    return max(8, min(128, 8192 // block_e))


def _empty_tiles(num_rows: int, num_experts: int, block_m: int, device: torch.device) -> TileTable:
    n = triton.cdiv(num_rows, block_m) + num_experts
    return TileTable(
        group=torch.empty((n,), dtype=torch.int32, device=device),
        rows=torch.empty((n, 2), dtype=torch.int32, device=device),
        num_tiles=n,
        block_m=block_m,
    )


def tile_table(group_sizes: torch.Tensor, num_rows: int, block_m: int) -> TileTable:
    """gemm.tile_table's table (same values) in one launch: group_sizes (E,) summing to num_rows."""
    e = group_sizes.shape[0]
    tiles = _empty_tiles(num_rows, e, block_m, group_sizes.device)
    block_e = next_pow2(e)
    _tile_table_kernel[(1,)](
        group_sizes, tiles.group, tiles.rows, e, tiles.num_tiles,
        BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_T=SPARE_TILES_BLOCK, num_warps=4,
    )  # fmt: skip
    return tiles


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch composition: ids (T, K) -> (order, src_to_dst, counts) as in Alignment, via a
    stable sort (no host synchronisation; ~8 launches)."""
    flat = ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    src_to_dst = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return order, src_to_dst, counts


def align(ids: torch.Tensor, num_experts: int, block_m: int | None = None) -> Alignment:
    """ids (T, K) int -> Alignment, with the tile table for block_m when given. One launch up to
    ALIGN_MAX_ROWS copies; beyond, the torch sort plus the one-launch tile table."""
    t, k = ids.shape
    m, e = t * k, num_experts
    dev = ids.device
    if m > ALIGN_MAX_ROWS:
        order, src_to_dst, counts = sort_by_expert(ids, e)
        tiles = tile_table(counts, m, block_m) if block_m is not None else None
        return Alignment(order, order // k, src_to_dst, counts, tiles)
    flat = ids.reshape(-1)
    flat = flat if flat.stride(0) == 1 else flat.contiguous()
    order = torch.empty((m,), dtype=torch.int64, device=dev)
    token = torch.empty((m,), dtype=torch.int64, device=dev)
    src_to_dst = torch.empty((m,), dtype=torch.int64, device=dev)
    counts = torch.empty((e,), dtype=torch.int64, device=dev)
    tiles = _empty_tiles(m, e, block_m, dev) if block_m is not None else None
    block_e = next_pow2(e)
    block_r = _block_rows(block_e)
    _align_kernel[(max(1, triton.cdiv(m, block_r)),)](
        flat, order, token, src_to_dst, counts,
        tiles.group if tiles is not None else counts, tiles.rows if tiles is not None else counts,
        m, e, k, tiles.num_tiles if tiles is not None else 0,
        TILES=tiles is not None, BLOCK_M=block_m or 16, BLOCK_R=block_r, BLOCK_E=block_e,
        BLOCK_T=SPARE_TILES_BLOCK, BLOCK_ALL=next_pow2(m), num_warps=4,
    )  # fmt: skip
    return Alignment(order, token, src_to_dst, counts, tiles)


# --------------------------------------------------------------------------- decode-sized MoE
#
# A few tokens (decode): no sort and no tile table. C = T * K copies (K includes the shared
# experts fused as ids E .. E + S - 1); copy c = t * K + k reads x[t] and expert ids[c].
#   up   grid (C, I / UP_N):  act[c, n] = silu(x[t] . w13[e, n]) * (x[t] . w13[e, I + n])
#   down grid (C, Dm / DOWN_N): y[c, n] = act[c] . w2[e, n]; the last of a token's K programs
#        on a column tile (a counter per (token, tile)) writes out[t, n] = sum_k w[t, k] y[t*K+k, n]
#        in k order, so the sum never depends on which program finished last.
# Both are the grouped GEMM's tl.dot tiles with BLOCK_M 16 and one valid row (memory-bound: the
# other rows cost no bytes), reducing K in BLOCK_K steps in order, rounding what the grouped
# path rounds (GEMM outputs and the activation to x's dtype), so they agree with it within that
# rounding. Each copy is computed alone with tiles fixed by the configuration, never by T.


@dataclass(frozen=True)
class DecodeConfig:
    """Tiles of the two decode kernels; FP8 steps K by 128 (one scale per step) whatever the
    *_k fields say. fused_combine=False: a third launch does the weighted combine."""

    up_n: int = 64
    up_k: int = 128
    up_warps: int = 4
    up_stages: int = 3
    down_n: int = 64
    down_k: int = 128
    down_warps: int = 4
    down_stages: int = 3
    fused_combine: bool = True


# The most token copies (T * K, shared experts included) sent to the decode kernels. Each copy
# streams its expert's rows itself, so an expert that several tokens pick is read several times
# (from L2 when they run together) where the grouped GEMM reads it once in a 16-row tile: the
# decode kernels win by launches at small T and lose by reads at large T. On an H200, in CUDA
# graphs, the whole layer against the grouped path (bench/bench_moe_decode.py, the tiles above;
# bench/results/2026-12-01_H200_decode_moe_two_launches/moe_decode_sweep/moe): V2-Lite bf16
# (8 copies per token) 1.23x at T = 1,
# 1.13x at 2, 1.07x at 4, 0.93x at 8; V3 bf16 (9 per token) 1.04x at 1 to 4, 0.98x at 8. FP8
# experts were slower at every T (0.94x at one V3 token, 0.72x at 16): they keep the grouped path
# (fused_moe).
DECODE_MAX_COPIES = 32


# Up to this many token copies (V2-Lite's one token: 6 routed + 2 shared) the down kernel takes
# 32-column tiles in 5 stages: 512 programs with 4 K steps in flight each. End to end on an H200
# (V2-Lite bf16, batch 1, same-run rows, bench/results/2026-12-02_H200_e2e_decode)
# 1.0 to 2.0% faster (483.1 to 485.6 tok/s against 474.3 to 480.2); at 16 and 32 copies (batch
# 2 and 4) 3% slower, so those keep DecodeConfig(). The layer alone in bench/bench_moe_decode.py
# (CUDA graphs, no kernel around it) does not show the gain (52.1 us against 51.2): it comes from
# how the down kernel meets the kernels around it under PDL. V3's one token (9 copies) was not
# measured end to end.
ONE_TOKEN_COPIES = 8
ONE_TOKEN_CONFIG = DecodeConfig(down_n=32, down_stages=5)


# MXFP4 experts (DeepSeek-V4's routed experts, packed e2m1 with UE8M0 scales per 32 values):
# the decode kernels take a copy's weight rows as GEMV rows, no MMA (_fp4_rows_dot): 32 rows
# per program (up: 6 copies x 2048 / 32 = 384 programs at V4-Flash's one token; down: 768),
# BLOCK_K values of each row (BLOCK_K / 2 bytes) per step, 3 steps in flight. The per-value
# decode, not the bytes, bounds them, and longer steps keep more of it in flight: on an H200 (the
# layer in CUDA graphs, bench/bench_v4_decode.py, 2026-12-03) one token (6 copies) 75.7 us with
# 512-value steps against 84.0 at 256 and 123.4 at 128; 8 tokens (48 copies) 473.5 us at 256
# against 536.8 at 512 and 731.9 at 128. The path they replace is permute, two grouped GEMMs
# with the SwiGLU between them and unpermute: 6 launches.
FP4_ONE_TOKEN_COPIES = 8
FP4_ONE_TOKEN_CONFIG = DecodeConfig(
    up_n=32, up_k=512, up_warps=4, up_stages=3, down_n=32, down_k=512, down_warps=4, down_stages=3
)
FP4_DECODE_CONFIG = DecodeConfig(
    up_n=32, up_k=256, up_warps=4, up_stages=3, down_n=32, down_k=256, down_warps=4, down_stages=3
)


# The SCALED decode's tiles (FP4_DECODE): 64 weight rows a program, the warpgroup MMA's smallest
# M (32 rows lower to mma.sync); steps as above. Not yet timed: picked by the loop's SASS for
# SM90 (Triton 3.6), 10.4 instructions a weight byte at 512-value steps and 12.0 at 256, against
# 20.3 for PAIR's 32 x 256 tiles and 18.6 for SCALED on 32 rows.
FP4_SCALED_ONE_TOKEN_CONFIG = DecodeConfig(
    up_n=64, up_k=512, up_warps=4, up_stages=3, down_n=64, down_k=512, down_warps=4, down_stages=3
)
FP4_SCALED_CONFIG = DecodeConfig(
    up_n=64, up_k=256, up_warps=4, up_stages=3, down_n=64, down_k=256, down_warps=4, down_stages=3
)


def fp4_decode_config(copies: int, decode: str = "PAIR") -> DecodeConfig:
    """The MXFP4 decode tiles of a launch of `copies` token copies under FP4_DECODE's `decode`."""
    one = copies <= FP4_ONE_TOKEN_COPIES
    if decode == "SCALED":
        return FP4_SCALED_ONE_TOKEN_CONFIG if one else FP4_SCALED_CONFIG
    return FP4_ONE_TOKEN_CONFIG if one else FP4_DECODE_CONFIG


# The most token copies sent to the MXFP4 decode kernels (V4-Flash: 6 per token, so up to 10
# tokens). Each copy reads its expert's bytes itself: at 64 tokens (384 copies over 256 experts)
# the grouped path reads each touched expert once in 16-row tiles instead. bench/bench_v4_decode.py
# times both at 1, 8 and 64 tokens.
FP4_DECODE_MAX_COPIES = 64


def decode_setting(pinned: tuple[int, ...] | None) -> tuple[DecodeConfig | None, int]:
    """The decode tiles and copy limit of DEEPINFER_CUDA_MOE_DECODE_TILES's value (UP_N, UP_K,
    UP_WARPS, UP_STAGES, DOWN_N, DOWN_K, DOWN_WARPS, DOWN_STAGES, FUSED_COMBINE, MAX_COPIES:
    bench/bench_moe_decode.py prints the best), which replaces both at every size; unset (None):
    no tiles (decode_config's by size) and DECODE_MAX_COPIES."""
    if pinned is None:
        return None, DECODE_MAX_COPIES
    up_n, up_k, up_warps, up_stages, down_n, down_k, down_warps, down_stages, fused, max_copies = pinned
    tiles = (up_n, up_k, up_warps, up_stages, down_n, down_k, down_warps, down_stages)
    return DecodeConfig(*tiles, fused_combine=bool(fused)), max_copies


def decode_config(copies: int) -> DecodeConfig:
    """The tiles of a launch of `copies` token copies where none are pinned (decode_setting):
    ONE_TOKEN_CONFIG up to ONE_TOKEN_COPIES copies and DecodeConfig() above. The Triton
    interpreter (CPU CI) pays per program, not per byte: there 128-column tiles keep the engine
    tests' decode steps near the grouped path's time."""
    if INTERPRET:
        return DecodeConfig(up_n=128, down_n=128)
    return ONE_TOKEN_CONFIG if copies <= ONE_TOKEN_COPIES else DecodeConfig()


# How _fp4_rows_dot decodes and multiplies the MXFP4 weights (DEEPINFER_CUDA_FP4_DECODE): the
# decode kernels are bound by the CUDA cores' work per weight value, not by the bytes.
#   PAIR: both nibbles to float32 (gemm.e2m1_pair: two multiplies a value, 2^126 and the scale),
#         times x by FMA into a (BLOCK_N, BLOCK_K / 2) partial;
#   GROUP: the nibbles' bits read as float32 (e2m1 * 2^-126) times x * 2^63 summed per 32-value
#         group in registers (each thread holds a group's 16 bytes), then times 2^63 and the
#         group's scale once: no multiply per value;
#   MMA: both nibbles' e2m1 values (no scale) as PAIR, rounded to bfloat16 (exact) and
#         multiplied on the tensor cores, the weights as the A operand (BLOCK_N features x 16
#         bytes of a group) and the token's row as column 0 of a 16-wide B, the group's scale
#         applied to its float32 product (_fp4_rows_dot_mma);
#   ASM: MMA with the nibbles decoded straight to bfloat16 pairs by inline PTX (prmt, shifts,
#         masks, a bf16x2 multiply) instead of float32 ops; the interpreter, which cannot run
#         assembly, makes the same values from float32 ops (_e2m1_bf16).
#   SCALED: Triton's microscaled product (tl.dot_scaled), operands swapped as in
#         gemm._grouped_mx_kernel: its own e2m1 upcast (byte permutes) into the registers of a
#         warpgroup MMA, the scales applied by it; the interpreter, which lacks the op, runs MMA.
FP4_DECODE = {"PAIR": 0, "GROUP": 1, "MMA": 2, "ASM": 3, "SCALED": 4}

# e2m1 codes of 4 packed bytes -> their bfloat16 values, exactly: the code's 3 magnitude bits to
# bf16 bits 6..8 and its sign to bit 15 (e2m1 * 2^-126; 0.5 becomes the subnormal 2^-127), two
# values a register, then times 2^126 (0x7E80; an exact bf16x2 multiply). $2: the 4 bytes; $0, $1:
# the 4 low (_LO) or high (_HI) nibbles' values; prmt spreads bytes 0, 1 (2, 3) to the 16-bit halves.
_E2M1_BF16_ASM = """{
.reg .b32 t<6>;
mov.b32 t5, 0;
prmt.b32 t0, $2, t5, 0x5140;
prmt.b32 t1, $2, t5, 0x5342;
shl.b32 t2, t0, {mag}; and.b32 t2, t2, 0x01C001C0;
shl.b32 t3, t0, {sign}; and.b32 t3, t3, 0x80008000;
or.b32 t2, t2, t3;
shl.b32 t3, t1, {mag}; and.b32 t3, t3, 0x01C001C0;
shl.b32 t4, t1, {sign}; and.b32 t4, t4, 0x80008000;
or.b32 t3, t3, t4;
mov.b32 t5, 0x7E807E80;
mul.rn.bf16x2 $0, t2, t5;
mul.rn.bf16x2 $1, t3, t5;
}"""
_E2M1_BF16_LO = tl.constexpr(_E2M1_BF16_ASM.replace("{mag}", "6").replace("{sign}", "12"))
_E2M1_BF16_HI = tl.constexpr(_E2M1_BF16_ASM.replace("{mag}", "2").replace("{sign}", "8"))


@triton.jit
def _e2m1_bf16(byte, LO: tl.constexpr):
    """Packed MXFP4 bytes (uint8 tile) -> the bfloat16 e2m1 values of their low (LO) or high
    nibbles: _E2M1_BF16_ASM on the GPU; the same bits from float32 ops (gemm.e2m1_pair's
    placement) in the interpreter."""
    if IS_INTERPRET:
        b = byte.to(tl.uint32)
        if LO:
            bits = ((b & 7) << 22) | ((b & 8) << 28)
        else:
            bits = ((b & 0x70) << 18) | ((b & 0x80) << 24)
        v = (bits.to(tl.float32, bitcast=True) * 8.507059173023462e37).to(tl.bfloat16)
    else:
        v = tl.inline_asm_elementwise(
            _E2M1_BF16_LO if LO else _E2M1_BF16_HI, "=r,=r,r", [byte], dtype=tl.bfloat16, is_pure=True,
            pack=4,
        )  # fmt: skip
    return v


@triton.jit
def _fp4_rows_dot_group(
    x_row, w_rows, s_rows, K, n_ok, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr
):  # fmt: skip
    """_fp4_rows_dot's GROUP decode: (BLOCK_N, G, 16) byte tiles, a group's 16 bytes one thread's
    vector, so the sum over a group stays in registers before its one scale multiply."""
    ng = tl.cdiv(K, 32)
    G: tl.constexpr = BLOCK_K // 32
    gi = tl.arange(0, G)
    ri = tl.arange(0, 16)
    acc_g = tl.zeros([BLOCK_N, G], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        j = k0 // 2 + gi[:, None] * 16 + ri[None, :]  # (G, 16) byte index
        j_ok = j < K // 2
        w_ok = n_ok[:, None, None] & j_ok[None, :, :]
        byte = tl.load(w_rows[:, :, None] + j[None, :, :], mask=w_ok, other=0)
        b = byte.to(tl.uint32)
        lo = (((b & 7) << 22) | ((b & 8) << 28)).to(tl.float32, bitcast=True)  # e2m1 * 2^-126
        hi = (((b & 0x70) << 18) | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)
        # x * 2^63 keeps the products normal (|e2m1 * x| >= 2^-63) below float32's top (|x| < 2^65)
        x0 = tl.load(x_row + 2 * j, mask=j_ok, other=0.0).to(tl.float32) * 9.223372036854775808e18
        x1 = tl.load(x_row + 2 * j + 1, mask=j_ok, other=0.0).to(tl.float32) * 9.223372036854775808e18
        part = tl.sum(lo * x0[None, :, :] + hi * x1[None, :, :], 2)  # (BLOCK_N, G)
        gs = k0 // 32 + gi
        s = tl.load(s_rows + gs[None, :], mask=n_ok[:, None] & (gs[None, :] < ng), other=127)
        acc_g += part * 9.223372036854775808e18 * e8m0_scale(s.to(tl.int32))
    return tl.sum(acc_g, 1)


@triton.jit
def _fp4_rows_dot(
    x_row, w_rows, s_rows, K, n_ok,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, DECODE: tl.constexpr,
):  # fmt: skip
    """(BLOCK_N,) float32: the row x_row[0 : K] (K even) times BLOCK_N MXFP4 weight rows, w_rows
    (BLOCK_N, 1) pointers at each row's packed bytes, s_rows at its UE8M0 bytes (rows where n_ok).
    Per step a (BLOCK_N, BLOCK_K / 2) byte tile (16-byte vectors along each row) and its
    BLOCK_K / 32 scales per row, decoded and multiplied as FP4_DECODE's DECODE says (PAIR: a GEMV
    into a (BLOCK_N, BLOCK_K / 2) float32 partial reduced once at the end; GROUP: a
    (BLOCK_N, BLOCK_K / 32) one; MMA / ASM: a (BLOCK_N, 16) accumulator whose column 0 is the
    token's, x bfloat16). PAIR's GEMV rather than an MMA: one token copy has one row, and the 15
    zero columns of the 16-wide B cost the tensor cores nothing, but the decoded weights take a
    layout change on their way to the MMA."""
    if DECODE == 1:
        v = _fp4_rows_dot_group(x_row, w_rows, s_rows, K, n_ok, BLOCK_N, BLOCK_K, STAGES)
    elif DECODE == 4 and not IS_INTERPRET:
        v = _fp4_rows_dot_scaled(x_row, w_rows, s_rows, K, n_ok, BLOCK_N, BLOCK_K, STAGES)
    elif DECODE >= 2:
        v = _fp4_rows_dot_mma(x_row, w_rows, s_rows, K, n_ok, BLOCK_N, BLOCK_K, STAGES, DECODE == 3)
    else:
        v = _fp4_rows_dot_pair(x_row, w_rows, s_rows, K, n_ok, BLOCK_N, BLOCK_K, STAGES)
    return v


@triton.jit
def _fp4_rows_dot_pair(
    x_row, w_rows, s_rows, K, n_ok, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr
):  # fmt: skip
    """_fp4_rows_dot's PAIR decode over (BLOCK_N, BLOCK_K / 2) byte tiles."""
    ng = tl.cdiv(K, 32)
    rj = tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros([BLOCK_N, BLOCK_K // 2], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        j = k0 // 2 + rj
        j_ok = j < K // 2
        byte = tl.load(w_rows + j[None, :], mask=n_ok[:, None] & j_ok[None, :], other=0)
        scale = fp4_scales(s_rows, k0 // 32, ng, n_ok[:, None], BLOCK_N, BLOCK_K // 32, 1)
        lo, hi = e2m1_pair(byte.to(tl.int32), scale)
        x0 = tl.load(x_row + 2 * j, mask=j_ok, other=0.0).to(tl.float32)
        x1 = tl.load(x_row + 2 * j + 1, mask=j_ok, other=0.0).to(tl.float32)
        acc += lo * x0[None, :] + hi * x1[None, :]
    return tl.sum(acc, 1)


@triton.jit
def _fp4_rows_dot_mma(
    x_row, w_rows, s_rows, K, n_ok,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """_fp4_rows_dot's MMA / ASM decodes: (G, BLOCK_N, 16) byte tiles (G = BLOCK_K / 32 groups),
    the nibbles decoded to their bfloat16 e2m1 values (exact, no scale: always normal numbers)
    and multiplied on the tensor cores as a batch of G products (BLOCK_N, 16) x (16, 16) per
    nibble, x's even (odd) columns of each group as column 0 of B; each group's (BLOCK_N, 16)
    float32 product then times its scale, so that the decode stays exact over the whole UE8M0
    range (a scale folded into bfloat16 weights would leave bfloat16's normal range)."""
    ng = tl.cdiv(K, 32)
    G: tl.constexpr = BLOCK_K // 32
    gi = tl.arange(0, G)
    ri = tl.arange(0, 16)
    col = tl.arange(0, 16)
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        j = k0 // 2 + gi[:, None, None] * 16 + ri[None, None, :]  # (G, 1, 16) byte index
        byte = tl.load(w_rows[None, :, :] + j, mask=n_ok[None, :, None] & (j < K // 2), other=0)
        if ASM:
            lo = _e2m1_bf16(byte, True)
            hi = _e2m1_bf16(byte, False)
        else:
            lo, hi = e2m1_pair(byte.to(tl.int32), 1.0)
            lo = lo.to(tl.bfloat16)
            hi = hi.to(tl.bfloat16)
        jx = k0 // 2 + gi[:, None, None] * 16 + ri[None, :, None]  # (G, 16, 1)
        b_ok = (jx < K // 2) & (col[None, None, :] == 0)
        x0 = tl.load(x_row + 2 * jx + col[None, None, :] * 0, mask=b_ok, other=0.0)  # (G, 16, 16)
        x1 = tl.load(x_row + 2 * jx + 1 + col[None, None, :] * 0, mask=b_ok, other=0.0)
        part = mma(lo, x0, tl.zeros([G, BLOCK_N, 16], tl.float32), False)
        part = mma(hi, x1, part, False)
        gs = k0 // 32 + gi[:, None, None]  # (G, 1, 1)
        s = tl.load(s_rows[None, :, :] + gs, mask=n_ok[None, :, None] & (gs < ng), other=127)
        acc += tl.sum(part * e8m0_scale(s.to(tl.int32)), 0)
    return tl.sum(acc, 1)


@triton.jit
def _fp4_rows_dot_scaled(
    x_row, w_rows, s_rows, K, n_ok, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr
):  # fmt: skip
    """_fp4_rows_dot's SCALED decode: (BLOCK_N, 16) += W (BLOCK_N rows, e2m1 packed along K, their
    UE8M0 scales) @ B (BLOCK_K, 16; column 0 the token's row, bf16) by tl.dot_scaled."""
    rj = tl.arange(0, BLOCK_K // 2)
    rg = tl.arange(0, BLOCK_K // 32)
    rk = tl.arange(0, BLOCK_K)
    col = tl.arange(0, 16)
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        w_ok = n_ok[:, None] & (rj[None, :] < (K - k0) // 2)
        w = tl.load(w_rows + k0 // 2 + rj[None, :], mask=w_ok, other=0)
        s_ok = n_ok[:, None] & (32 * rg[None, :] < K - k0)
        s = tl.load(s_rows + k0 // 32 + rg[None, :], mask=s_ok, other=127)
        b_ok = (rk[:, None] < K - k0) & (col[None, :] == 0)
        b = tl.load(x_row + k0 + rk[:, None] + col[None, :] * 0, mask=b_ok, other=0.0)
        acc = tl.dot_scaled(w, s, "e2m1", b, None, "bf16", acc, fast_math=True)
    return tl.sum(acc, 1)


@triton.jit
def _row_operand(row_ptr, k0, K, rm, rk, FP8: tl.constexpr):
    """The (BLOCK_M, BLOCK_K) A operand of one K step: row 0 = row[k0 : k0 + BLOCK_K], the other
    rows zero, and its scale. FP8: the 128 values quantised to e4m3 as gemm.quantize_fp8 does
    (amax / 448 by IEEE division), so no separate quantisation launch; else scale 1. Loaded
    through L2 only (.cg): a shared expert's copy may read x before its wait (_decode_up_kernel),
    when no launch boundary has dropped this SM's L1 lines of a buffer that held other data."""
    k_ok = rk < K - k0
    if FP8:
        v = tl.load(row_ptr + k0 + rk, mask=k_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(v), 0), 1e-10), 448.0)
        q = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -448.0), 448.0)
        return to_e4m3(tl.where(rm[:, None] == 0, q[None, :], 0.0)), scale
    else:  # one 2-D load straight into the dot (pipelined like the weights)
        a = tl.load(
            row_ptr + rm[:, None] * 0 + (k0 + rk)[None, :],
            mask=(rm[:, None] == 0) & k_ok[None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        return a, 1.0


@triton.jit
def _decode_up_kernel(
    x_ptr, w_ptr, ws_ptr, ids_ptr, act_ptr, count_ptr, I, H, K_IDS, NUM_COUNTS, NUM_EXPERTS,
    stride_x, stride_we, stride_wn, stride_wse, stride_wsn, stride_act, limit,
    FP8: tl.constexpr, IEEE: tl.constexpr, ZERO_BLOCK: tl.constexpr, SHARED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    FP4: tl.constexpr, CLAMP: tl.constexpr, STAGES: tl.constexpr, DECODE: tl.constexpr = 0,
):  # fmt: skip
    """Copy c, columns n of one tile: act[c, n] = silu(gate) * up, gate and up rounded to act's
    dtype first (what the grouped GEMM stores before silu_and_mul); CLAMP: DeepSeek-V4's SwiGLU,
    gate clamped above and up on both sides at `limit` (small.clamped_silu_and_mul's order).
    FP4: MXFP4 w13 (E, 2I, H/2) packed with UE8M0 scales (E, 2I, H/32), by _fp4_rows_dot (row 0
    of the (BLOCK_M, BLOCK_N) accumulators holds the result, as the MMA path leaves it).
    Programs (c, 0) also zero ZERO_BLOCK of the down kernel's counters each (the launch before
    it, on the same stream).
    PDL: the routed experts' ids come from the router, the previous kernel: their copies wait for
    it first. SHARED = S > 0: the last S ids of each token are always experts NUM_EXPERTS - S ..
    NUM_EXPERTS - 1 (the shared experts the router appends), and the router lets this kernel
    start only after ITS wait (x is whole then: common.pdl_enabled), so those copies compute
    while the routing runs and wait only before their stores. Each program lets the down kernel
    launch after its loop and its wait (a routed copy signalling right after its first wait, so
    that the down kernel's programs sit resident through this kernel, was no faster end to end:
    bench/results/2026-12-02_H200_wuv_split_merge/variant_conformance)."""
    c = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    t = c // K_IDS
    k = c % K_IDS
    if k >= K_IDS - SHARED:  # a shared expert: known without the router
        e = NUM_EXPERTS - K_IDS + k
    else:
        wait_for_previous(PDL)
        e = tl.load(ids_ptr + c).to(tl.int64)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < I
    # (BLOCK_K, BLOCK_N) tiles of w13[e]^T: gate rows n, up rows I + n, contiguous along K
    gate_ptrs = w_ptr + e * stride_we + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]
    up_ptrs = gate_ptrs + I * stride_wn
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if FP4:  # gate rows n, up rows I + n of the packed w13[e] and of its scales
        w_rows = w_ptr + e * stride_we + rn[:, None].to(tl.int64) * stride_wn
        s_rows = ws_ptr + e * stride_wse + rn[:, None].to(tl.int64) * stride_wsn
        x_row = x_ptr + t * stride_x
        g_v = _fp4_rows_dot(x_row, w_rows, s_rows, H, n_ok, BLOCK_N, BLOCK_K, STAGES, DECODE)
        u_v = _fp4_rows_dot(x_row, w_rows + I * stride_wn, s_rows + I * stride_wsn, H, n_ok, BLOCK_N,
                            BLOCK_K, STAGES, DECODE)  # fmt: skip
        gate = tl.where(rm[:, None] == 0, g_v[None, :], 0.0)
        up = tl.where(rm[:, None] == 0, u_v[None, :], 0.0)
    else:
        for k0 in range(0, H, BLOCK_K):
            a, a_s = _row_operand(x_ptr + t * stride_x, k0, H, rm, rk, FP8)
            w_mask = n_ok[None, :] & (rk[:, None] < H - k0)
            g = tl.load(gate_ptrs, mask=w_mask, other=0.0)
            u = tl.load(up_ptrs, mask=w_mask, other=0.0)
            if FP8:  # as the grouped kernel: each step's product times the row scale, then the weight's
                s_ptrs = ws_ptr + e * stride_wse + k0 // BLOCK_K
                g_s = tl.load(s_ptrs + (rn // BLOCK_K) * stride_wsn, mask=n_ok, other=0.0)
                u_s = tl.load(s_ptrs + ((rn + I) // BLOCK_K) * stride_wsn, mask=n_ok, other=0.0)
                gate += mma(a, g, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), False) * a_s * g_s[None, :]
                up += mma(a, u, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), False) * a_s * u_s[None, :]
            else:
                gate = mma(a, g, gate, IEEE)
                up = mma(a, u, up, IEEE)
            gate_ptrs += BLOCK_K
            up_ptrs += BLOCK_K
    dtype = act_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    if CLAMP:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    act = gate / (1.0 + tl.exp(-gate)) * up  # small.silu_and_mul's float32 formula
    wait_for_previous(PDL)  # (again for a routed copy: returns at once) nothing stored before it
    launch_dependents(PDL)  # after the wait: the down kernel loads ids and weights before its own
    if ZERO_BLOCK > 0:  # noqa: SIM102 (nested: the compiler prunes the outer constexpr branch first)
        if pid_n == 0:
            z = c * ZERO_BLOCK + tl.arange(0, ZERO_BLOCK)
            tl.store(count_ptr + z, tl.zeros([ZERO_BLOCK], tl.int32), mask=z < NUM_COUNTS)
    ptrs = act_ptr + c * stride_act + rm[:, None] * 0 + rn[None, :]
    tl.store(ptrs, act.to(dtype), mask=(rm[:, None] == 0) & n_ok[None, :])


@triton.jit
def _combine_row(
    y_ptr, wt_ptr, out_ptr, t, rn, n_ok, K_IDS: tl.constexpr, stride_y, stride_out, VOLATILE: tl.constexpr
):  # fmt: skip
    """out[t, n] = sum over k, in order, of w[t, k] * y[t*K + k, n] in float32 (small.weighted_combine's
    arithmetic). VOLATILE: y was written by other programs of this launch (no stale L1 lines).
    The loop is unrolled (K_IDS constexpr), so the K rows' loads are in flight together rather
    than one L2 round trip after another at the end of the down kernel."""
    acc = tl.zeros(rn.shape, tl.float32)
    for k in tl.static_range(K_IDS):
        c = t * K_IDS + k
        y = tl.load(y_ptr + c * stride_y + rn, mask=n_ok, other=0.0, volatile=VOLATILE)
        acc += tl.load(wt_ptr + c).to(tl.float32) * y.to(tl.float32)
    tl.store(out_ptr + t * stride_out + rn, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _down_step(
    a_row, ws_e, b, k0, I, rm, rn, rk, n_ok, stride_wsn, acc,
    FP8: tl.constexpr, IEEE: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """acc + the K step at k0 of one copy's down product: its activation row a_row[k0 : k0 +
    BLOCK_K] times b, the (BLOCK_K, BLOCK_N) tile of its expert's w2 rows rn (FP8: both scaled)."""
    a, a_s = _row_operand(a_row, k0, I, rm, rk, FP8)
    if FP8:
        b_s = tl.load(ws_e + (rn // BLOCK_K) * stride_wsn + k0 // BLOCK_K, mask=n_ok, other=0.0)
        return acc + mma(a, b, tl.zeros(acc.shape, tl.float32), False) * a_s * b_s[None, :]
    else:
        return mma(a, b, acc, IEEE)


@triton.jit
def _decode_down_kernel(
    a_ptr, w_ptr, ws_ptr, ids_ptr, wt_ptr, y_ptr, out_ptr, count_ptr, H, I, K_IDS: tl.constexpr, NUM_EXPERTS,
    stride_a, stride_we, stride_wn, stride_wse, stride_wsn, stride_y, stride_out,
    FP8: tl.constexpr, IEEE: tl.constexpr, COMBINE: tl.constexpr, SHARED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    FP4: tl.constexpr, STAGES: tl.constexpr, DECODE: tl.constexpr = 0,
):  # fmt: skip
    """Copy c, output columns n of one tile: y[c, n] = act[c] . w2[e, n] in out's dtype; COMBINE:
    then the token's last program on this tile writes out[t, n] (counter (t, tile), zeroed by the
    up kernel). PDL: the up kernel lets this one start after its wait, when the router, which
    wrote the ids, has finished: the id and the first K step of the weights are loaded before
    this kernel waits for the up kernel's activations. SHARED: as in the up kernel."""
    c = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    k = c % K_IDS
    if k >= K_IDS - SHARED:
        e = NUM_EXPERTS - K_IDS + k
    else:
        e = tl.load(ids_ptr + c, cache_modifier=".cg").to(tl.int64)  # before the wait: through L2 only
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < H
    if FP4:  # MXFP4 w2 (E, H, I/2), scales (E, H, I/32): the GEMV rows of _fp4_rows_dot
        wait_for_previous(PDL)
        launch_dependents(PDL)
        w_rows = w_ptr + e * stride_we + rn[:, None].to(tl.int64) * stride_wn
        s_rows = ws_ptr + e * stride_wse + rn[:, None].to(tl.int64) * stride_wsn
        v = _fp4_rows_dot(a_ptr + c * stride_a, w_rows, s_rows, I, n_ok, BLOCK_N, BLOCK_K, STAGES, DECODE)
        acc = tl.where(rm[:, None] == 0, v[None, :], 0.0)
    else:
        w_ptrs = w_ptr + e * stride_we + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]
        b = tl.load(w_ptrs, mask=n_ok[None, :] & (rk[:, None] < I), other=0.0)  # K step 0
        wait_for_previous(PDL)
        launch_dependents(PDL)
        acc = _down_step(
            a_ptr + c * stride_a, ws_ptr + e * stride_wse, b, 0, I, rm, rn, rk, n_ok, stride_wsn,
            tl.zeros([BLOCK_M, BLOCK_N], tl.float32), FP8, IEEE, BLOCK_K,
        )  # fmt: skip
        for k0 in range(BLOCK_K, I, BLOCK_K):
            w_ptrs += BLOCK_K
            b = tl.load(w_ptrs, mask=n_ok[None, :] & (rk[:, None] < I - k0), other=0.0)
            acc = _down_step(
                a_ptr + c * stride_a, ws_ptr + e * stride_wse, b, k0, I, rm, rn, rk, n_ok, stride_wsn,
                acc, FP8, IEEE, BLOCK_K,
            )  # fmt: skip
    ptrs = y_ptr + c * stride_y + rm[:, None] * 0 + rn[None, :]
    tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] == 0) & n_ok[None, :])
    if COMBINE:
        tl.debug_barrier()  # every thread's y is stored before the program counts itself in
        t = c // K_IDS
        arrived = tl.atomic_add(count_ptr + t * tl.num_programs(1) + pid_n, 1, sem="acq_rel")
        if arrived < K_IDS - 1:
            return
        _combine_row(y_ptr, wt_ptr, out_ptr, t, rn, n_ok, K_IDS, stride_y, stride_out, VOLATILE=True)


@triton.jit
def _decode_combine_kernel(
    y_ptr, wt_ptr, out_ptr, H, K_IDS: tl.constexpr, stride_y, stride_out, BLOCK: tl.constexpr
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    _combine_row(y_ptr, wt_ptr, out_ptr, t, rn, rn < H, K_IDS, stride_y, stride_out, VOLATILE=False)


DECODE_BLOCK_M = 16  # tl.dot's smallest M; one row of it is a token copy


def decode_moe(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    shared_experts: int = 0,
    pdl: bool = True,
    swiglu_limit: float | None = None,
    fp4_decode: str = "PAIR",
) -> torch.Tensor:
    """fused_moe for a few tokens in two launches (three without the fused combine), no sort:
    x (T, Dm), weights / ids (T, K) -> (T, Dm) in x's dtype. w13 (E, 2I, Dm), w2 (E, Dm, I);
    FP8: e4m3 weights with w13_scale (E, 2I/128, Dm/128) and w2_scale (E, Dm/128, I/128), x and
    the activations quantised per token and 128 channels inside the kernels;
    MXFP4: packed uint8 w13 (E, 2I, Dm/2), w2 (E, Dm, I/2) with UE8M0 bytes w13_scale
    (E, 2I, Dm/32), w2_scale (E, Dm, I/32), nothing quantised (fp4_decode_config's GEMV tiles).
    swiglu_limit: DeepSeek-V4's clamped SwiGLU between the two products.
    shared_experts = S: the last S columns of ids are experts E - S .. E - 1 in every row, and x
    was whole before the kernel launched just before this call began (select_experts' one-launch
    router on the same x, which signals its dependents after its wait): those copies then compute
    while that kernel still runs (_decode_up_kernel). config: the tiles (default decode_config's
    for the launch's copies; MXFP4 outside the interpreter: fp4_decode_config's); pdl: as
    router_logits'. fp4_decode: how MXFP4 weights are decoded (FP4_DECODE's names; MMA and ASM
    for bfloat16 x, PAIR otherwise)."""
    t, k = ids.shape
    fp4 = w13.dtype == torch.uint8
    if fp4_decode not in FP4_DECODE:
        raise ValueError(f"decode_moe: fp4_decode={fp4_decode!r}; choose one of {', '.join(FP4_DECODE)}")
    if fp4_decode in ("MMA", "ASM", "SCALED") and x.dtype != torch.bfloat16:  # bf16 tensor-core operands
        fp4_decode = "PAIR"
    decode = FP4_DECODE[fp4_decode]
    if fp4 and not INTERPRET:
        cfg = config or fp4_decode_config(t * k, fp4_decode)
    else:
        cfg = config or decode_config(t * k)
    e, two_i, h = w13.shape
    h = 2 * h if fp4 else h
    inter = two_i // 2
    if x.shape[-1] != h or w2.shape != (e, h, inter // 2 if fp4 else inter):
        raise ValueError(
            f"decode_moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit "
            f"(E, 2I, Dm{'/2' if fp4 else ''}) and (E, Dm, I{'/2' if fp4 else ''})"
        )
    if not 0 <= shared_experts <= min(k, e):
        raise ValueError(f"decode_moe: shared_experts={shared_experts} must lie in [0, min(K={k}, E={e})]")
    if (w13_scale is None) != (w2_scale is None) or (fp4 and w13_scale is None):
        raise ValueError("quantised experts need both w13_scale and w2_scale")
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    if t == 0 or h == 0:
        return out
    if k == 0 or inter == 0:
        return out.zero_()
    fp8 = w13_scale is not None and not fp4
    up_k, down_k = (128, 128) if fp8 else (cfg.up_k, cfg.down_k)
    if fp4 and (up_k < 32 or up_k & (up_k - 1) or down_k < 32 or down_k & (down_k - 1)):
        raise ValueError(f"decode_moe: MXFP4 steps must be powers of two >= 32 values, got {cfg}")
    copies = t * k
    # a copy of x made here (the launch just before the up kernel's) is not whole before its wait
    shared = shared_experts if x.stride(-1) == 1 else 0
    x = x if x.stride(-1) == 1 else x.contiguous()
    ids = ids.reshape(-1).contiguous()
    w13 = w13 if w13.stride(-1) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(-1) == 1 else w2.contiguous()
    if fp4:  # UE8M0 bytes, read as they are
        assert w13_scale is not None and w2_scale is not None
        s13, s2 = w13_scale.view(torch.uint8).contiguous(), w2_scale.view(torch.uint8).contiguous()
    else:
        s13 = w13_scale.float().contiguous() if w13_scale is not None else x
        s2 = w2_scale.float().contiguous() if w2_scale is not None else x
    scaled = fp8 or fp4
    act = torch.empty((copies, inter), dtype=x.dtype, device=x.device)
    y = torch.empty((copies, h), dtype=x.dtype, device=x.device)
    down_tiles = triton.cdiv(h, cfg.down_n)
    counts = torch.empty((t * down_tiles if cfg.fused_combine else 1,), dtype=torch.int32, device=x.device)
    zero_block = next_pow2(triton.cdiv(t * down_tiles, copies), 1) if cfg.fused_combine else 0
    ieee = x.dtype == torch.float32
    pdl = pdl_enabled(x.device, pdl)
    _decode_up_kernel[(copies, triton.cdiv(inter, cfg.up_n))](
        x, w13, s13, ids, act, counts, inter, h, k, counts.numel(), e,
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0) if scaled else 0,
        s13.stride(1) if scaled else 0, act.stride(0), float(swiglu_limit or 0.0),
        FP8=fp8, IEEE=ieee, ZERO_BLOCK=zero_block, SHARED=shared,
        BLOCK_M=DECODE_BLOCK_M, BLOCK_N=cfg.up_n, BLOCK_K=up_k,
        PDL=pdl, FP4=fp4, CLAMP=swiglu_limit is not None, STAGES=cfg.up_stages, DECODE=decode,
        num_warps=cfg.up_warps, num_stages=cfg.up_stages, launch_pdl=pdl,
    )  # fmt: skip
    w = weights.reshape(-1).float().contiguous()
    _decode_down_kernel[(copies, down_tiles)](
        act, w2, s2, ids, w, y, out, counts, h, inter, k, e,
        act.stride(0), w2.stride(0), w2.stride(1), s2.stride(0) if scaled else 0,
        s2.stride(1) if scaled else 0, y.stride(0), out.stride(0),
        FP8=fp8, IEEE=ieee, COMBINE=cfg.fused_combine, SHARED=shared,
        BLOCK_M=DECODE_BLOCK_M, BLOCK_N=cfg.down_n, BLOCK_K=down_k,
        PDL=pdl, FP4=fp4, STAGES=cfg.down_stages, DECODE=decode,
        num_warps=cfg.down_warps, num_stages=cfg.down_stages, launch_pdl=pdl,
    )  # fmt: skip
    if not cfg.fused_combine:
        block = min(1024, next_pow2(h))
        _decode_combine_kernel[(t, triton.cdiv(h, block))](
            y, w, out, h, k, y.stride(0), out.stride(0), BLOCK=block, num_warps=4
        )
    return out
