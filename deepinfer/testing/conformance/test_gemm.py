"""Dense, FP8 block-scaled and grouped GEMMs (float, FP8, MXFP4) against the float64 reference.

Two families of shapes: odd ones (K and N that no tile divides, empty and single rows, empty
groups) where kernels must mask, and ALIGNED ones (`aligned` in the test id: K and N multiples of
128, M and group sizes multiples of 16 / 64 / 128 among ragged ones) where kernels take the fast
paths that need alignment (torch._grouped_mm, TMA descriptors, DeepGEMM). A backend that only
ever ran the odd shapes has never run its fast path.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from deepinfer.backend.ops import Backend
from deepinfer.reference import gemm as ref_gemm
from deepinfer.testing.helpers import mxfp4_weight, oracle, quantized_weight, randn
from deepinfer.testing.tolerances import (
    FP8_REL,
    FP8_SUBNORMAL,
    Locator,
    assert_close,
    index_locator,
    tolerance,
)

SHAPES = [(0, 17, 9), (1, 64, 32), (7, 67, 45), (33, 128, 130)]  # (M, K, N)
FP8_SHAPES = [
    (0, 128, 128), (1, 200, 150), (5, 384, 256), (33, 130, 70), (3, 64, 40), (2, 129, 257),
    (300, 384, 136), (260, 200, 130),  # M past 256: backends may switch kernels by M
]  # fmt: skip


# (M, K, N) with K and N multiples of 128: decode-sized and prefill-sized M, and M not a multiple
ALIGNED_SHAPES = [(1, 256, 128), (16, 512, 384), (128, 256, 512), (200, 384, 256)]
ALIGNED_FP8_SHAPES = [(1, 512, 256), (64, 256, 384), (128, 1024, 128), (130, 512, 256)]
# group sizes over 4 experts with K = 256, N = 384: 128-row groups, 16-row groups, empty ones, and
# ragged ones next to aligned ones (an aligned fast path must not assume every group is aligned)
ALIGNED_GROUPS = [[128, 0, 256, 128], [16, 16, 16, 16], [64, 0, 0, 64], [128, 1, 127, 16], [0, 0, 0, 0]]


def ids(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def mn_locator(shape: tuple[int, ...]) -> Locator:
    return index_locator(shape, ("row", "column"))


def grouped_locator(sizes: list[int]) -> Locator:
    """Names an output element by row, its group (expert) and column."""
    bounds = [sum(sizes[:g]) for g in range(len(sizes) + 1)]

    def locate(index: tuple[int, ...]) -> str:
        row, col = index
        group = max(g for g in range(len(sizes)) if bounds[g] <= row and sizes[g])
        return f"row {row} (group {group}, its row {row - bounds[group]}), column {col}"

    return locate


Product = Callable[[torch.Tensor], torch.Tensor]  # (K,) bool: x's columns kept -> (M, N)


def k_blocks_at_fault(
    run: Product, expect: Product, k: int, block: int, dtype: torch.dtype, fp8_act: bool = False
) -> str:
    """Which K blocks an FP8 GEMM gets wrong: each block's product alone (x zeroed outside its
    columns: `run` on the backend, `expect` the float64 reference), compared with the budget."""
    tol = tolerance(dtype, fp8_act)
    blocks = math.ceil(k / block)
    bad = []
    for kb in range(blocks):
        keep = torch.zeros(k, dtype=torch.bool)
        keep[kb * block : (kb + 1) * block] = True
        a, e = run(keep).detach().to("cpu", torch.float64), expect(keep)
        ratio = float(((a - e).abs() / (tol.atol + tol.rtol * e.abs())).nan_to_num(float("inf")).max())
        if ratio > 1:
            bad.append(f"K block {kb} (columns {kb * block}..{min(k, (kb + 1) * block) - 1}): {ratio:.3g}x")
    if not bad:
        return (
            f"each of the {blocks} K block(s) alone is within budget: the blocks' products are summed wrong"
        )
    return f"K block(s) wrong alone, error / budget: {'; '.join(bad)} (of {blocks} K blocks of {block})"


def assert_close_by_k_block(
    y: torch.Tensor,
    expected: torch.Tensor,
    dtype: torch.dtype,
    run: Product,
    expect: Product,
    k: int,
    block: int,
    *,
    what: str,
    case: str,
    fp8_act: bool = False,
    locate: Locator | None = None,
) -> None:
    """assert_close of an FP8 product; a failure also names the K blocks at fault (and the
    element by `locate`, default (row, column) of y)."""
    __tracebackhide__ = True
    try:
        assert_close(
            y, expected, dtype, what=what, fp8_act=fp8_act, locate=locate or mn_locator(tuple(y.shape)),
            case=case,
        )  # fmt: skip
    except AssertionError as exc:
        raise AssertionError(f"{exc}; {k_blocks_at_fault(run, expect, k, block, dtype, fp8_act)}") from None


def fp8_gemm_by_k_block(
    backend: Backend,
    dtype: torch.dtype,
    xq: torch.Tensor,
    xs: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    expect: Callable[[torch.Tensor], torch.Tensor],
    block: int,
    what: str,
) -> None:
    """fp8_gemm on CPU operands xq (M, K) e4m3, wq (N, K) against `expect(xq)` (float64); a
    failure names the K blocks at fault (the product of xq's columns of one block at a time)."""
    __tracebackhide__ = True
    dev = backend.device.device()
    (m, k), n = xq.shape, wq.shape[0]

    def masked(keep: torch.Tensor) -> torch.Tensor:
        return torch.where(keep, xq.float(), 0.0).to(xq.dtype)  # e4m3 values: exact

    def run(x: torch.Tensor) -> torch.Tensor:
        return backend.gemm.fp8_gemm(x.to(dev), xs.to(dev), wq.to(dev), ws.to(dev), dtype, block=block)

    y = run(xq)
    assert y.dtype == dtype and y.shape == (m, n), f"fp8_gemm returned {y.dtype} {tuple(y.shape)}"
    assert_close_by_k_block(
        y, expect(xq), dtype, lambda keep: run(masked(keep)), lambda keep: expect(masked(keep)), k, block,
        what=what, case=f"M={m} K={k} N={n}",
    )  # fmt: skip


@pytest.mark.parametrize("shape", SHAPES, ids=ids)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_linear(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, shape: tuple[int, int, int], with_bias: bool
) -> None:
    m, k, n = shape
    dev = backend.device.device()
    x = randn((m, k), dtype, dev, gen)
    w = randn((n, k), dtype, dev, gen, k**-0.5)
    b = randn((n,), dtype, dev, gen) if with_bias else None
    y = backend.gemm.linear(x, w, b)
    expected = ref_gemm.linear(oracle(x), oracle(w), None if b is None else oracle(b), False)
    assert y.dtype == dtype
    case = f"M={m} K={k} N={n}, {'with' if with_bias else 'no'} bias"
    assert_close(y, expected, dtype, what="linear", locate=mn_locator(tuple(y.shape)), case=case)


@pytest.mark.parametrize("shape", ALIGNED_SHAPES, ids=lambda s: "aligned-" + ids(s))
def test_linear_aligned(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, shape: tuple[int, int, int]
) -> None:
    test_linear(backend, dtype, gen, shape, with_bias=False)


@pytest.mark.parametrize("shape", [(16, 64, 128, 512), (16, 64, 512, 128)], ids=lambda s: "aligned-" + ids(s))
def test_batched_linear_aligned(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, shape: tuple[int, int, int, int]
) -> None:
    """MLA's per-head products at DeepSeek's sizes: 16 heads, nope 128 -> latent 512 and back."""
    test_batched_linear(backend, dtype, gen, shape)


@pytest.mark.parametrize(
    "shape", [(1, 0, 16, 8), (2, 1, 24, 40), (16, 9, 128, 512), (3, 33, 130, 70)], ids=ids
)
def test_batched_linear(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, shape: tuple[int, int, int, int]
) -> None:
    g, m, k, n = shape
    dev = backend.device.device()
    x = randn((m, g, k), dtype, dev, gen).transpose(0, 1)  # (G, M, K) as a strided view, as MLA passes it
    w = randn((g, n, k), dtype, dev, gen, k**-0.5)
    y = backend.gemm.batched_linear(x, w)
    expected = ref_gemm.batched_linear(oracle(x), oracle(w))
    assert y.dtype == dtype and y.shape == (g, m, n)
    where = index_locator(tuple(y.shape), ("group", "row", "column"))
    case = f"G={g} M={m} K={k} N={n}, x a strided view"
    assert_close(y, expected, dtype, what="batched_linear", locate=where, case=case)


def test_batched_linear_strided_weight(backend: Backend, dtype: torch.dtype, gen: torch.Generator) -> None:
    """MLA's per-head weights are views of one up-projection: W_UK (H, nope, L) a slice of it and
    W_UV^T (H, L, v) a transposed slice (last dim strided)."""
    h, nope, v, lat, t = 3, 16, 12, 40, 5
    dev = backend.device.device()
    kv_b = randn((h, nope + v, lat), dtype, dev, gen, lat**-0.5)
    w_uk, w_uv_t = kv_b[:, :nope], kv_b[:, nope:].transpose(1, 2)  # (H, nope, L), (H, L, v)
    q = randn((h, t, lat), dtype, dev, gen)
    y = backend.gemm.batched_linear(q, w_uk)
    assert_close(
        y, ref_gemm.batched_linear(oracle(q), oracle(w_uk)), dtype, what="batched_linear (W_UK view)"
    )
    o = randn((h, t, v), dtype, dev, gen)
    z = backend.gemm.batched_linear(o, w_uv_t)
    assert_close(z, ref_gemm.batched_linear(oracle(o), oracle(w_uv_t)), dtype, what="batched_linear (W_UV^T)")


@pytest.mark.parametrize("shape", [(0, 128), (1, 1), (5, 300), (4, 256), (3, 129), (4, 40)], ids=ids)
def test_quantize_fp8(
    backend: Backend, fp8: None, dtype: torch.dtype, gen: torch.Generator, shape: tuple[int, int]
) -> None:
    m, k = shape
    x = randn((m, k), dtype, backend.device.device(), gen, 3.0)
    if m > 2:
        x[1] = 0  # an all-zero row must stay finite
        x[2, :5] *= 1e-3  # small values reach the subnormal range
    xq, scale = backend.gemm.quantize_fp8(x)
    assert xq.dtype == torch.float8_e4m3fn and xq.shape == (m, k)
    assert scale.dtype == torch.float32 and scale.shape == (m, math.ceil(k / 128))
    _, ref_scale = ref_gemm.quantize_fp8(oracle(x))
    assert_close(scale, ref_scale.double(), torch.float64, what="fp8 scales")
    deq = ref_gemm.dequantize_act(xq.cpu(), scale.cpu()).double()
    xs = oracle(x)
    s = scale.cpu().double().repeat_interleave(128, dim=-1)[:, :k]
    err = (deq - xs).abs()
    bound = FP8_REL * xs.abs() + FP8_SUBNORMAL * s + 1e-30
    assert torch.isfinite(deq).all() and bool((err <= bound).all()), f"max fp8 error {err.max() if m else 0}"


@pytest.mark.parametrize("shape", FP8_SHAPES, ids=ids)
def test_fp8_gemm(
    backend: Backend, fp8: None, dtype: torch.dtype, gen: torch.Generator, shape: tuple[int, ...]
) -> None:
    m, k, n = shape
    xq, xs = ref_gemm.quantize_fp8(randn((m, k), torch.float32, "cpu", gen))
    wq, ws = quantized_weight((n, k), "cpu", gen, k**-0.5)
    fp8_gemm_by_k_block(
        backend, dtype, xq, xs, wq, ws, lambda x: ref_gemm.fp8_gemm(x, xs, wq, ws, torch.float64),
        ref_gemm.FP8_BLOCK, "fp8_gemm",
    )  # fmt: skip


# (M, K, N, the K block whose scales are perturbed): one K block (K = 128), the last of three
FP8_SCALE_CASES = [(5, 128, 136, 0), (7, 384, 256, 2), (130, 384, 256, 1)]


@pytest.mark.parametrize("case", FP8_SCALE_CASES, ids=lambda c: f"{ids(c[:3])}-kblock{c[3]}")
def test_fp8_gemm_one_block_scale_perturbed(
    backend: Backend, fp8: None, dtype: torch.dtype, gen: torch.Generator, case: tuple[int, ...]
) -> None:
    """One weight block scale times 8 (N block 1, K block j) and one activation scale times 1/4
    (row 1, K block j): random scales are all alike, so only scales that differ show a backend
    that reads a block's scale from the wrong place (the first K block's, the last one's). The
    failure names the block."""
    m, k, n, j = case
    xq, xs = ref_gemm.quantize_fp8(randn((m, k), torch.float32, "cpu", gen))
    wq, ws = quantized_weight((n, k), "cpu", gen, k**-0.5)
    ws[1, j] *= 8.0
    xs[1, j] *= 0.25
    what = (
        f"fp8_gemm, weight scale of block (N block 1, K block {j}) x8 and x scale (row 1, K block {j}) x1/4"
    )
    fp8_gemm_by_k_block(
        backend, dtype, xq, xs, wq, ws, lambda x: ref_gemm.fp8_gemm(x, xs, wq, ws, torch.float64),
        ref_gemm.FP8_BLOCK, what,
    )  # fmt: skip


@pytest.mark.parametrize("shape", ALIGNED_FP8_SHAPES, ids=lambda s: "aligned-" + ids(s))
def test_fp8_gemm_aligned(
    backend: Backend, fp8: None, dtype: torch.dtype, gen: torch.Generator, shape: tuple[int, ...]
) -> None:
    test_fp8_gemm(backend, fp8, dtype, gen, shape)


def test_fp8_gemm_column_major_scales(
    backend: Backend, fp8: None, dtype: torch.dtype, gen: torch.Generator
) -> None:
    """Scales in column-major storage (the layout TMA-based FP8 GEMMs keep activation scales
    in); the shapes, and so the meaning, are the contract's."""
    m, k, n = 5, 300, 260
    dev = backend.device.device()
    xq, xs = ref_gemm.quantize_fp8(randn((m, k), torch.float32, "cpu", gen))
    wq, ws = quantized_weight((n, k), "cpu", gen, k**-0.5)
    xs_cm = xs.t().contiguous().to(dev).t()  # (M, Kb), stride (1, M)
    ws_cm = ws.t().contiguous().to(dev).t()
    assert not xs_cm.is_contiguous() and not ws_cm.is_contiguous()
    y = backend.gemm.fp8_gemm(xq.to(dev), xs_cm, wq.to(dev), ws_cm, dtype)
    expected = ref_gemm.fp8_gemm(xq, xs, wq, ws, torch.float64)
    assert_close(y, expected, dtype, what="fp8_gemm (column-major scales)")
    # grouped: per-expert scales (E, N/128, K/128) stored K-block-major
    sizes = torch.tensor([3, 0, 2], dtype=torch.int64)
    x = randn((5, k), dtype, dev, gen)
    gq, gs = quantized_weight((3, 140, k), "cpu", gen, k**-0.5)
    gs_t = gs.transpose(1, 2).contiguous().to(dev).transpose(1, 2)
    assert not gs_t.is_contiguous()
    y = backend.gemm.grouped_gemm_fp8(x, gq.to(dev), gs_t, sizes.to(dev))
    expected = ref_gemm.grouped_gemm_fp8(oracle(x), gq, gs, sizes)
    assert_close(y, expected, dtype, what="grouped_gemm_fp8 (strided scales)", fp8_act=True)


# --------------------------------------------------------------------------- 32-blocks (V4.1)

MX = 32  # DeepSeek-V4.1's FP8 block (deepinfer.backend.fp8.MXFP8_BLOCK)
# (M, K, N): one block, K and N no block divides, decode and prefill M, M past 256
MXFP8_SHAPES = [(0, 64, 32), (1, 32, 32), (3, 200, 150), (5, 96, 64), (33, 130, 70), (260, 200, 130)]


def _blockwise(q: torch.Tensor, s: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """q (R, C) e4m3 times its scales s read at [r // rows, c // cols], in float64: the 32-block
    meaning written out by index, independent of the reference's expand_block_scale."""
    r, c = torch.arange(q.shape[0]) // rows, torch.arange(q.shape[1]) // cols
    return q.double() * s.double()[r[:, None], c[None, :]]


def _mx_operands(
    m: int, k: int, n: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(xq, xs (M, ceil(K/32)), wq, ws (ceil(N/32), ceil(K/32))) on the CPU; the last weight
    block of K block 0 scaled x8 and row 0's last K block's activation scale x1/4, so that a
    kernel that reads a scale from a 128-block's place (or the wrong block) is off there."""
    xq, xs = ref_gemm.quantize_fp8(randn((m, k), torch.float32, "cpu", gen), MX)
    wq, ws = quantized_weight((n, k), "cpu", gen, k**-0.5, block=MX)
    ws[-1, 0] *= 8.0
    if m:
        xs[0, -1] *= 0.25
    return xq, xs, wq, ws


@pytest.mark.parametrize("shape", [(0, 64), (1, 1), (5, 300), (4, 96), (3, 33)], ids=ids)
def test_quantize_fp8_block32(
    backend: Backend, fp8: None, dtype: torch.dtype, gen: torch.Generator, shape: tuple[int, int]
) -> None:
    """Per token per 32 channels: scales (M, ceil(K/32)) = amax / 448 of each 32 channels."""
    m, k = shape
    x = randn((m, k), dtype, backend.device.device(), gen, 3.0)
    if m > 2:
        x[1] = 0
        x[2, :40] *= 1e-3  # one whole 32-block of small values
    xq, scale = backend.gemm.quantize_fp8(x, MX)
    assert xq.dtype == torch.float8_e4m3fn and xq.shape == (m, k)
    assert scale.dtype == torch.float32 and scale.shape == (m, math.ceil(k / MX))
    xs = oracle(x)
    pad = torch.nn.functional.pad(xs.abs(), (0, -k % MX)).view(m, math.ceil(k / MX), MX)
    want = (pad.amax(-1).clamp(min=ref_gemm.AMAX_EPS) / ref_gemm.FP8_MAX).float().double()
    assert_close(scale, want, torch.float64, what="fp8 scales per 32 channels")
    deq = xq.cpu().double() * scale.cpu().double().repeat_interleave(MX, dim=-1)[:, :k]
    s = scale.cpu().double().repeat_interleave(MX, dim=-1)[:, :k]
    err = (deq - xs).abs()
    bound = FP8_REL * xs.abs() + FP8_SUBNORMAL * s + 1e-30
    assert torch.isfinite(deq).all() and bool((err <= bound).all()), f"max fp8 error {err.max() if m else 0}"


@pytest.mark.parametrize("shape", MXFP8_SHAPES, ids=ids)
def test_fp8_gemm_block32(
    backend: Backend, fp8: None, dtype: torch.dtype, gen: torch.Generator, shape: tuple[int, ...]
) -> None:
    m, k, n = shape
    xq, xs, wq, ws = _mx_operands(m, k, n, gen)
    what = "fp8_gemm, 32 x 32 blocks (weight block (last, 0) x8, x scale (0, last) x1/4)"
    fp8_gemm_by_k_block(
        backend, dtype, xq, xs, wq, ws, lambda x: _blockwise(x, xs, 1, MX) @ _blockwise(wq, ws, MX, MX).T,
        MX, what,
    )  # fmt: skip


@pytest.mark.parametrize("shape", MXFP8_SHAPES, ids=ids)
def test_linear_fp8_block32(
    backend: Backend, fp8: None, dtype: torch.dtype, gen: torch.Generator, shape: tuple[int, ...]
) -> None:
    """x quantised per token per 32 channels inside the op, then the 32-block product."""
    m, k, n = shape
    dev = backend.device.device()
    x = randn((m, k), dtype, dev, gen)
    _, _, wq, ws = _mx_operands(0, k, n, gen)
    y = backend.gemm.linear_fp8(x, wq.to(dev), ws.to(dev), block=MX)
    xq, xs = ref_gemm.quantize_fp8(oracle(x), MX)
    expected = _blockwise(xq, xs, 1, MX) @ _blockwise(wq, ws, MX, MX).T
    assert y.dtype == dtype
    assert_close(
        y, expected, dtype, what="linear_fp8 (32 x 32 blocks)", fp8_act=True,
        locate=mn_locator(tuple(y.shape)), case=f"M={m} K={k} N={n}",
    )  # fmt: skip


@pytest.mark.parametrize("shape", [(2, 1, 64, 32), (4, 3, 96, 64), (2, 17, 130, 40)], ids=ids)
def test_batched_linear_fp8_block32(
    backend: Backend, fp8: None, dtype: torch.dtype, gen: torch.Generator, shape: tuple[int, ...]
) -> None:
    """V4.1's grouped wo_a: G products, x a strided (G, M, K) view, scales (G, N/32, K/32)."""
    g, m, k, n = shape
    dev = backend.device.device()
    x = randn((m, g, k), dtype, dev, gen).transpose(0, 1)
    wq, ws = quantized_weight((g, n, k), "cpu", gen, k**-0.5, block=MX)
    ws[-1, -1, 0] *= 8.0
    y = backend.gemm.batched_linear_fp8(x, wq.to(dev), ws.to(dev), block=MX)
    assert y.dtype == dtype and y.shape == (g, m, n)
    expected = torch.empty((g, m, n), dtype=torch.float64)
    for i in range(g):
        xq, xs = ref_gemm.quantize_fp8(oracle(x[i]), MX)
        expected[i] = _blockwise(xq, xs, 1, MX) @ _blockwise(wq[i], ws[i], MX, MX).T
    where = index_locator(tuple(y.shape), ("group", "row", "column"))
    assert_close(y, expected, dtype, what="batched_linear_fp8 (32 x 32 blocks)", fp8_act=True, locate=where)


def test_fp8_gemm_block32_refuses_128_block_scales(
    backend: Backend, fp8: None, dtype: torch.dtype, gen: torch.Generator
) -> None:
    """128-block scales handed over as 32-block ones are a shape error, not a wrong product."""
    dev = backend.device.device()
    xq, xs = ref_gemm.quantize_fp8(randn((3, 256), torch.float32, "cpu", gen))  # (3, 2): 128-blocks
    wq, ws = quantized_weight((64, 256), "cpu", gen, 0.1)  # (1, 2)
    with pytest.raises(ValueError, match="scale"):
        backend.gemm.fp8_gemm(xq.to(dev), xs.to(dev), wq.to(dev), ws.to(dev), dtype, block=MX)


def test_quantize_fp8_strided_rows(
    backend: Backend, fp8: None, dtype: torch.dtype, gen: torch.Generator
) -> None:
    """x a column slice of wider rows."""
    x = randn((4, 300), dtype, backend.device.device(), gen, 2.0)[:, 20:280]
    xq, scale = backend.gemm.quantize_fp8(x)
    _, ref_scale = ref_gemm.quantize_fp8(oracle(x))
    assert_close(scale, ref_scale.double(), torch.float64, what="fp8 scales (strided x)")
    deq = ref_gemm.dequantize_act(xq.cpu(), scale.cpu()).double()
    s = scale.cpu().double().repeat_interleave(128, dim=-1)[:, :260]
    err = (deq - oracle(x)).abs()
    assert bool((err <= FP8_REL * oracle(x).abs() + FP8_SUBNORMAL * s + 1e-30).all()), (
        f"max error {err.max()}"
    )


@pytest.mark.parametrize("shape", FP8_SHAPES, ids=ids)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_linear_fp8(
    backend: Backend,
    fp8: None,
    dtype: torch.dtype,
    gen: torch.Generator,
    shape: tuple[int, ...],
    with_bias: bool,
) -> None:
    m, k, n = shape
    dev = backend.device.device()
    x = randn((m, k), dtype, dev, gen)
    wq, ws = quantized_weight((n, k), dev, gen, k**-0.5)
    b = randn((n,), dtype, dev, gen) if with_bias else None
    y = backend.gemm.linear_fp8(x, wq, ws, b)

    def expect(xk: torch.Tensor) -> torch.Tensor:
        xq, xs = ref_gemm.quantize_fp8(oracle(xk))
        out = ref_gemm.fp8_gemm(xq, xs, wq.cpu(), ws.cpu(), torch.float64)
        return out if b is None else out + oracle(b)

    def masked(keep: torch.Tensor) -> torch.Tensor:
        return torch.where(keep.to(dev), x, 0)

    assert y.dtype == dtype
    assert_close_by_k_block(
        y, expect(x), dtype, lambda keep: backend.gemm.linear_fp8(masked(keep), wq, ws, b),
        lambda keep: expect(masked(keep)), k, ref_gemm.FP8_BLOCK, what="linear_fp8", fp8_act=True,
        case=f"M={m} K={k} N={n}, {'with' if with_bias else 'no'} bias",
    )  # fmt: skip


@pytest.mark.parametrize("shape", ALIGNED_FP8_SHAPES, ids=lambda s: "aligned-" + ids(s))
def test_linear_fp8_aligned(
    backend: Backend, fp8: None, dtype: torch.dtype, gen: torch.Generator, shape: tuple[int, ...]
) -> None:
    test_linear_fp8(backend, fp8, dtype, gen, shape, with_bias=False)


GROUPS = [[0, 0, 0], [1], [3, 0, 5, 1], [0, 7, 0, 2, 11], [0, 0, 0, 9], [6, 0, 0]]


def run_grouped_gemm(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, sizes: list[int], k: int, n: int
) -> None:
    dev = backend.device.device()
    x = randn((sum(sizes), k), dtype, dev, gen)
    w = randn((len(sizes), n, k), dtype, dev, gen, k**-0.5)
    group_sizes = torch.tensor(sizes, dtype=torch.int64)
    y = backend.gemm.grouped_gemm(x, w, group_sizes.to(dev))
    expected = ref_gemm.grouped_gemm(oracle(x), oracle(w), group_sizes)
    assert y.dtype == dtype
    assert_close(
        y, expected, dtype, what="grouped_gemm", locate=grouped_locator(sizes),
        case=f"group sizes {sizes}, K={k} N={n}",
    )  # fmt: skip


@pytest.mark.parametrize("sizes", GROUPS, ids=lambda g: "-".join(map(str, g)))
def test_grouped_gemm(backend: Backend, dtype: torch.dtype, gen: torch.Generator, sizes: list[int]) -> None:
    run_grouped_gemm(backend, dtype, gen, sizes, 67, 45)


@pytest.mark.parametrize("sizes", ALIGNED_GROUPS, ids=lambda g: "aligned-" + "-".join(map(str, g)))
def test_grouped_gemm_aligned(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, sizes: list[int]
) -> None:
    run_grouped_gemm(backend, dtype, gen, sizes, 256, 384)


def run_grouped_gemm_fp8(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, sizes: list[int], k: int, n: int
) -> None:
    dev = backend.device.device()
    x = randn((sum(sizes), k), dtype, dev, gen)
    wq, ws = quantized_weight((len(sizes), n, k), dev, gen, k**-0.5)
    group_sizes = torch.tensor(sizes, dtype=torch.int64)
    y = backend.gemm.grouped_gemm_fp8(x, wq, ws, group_sizes.to(dev))
    expected = ref_gemm.grouped_gemm_fp8(oracle(x), wq.cpu(), ws.cpu(), group_sizes)
    assert y.dtype == dtype

    def masked(keep: torch.Tensor) -> torch.Tensor:  # x's columns outside one K block zeroed:
        return torch.where(keep.to(dev), x, 0)  # the kept block quantises as in x (own scales)

    def run(keep: torch.Tensor) -> torch.Tensor:
        return backend.gemm.grouped_gemm_fp8(masked(keep), wq, ws, group_sizes.to(dev))

    def expect(keep: torch.Tensor) -> torch.Tensor:
        return ref_gemm.grouped_gemm_fp8(oracle(masked(keep)), wq.cpu(), ws.cpu(), group_sizes)

    assert_close_by_k_block(
        y, expected, dtype, run, expect, k, ref_gemm.FP8_BLOCK, what="grouped_gemm_fp8", fp8_act=True,
        case=f"group sizes {sizes}, K={k} N={n}", locate=grouped_locator(sizes),
    )  # fmt: skip


@pytest.mark.parametrize("sizes", GROUPS, ids=lambda g: "-".join(map(str, g)))
def test_grouped_gemm_fp8(
    backend: Backend, fp8: None, dtype: torch.dtype, gen: torch.Generator, sizes: list[int]
) -> None:
    run_grouped_gemm_fp8(backend, dtype, gen, sizes, 200, 150)


@pytest.mark.parametrize("sizes", ALIGNED_GROUPS, ids=lambda g: "aligned-" + "-".join(map(str, g)))
def test_grouped_gemm_fp8_aligned(
    backend: Backend, fp8: None, dtype: torch.dtype, gen: torch.Generator, sizes: list[int]
) -> None:
    run_grouped_gemm_fp8(backend, dtype, gen, sizes, 256, 384)


# --------------------------------------------------------------------------- MXFP4 (DeepSeek-V4 experts)


def mxfp4_oracle(packed: torch.Tensor, scales: torch.Tensor, k: int) -> torch.Tensor:
    """(E, N, K/2) packed e2m1 with (E, N, ceil(K/32)) UE8M0 bytes -> float64 (E, N, K), decoded
    here from the format's definition (not deepinfer.backend.fp4): byte j holds element 2j in
    its low nibble; code = sign | exponent (2 bits) | mantissa (1 bit), value
    (-1)^sign 2^(exponent-1) (1 + mantissa/2), or mantissa/2 for exponent 0; times 2^(byte-127)."""
    b = packed.cpu().long()
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)
    exponent, mantissa = ((codes >> 1) & 3).double(), (codes & 1).double()
    magnitude = torch.where(exponent == 0, mantissa / 2, 2.0 ** (exponent - 1) * (1 + mantissa / 2))
    value = torch.where(codes >= 8, -magnitude, magnitude)
    scale = torch.pow(2.0, scales.cpu().double() - 127).repeat_interleave(32, dim=-1)[..., :k]
    return value * scale


def run_grouped_gemm_fp4(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, sizes: list[int], k: int, n: int
) -> None:
    dev = backend.device.device()
    x = randn((sum(sizes), k), dtype, dev, gen)
    packed, scales = mxfp4_weight((len(sizes), n, k), dev, gen, k**-0.5)
    group_sizes = torch.tensor(sizes, dtype=torch.int64)
    y = backend.gemm.grouped_gemm_fp4(x, packed, scales, group_sizes.to(dev))
    expected = ref_gemm.grouped_gemm(oracle(x), mxfp4_oracle(packed, scales, k), group_sizes)
    assert y.dtype == dtype and y.shape == (sum(sizes), n)
    assert_close(
        y, expected, dtype, what="grouped_gemm_fp4", locate=grouped_locator(sizes),
        case=f"group sizes {sizes}, K={k} N={n}",
    )  # fmt: skip


@pytest.mark.parametrize("sizes", GROUPS, ids=lambda g: "-".join(map(str, g)))
def test_grouped_gemm_fp4(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, sizes: list[int]
) -> None:
    """MXFP4 experts (no activation quantisation): K = 70, three scales per row, the last one
    covering 6 values; N = 45."""
    run_grouped_gemm_fp4(backend, dtype, gen, sizes, 70, 45)


@pytest.mark.parametrize("sizes", ALIGNED_GROUPS, ids=lambda g: "aligned-" + "-".join(map(str, g)))
def test_grouped_gemm_fp4_aligned(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, sizes: list[int]
) -> None:
    run_grouped_gemm_fp4(backend, dtype, gen, sizes, 256, 384)
