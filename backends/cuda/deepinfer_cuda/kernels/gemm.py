# mypy: disable-error-code="no-untyped-def,untyped-decorator,no-untyped-call"
# (Triton kernels take untyped tensor-like arguments by design; the launchers are typed.)
"""GEMM kernels: FP8 e4m3 block-scaled (b x b weight scales, 1 x b activation scales, b = 128 as
DeepSeek-V3 / V4 or 32 as DeepSeek-V4.1), the
fused per-token activation quantiser, a fixed-tile float matmul (batch-invariant linear), and a
grouped GEMM over expert-sorted rows (float or FP8, optionally gathering its input rows).

Every kernel reduces K in BLOCK_K steps, in an order that does not depend on M (the
batch-invariant matmul may split its K chunks over programs at small M; the tile's last program
adds the chunk sums in the same order), so a row's result never depends on M. Scales MULTIPLY
(DeepSeek's convention): value = fp8 * scale.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from deepinfer.backend.fp8 import AMAX_EPS, FP8_BLOCKS, FP8_DTYPE, FP8_MAX
from deepinfer.backend.fp8 import FP8_BLOCK as SCALE_BLOCK
from deepinfer.reference.gemm import check_fp8_operands
from deepinfer_cuda.kernels.common import (
    INTERPRET,
    Semaphores,
    is_sm90,
    launch_dependents,
    mma,
    next_pow2,
    num_sms,
    pdl_enabled,
    tma_supported,
    to_dtype,
    to_e4m3,
    wait_for_previous,
)

# The kernels spell the format's constants as literals (Triton jit code reads no Python globals
# that are not constexpr): 448.0 is FP8_MAX, 1e-10 AMAX_EPS, as deepinfer.backend.fp8 defines.
assert (FP8_MAX, AMAX_EPS) == (448.0, 1e-10)


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 128  # FP8 kernels: the scale block (128 or 32), one scale per K step
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


def fp8_config(m: int, block: int = SCALE_BLOCK) -> GemmConfig:
    """Tile choice for the dense FP8 GEMM by M (never changes the reduction order over K).
    Large M: 128x128, 8 warps, 4 stages was the best of six tilings on an H200; small M takes
    64x64 tiles so that more programs share the work. block_k is the scale block (one activation
    and one weight scale per K step): 32-blocks (V4.1) take the same tiles, not tuned on a GPU."""
    if m <= 256:
        return GemmConfig(block_m=64, block_n=64, block_k=block, num_warps=4, num_stages=5)
    return GemmConfig(block_m=128, block_n=128, block_k=block, num_warps=8, num_stages=4)


def fp8_tma_config(m: int) -> GemmConfig:
    """Tiles for the persistent TMA FP8 kernel (block_n fixed at 128: one weight scale per step).
    128x128, 8 warps, 5 stages: the best of five tilings at M = 4096 on an H200."""
    if m <= 256:
        return GemmConfig(block_m=64, block_n=128, num_warps=4, num_stages=6)
    return GemmConfig(block_m=128, block_n=128, num_warps=8, num_stages=5)


# Below this M the pointer kernel's 64x64 tiles beat the persistent TMA kernel (too few
# 128-wide output tiles to fill the GPU): measured on an H200 at M = 128.
TMA_MIN_M = 256


# Batch-invariant mode: one configuration for every M.
INVARIANT_CONFIG = GemmConfig(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=3)


# --------------------------------------------------------------------------- quantisation


@triton.jit(do_not_specialize=["K", "G"])
def _quantize_kernel(
    x_ptr, q_ptr, s_ptr, K, G, stride_xm, stride_qm, stride_sm,
    GROUPS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One program: GROUPS consecutive 128-channel groups of one row."""
    m = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)  # (GROUPS,)
    cols = g[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # (GROUPS, BLOCK)
    mask = (g[:, None] < G) & (cols < K)
    x = tl.load(x_ptr + m * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10)
    scale = tl.math.div_rn(amax, 448.0)  # IEEE division: the reference's bits (`/` is approximate)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -448.0), 448.0)
    tl.store(q_ptr + m * stride_qm + cols, to_e4m3(q), mask=mask)
    tl.store(s_ptr + m * stride_sm + g, scale, mask=g < G)


def quantize_fp8(x: torch.Tensor, block: int = SCALE_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float -> (xq (M, K) e4m3, scale (M, ceil(K/block)) float32 = amax / 448)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_fp8 takes a 2-D (M, K) tensor, got shape {tuple(x.shape)}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"quantisation block must be a power of two >= 16, got {block}")
    m, k = x.shape
    g = triton.cdiv(k, block)
    xq = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, g), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return xq, scale
    x = x if x.stride(-1) == 1 else x.contiguous()
    groups = min(8, next_pow2(g, 1))
    _quantize_kernel[(m, triton.cdiv(g, groups))](
        x,
        xq,
        scale,
        k,
        g,
        x.stride(0),
        xq.stride(0),
        scale.stride(0),
        GROUPS=groups,
        BLOCK=block,
        num_warps=4,
    )
    return xq, scale


# --------------------------------------------------------------------------- dense GEMMs


