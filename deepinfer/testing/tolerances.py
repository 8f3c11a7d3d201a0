"""Conformance tolerances, in one place.

A backend's result in dtype `dt` is compared with the reference computed in float64 (on float64
copies of the very same inputs, so input rounding is not part of the error):

    |actual - expected| <= atol + rtol * |expected|      elementwise

Inputs are scaled so that outputs are O(1) (weights by 1/sqrt(K), attention scales near 1/sqrt(D)).
The budgets allow a few output roundings plus a low-precision intermediate (e.g. attention
probabilities rounded to the input dtype before the P @ V product, or TF32 tensor cores for
float32). Ops that quantise activations to FP8 themselves get FP8_ACT on top: two correct
implementations may round an element that sits on a tie to neighbouring e4m3 codes (and a
low-precision intermediate, e.g. the expert MLP's hidden activations rounded to bf16 before
they are quantised again, moves many elements across ties). So those ops get a loose
elementwise budget that still catches wrong scales, blocks or layouts, plus a bound on the
relative L2 error ||actual - expected|| / ||expected|| that catches a missing quantisation
(measured: correct implementations <= 0.022, no activation quantisation >= 0.039).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    rel_l2: float | None = None  # bound on ||actual - expected|| / ||expected||, when set

    def __add__(self, other: Tolerance) -> Tolerance:
        l2 = [t for t in (self.rel_l2, other.rel_l2) if t is not None]
        return Tolerance(self.atol + other.atol, self.rtol + other.rtol, max(l2) if l2 else None)


TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(atol=1e-5, rtol=1e-5),  # the reference computes some ops in float32
    torch.float32: Tolerance(atol=2e-3, rtol=2e-3),  # TF32 tensor cores are allowed
    torch.float16: Tolerance(atol=4e-3, rtol=4e-3),
    torch.bfloat16: Tolerance(atol=2.5e-2, rtol=2.5e-2),
}

# Extra budget for ops that quantise float activations to FP8 e4m3 inside the op.
FP8_ACT = Tolerance(atol=0.12, rtol=0.12, rel_l2=0.03)

# Quantisation itself: |dequant(quantize(x)) - x| <= FP8_REL * |x| + FP8_SUBNORMAL * scale
# (round to nearest: half of e4m3's 3-bit mantissa step, or of the subnormal step 2^-9).
FP8_REL = 2.0**-4
FP8_SUBNORMAL = 2.0**-10


# A systematic scale error (a weight, a norm or a factor off by 1%) hides inside the elementwise
# budget of bfloat16 (2.5e-2), but not inside a least-squares fit over thousands of elements:
# rounding to nearest is unbiased (|fitted scale - 1| <= 5e-5 for the reference in bfloat16 on the
# cases of test_precision.py, measured), and
# even truncating intermediates shifts it by less than 2^-8. Budget: half a percent at most.
SCALE_BIAS_MAX = 5e-3


def tolerance(dtype: torch.dtype, fp8_act: bool = False) -> Tolerance:
    """The comparison budget for a result computed in `dtype`."""
    if dtype not in TOLERANCES:
        raise KeyError(f"no conformance tolerance for {dtype}; known: {sorted(map(str, TOLERANCES))}")
    tol = TOLERANCES[dtype]
    return tol + FP8_ACT if fp8_act else tol


def scale_bias(dtype: torch.dtype) -> float:
    """The largest |fitted scale - 1| a result in `dtype` may show (see SCALE_BIAS_MAX)."""
    return min(tolerance(dtype).rtol, SCALE_BIAS_MAX)


def assert_unscaled(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, *, what: str = "result", case: str = ""
) -> None:
    """The least-squares scale between `actual` and `expected`, <a, e> / <e, e> in float64, is
    within scale_bias(dtype) of 1: catches an output off by a constant factor smaller than the
    elementwise budget (e.g. 1% in bfloat16). Non-finite elements are left out."""
    __tracebackhide__ = True
    a = actual.detach().to("cpu", torch.float64).flatten()
    e = expected.detach().to("cpu", torch.float64).flatten()
    keep = torch.isfinite(a) & torch.isfinite(e)
    a, e = a[keep], e[keep]
    energy = float((e * e).sum())
    if energy == 0.0:
        return
    alpha = float((a * e).sum()) / energy
    bias = scale_bias(dtype)
    if abs(alpha - 1.0) > bias:
        raise AssertionError(
            f"{what} ({dtype}{'; ' + case if case else ''}): the output is the reference times "
            f"{alpha:.5f} (least-squares fit over {e.numel()} elements; allowed |scale - 1| <= {bias}): "
            f"a systematic scale error of {alpha - 1.0:+.2%}, inside the elementwise budget but not an "
            "unbiased rounding"
        )


Locator = Callable[[tuple[int, ...]], str]


def index_locator(shape: tuple[int, ...], names: tuple[str, ...] = ()) -> Locator:
    """Names an element by its index: "row 3, column 17" with names ("row", "column"), else
    "index (3, 17)"."""

    def locate(index: tuple[int, ...]) -> str:
        if names and len(names) == len(index):
            return ", ".join(f"{n} {i}" for n, i in zip(names, index))
        return f"index {index}"

    return locate


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for size in reversed(shape):
        out.append(flat % size)
        flat //= size
    return tuple(reversed(out))


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    dtype: torch.dtype,
    *,
    what: str = "result",
    fp8_act: bool = False,
    locate: Locator | None = None,
    case: str = "",
) -> None:
    """Compare in float64 on the CPU with the budget of `dtype`; shapes must match exactly.

    A failure says WHERE, not only how much: the worst element's place (`locate` turns an index
    into words, e.g. "request 1, query row 3 (position 36), head 0, column 17"; by default the
    index), how many elements are out of budget, the count and first place of non-finite
    mismatches ("NaN where the reference is finite"), and `case`, the parameters of the case
    (e.g. "window=8, sinks, top-k 6, poisoned rows")."""
    __tracebackhide__ = True  # the failure is reported at the test's line
    where = locate or index_locator(tuple(actual.shape))
    head = f"{what} ({dtype}{'; ' + case if case else ''})"
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{head}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    tol = tolerance(dtype, fp8_act)
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if a.numel() == 0:
        return
    shape = tuple(a.shape)

    def first(mask: torch.Tensor) -> str:
        return where(_unravel(int(mask.flatten().nonzero()[0]), shape))

    finite_e = torch.isfinite(e)
    problems = []
    for bad_mask, text in (
        (torch.isnan(a) & finite_e, "NaN where the reference is finite"),
        (torch.isinf(a) & finite_e, "inf where the reference is finite"),
        (
            ~finite_e & (a != e) & ~(torch.isnan(a) & torch.isnan(e)),
            "differ where the reference is non-finite",
        ),
    ):
        n = int(bad_mask.sum())
        if n:
            problems.append(f"{n} element(s) {text}, the first at {first(bad_mask)}")
    if problems:
        raise AssertionError(f"{head}: " + "; ".join(problems))
    err = torch.where(finite_e, (a - e).abs(), 0.0)
    bound = tol.atol + tol.rtol * torch.where(finite_e, e.abs(), 0.0)
    bad = err > bound
    if bad.any():
        worst = _unravel(int(torch.argmax(torch.where(bad, err - bound, -1.0))), shape)
        raise AssertionError(
            f"{head}: {int(bad.sum())}/{err.numel()} elements outside atol={tol.atol} rtol={tol.rtol} "
            f"(the first at {first(bad)}); worst at {where(worst)}: {a[worst].item():.6g} vs expected "
            f"{e[worst].item():.6g} (abs error {err[worst].item():.3e}; max abs error {err.max().item():.3e})"
        )
    norm = e[finite_e].norm().item()
    l2 = err.norm().item()
    if tol.rel_l2 is not None and norm > 0 and l2 > tol.rel_l2 * norm:
        raise AssertionError(f"{head}: relative L2 error {l2 / norm:.3e} > {tol.rel_l2}")


def assert_bitwise_equal(
    actual: torch.Tensor, expected: torch.Tensor, *, what: str = "result", locate: Locator | None = None
) -> None:
    """Same shape, dtype and bits (NaNs with equal bits compare equal). `locate` names the first
    differing element (e.g. a KV cache row by slot, block and offset); by default its index."""
    __tracebackhide__ = True
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(
            f"{what}: {tuple(actual.shape)} {actual.dtype} != {tuple(expected.shape)} {expected.dtype}"
        )
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if a.is_floating_point():
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, e = a.contiguous().view(bits), e.contiguous().view(bits)
    if not torch.equal(a, e):
        diff = a != e
        n = int(diff.sum())
        first = _unravel(int(diff.flatten().nonzero()[0]), tuple(a.shape))
        where = locate(first) if locate is not None else f"index {first}"
        raise AssertionError(f"{what}: {n}/{a.numel()} elements differ bitwise, the first at {where}")