@triton.jit
def _dense_kernel(
    a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, bias_ptr, ws_ptr, tickets_ptr, M, N, K, K_CHUNK,
    stride_am, stride_bn, stride_cm, stride_asm, stride_bsn, stride_ag, stride_bg, stride_cg, stride_ws,
    FP8: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLITS: tl.constexpr,
):  # fmt: skip
    """C (M, N) = A (M, K) @ B (N, K)^T (+ bias), tiles swizzled in GROUP_M bands for L2 reuse.
    FP8: A and B e4m3 with A scales (M, K/128) and B scales (N/128, K/128); BLOCK_K == 128.
    Grid axis 1 is a batch of G such products (strides stride_ag, stride_bg, stride_cg between
    them): every one is computed exactly as it would be alone.

    K is reduced in chunks of K_CHUNK (a multiple of BLOCK_K; K_CHUNK >= K: one chunk), each
    from zero in BLOCK_K steps, the chunk sums added in order. SPLIT: grid axis 2 is the chunk s
    of S = SPLITS; program s writes chunk s's float32 sum to ws + s * stride_ws (an (S, G, M, N)
    workspace laid out as C) and counts itself in on its (product, tile) ticket (tickets: (G,
    tiles) int32, zero between launches); the tile's last program to arrive resets the ticket and
    adds the S sums in order s = 0 .. S-1 as the walk below does, so both ways give the same
    bits (an unrolled loop: the S loads are in flight together)."""
    g = tl.program_id(1).to(tl.int64)
    a_ptr += g * stride_ag
    b_ptr += g * stride_bg
    c_ptr += g * stride_cg
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    band = GROUP_M * grid_n
    first_m = (pid // band) * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % band) % size_m
    pid_n = (pid % band) // size_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    c_mask = (rm[:, None] < M) & (rn[None, :] < N)
    c_offs = rm[:, None].to(tl.int64) * stride_cm + rn[None, :]  # (BLOCK_M, BLOCK_N) in C and ws
    a_rows = a_ptr + rm[:, None].to(tl.int64) * stride_am
    b_cols = b_ptr + rn[None, :].to(tl.int64) * stride_bn  # (BLOCK_K, BLOCK_N) tiles = B^T
    first = 0
    last = K
    if SPLIT:  # this program's chunk only
        first = tl.program_id(2) * K_CHUNK
        last = first + 1
    total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for c0 in range(first, last, K_CHUNK):
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(c0, tl.minimum(c0 + K_CHUNK, K), BLOCK_K):
            kmask = rk < K - k0
            a = tl.load(a_rows + (k0 + rk)[None, :], mask=(rm[:, None] < M) & kmask[None, :], other=0.0)
            b = tl.load(b_cols + (k0 + rk)[:, None], mask=(rn[None, :] < N) & kmask[:, None], other=0.0)
            if FP8:
                kb = k0 // BLOCK_K
                a_s = tl.load(as_ptr + rm * stride_asm + kb, mask=rm < M, other=0.0)
                b_s = tl.load(bs_ptr + (rn // BLOCK_K) * stride_bsn + kb, mask=rn < N, other=0.0)
                acc += (
                    mma(a, b, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), False) * a_s[:, None] * b_s[None, :]
                )
            else:
                acc = mma(a, b, acc, IEEE)
        total += acc
    if SPLIT:
        ws_tile = ws_ptr + g * stride_cg + c_offs
        tl.store(ws_tile + tl.program_id(2).to(tl.int64) * stride_ws, total, mask=c_mask)
        tl.debug_barrier()  # every thread's chunk sum is stored before the program counts itself in
        ticket = tickets_ptr + g * tl.num_programs(0) + pid
        arrived = tl.atomic_add(ticket, 1, sem="acq_rel")
        if arrived < SPLITS - 1:
            return
        tl.store(ticket, 0)  # the tile's last program: ready for the next launch (and graph replay)
        total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for s in tl.static_range(SPLITS):  # written by other programs: volatile, no stale L1 lines
            total += tl.load(ws_tile + s * stride_ws, mask=c_mask, other=0.0, volatile=True)
    if HAS_BIAS:
        total += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + c_offs, total.to(c_ptr.dtype.element_ty), mask=c_mask)


# One int32 ticket per (product, output tile) of a split _dense_kernel launch (zero between launches).
_TILE_TICKETS = Semaphores()


def _launch_dense(
    a: torch.Tensor,
    b: torch.Tensor,
    out_dtype: torch.dtype,
    cfg: GemmConfig,
    a_scale: torch.Tensor | None = None,
    b_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    k_chunk: int | None = None,
    split: bool = False,
) -> torch.Tensor:
    """a (M, K) @ b (N, K)^T, or a (G, M, K) @ b (G, N, K)^T batched -> (M, N) / (G, M, N).
    k_chunk: reduce K in chunks of that many (the batch-invariant matmul's K_CHUNK; None: one
    chunk); split: one program per chunk and tile in the same launch, each tile's last program
    adding the chunk sums in order."""
    batched = a.dim() == 3
    g = a.shape[0] if batched else 1
    m, k = a.shape[-2:]
    n = b.shape[-2]
    c = torch.empty((*a.shape[:-2], m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0 or g == 0:
        return c
    if k == 0:
        c.zero_()
        return c if bias is None else c.add_(bias)
    a = a if a.stride(-1) == 1 else a.contiguous()
    b = b if b.stride(-1) == 1 else b.contiguous()
    fp8 = a_scale is not None
    chunk = k_chunk or triton.cdiv(k, cfg.block_k) * cfg.block_k
    if chunk % cfg.block_k:
        raise ValueError(f"K chunk {chunk} must be a multiple of block_k {cfg.block_k}")
    chunks = triton.cdiv(k, chunk)
    split = split and chunks > 1
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    dummy = c
    ws = torch.empty((chunks, g, m, n), dtype=torch.float32, device=a.device) if split else dummy
    tickets = _TILE_TICKETS.get(a.device, g * tiles) if split else dummy
    _dense_kernel[(tiles, g, chunks if split else 1)](
        a, b, c,
        a_scale if fp8 else dummy, b_scale if fp8 else dummy, bias if bias is not None else dummy,
        ws, tickets, m, n, k, chunk, a.stride(-2), b.stride(-2), n,
        a_scale.stride(0) if a_scale is not None else 0, b_scale.stride(0) if b_scale is not None else 0,
        a.stride(0) if batched else 0, b.stride(0) if batched else 0, m * n, g * m * n,
        FP8=fp8, HAS_BIAS=bias is not None, IEEE=a.dtype == torch.float32, SPLIT=split,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        SPLITS=chunks if split else 1, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return c


@triton.jit
def _fp8_tma_kernel(
    a_desc, b_desc, c_desc, as_ptr, bs_ptr, M, N, K, stride_asm, stride_bsn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):  # fmt: skip
    """Persistent FP8 block-scaled GEMM over TMA descriptors (SM90+): C = A @ B^T as _dense_kernel
    computes it (same K order, same per-step scaling), but each program walks output tiles
    NUM_PROGRAMS apart and the tensor-memory accelerator loads A and B tiles (zero-filled past
    the edges, so no masks). BLOCK_N == 128: one weight scale per (tile, K step)."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    band = GROUP_M * grid_n
    k_steps = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(pid, grid_m * grid_n, NUM_PROGRAMS, flatten=True):
        first_m = (tile // band) * GROUP_M
        size_m = tl.minimum(grid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % band) % size_m
        pid_n = (tile % band) // size_m
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        rm = off_m + tl.arange(0, BLOCK_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kb in range(k_steps):
            a = a_desc.load([off_m, kb * BLOCK_K])
            b = b_desc.load([off_n, kb * BLOCK_K])
            a_s = tl.load(as_ptr + rm * stride_asm + kb, mask=rm < M, other=0.0)
            b_s = tl.load(bs_ptr + pid_n * stride_bsn + kb)
            acc += mma(a, b.T, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), False) * a_s[:, None] * b_s
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


def _tma_ok(xq: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """TMA needs SM90+, unit inner strides and 16-byte aligned rows and bases."""
    if not tma_supported(xq.device):
        return False
    out_bytes = out_dtype.itemsize
    return (
        xq.stride(-1) == 1
        and weight.stride(-1) == 1
        and xq.stride(0) % 16 == 0
        and weight.stride(0) % 16 == 0
        and xq.data_ptr() % 16 == 0
        and weight.data_ptr() % 16 == 0
        and (weight.shape[0] * out_bytes) % 16 == 0
    )


def _launch_fp8_tma(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    cfg: GemmConfig,
) -> torch.Tensor:
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = xq.shape
    n = weight.shape[0]
    c = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0 or n == 0:
        return c
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    programs = min(tiles, num_sms(xq.device))
    a_desc = TensorDescriptor.from_tensor(xq, [cfg.block_m, cfg.block_k])
    b_desc = TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k])
    c_desc = TensorDescriptor.from_tensor(c, [cfg.block_m, cfg.block_n])
    _fp8_tma_kernel[(programs,)](
        a_desc, b_desc, c_desc, x_scale, weight_scale, m, n, k, x_scale.stride(0), weight_scale.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        NUM_PROGRAMS=programs, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return c


def _check_fp8(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: int = SCALE_BLOCK,
) -> None:
    if block not in FP8_BLOCKS:
        raise NotImplementedError(f"fp8_gemm: scale blocks of {block}; the kernels take {FP8_BLOCKS}")
    check_fp8_operands(xq, x_scale, weight, weight_scale, block)
    if xq.dtype != FP8_DTYPE or weight.dtype != FP8_DTYPE:
        raise ValueError(f"fp8_gemm takes float8_e4m3fn operands, got {xq.dtype} and {weight.dtype}")


def fp8_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    config: GemmConfig | None = None,
    batch_invariant: bool = False,
    tma: bool | None = None,
    block: int = SCALE_BLOCK,
) -> torch.Tensor:
    """(xq * x_scale) @ (weight * weight_scale)^T -> (M, N) out_dtype, float32 accumulation,
    with `block` x `block` weight scales and 1 x `block` activation scales (128 or 32).

    tma: the persistent TMA kernel (SM90+, aligned operands, block_n 128, 128-blocks only: one
    weight scale per tile and K step); None picks it where it applies and M > TMA_MIN_M, outside
    batch-invariant mode (which keeps one pointer-kernel tiling for every M). 32-blocks run on
    the pointer kernel with block_k = 32."""
    _check_fp8(xq, x_scale, weight, weight_scale, block)
    if tma is None:
        tma = (
            block == SCALE_BLOCK
            and not batch_invariant
            and xq.shape[0] > TMA_MIN_M
            and _tma_ok(xq, weight, out_dtype)
        )
    elif tma and (block != SCALE_BLOCK or not _tma_ok(xq, weight, out_dtype)):
        raise ValueError(
            "fp8_gemm: the TMA kernel needs 128-blocks, SM90+, unit inner strides and 16-byte rows"
        )
    if tma:
        cfg = config or fp8_tma_config(xq.shape[0])
    elif batch_invariant:
        cfg = config or replace(INVARIANT_CONFIG, block_k=block)
    else:
        cfg = config or fp8_config(xq.shape[0], block)
    if cfg.block_k != block or (tma and cfg.block_n != block):
        raise ValueError(
            f"FP8 GEMM tiles need block_k = the scale block {block} (and block_n = 128 with TMA), got {cfg}"
        )
    # the kernels index scales by row stride only: make the K-block axis contiguous
    x_scale, weight_scale = x_scale.float().contiguous(), weight_scale.float().contiguous()
    if tma:
        return _launch_fp8_tma(xq, x_scale, weight, weight_scale, out_dtype, cfg)
    chunk = (
        None
        if batch_invariant or config is not None
        else fp8_k_chunk(xq.shape[0], weight.shape[0], weight.shape[1], cfg, xq.device)
    )
    return _launch_dense(
        xq, weight, out_dtype, cfg, x_scale, weight_scale, k_chunk=chunk, split=chunk is not None
    )


# Decode-sized FP8 products with few output tiles split K over the programs of one launch: V4-
# Flash's wo_b (N = 4096, K = 8192) has 64 tiles of 64 columns at M <= 64, which leave half the
# H200's 132 SMs idle, each program walking 64 K steps. Up to FP8_SPLIT_MAX_M rows, where the
# tiles are fewer than half of FP8_SPLIT_PROGRAMS_PER_SM x SMs, K is cut into chunks until about
# that many programs run; the tile's last program adds the chunk sums in order (_dense_kernel's
# SPLIT: no float atomics, the same bits run to run). The chunking depends on (M tiles, N, K)
# only, so every M up to 64 (one M tile) reduces in the same order.
FP8_SPLIT_MAX_M = 64
FP8_SPLIT_PROGRAMS_PER_SM = 2


def fp8_k_chunk(m: int, n: int, k: int, cfg: GemmConfig, device: torch.device) -> int | None:
    """The K chunk of a split fp8_gemm launch (a multiple of block_k), or None: one chunk."""
    if not 0 < m <= FP8_SPLIT_MAX_M or n == 0:
        return None
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    want = FP8_SPLIT_PROGRAMS_PER_SM * num_sms(device)
    steps = triton.cdiv(k, cfg.block_k)
    chunks = min(steps, want // tiles)
    if 2 * tiles > want or chunks < 2:
        return None
    return int(triton.cdiv(steps, chunks)) * cfg.block_k


# Batch-invariant float matmul: K reduced in chunks of this many, each from zero, the chunk sums
# added in order (_dense_kernel). A row's bits depend on K_CHUNK and BLOCK_K (the order of the
# sum), not on M: small-M calls split the chunks over programs (more of them to fill the GPU)
# and large-M calls walk them in one program, with the same bits.
INVARIANT_K_CHUNK = 512
# Split the chunks over programs at decode sizes while the output tiles are fewer than this many
# per SM (at 256 rows and more, walking them in one program was faster on an H200).
SPLIT_BELOW_TILES_PER_SM = 2
SPLIT_MAX_M = 64


def invariant_setting(pinned: tuple[int, ...] | None) -> GemmConfig | None:
    """The one tile DEEPINFER_CUDA_INVARIANT_TILE's value (BM, BN, BK, WARPS, STAGES) fixes for the
    batch-invariant matmul at every M (benchmarks: the cuda backend passes it as `config`); None
    where it is unset (_invariant_tile's by M)."""
    if pinned is None:
        return None
    bm, bn, bk, warps, stages = pinned
    return GemmConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)


def _invariant_tile(m: int, dtype: torch.dtype, device: torch.device) -> GemmConfig:
    """The batch-invariant matmul's tiles for M rows. Every choice reduces K in BLOCK_K = 128
    steps; on an H200 (SM90) the tiles below gave bit-identical rows for every M (MMA shape,
    warps and stages apart: bench/bench_invariant_tiles.py --bits, 2026-12-01), so the tile
    follows M there. Elsewhere (another MMA generation, unchecked) one tile serves every M.
    invariant_setting pins one for every M (benchmarks)."""
    if dtype == torch.float32 or not is_sm90(device):  # float32 (IEEE products, unchecked) or not SM90
        return GemmConfig(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=4)
    # the fastest of five tilings per M for V2-Lite's linears in CUDA graphs on an H200
    # (bench/bench_invariant_tiles.py, bench/results/2026-12-01_H200_moe_tiles_invariant_linear)
    if m <= 16:
        return GemmConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
    if m <= 48:
        return GemmConfig(block_m=32, block_n=32, block_k=128, num_warps=4, num_stages=3)
    if m <= 512:
        return GemmConfig(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3)
    return GemmConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3)


def _invariant_launch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemmConfig | None
) -> torch.Tensor:
    m, n = x.shape[-2], weight.shape[-2]
    cfg = config or _invariant_tile(m, x.dtype, x.device)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n) * (x.shape[0] if x.dim() == 3 else 1)
    split = m <= SPLIT_MAX_M and tiles < SPLIT_BELOW_TILES_PER_SM * num_sms(x.device)
    return _launch_dense(x, weight, x.dtype, cfg, bias=bias, k_chunk=INVARIANT_K_CHUNK, split=split)


def matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: GemmConfig | None = None
) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T (+ bias): the batch-invariant linear (K in INVARIANT_K_CHUNK
    chunks added in order; `config` (benchmarks) fixes the tiles)."""
    return _invariant_launch(x, weight, bias, config)


def batched_matmul(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig | None = None) -> torch.Tensor:
    """x (G, M, K) @ weight (G, N, K)^T -> (G, M, N) in ONE launch (grid axis 1 over G), each
    product reduced exactly as matmul reduces it alone: batch-invariant, bit for bit equal to G
    matmul calls (MLA's per-head absorbed projections: G = heads, 2 launches per layer instead
    of 2 x heads)."""
    if x.dim() != 3 or weight.dim() != 3 or x.shape[0] != weight.shape[0] or x.shape[2] != weight.shape[2]:
        raise ValueError(f"batched_matmul: x (G, M, K) and weight (G, N, K), got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")  # fmt: skip
    return _invariant_launch(x, weight, None, config)


# --------------------------------------------------------------------------- skinny GEMM


@dataclass(frozen=True)
class SkinnyConfig:
    """Tiles of the skinny GEMM: block_n weight rows per program (the MMA's M side), and either
    a slab of K per program (slab > 0), or block_k per step with the K range split over programs
    until about programs_per_sm x SMs programs run (slab = 0)."""

    block_n: int = 64
    block_k: int = 128
    programs_per_sm: int = 2
    num_warps: int = 4
    num_stages: int = 4
    # > 0: each program loads its whole K range of slab (a power of two) in one go, and with pdl
    # (programmatic dependent launch, SM90+) does so before waiting for the previous kernel
    slab: int = 0
    pdl: bool = False
    # FP8 weights only (skinny_fp8_matmul): e4m3 x e4m3 products on the tensor cores
    # (_skinny_fp8_mma_kernel) instead of both operands dequantised to x's dtype (_skinny_kernel's
    # FP8 path). Not taken by default: bench/bench_v4_decode.py measures it ("mma" rows).
    fp8_mma: bool = False


# Up to this many rows of x the float linear takes the skinny kernel (outside batch-invariant
# mode). Alone it only matches cuBLAS (bench_cuda.py --only skinny: both about 6.7 us for
# V2-Lite's o_proj at M = 1 on an H200, 1.3 TB/s: a decode-sized GEMM is mostly ramp-up); what it
# adds is programmatic dependent launch: each program loads its 64 x 512 weight slab while the
# previous kernel (an rms_norm, the attention's combine, another skinny GEMM: they signal
# launch_dependents) still runs, and waits for it only before reading x. A chain of 16 such
# products took 4.1 us each against cuBLAS's 6.7 (2026-12-01, H200). Larger weights stay on
# cuBLAS: there the 512-wide slabs lost (V2-Lite's dense MLP 0.80x and 0.91x, its LM head 0.80x).
SKINNY_MAX_M = 8
SKINNY_MAX_WEIGHT_BYTES = 32 * 2**20
SKINNY_CONFIG = SkinnyConfig(block_n=64, block_k=128, num_warps=8, slab=512, pdl=True)
# FP8 weights (linear_fp8, DeepSeek's 128 x 128 block-scaled e4m3) take the skinny kernel up to
# this many rows and SKINNY_FP8_MAX_WEIGHT_BYTES: the path it replaces is a quantisation launch
# and the Triton block-scaled GEMM (fp8_config), about 17 us whatever the size at decode rows.
# The x^T operand takes BLOCK_M = next_pow2(M) >= 16 rows (the MMA's N side), so 64 rows are
# still one tile. The kernel dequantises both operands in registers and runs near 500 GB/s, so
# it wins only where that fixed cost dominates: on an H200 (bench/results/
# 2026-12-03_H200_v4_published_decode) V4-Flash's wq_a (4 MiB) 9.4 / 14.4 us at M = 1 / 64
# against 17.6 / 18.1, wkv (2 MiB) 7.1 / 8.5 against 17.4 / 17.7; but wq_b and wo_b (32 MiB)
# 68 against 18 and 31 us, the shared experts (8, 16 MiB) 17 and 34 against 11 and 18.
SKINNY_FP8_MAX_M = 64
SKINNY_FP8_MAX_WEIGHT_BYTES = 4 * 2**20
# 64 rows x 512 columns of e4m3 (32 KiB, half the bf16 slab's bytes) per program, loaded before
# the wait; above 16 rows the x^T operand (512 x BLOCK_M) grows, so the slab halves to keep both
# operands in registers. One row: 256 columns and 4 warps, measured in the same run at 4.8 us
# (wq_a) and 3.8 us (wkv) against 9.4 and 7.1 with the 16-row tiles.
SKINNY_FP8_ONE_ROW_CONFIG = SkinnyConfig(block_n=64, block_k=128, num_warps=4, slab=256, pdl=True)
SKINNY_FP8_CONFIG = SkinnyConfig(block_n=64, block_k=128, num_warps=8, slab=512, pdl=True)
SKINNY_FP8_WIDE_CONFIG = SkinnyConfig(block_n=64, block_k=128, num_warps=8, slab=256, pdl=True)
# Split-KV partials merged per step of skinny_merge_matmul (a (MERGE_SPLITS, slab) float32 load).
MERGE_SPLITS = 16


@triton.jit
def _merge_step(
    part_ptr, lse_ptr, row, s0, NUM_SPLITS, ks, K, stride_part, rs, mx, acc, den, BY_LSE: tl.constexpr
):  # fmt: skip
    """Splits [s0, s0 + BLOCK_S) of one row into the running (maximum, sum of weighted partials,
    sum of weights). BY_LSE: a partial is loaded only where its split is not empty (its load then
    waits for the log-sum-exps); else every partial in range is loaded beside them, and an empty
    split's (possibly unwritten memory) is dropped by a select, never multiplied."""
    sp = s0 + rs
    lse = tl.load(lse_ptr + row + sp, mask=sp < NUM_SPLITS, other=float("-inf"))
    full = lse > float("-inf")
    load = full if BY_LSE else sp < NUM_SPLITS
    o = tl.load(
        part_ptr + (row + sp)[:, None] * stride_part + ks[None, :],
        mask=load[:, None] & (ks < K)[None, :],
        other=0.0,
    )  # (BLOCK_S, SLAB)
    m_new = tl.maximum(mx, tl.max(lse, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(mx - m_safe)
    w = tl.where(full, tl.exp2(lse - m_safe), 0.0)
    acc = acc * alpha + tl.sum(w[:, None] * tl.where(full[:, None], o, 0.0), 0)
    den = den * alpha + tl.sum(w, 0)
    return m_new, acc, den


@triton.jit
def _merged_rows_t(
    part_ptr, lse_ptr, g, G, M, NUM_SPLITS, ks, K, stride_part, rm,
    BLOCK_M: tl.constexpr, SLAB: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """x^T (SLAB, BLOCK_M) float32, columns ks, where x[m] is head g of token m merged from its
    NUM_SPLITS split-KV partials (attention.SplitPartials, row (m*G + g)*NUM_SPLITS + s): the
    softmax-weighted mean of the partials by their log2-sum-exps, BLOCK_S splits at a time with a
    running maximum (attention's combine, in one pass). The first BLOCK_S splits' partials load
    beside their log-sum-exps (a decode step's splits usually fit: one round trip); later ones
    only where not empty (a graph captured for long rows has many empty splits). An empty split
    (-inf) adds nothing."""
    rs = tl.arange(0, BLOCK_S)
    xt = tl.zeros([SLAB, BLOCK_M], tl.float32)
    for m in range(0, M):
        row = (m * G + g) * NUM_SPLITS  # int64
        mx = tl.full([], float("-inf"), tl.float32)
        acc = tl.zeros([SLAB], tl.float32)
        den = tl.zeros([], tl.float32)
        mx, acc, den = _merge_step(
            part_ptr, lse_ptr, row, 0, NUM_SPLITS, ks, K, stride_part, rs, mx, acc, den, False
        )
        for s0 in range(BLOCK_S, NUM_SPLITS, BLOCK_S):
            mx, acc, den = _merge_step(
                part_ptr, lse_ptr, row, s0, NUM_SPLITS, ks, K, stride_part, rs, mx, acc, den, True
            )
        merged = acc / tl.where(den == 0.0, 1.0, den)
        xt = tl.where(rm[None, :] == m, merged[:, None], xt)
    return xt


@triton.jit
def _fp8_round_trip_t(xt, SLAB: tl.constexpr, BLOCK_M: tl.constexpr):
    """x^T (SLAB, BLOCK_M) float32 -> the values each row's 128-column groups take once quantised
    to e4m3 with scale amax / 448 (gemm.quantize_fp8's format), dequantised again in float32. The
    quotient is a product by the scale's reciprocal, which may put a value that sits on a tie on
    the neighbouring code (the FP8 budget of the contract allows it): a division per element
    would cost about as much as decoding the weights."""
    blocks = tl.reshape(xt, (SLAB // 128, 128, BLOCK_M))
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(blocks), 1), 1e-10), 448.0)  # (SLAB/128, BLOCK_M)
    inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    q = tl.minimum(tl.maximum(blocks * inv[:, None, :], -448.0), 448.0)
    q = to_e4m3(q).to(tl.float32) * scale[:, None, :]
    return tl.reshape(q, (SLAB, BLOCK_M))


@triton.jit
def _skinny_kernel(
    x_ptr, w_ptr, out_ptr, ws_ptr, tickets_ptr, lse_ptr, wscale_ptr, M, N, K, K_SPLIT, NUM_SPLITS,
    stride_xg, stride_xm, stride_wg, stride_wn, stride_og, stride_om, stride_on, stride_sg, stride_sn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    SLAB: tl.constexpr, MERGE: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
    SPLITS: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """out (M, N) = x (M, K) @ w (N, K)^T for M <= BLOCK_M, with the operands swapped: each
    program multiplies BLOCK_N weight rows by x^T (BLOCK_K, BLOCK_M), so the MMA's wide side is
    the weight's (64 rows fill a Hopper warpgroup MMA where M = 1 would waste it). Grid (N tiles,
    G products, S = SPLITS K-ranges of K_SPLIT). SPLIT: program s writes its float32 partial sum
    to ws (S, G, M, N) and counts itself in on its (product, tile) ticket; the last to arrive
    resets it and adds the S partials in order s = 0 .. S - 1 (deterministic, no float atomics;
    the loop is unrolled, so the S loads are in flight together, not one L2 round trip after
    another at the end of the kernel).
    MERGE (SLAB only): x is attention's split-KV partials (x_ptr the partials, stride_xm their
    row stride, lse_ptr their log2-sum-exps, NUM_SPLITS per row), merged as they are read and
    rounded to the weight's dtype, as attention's combine stores them.
    FP8 (SLAB only): w e4m3 with one float32 scale per 128 x 128 block (wscale, (G, N/128, K/128),
    strides stride_sg, stride_sn, unit along K), x in out's dtype, quantised per row and 128
    columns in the program as linear_fp8 quantises it (_fp8_round_trip_t); both operands are
    dequantised in registers to out's dtype (the weight exactly where its scales are powers of
    two, as DeepSeek-V4's UE8M0 scales are; else rounded once, far inside the FP8 budget) and
    multiplied there. BLOCK_N divides 128, so a program's rows share one row of scale blocks and
    its slab spans SLAB / 128 of them: SLAB scale loads (L1 broadcasts), not one per weight.
    Half the weight bytes of bf16 for the same MMA, and the slab still loads before the wait."""
    pid_n = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    s = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + g * stride_wg + rn[:, None].to(tl.int64) * stride_wn  # (BLOCK_N, 1)
    x_cols = x_ptr + g * stride_xg + rm[None, :].to(tl.int64) * stride_xm  # (1, BLOCK_M)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    if SLAB:  # the program's whole range (K_SPLIT == SLAB) in one load and one product
        launch_dependents(PDL)  # the next kernel may start launching
        ks = s * SLAB + tl.arange(0, SLAB)
        w = tl.load(w_rows + ks[None, :], mask=(rn[:, None] < N) & (ks[None, :] < K), other=0.0)
        if FP8:  # (BLOCK_N, SLAB) e4m3 -> out's dtype, times the slab's SLAB / 128 block scales
            scale_row = wscale_ptr + g * stride_sg + ((pid_n * BLOCK_N) // 128) * stride_sn
            w_s = tl.load(scale_row + ks // 128, mask=ks < K, other=0.0)
            w = (w.to(tl.float32) * w_s[None, :]).to(out_ptr.dtype.element_ty)
        wait_for_previous(PDL)  # the weights do not depend on the previous kernel; x does
        if MERGE:
            xt = _merged_rows_t(
                x_ptr, lse_ptr, g, tl.num_programs(1), M, NUM_SPLITS, ks, K, stride_xm, rm,
                BLOCK_M, SLAB, BLOCK_S,
            ).to(w.dtype)  # fmt: skip
        else:
            xt = tl.load(x_cols + ks[:, None], mask=(rm[None, :] < M) & (ks[:, None] < K), other=0.0)
            if FP8:
                xt = _fp8_round_trip_t(xt.to(tl.float32), SLAB, BLOCK_M).to(w.dtype)
        acc = mma(w, xt, acc, False)
    else:
        launch_dependents(PDL)
        wait_for_previous(PDL)
        for k0 in range(s * K_SPLIT, tl.minimum(s * K_SPLIT + K_SPLIT, K), BLOCK_K):
            kk = k0 + rk
            w = tl.load(w_rows + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
            xt = tl.load(x_cols + kk[:, None], mask=(rm[None, :] < M) & (kk[:, None] < K), other=0.0)
            acc = mma(w, xt, acc, False)
    out_mask = (rn[:, None] < N) & (rm[None, :] < M)
    tile = rm[None, :].to(tl.int64) * N + rn[:, None]  # (BLOCK_N, BLOCK_M) in one (M, N) partial
    if SPLIT:
        mn = M * N
        part = ws_ptr + g * mn + tile
        tl.store(part + s.to(tl.int64) * tl.num_programs(1) * mn, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is stored before the program counts itself in
        ticket = tickets_ptr + g * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(ticket, 1, sem="acq_rel")
        if arrived < SPLITS - 1:
            return
        tl.store(ticket, 0)  # the tile's last program: ready for the next launch (and graph replay)
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for r in tl.static_range(SPLITS):  # written by other programs: volatile, no stale L1 lines
            acc += tl.load(part + r * tl.num_programs(1) * mn, mask=out_mask, other=0.0, volatile=True)
    out = out_ptr + g * stride_og + rm[None, :].to(tl.int64) * stride_om + rn[:, None] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _skinny_fp8_mma_kernel(
    x_ptr, w_ptr, wscale_ptr, out_ptr, ws_ptr, tickets_ptr, M, N, K,
    stride_xg, stride_xm, stride_wg, stride_wn, stride_og, stride_om, stride_on, stride_sg, stride_sn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SLAB: tl.constexpr, SPLIT: tl.constexpr,
    SPLITS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """linear_fp8 for M <= BLOCK_M with e4m3 x e4m3 products on the tensor cores: out (M, N) =
    quantize_fp8(x) @ (w * wscale)^T, w (N, K) e4m3 with float32 scales per 128 x 128 block
    (wscale (G, ceil(N/128), ceil(K/128)), strides stride_sg, stride_sn, unit along K).

    _skinny_kernel's SLAB layout: grid (N tiles, G products, S = SPLITS slabs of SLAB columns),
    BLOCK_N weight rows per program on the MMA's M side (BLOCK_N divides 128: the program's rows
    share one row of scale blocks), x^T (128, BLOCK_M >= 16) on its N side; the slab's SLAB / 128
    weight blocks (BLOCK_N, 128) and their scales load before the wait (PDL), x after it; SPLIT:
    float32 partials in ws (S, G, M, N) and a ticket per (product, tile), the last program adding
    them in order s = 0 .. S - 1, as there.

    x is quantised per row and 128 columns in the program exactly as quantize_fp8 (the contract,
    deepinfer.reference.gemm) does it: scale = amax / 448 and each quotient by IEEE division,
    clamped to +-448 and rounded to nearest even, so the e4m3 codes and scales are the contract's.

    Promotion every 128 K, as DeepGEMM does: each 128-wide K block's product starts from zero on
    the tensor cores (an e4m3 x e4m3 MMA accumulating in float32; on SM90 its FP8 accumulation
    keeps about 14 bits, DeepSeek-V3's report), is scaled in registers by x's per-row scale times
    the weight block's scale and added to the float32 accumulator: the MMA never sums across scale
    blocks, and no operand is dequantised (_skinny_kernel's FP8 path converts the weight slab and
    x^T to bf16 element by element)."""
    pid_n = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    s = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, 128)
    w_rows = w_ptr + g * stride_wg + rn[:, None].to(tl.int64) * stride_wn  # (BLOCK_N, 1)
    x_cols = x_ptr + g * stride_xg + rm[None, :].to(tl.int64) * stride_xm  # (1, BLOCK_M)
    scale_row = wscale_ptr + g * stride_sg + ((pid_n * BLOCK_N) // 128) * stride_sn
    launch_dependents(PDL)  # the next kernel may start launching
    # the slab as SLAB / 128 tiles (BLOCK_N, 128) e4m3 and one scale each: the weights do not
    # depend on the previous kernel, so they load before the wait (a tuple: one tile per MMA)
    w_blocks = ()
    w_scales = ()
    for j in tl.static_range(SLAB // 128):
        kk = s * SLAB + j * 128 + rk
        w = tl.load(w_rows + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        kb = s * (SLAB // 128) + j
        # (concatenated: Triton's compiler takes no starred tuples; mypy typed them empty)
        w_blocks = w_blocks + (w,)  # type: ignore[assignment]  # noqa: RUF005
        w_s = tl.load(scale_row + kb, mask=kb * 128 < K, other=0.0)
        w_scales = w_scales + (w_s,)  # type: ignore[assignment]  # noqa: RUF005
    wait_for_previous(PDL)  # x is the previous kernel's
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for j in tl.static_range(SLAB // 128):
        kk = s * SLAB + j * 128 + rk
        xt = tl.load(x_cols + kk[:, None], mask=(rm[None, :] < M) & (kk[:, None] < K), other=0.0)
        xt = xt.to(tl.float32)  # (128, BLOCK_M): one scale per column (a row of x)
        x_s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(xt), 0), 1e-10), 448.0)  # (BLOCK_M,)
        q = to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(xt, x_s[None, :]), -448.0), 448.0))
        part = mma(w_blocks[j], q, tl.zeros([BLOCK_N, BLOCK_M], tl.float32), False)  # e4m3 MMA
        acc += part * x_s[None, :] * w_scales[j]  # promoted: _dense_kernel's order of the scales
    out_mask = (rn[:, None] < N) & (rm[None, :] < M)
    tile = rm[None, :].to(tl.int64) * N + rn[:, None]  # (BLOCK_N, BLOCK_M) in one (M, N) partial
    if SPLIT:
        mn = M * N
        part_ptr = ws_ptr + g * mn + tile
        tl.store(part_ptr + s.to(tl.int64) * tl.num_programs(1) * mn, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is stored before the program counts itself in
        ticket = tickets_ptr + g * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(ticket, 1, sem="acq_rel")
        if arrived < SPLITS - 1:
            return
        tl.store(ticket, 0)  # the tile's last program: ready for the next launch (and graph replay)
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for r in tl.static_range(SPLITS):  # written by other programs: volatile, no stale L1 lines
            acc += tl.load(part_ptr + r * tl.num_programs(1) * mn, mask=out_mask, other=0.0, volatile=True)
    out = out_ptr + g * stride_og + rm[None, :].to(tl.int64) * stride_om + rn[:, None] * stride_on
    tl.store(out, to_dtype(acc, out_ptr.dtype.element_ty), mask=out_mask)


# One int32 ticket per (product, weight-row tile) of a split _skinny_kernel launch.
_SKINNY_TICKETS = Semaphores()


def skinny_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether skinny_matmul serves x (.., M, K) @ weight (.., N, K)^T: bfloat16 or float16
    operands of one dtype, M <= SKINNY_MAX_M, unit stride along K."""
    return (
        x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and 0 < x.shape[-2] <= SKINNY_MAX_M
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
    )


def skinny_pays(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Where the engine takes the skinny kernel: skinny_ok, and a weight of at most
    SKINNY_MAX_WEIGHT_BYTES (all groups together)."""
    return skinny_ok(x, weight) and weight.numel() * weight.element_size() <= SKINNY_MAX_WEIGHT_BYTES


def skinny_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
    pdl: bool = True,
) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T -> (M, N), or batched x (G, M, K) @ weight (G, N, K)^T ->
    (G, M, N), for M <= SKINNY_MAX_M (decode sizes), in one launch. `out` (any strides, the
    result's shape) receives it: MLA writes its per-head products straight into (T, H, Vh).
    pdl: launch with PDL where the config and the device allow it (common.pdl_enabled)."""
    if not skinny_ok(x, weight) or x.dim() != weight.dim() or x.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"skinny_matmul: x (.., M <= {SKINNY_MAX_M}, K) and weight (.., N, K) of one float16 or "
            f"bfloat16 dtype, unit stride along K; got {tuple(x.shape)} {x.dtype} and "
            f"{tuple(weight.shape)} {weight.dtype}"
        )
    batched = x.dim() == 3
    g = x.shape[0] if batched else 1
    m, k = x.shape[-2:]
    if out is None:
        out = torch.empty((*x.shape[:-2], m, weight.shape[-2]), dtype=x.dtype, device=x.device)
    strides = (x.stride(0) if batched else 0, x.stride(-2))
    return _launch_skinny(x, strides, None, 0, weight, out, g, m, k, batched, config or SKINNY_CONFIG, pdl)


def skinny_fp8_ok(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> bool:
    """Whether skinny_fp8_matmul serves x (.., M, K) float @ weight (.., N, K) e4m3: bfloat16 or
    float16 x, 0 < M <= SKINNY_FP8_MAX_M, unit strides along K, and the block-scale shape
    (.., ceil(N/128), ceil(K/128)). Any weight size (benchmarks time every shape)."""
    n, k = weight.shape[-2:]
    return (
        x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == FP8_DTYPE
        and x.dim() == weight.dim() == weight_scale.dim()
        and x.shape[-1] == k
        and 0 < x.shape[-2] <= SKINNY_FP8_MAX_M
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
        and tuple(weight_scale.shape[-2:]) == (triton.cdiv(n, SCALE_BLOCK), triton.cdiv(k, SCALE_BLOCK))
    )


def skinny_fp8_pays(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> bool:
    """Where the engine takes the skinny FP8 kernel: skinny_fp8_ok, and a weight of at most
    SKINNY_FP8_MAX_WEIGHT_BYTES (every group together)."""
    nbytes = weight.numel() * weight.element_size()
    return nbytes <= SKINNY_FP8_MAX_WEIGHT_BYTES and skinny_fp8_ok(x, weight, weight_scale)


def skinny_fp8_config(m: int) -> SkinnyConfig:
    """The FP8 skinny tiles for M rows (one row, up to 16, then the narrower slab)."""
    if m == 1:
        return SKINNY_FP8_ONE_ROW_CONFIG
    return SKINNY_FP8_CONFIG if m <= 16 else SKINNY_FP8_WIDE_CONFIG


def skinny_fp8_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
    pdl: bool = True,
) -> torch.Tensor:
    """linear_fp8 at decode sizes in one launch: x (M, K) bf16 / fp16 quantised per row and 128
    columns inside the kernel, weight (N, K) e4m3 with float32 block scales (ceil(N/128),
    ceil(K/128)) -> (M, N) in x's dtype; or batched x (G, M, K) (any strides but unit along K),
    weight (G, N, K), scales (G, ceil(N/128), ceil(K/128)) -> (G, M, N) (DeepSeek-V4's grouped
    wo_a). `out` (any strides, the result's shape) receives it. pdl: as skinny_matmul's.
    config.fp8_mma: the e4m3 x e4m3 tensor-core kernel (_skinny_fp8_mma_kernel, x quantised
    exactly as quantize_fp8 does) instead of the default's operands dequantised to x's dtype."""
    if not skinny_fp8_ok(x, weight, weight_scale):
        raise ValueError(
            f"skinny_fp8_matmul: x (.., M <= {SKINNY_FP8_MAX_M}, K) bfloat16 / float16, weight (.., N, K) "
            f"float8_e4m3fn and scales (.., ceil(N/128), ceil(K/128)), unit stride along K; got "
            f"{tuple(x.shape)} {x.dtype}, {tuple(weight.shape)} {weight.dtype}, {tuple(weight_scale.shape)}"
        )
    batched = x.dim() == 3
    if batched and not (x.shape[0] == weight.shape[0] == weight_scale.shape[0]):
        raise ValueError(f"skinny_fp8_matmul: {x.shape[0]} groups of x, {weight.shape[0]} of the weight")
    g = x.shape[0] if batched else 1
    m, k = x.shape[-2:]
    cfg = config or skinny_fp8_config(m)
    if not cfg.slab or cfg.slab % SCALE_BLOCK or SCALE_BLOCK % cfg.block_n:
        raise ValueError(f"skinny_fp8_matmul: slab a multiple of 128 and block_n dividing 128, got {cfg}")
    if cfg.fp8_mma and cfg.block_n not in (64, 128):
        # SM90's FP8 MMA is a warpgroup's, 64 rows on its M side: narrower tiles compile to
        # mma.sync on float16 operands (tests/test_cuda_compile.py), not e4m3 products
        raise ValueError(f"skinny_fp8_matmul: fp8_mma takes block_n 64 or 128, got {cfg}")
    if out is None:
        out = torch.empty((*x.shape[:-2], m, weight.shape[-2]), dtype=x.dtype, device=x.device)
    strides = (x.stride(0) if batched else 0, x.stride(-2))
    scale = weight_scale.float()
    scale = scale if scale.stride(-1) == 1 else scale.contiguous()
    return _launch_skinny(x, strides, None, 0, weight, out, g, m, k, batched, cfg, pdl, scale)


def skinny_merge_ok(tokens: int, weight: torch.Tensor) -> bool:
    """Whether skinny_merge_matmul serves `tokens` rows against weight (G, N, K): skinny_ok's
    sizes and dtypes, and the configured SKINNY_CONFIG loads whole slabs (the merge's place)."""
    return (
        SKINNY_CONFIG.slab > 0
        and weight.dim() == 3
        and 0 < tokens <= SKINNY_MAX_M
        and weight.dtype in (torch.bfloat16, torch.float16)
        and weight.stride(-1) == 1
    )


def skinny_merge_matmul(
    part: torch.Tensor, lse: torch.Tensor, splits: int, tokens: int, weight: torch.Tensor, pdl: bool = True
) -> torch.Tensor:
    """Attention's split-KV partials merged and multiplied per head in one launch: x[t, h] (K,) is
    head h of token t merged from its `splits` partials (attention.SplitPartials: part
    (T*G*splits, >= K) float32, lse (T*G*splits,), row (t*G + h)*splits + s) and rounded to the
    weight's dtype, as combine_splits would store it; -> (T, G, N) = x[:, g] @ weight[g]^T for
    weight (G, N, K), in the weight's dtype. The merge is combine_splits' in one pass (a running
    maximum), so the result may differ from the two launches by the rounding of x. pdl: as
    skinny_matmul's."""
    g, n, k = weight.shape
    if not skinny_merge_ok(tokens, weight) or part.dim() != 2 or part.shape[1] < k:
        raise ValueError(
            f"skinny_merge_matmul: {tokens} tokens (<= {SKINNY_MAX_M}) and a (G, N, K) float16 or bfloat16 "
            f"weight with K <= the partials' width; got weight {tuple(weight.shape)} {weight.dtype}, "
            f"partials {tuple(part.shape)}"
        )
    if part.shape[0] != tokens * g * splits or lse.shape != (part.shape[0],) or part.stride(1) != 1:
        raise ValueError(
            f"skinny_merge_matmul: {tokens} tokens x {g} heads x {splits} splits need partials of "
            f"{tokens * g * splits} unit-stride rows and as many log-sum-exps; got {tuple(part.shape)} "
            f"and {tuple(lse.shape)}"
        )
    out = torch.empty((tokens, g, n), dtype=weight.dtype, device=weight.device)
    return _launch_skinny(
        part, (0, part.stride(0)), lse, splits, weight, out.transpose(0, 1), g, tokens, k, True,
        SKINNY_CONFIG, pdl,
    ).transpose(0, 1)  # fmt: skip


def _launch_skinny(
    x: torch.Tensor,
    x_strides: tuple[int, int],
    lse: torch.Tensor | None,
    splits: int,
    weight: torch.Tensor,
    out: torch.Tensor,
    g: int,
    m: int,
    k: int,
    batched: bool,
    cfg: SkinnyConfig,
    pdl: bool,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """_skinny_kernel for G products of M rows over K, into `out` (G, M, N) or (M, N); x's
    (group, row) strides; lse: MERGE, x the attention partials and `splits` per row;
    weight_scale: FP8 weights' block scales (unit stride along K)."""
    n = weight.shape[-2]
    if n == 0 or g == 0:
        return out
    tiles = triton.cdiv(n, cfg.block_n)
    if cfg.slab:
        k_split = cfg.slab
    else:
        steps = triton.cdiv(k, cfg.block_k)
        split = max(1, min(steps, cfg.programs_per_sm * num_sms(x.device) // (tiles * g)))
        k_split = triton.cdiv(steps, split) * cfg.block_k
    split = triton.cdiv(k, k_split)  # no empty range
    pdl = cfg.pdl and pdl_enabled(x.device, pdl)
    ws = torch.empty((split, g, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    tickets = _SKINNY_TICKETS.get(x.device, g * tiles) if split > 1 else out
    fp8 = weight_scale is not None
    scale_strides = (0, 0)
    if weight_scale is not None:
        scale_strides = (weight_scale.stride(0) if batched else 0, weight_scale.stride(-2))
    if weight_scale is not None and cfg.fp8_mma:
        _skinny_fp8_mma_kernel[(tiles, g, split)](
            x, weight, weight_scale, out, ws, tickets, m, n, k,
            x_strides[0], x_strides[1], weight.stride(0) if batched else 0, weight.stride(-2),
            out.stride(0) if batched else 0, out.stride(-2), out.stride(-1), *scale_strides,
            BLOCK_M=next_pow2(m), BLOCK_N=cfg.block_n, SLAB=cfg.slab, SPLIT=split > 1, SPLITS=split, PDL=pdl,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl,
        )  # fmt: skip
        return out
    _skinny_kernel[(tiles, g, split)](
        x, weight, out, ws, tickets, lse if lse is not None else x, weight_scale if fp8 else x,
        m, n, k, k_split, splits,
        x_strides[0], x_strides[1], weight.stride(0) if batched else 0, weight.stride(-2),
        out.stride(0) if batched else 0, out.stride(-2), out.stride(-1), *scale_strides,
        BLOCK_M=next_pow2(m) if fp8 else 16, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split > 1,
        SLAB=cfg.slab, MERGE=lse is not None, BLOCK_S=MERGE_SPLITS, PDL=pdl, SPLITS=split, FP8=fp8,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl,
    )  # fmt: skip
    return out


# --------------------------------------------------------------------------- grouped GEMM


@dataclass(frozen=True)
class TileTable:
    """The grouped GEMM's M-tiles mapped to groups (see tile_table). A MoE layer computes it once
    (kernels/moe.py, with the expert sort) and both expert GEMMs use it: they sort the same rows
    with the same block_m."""

    group: torch.Tensor  # (n,) int32: the group of each tile
    rows: torch.Tensor  # (n, 2) int32: [start, end) sorted rows of each tile (empty: spare tile)
    num_tiles: int  # n = ceil(M / block_m) + E, an upper bound known without a host sync
    block_m: int


def tile_table(
    group_sizes: torch.Tensor, num_rows: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Map M-tiles to groups without a host sync (moe_align_block_size, unpadded), in torch
    (~20 small launches; kernels/moe.py computes the same table in one).

    Rows are sorted by group. Returns (tile_group (n,) int32, tile_rows (n, 2) int32 [start, end)
    of each tile, n): n = ceil(M / block_m) + E is an upper bound; spare tiles are empty."""
    e = group_sizes.shape[0]
    gs = group_sizes.long()
    tiles = (gs + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    row_off = torch.cumsum(gs, 0) - gs
    n = triton.cdiv(num_rows, block_m) + e
    t = torch.arange(n, device=gs.device)
    grp = torch.searchsorted(tile_end, t, right=True)
    valid = grp < e
    g = grp.clamp(max=max(e - 1, 0))
    start = row_off[g] + (t - (tile_end[g] - tiles[g])) * block_m
    end = torch.where(valid, torch.minimum(start + block_m, row_off[g] + gs[g]), start)
    return g.to(torch.int32), torch.stack([start, end], 1).to(torch.int32), n


@triton.jit
def _grouped_kernel(
    a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, gather_ptr, tile_group_ptr, tile_rows_ptr, N, K,
    stride_am, stride_be, stride_bn, stride_cm, stride_asm, stride_bse, stride_bsn,
    FP8: tl.constexpr, GATHER: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """C rows [start, end) of one tile = A rows (gathered: A[gather[r]]) @ B[group]^T."""
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    start = tl.load(tile_rows_ptr + 2 * pid_t)
    end = tl.load(tile_rows_ptr + 2 * pid_t + 1)
    if start >= end:
        return
    grp = tl.load(tile_group_ptr + pid_t).to(tl.int64)
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    if GATHER:
        src = tl.load(gather_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + src[:, None] * stride_am + rk[None, :]
    b_ptrs = b_ptr + grp * stride_be + rn[None, :].to(tl.int64) * stride_bn + rk[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = rk < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=(rn[None, :] < N) & kmask[:, None], other=0.0)
        if FP8:
            kb = k0 // BLOCK_K
            a_s = tl.load(as_ptr + src * stride_asm + kb, mask=row_ok, other=0.0)
            b_s = tl.load(
                bs_ptr + grp * stride_bse + (rn // BLOCK_K) * stride_bsn + kb, mask=rn < N, other=0.0
            )
            acc += mma(a, b, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), False) * a_s[:, None] * b_s[None, :]
        else:
            acc = mma(a, b, acc, IEEE)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & (rn[None, :] < N))


DECODE_ROWS = 128  # token copies of a decode step at up to 16 tokens (top-8)


def grouped_config(
    rows: int, fp8: bool, batch_invariant: bool, device: torch.device | None = None
) -> GemmConfig:
    """Tiles for the grouped GEMM; rows = sorted rows in the launch (token copies).
    Batch-invariant mode keeps BLOCK_K (64, FP8 128: a row's order of sums) for every rows; on
    SM90 (`device`), where the MMA gives a row the same bits in any tile (as for the dense
    matmul, _invariant_tile; tests/test_cuda_kernels.py checks the grouped GEMM), the other tile
    sizes follow rows as by default; elsewhere one tile serves every launch."""
    if batch_invariant and not is_sm90(device):
        return GemmConfig(block_m=64, block_n=128, block_k=128 if fp8 else 64, num_warps=4, num_stages=3)
    if rows <= DECODE_ROWS and (fp8 or not batch_invariant):  # BLOCK_K 128: not bf16's invariant 64
        # 16 x 64 x 128: the best of five tilings at 1 to 8 decode tokens on an H200, V2-Lite
        # and V3 shapes, bf16 and FP8 (bench/bench_moe_decode.py; at one V2-Lite token 2210
        # against 1978 GB/s for 16 x 128 x 64, and ahead of two GEMV-shaped kernels that read
        # each token copy's expert rows directly: 2165 GB/s,
        # bench/results/2026-12-01_H200_moe_tiles_invariant_linear)
        return GemmConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4 if fp8 else 3)
    block_m = 16 if rows <= 1024 else 64 if rows <= 16384 else 128
    warps = 8 if block_m == 128 else 4
    return GemmConfig(block_m=block_m, block_n=128, block_k=128 if fp8 else 64, num_warps=warps, num_stages=3)


def grouped_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    group_sizes: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    x_scale: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    gather: torch.Tensor | None = None,
    num_rows: int | None = None,
    batch_invariant: bool = False,
    config: GemmConfig | None = None,
    tiles: TileTable | None = None,
) -> torch.Tensor:
    """Rows sorted by group times weight[group]^T. x (M, K) (or, with gather (R,), the source of
    sorted row r is x[gather[r]]), weight (E, N, K), group_sizes (E,) summing to the row count.
    FP8 when x_scale / weight_scale are given (x and weight e4m3). -> (rows, N) out_dtype.
    tiles: a precomputed tile table for these group sizes (its block_m is the config's);
    without it the table is computed here, in torch."""
    e, n, k = weight.shape
    rows = num_rows if num_rows is not None else (gather.shape[0] if gather is not None else x.shape[0])
    if x.shape[-1] != k:
        raise ValueError(f"grouped_gemm: x has K={x.shape[-1]} but the weights have K={k}")
    if group_sizes.shape != (e,):
        raise ValueError(f"grouped_gemm: group_sizes must be ({e},), got {tuple(group_sizes.shape)}")
    out = torch.empty((rows, n), dtype=out_dtype, device=x.device)
    if rows == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    fp8 = x_scale is not None
    cfg = config or grouped_config(rows, fp8, batch_invariant, x.device)
    if tiles is None:
        tile_group, tile_rows, n_tiles = tile_table(group_sizes, rows, cfg.block_m)
    elif tiles.block_m != cfg.block_m or tiles.num_tiles != triton.cdiv(rows, cfg.block_m) + e:
        raise ValueError(f"grouped_gemm: tile table for block_m {tiles.block_m} and {tiles.num_tiles} tiles "
                         f"does not fit {rows} rows of {e} groups in block_m {cfg.block_m}")  # fmt: skip
    else:
        tile_group, tile_rows, n_tiles = tiles.group, tiles.rows, tiles.num_tiles
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    # the kernel indexes scales with unit stride along the K blocks
    x_scale = x_scale.contiguous() if x_scale is not None else None
    weight_scale = weight_scale.contiguous() if weight_scale is not None else None
    dummy = out
    grid = (n_tiles, triton.cdiv(n, cfg.block_n))
    _grouped_kernel[grid](
        x, weight, out,
        x_scale if fp8 else dummy, weight_scale if weight_scale is not None else dummy,
        gather if gather is not None else dummy, tile_group, tile_rows, n, k,
        x.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        x_scale.stride(0) if x_scale is not None else 0,
        weight_scale.stride(0) if weight_scale is not None else 0,
        weight_scale.stride(1) if weight_scale is not None else 0,
        FP8=fp8, GATHER=gather is not None, IEEE=x.dtype == torch.float32,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


# --------------------------------------------------------------------------- MXFP4 experts


@triton.jit
def _e2m1_tile(w_ptr, s_ptr, grp, rn, k, N, K, stride_we, stride_wn, stride_se, stride_sn):
    """float32 (BLOCK_K, BLOCK_N) tile of dequantised MXFP4 weights W[grp][rn, k]^T: the e2m1
    code of element k sits in byte k // 2 (low nibble for even k), its UE8M0 scale in byte
    k // 32 of the row's scales. Decoded arithmetically: code = sign | exponent e (2 bits) |
    mantissa m (1 bit), magnitude (1 + m/2) 2^(e-1), or m 2^-1 for e = 0 (powers of two are
    written into float32 exponent bits: exact, no exp2)."""
    ok = (rn[None, :] < N) & (k[:, None] < K)
    row = grp * stride_we + rn[None, :].to(tl.int64) * stride_wn
    byte = tl.load(w_ptr + row + k[:, None] // 2, mask=ok, other=0).to(tl.int32)
    code = (byte >> ((k[:, None] % 2) * 4)) & 0xF
    e = (code >> 1) & 3
    m = (code & 1).to(tl.float32)
    pow2 = ((e + 126) << 23).to(tl.float32, bitcast=True)  # 2^(e-1)
    magnitude = tl.where(e == 0, m, 1.0 + 0.5 * m) * pow2
    value = tl.where(code >= 8, -magnitude, magnitude)
    srow = grp * stride_se + rn[None, :].to(tl.int64) * stride_sn
    s = tl.load(s_ptr + srow + k[:, None] // 32, mask=ok, other=127).to(tl.int32)
    # 2^(s - 127) written into the float32 exponent bits (s = 0: the subnormal 2^-127)
    scale = tl.where(s == 0, 5.877471754111438e-39, (s << 23).to(tl.float32, bitcast=True))
    return value * scale


@triton.jit
def e8m0_scale(s):
    """UE8M0 bytes (int32) -> float32 2^(s - 127), written into the exponent bits (s = 0: the
    subnormal 2^-127)."""
    return tl.where(s == 0, 5.877471754111438e-39, (s << 23).to(tl.float32, bitcast=True))


@triton.jit
def e2m1_pair(byte, scale):
    """Packed MXFP4 bytes (int32 tile) and their scales (float32, same shape) -> the float32
    values of the low and the high nibble (elements 2j and 2j + 1 of byte j), exactly.
    Each code's 3 magnitude bits go to float32 bits 22..24 and its sign to bit 31: read as a
    float32, that is the e2m1 magnitude times 2^-126 for every code (0.5 becomes the subnormal
    2^-127, which the product below keeps: no flush-to-zero on these multiplies), so two
    products (2^126, exact, then the power-of-two scale) give the value. About 7 integer and
    float operations per value where the arithmetic decode (_e2m1_tile) takes about 15, and the
    byte is loaded once for both its values."""
    b = byte.to(tl.uint32)
    lo = ((b & 7) << 22) | ((b & 8) << 28)
    hi = ((b & 0x70) << 18) | ((b & 0x80) << 24)
    lo_v = lo.to(tl.float32, bitcast=True) * 8.507059173023462e37 * scale
    hi_v = hi.to(tl.float32, bitcast=True) * 8.507059173023462e37 * scale
    return lo_v, hi_v


@triton.jit
def fp4_scales(s_rows, g0, NG, rows_ok, R: tl.constexpr, BLOCK_G: tl.constexpr, AXIS: tl.constexpr):
    """The float32 scales of 16 * BLOCK_G packed bytes of each row, broadcast to one per byte:
    s_rows points at the UE8M0 bytes of R rows (AXIS = 1: a (R, 1) column of row pointers, result
    (R, 16 * BLOCK_G); AXIS = 0: a (1, R) row of them, result (16 * BLOCK_G, R)), groups
    g0 .. g0 + BLOCK_G - 1 of NG (32 values, 16 bytes each). Loaded once per group and
    broadcast in registers, rather than one load per weight."""
    gs = g0 + tl.arange(0, BLOCK_G)
    if AXIS == 1:
        s = tl.load(s_rows + gs[None, :], mask=rows_ok & (gs[None, :] < NG), other=127).to(tl.int32)
        sc = e8m0_scale(s)  # (R, BLOCK_G)
        return tl.reshape(tl.broadcast_to(sc[:, :, None], (R, BLOCK_G, 16)), (R, BLOCK_G * 16))
    else:
        s = tl.load(s_rows + gs[:, None], mask=rows_ok & (gs[:, None] < NG), other=127).to(tl.int32)
        sc = e8m0_scale(s)  # (BLOCK_G, R)
        return tl.reshape(tl.broadcast_to(sc[:, None, :], (BLOCK_G, 16, R)), (BLOCK_G * 16, R))


@triton.jit
def _grouped_fp4_kernel(
    a_ptr, w_ptr, s_ptr, c_ptr, tile_group_ptr, tile_rows_ptr, N, K,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_cm,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PAIRS: tl.constexpr,
):  # fmt: skip
    """C rows [start, end) of one tile = A rows @ dequant(W[group])^T; A is not quantised, the
    weights are dequantised in float32 (exact) and cast to A's dtype (exact: 2 significant bits
    times a power of two) for the product, accumulated in float32.
    PAIRS: each K step loads the (BLOCK_K / 2, BLOCK_N) packed bytes once, decodes both nibbles
    (e2m1_pair) with one scale load per 32 values (fp4_scales), and multiplies the even and the
    odd columns of A by the low and the high nibbles' tiles: two products of BLOCK_K / 2, no
    interleave in registers. Else (DEEPINFER_CUDA_V4_DECODE=0, the path before) the arithmetic
    decode of each element of a (BLOCK_K, BLOCK_N) tile, its byte and scale loaded per element."""
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    start = tl.load(tile_rows_ptr + 2 * pid_t)
    end = tl.load(tile_rows_ptr + 2 * pid_t + 1)
    if start >= end:
        return
    grp = tl.load(tile_group_ptr + pid_t).to(tl.int64)
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + rk[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if PAIRS:
        rj = tl.arange(0, BLOCK_K // 2)  # bytes of a step: values 2j (low nibble) and 2j + 1
        n_ok = rn[None, :] < N
        w_cols = w_ptr + grp * stride_we + rn[None, :].to(tl.int64) * stride_wn  # (1, BLOCK_N)
        s_cols = s_ptr + grp * stride_se + rn[None, :].to(tl.int64) * stride_sn
        a_even = a_ptr + rows[:, None].to(tl.int64) * stride_am + 2 * rj[None, :]
        for k0 in range(0, K, BLOCK_K):
            j = k0 // 2 + rj
            byte = tl.load(w_cols + j[:, None], mask=n_ok & (j[:, None] < K // 2), other=0)
            scale = fp4_scales(s_cols, k0 // 32, tl.cdiv(K, 32), n_ok, BLOCK_N, BLOCK_K // 32, 0)
            lo, hi = e2m1_pair(byte.to(tl.int32), scale)  # (BLOCK_K / 2, BLOCK_N) each
            a_mask = row_ok[:, None] & (2 * rj[None, :] < K - k0)
            a0 = tl.load(a_even + k0, mask=a_mask, other=0.0)
            a1 = tl.load(a_even + k0 + 1, mask=a_mask, other=0.0)
            acc = mma(a0, lo.to(a0.dtype), acc, IEEE)
            acc = mma(a1, hi.to(a1.dtype), acc, IEEE)
    else:
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs, mask=row_ok[:, None] & (rk[None, :] < K - k0), other=0.0)
            b = _e2m1_tile(w_ptr, s_ptr, grp, rn, k0 + rk, N, K, stride_we, stride_wn, stride_se, stride_sn)
            acc = mma(a, b.to(a.dtype), acc, IEEE)
            a_ptrs += BLOCK_K
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & (rn[None, :] < N))


@triton.jit
def _grouped_mx_kernel(
    a_ptr, w_ptr, s_ptr, c_ptr, tile_group_ptr, tile_rows_ptr, N, K,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The MXFP4 grouped GEMM on Triton's microscaled product (tl.dot_scaled), operands swapped:
    C[rows, n]^T (BLOCK_N, BLOCK_M) = W[group][n] (BLOCK_N weight rows, e2m1 packed along K, with
    their (BLOCK_N, BLOCK_K / 32) UE8M0 scales, as stored) @ A[rows]^T (BLOCK_K, BLOCK_M tokens,
    bf16). The weights are the MMA's first operand, so Triton's upcast of e2m1 to bf16 (a byte
    permute table per 8 values) lands in the registers the MMA reads, with no shared-memory round
    trip; a decode tile's few token rows are the small N side of the MMA. Hopper has no FP4 MMA:
    Triton upcasts with the scale applied (exact, the scales are powers of two) and runs bf16."""
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    start = tl.load(tile_rows_ptr + 2 * pid_t)
    end = tl.load(tile_rows_ptr + 2 * pid_t + 1)
    if start >= end:
        return
    grp = tl.load(tile_group_ptr + pid_t).to(tl.int64)
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn[:, None] < N
    rj = tl.arange(0, BLOCK_K // 2)
    rg = tl.arange(0, BLOCK_K // 32)
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + grp * stride_we + rn[:, None].to(tl.int64) * stride_wn  # (BLOCK_N, 1)
    s_rows = s_ptr + grp * stride_se + rn[:, None].to(tl.int64) * stride_sn
    a_cols = a_ptr + rows[None, :].to(tl.int64) * stride_am + rk[:, None]  # (BLOCK_K, BLOCK_M)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = tl.load(w_rows + k0 // 2 + rj[None, :], mask=n_ok & (rj[None, :] < (K - k0) // 2), other=0)
        s = tl.load(s_rows + k0 // 32 + rg[None, :], mask=n_ok & (32 * rg[None, :] < K - k0), other=127)
        a = tl.load(a_cols + k0, mask=(rk[:, None] < K - k0) & row_ok[None, :], other=0.0)
        acc = tl.dot_scaled(w, s, "e2m1", a, None, "bf16", acc, fast_math=True)
    c_ptrs = c_ptr + rows[None, :].to(tl.int64) * stride_cm + rn[:, None]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[None, :] & n_ok)


def grouped_fp4_config(
    rows: int, batch_invariant: bool, device: torch.device | None = None, pairs: bool = True
) -> GemmConfig:
    """Tiles of the MXFP4 grouped GEMM. block_m follows grouped_config (so one tile table serves
    both), BLOCK_K is 128 for every row count (64 packed bytes of each weight row, 4 scales, per
    step; the order of a row's sums then never changes with the rows, as batch-invariant mode
    needs). Decode sizes keep the float path's 16 x 64 tiles; prefill takes 128-wide N tiles, 8
    warps at 64 and 128 rows (the weight decode, not the MMA, is the per-step work, and it is
    spread over more threads), 3 stages. pairs=False: the tiles of the path before
    (grouped_config's, BLOCK_K 64), for DEEPINFER_CUDA_V4_DECODE=0."""
    base = grouped_config(rows, False, batch_invariant, device)
    if not pairs:
        return base
    if batch_invariant and not is_sm90(device):
        return GemmConfig(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=3)
    if base.block_m <= 16:
        return GemmConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
    return GemmConfig(block_m=base.block_m, block_n=128, block_k=128, num_warps=8, num_stages=3)


def grouped_gemm_fp4(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    group_sizes: torch.Tensor,
    *,
    batch_invariant: bool = False,
    tiles: TileTable | None = None,
    pairs: bool = True,
    config: GemmConfig | None = None,
    scaled: bool = False,
) -> torch.Tensor:
    """Rows of x (M, K) sorted by group times the dequantised MXFP4 weight[group]^T: weight
    (E, N, K/2) uint8 packed e2m1, weight_scale (E, N, ceil(K/32)) uint8 UE8M0 (the format of
    deepinfer.backend.fp4) -> (M, N) in x's dtype. x is not quantised. Tiles: grouped_fp4_config
    (`config`, benchmarks, replaces them); tiles: a precomputed tile table for that block_m.
    pairs: the kernel's nibble-pair decode (False: the per-element decode it replaced).
    scaled: _grouped_mx_kernel (tl.dot_scaled; compiled, bf16 x) rather than the nibble pairs,
    with grouped_mx_config's tiles (CudaGemm picks it outside batch-invariant mode)."""
    e, n, half_k = weight.shape
    k = x.shape[-1]
    if weight.dtype != torch.uint8 or weight_scale.dtype != torch.uint8:
        raise ValueError(
            f"grouped_gemm_fp4 takes uint8 weights and scales, got {weight.dtype}, {weight_scale.dtype}"
        )
    if 2 * half_k != k or weight_scale.shape != (e, n, -(-k // 32)):
        raise ValueError(
            f"grouped_gemm_fp4: x has K={k}; weights {tuple(weight.shape)} and scales "
            f"{tuple(weight_scale.shape)} need (E, N, K/2) and (E, N, ceil(K/32))"
        )
    if group_sizes.shape != (e,):
        raise ValueError(f"grouped_gemm_fp4: group_sizes must be ({e},), got {tuple(group_sizes.shape)}")
    rows = x.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    if scaled:
        return _grouped_gemm_mx(
            x, weight, weight_scale, group_sizes, out, config or grouped_mx_config(rows, e), tiles
        )
    cfg = config or grouped_fp4_config(rows, batch_invariant, x.device, pairs)
    if pairs and (cfg.block_k < 32 or cfg.block_k & (cfg.block_k - 1)):
        raise ValueError(f"grouped_gemm_fp4: block_k must be a power of two >= 32, got {cfg.block_k}")
    if tiles is None or tiles.block_m != cfg.block_m:
        tile_group, tile_rows, n_tiles = tile_table(group_sizes, rows, cfg.block_m)
    else:
        tile_group, tile_rows, n_tiles = tiles.group, tiles.rows, tiles.num_tiles
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight, weight_scale = weight.contiguous(), weight_scale.contiguous()
    grid = (n_tiles, triton.cdiv(n, cfg.block_n))
    _grouped_fp4_kernel[grid](
        x, weight, weight_scale, out, tile_group, tile_rows, n, k,
        x.stride(0), weight.stride(0), weight.stride(1), weight_scale.stride(0), weight_scale.stride(1),
        out.stride(0), IEEE=x.dtype == torch.float32,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PAIRS=pairs,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


# The microscaled kernel pays from this many token copies an expert on average (V4-Flash's
# gate_up on an H200, bench/bench_v4_decode.py --only prefill: at 1.5 copies an expert the
# nibble-pair kernel's 1.73 ms beat its best 2.00 ms; at 6, 12 and 96 it ran 2.7x, 2.8x and 1.8x
# the nibble pairs: 2.68 / 2.99 / 11.16 ms against 7.33 / 8.28 / 20.22 ms).
MX_MIN_ROWS_PER_GROUP = 4


def grouped_mx_config(rows: int, groups: int = 1) -> GemmConfig:
    """Tiles of _grouped_mx_kernel: block_m token rows, block_n weight rows, block_k values per
    step, from the copies an expert gets on average (rows / groups). The best of twelve tilings
    on an H200 (V4-Flash gate_up, 256 experts): 16 x 128 x 128, 8 warps, 3 stages at 6 and 12
    copies an expert; 64 x 256 x 128, 8 warps at 96 (11.16 ms against 13.27 for 64 x 128)."""
    if rows <= 32 * max(groups, 1):
        return GemmConfig(block_m=16, block_n=128, block_k=128, num_warps=8, num_stages=3)
    return GemmConfig(block_m=64, block_n=256, block_k=128, num_warps=8, num_stages=3)


def _grouped_gemm_mx(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    group_sizes: torch.Tensor,
    out: torch.Tensor,
    cfg: GemmConfig,
    tiles: TileTable | None,
) -> torch.Tensor:
    """grouped_gemm_fp4 on _grouped_mx_kernel (checked operands, `out` (rows, N) to fill)."""
    if x.dtype != torch.bfloat16 or INTERPRET:
        raise ValueError(f"grouped_gemm_fp4: the microscaled kernel takes bf16 x (compiled), got {x.dtype}")
    if cfg.block_k < 32 or cfg.block_k & (cfg.block_k - 1) or cfg.block_m < 16:
        raise ValueError(f"grouped_gemm_fp4: block_k must be a power of two >= 32, block_m >= 16, got {cfg}")
    rows, n = out.shape
    if tiles is None or tiles.block_m != cfg.block_m:
        tile_group, tile_rows, n_tiles = tile_table(group_sizes, rows, cfg.block_m)
    else:
        tile_group, tile_rows, n_tiles = tiles.group, tiles.rows, tiles.num_tiles
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight, weight_scale = weight.contiguous(), weight_scale.contiguous()
    grid = (n_tiles, triton.cdiv(n, cfg.block_n))
    _grouped_mx_kernel[grid](
        x, weight, weight_scale, out, tile_group, tile_rows, n, x.shape[-1],
        x.stride(0), weight.stride(0), weight.stride(1), weight_scale.stride(0), weight_scale.stride(1),
        out.stride(0), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
