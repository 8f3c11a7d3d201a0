"""rms_norm, add_rms_norm, rope, silu_and_mul, token bitmask and sampling against the reference."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.backend.ops import Backend
from deepinfer.reference import small as ref_small
from deepinfer.testing.helpers import oracle, randn
from deepinfer.testing.tolerances import Locator, assert_close, index_locator


def norm(
    backend: Backend,
    x: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    res: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The backend's rms_norm (res None) or add_rms_norm: (y, h or None)."""
    if res is None:
        return backend.small.rms_norm(x, w, eps), None
    y, h = backend.small.add_rms_norm(x, res, w, eps)
    return y, h


def ref_norm(
    x: torch.Tensor, w: torch.Tensor, eps: float, res: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The float64 reference of `norm` on CPU copies."""
    if res is None:
        return ref_small.rms_norm(oracle(x), oracle(w), eps), None
    y, h = ref_small.add_rms_norm(oracle(x), oracle(res), oracle(w), eps)
    return y, h


def rows_locator(shape: tuple[int, ...]) -> Locator:
    return index_locator(shape, ("row", "column") if len(shape) == 2 else ())


# (..., Dm): empty, odd widths, 3-D, and production widths (DeepSeek-V3's 7168, its 1536 query and
# 512 KV latents, V2-Lite's 2048) over aligned row counts
NORM_SHAPES = [(0, 64), (1, 129), (7, 257), (3, 2, 64), (2, 7168), (64, 1536), (128, 512), (16, 2048)]


@pytest.mark.parametrize("shape", NORM_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, shape: tuple[int, ...], with_residual: bool
) -> None:
    """rms_norm, and add_rms_norm (the residual add fused with the norm: y and the sum h)."""
    dev = backend.device.device()
    x = randn(shape, dtype, dev, gen, 2.0)
    w = (1 + randn((shape[-1],), torch.float32, "cpu", gen, 0.1)).to(dtype).to(dev)
    res = randn(shape, dtype, dev, gen) if with_residual else None
    y, h = norm(backend, x, w, 1e-6, res)
    ry, rh = ref_norm(x, w, 1e-6, res)
    op = "add_rms_norm" if with_residual else "rms_norm"
    case = f"x {tuple(shape)}"
    assert y.dtype == dtype, f"{op} returned {y.dtype} for {dtype} input"
    assert_close(y, ry, dtype, what=f"{op} y", locate=rows_locator(tuple(y.shape)), case=case)
    if res is not None:
        assert h is not None and rh is not None and h.dtype == dtype, f"{op} h must be in {dtype}"
        assert_close(
            h, rh, dtype, what=f"{op} h = x + residual", locate=rows_locator(tuple(h.shape)), case=case
        )


# Row magnitudes where eps decides the result: all zeros (0 / sqrt(0 + eps) = 0, never NaN),
# 1e-20 (x^2 underflows float32: only eps keeps the scale finite), 1e-4 (mean(x^2) = 1e-8, far
# below eps), 1e-3 (mean(x^2) = eps) and ordinary rows.
ROW_SCALES = (0.0, 1e-20, 1e-4, 1e-3, 1.0, 0.0)


@pytest.mark.parametrize("eps", [1e-6, 1e-2], ids=["eps1e-6", "eps1e-2"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_zero_and_tiny_rows(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, with_residual: bool, eps: float
) -> None:
    """All-zero rows and rows so small that eps dominates the mean square: the result is finite
    (zeros stay zeros) and scaled by eps exactly as the reference says. With a residual, one row's
    residual is -x (h = 0) and tiny rows get tiny residuals."""
    dev = backend.device.device()
    scales = torch.tensor(ROW_SCALES, dtype=torch.float64)[:, None]
    rows = torch.randn((len(ROW_SCALES), 136), generator=gen, dtype=torch.float64)
    x = (rows * scales).to(dtype)
    w = (1 + randn((136,), torch.float32, "cpu", gen, 0.1)).to(dtype).to(dev)
    res = None
    if with_residual:
        r = (torch.randn(rows.shape, generator=gen, dtype=torch.float64) * scales).to(dtype)
        x[-1] = rows[-1].to(dtype)  # an ordinary x cancelled by its residual: h = 0
        r[-1] = -x[-1]
        res = r.to(dev)
    x = x.to(dev)
    y, h = norm(backend, x, w, eps, res)
    ry, rh = ref_norm(x, w, eps, res)
    assert y.dtype == dtype
    finite = torch.isfinite(y.cpu()).all(dim=-1)
    if not finite.all():
        scale = [ROW_SCALES[i] for i in (~finite).nonzero().flatten().tolist()]
        raise AssertionError(
            f"rms_norm gave NaN/inf on rows of magnitude {scale} (0: all zeros; eps={eps} belongs inside "
            f"the square root: x / sqrt(mean(x^2) + eps))"
        )
    assert_close(y, ry, dtype, what=f"rms_norm y on zero / tiny rows (eps={eps})")
    if res is not None:
        assert h is not None and rh is not None
        assert_close(h, rh, dtype, what="rms_norm residual sum on zero / tiny rows")
        assert not h.cpu()[-1].any(), "x + (-x) must be an all-zero row"


# Mean squares of the rows relative to eps: eps a tenth of it, equal to it, ten times it.
EPS_RATIOS = (10.0, 1.0, 0.1)


@pytest.mark.parametrize("eps", [1e-6, 1e-5, 1e-3, 0.1], ids=lambda e: f"eps{e:g}")
def test_rms_norm_eps_magnitudes(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, eps: float
) -> None:
    """Rows whose mean square is 10, 1 and 0.1 times eps, at several eps: the scale
    1 / sqrt(mean(x^2) + eps) moves by 5% to 3x with eps, so an eps ignored, doubled, or added
    outside the square root fails at every dtype's budget (checked against the reference with
    2 * eps, below)."""
    dev = backend.device.device()
    d = 136
    rows = torch.randn((len(EPS_RATIOS) * 2, d), generator=gen, dtype=torch.float64)
    rows = rows / rows.pow(2).mean(dim=-1, keepdim=True).sqrt()  # unit mean square
    ms = torch.tensor(EPS_RATIOS, dtype=torch.float64).repeat(2)[:, None] * eps
    x = (rows * ms.sqrt()).to(dtype)
    w = (1 + randn((d,), torch.float32, "cpu", gen, 0.1)).to(dtype)
    y, _ = norm(backend, x.to(dev), w.to(dev), eps, None)
    ry, _ = ref_norm(x, w, eps, None)
    case = f"rows of mean square {', '.join(f'{r:g}' for r in EPS_RATIOS)} x eps={eps:g}"
    assert_close(y, ry, dtype, what="rms_norm y", locate=rows_locator(tuple(y.shape)), case=case)
    wrong, _ = ref_norm(x, w, 2 * eps, None)
    with pytest.raises(AssertionError):  # the case tells eps from 2 * eps
        assert_close(wrong, ry, dtype, what="rms_norm with 2 * eps")


def cos_sin_cache(max_pos: int, rot: int, base: float = 10000.0) -> torch.Tensor:
    inv = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=-1).float()  # (P, R)


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
@pytest.mark.parametrize(
    "tokens,heads,rot", [(0, 2, 64), (1, 1, 64), (9, 3, 64), (5, 4, 8), (4, 2, 6), (3, 17, 24)]
)
@pytest.mark.parametrize("contiguous", [True, False], ids=["contig", "slice"])
def test_rope(
    backend: Backend,
    dtype: torch.dtype,
    gen: torch.Generator,
    interleaved: bool,
    tokens: int,
    heads: int,
    rot: int,
    contiguous: bool,
) -> None:
    dev = backend.device.device()
    if contiguous:
        x = randn((tokens, heads, rot), dtype, dev, gen)
    else:  # the rope part of a wider head, as models pass q[..., nope:]
        x = randn((tokens, heads, 16 + rot), dtype, dev, gen)[..., 16:]
    cache = cos_sin_cache(300, rot)
    positions = torch.randint(0, 300, (tokens,), generator=gen)
    y = backend.small.rope(x, positions.to(dev), cache.to(dev), interleaved)
    expected = ref_small.rope(oracle(x), positions, cache.double(), interleaved)
    assert y.dtype == dtype
    assert_close(y, expected, dtype, what="rope")


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
def test_rope_far_positions(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, interleaved: bool
) -> None:
    """Positions across a long table: the first and last rows, and ones far past a short prompt."""
    dev = backend.device.device()
    table = cos_sin_cache(5000, 64)
    positions = torch.tensor([4999, 0, 4096, 2047, 4998, 1, 3333], dtype=torch.int64)
    x = randn((positions.numel(), 2, 64), dtype, dev, gen)
    y = backend.small.rope(x, positions.to(dev), table.to(dev), interleaved)
    expected = ref_small.rope(oracle(x), positions, table.double(), interleaved)
    assert_close(y, expected, dtype, what="rope at far positions")


def test_rope_strided_positions(backend: Backend, dtype: torch.dtype, gen: torch.Generator) -> None:
    """positions a strided view (one column of a (T, 2) position table)."""
    dev = backend.device.device()
    table = cos_sin_cache(64, 16)
    pos2 = torch.randint(0, 64, (6, 2), generator=gen)
    x = randn((6, 3, 16), dtype, dev, gen)
    y = backend.small.rope(x, pos2.to(dev)[:, 1], table.to(dev), False)
    expected = ref_small.rope(oracle(x), pos2[:, 1], table.double(), False)
    assert_close(y, expected, dtype, what="rope (strided positions)")


def bits(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy to compare bitwise later (inputs must not change)."""
    return t.detach().cpu().clone()


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_strided_input(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, with_residual: bool
) -> None:
    """x a column slice of wider rows (as the KV latent is normalised inside the kv_a output)."""
    dev = backend.device.device()
    wide = randn((6, 80), dtype, dev, gen, 2.0)
    x = wide[:, :72]
    w = (1 + randn((72,), torch.float32, "cpu", gen, 0.1)).to(dtype).to(dev)
    res = randn((6, 72), dtype, dev, gen) if with_residual else None
    before = bits(wide)
    y, h = norm(backend, x, w, 1e-6, res)
    ry, rh = ref_norm(x, w, 1e-6, res)
    assert_close(y, ry, dtype, what="rms_norm y (strided x)")
    if res is not None:
        assert h is not None and rh is not None
        assert_close(h, rh, dtype, what="rms_norm residual sum (strided x)")
    assert torch.equal(bits(wide), before), "rms_norm modified its input"


def test_rms_norm_float32_weight(backend: Backend, dtype: torch.dtype, gen: torch.Generator) -> None:
    """Norm weights kept in float32 next to lower-precision activations."""
    dev = backend.device.device()
    x = randn((4, 40), dtype, dev, gen, 2.0)
    w = 1 + randn((40,), torch.float32, dev, gen, 0.3)
    res = randn((4, 40), dtype, dev, gen)
    assert_close(
        backend.small.rms_norm(x, w, 1e-5), ref_small.rms_norm(oracle(x), oracle(w), 1e-5), dtype,
        what="rms_norm y (float32 weight)",
    )  # fmt: skip
    y, h = backend.small.add_rms_norm(x, res, w, 1e-5)
    ry, rh = ref_small.add_rms_norm(oracle(x), oracle(res), oracle(w), 1e-5)
    assert y.dtype == dtype and h.dtype == dtype
    assert_close(y, ry, dtype, what="rms_norm y (float32 weight)")
    assert_close(h, rh, dtype, what="rms_norm h (float32 weight)")


def test_rms_norm_residual_aliasing(backend: Backend, dtype: torch.dtype, gen: torch.Generator) -> None:
    """residual may be the very tensor x (h = 2x); inputs are never modified."""
    dev = backend.device.device()
    x = randn((5, 96), dtype, dev, gen)
    w = (1 + randn((96,), torch.float32, "cpu", gen, 0.1)).to(dtype).to(dev)
    before = bits(x)
    y, h = backend.small.add_rms_norm(x, x, w, 1e-6)
    ry, rh = ref_small.add_rms_norm(oracle(before), oracle(before), oracle(w), 1e-6)
    assert_close(y, ry, dtype, what="rms_norm y (residual is x)")
    assert_close(h, rh, dtype, what="rms_norm residual sum (residual is x)")
    assert torch.equal(bits(x), before), "rms_norm modified x / residual"
    # a residual stream held in a wider buffer, as x: both views of one tensor
    buf = randn((4, 2, 64), dtype, dev, gen)
    snapshot = bits(buf)
    y, h = backend.small.add_rms_norm(buf[:, 0], buf[:, 1], w[:64], 1e-6)
    ry, rh = ref_small.add_rms_norm(oracle(snapshot[:, 0]), oracle(snapshot[:, 1]), oracle(w[:64]), 1e-6)
    assert_close(y, ry, dtype, what="rms_norm y (x, residual views of one buffer)")
    assert_close(h, rh, dtype, what="rms_norm h (x, residual views of one buffer)")
    assert torch.equal(bits(buf), snapshot), "rms_norm modified its inputs"


@pytest.mark.parametrize("shape", [(0, 16), (1, 2), (9, 74), (3, 2200)], ids=lambda s: "x".join(map(str, s)))
def test_silu_and_mul(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, shape: tuple[int, int]
) -> None:
    x = randn(shape, dtype, backend.device.device(), gen, 2.0)
    y = backend.small.silu_and_mul(x)
    assert y.dtype == dtype
    assert_close(y, ref_small.silu_and_mul(oracle(x)), dtype, what="silu_and_mul")


@pytest.mark.parametrize("batch,vocab", [(0, 64), (1, 1), (5, 100), (3, 64), (2, 33), (3, 31), (2, 1057)])
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded_rows"])
def test_apply_token_bitmask(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, batch: int, vocab: int, padded: bool
) -> None:
    dev = backend.device.device()
    if padded:  # logits rows inside a wider (padded-vocabulary) buffer; the padding stays intact
        buf = randn((batch, vocab + 7), dtype, dev, gen)
        logits = buf[:, :vocab]
        tail = bits(buf[:, vocab:])
    else:
        logits = randn((batch, vocab), dtype, dev, gen)
    words = math.ceil(vocab / 32)
    bitmask = torch.randint(-(2**31), 2**31, (batch, words), generator=gen, dtype=torch.int64).to(torch.int32)
    expected = oracle(logits)
    ref_small.apply_token_bitmask(expected, bitmask)
    out = backend.small.apply_token_bitmask(logits, bitmask.to(dev))  # type: ignore[func-returns-value]
    assert out is None, "apply_token_bitmask works in place"
    assert torch.equal(logits.cpu().double(), expected), "masked logits differ from the reference"
    if padded:
        assert torch.equal(bits(buf[:, vocab:]), tail), "apply_token_bitmask wrote past the vocabulary"


def sampling_inputs(gen: torch.Generator, batch: int, vocab: int) -> dict[str, torch.Tensor]:
    """Rows mixing greedy, temperature, top-k (off, 1, mid, >= V), top-p and min-p settings."""
    pattern = [  # (temperature, top_k, top_p, min_p)
        (0.0, 0, 1.0, 0.0),
        (1.0, 0, 1.0, 0.0),
        (0.7, 5, 1.0, 0.0),
        (1.3, 1, 1.0, 0.0),
        (1.0, 0, 0.6, 0.0),
        (1.0, 0, 1.0, 0.2),
        (0.9, 8, 0.8, 0.05),
        (1.0, vocab, 0.95, 0.0),
        (0.0, 3, 0.5, 0.1),
        (2.0, vocab + 5, 1.0, 0.0),
    ]
    rows = [pattern[i % len(pattern)] for i in range(batch)]
    return {
        "logits": torch.randn((batch, vocab), generator=gen) * 3,
        "temperature": torch.tensor([r[0] for r in rows], dtype=torch.float32),
        "top_k": torch.tensor([r[1] for r in rows], dtype=torch.int64),
        "top_p": torch.tensor([r[2] for r in rows], dtype=torch.float32),
        "min_p": torch.tensor([r[3] for r in rows], dtype=torch.float32),
    }


def exp_noise(gen: torch.Generator, shape: tuple[int, int]) -> torch.Tensor:
    return torch.empty(shape).exponential_(1.0, generator=gen)


# widths: tiny, odd, one past a power of two, and production vocabularies (V2's 102400, V3's 129280)
ARGMAX_VOCABS = [7, 97, 4097, 102400, 129280]


@pytest.mark.parametrize("vocab", ARGMAX_VOCABS)
def test_argmax_is_the_first_maximum(backend: Backend, gen: torch.Generator, vocab: int) -> None:
    """Greedy sampling's reduction against torch.argmax: ties go to the first maximum (inside a
    block of columns and across blocks), a row of -inf to 0, an all-equal row to 0; into the
    caller's buffer, and into a new one."""
    dev = backend.device.device()
    logits = torch.randn((6, vocab), generator=gen)
    logits[1, vocab // 3] = logits[1, vocab - 1] = 9.0  # a tie far apart: the first wins
    logits[2, :] = float("-inf")  # every token banned
    logits[3, min(7, vocab - 2)] = logits[3, min(8, vocab - 1)] = 9.0  # neighbours tied
    logits[4, :] = 0.5
    logits[5, vocab - 1] = 1e30  # the last column
    expected = logits.argmax(dim=-1)
    out = torch.full((6,), -1, dtype=torch.int64, device=dev)
    got = backend.small.argmax(logits.to(dev), out)
    assert got.dtype == torch.int64 and got.shape == (6,)
    assert torch.equal(out.cpu(), expected), f"argmax {out.tolist()} != torch's {expected.tolist()}"
    assert torch.equal(backend.small.argmax(logits.to(dev)).cpu(), expected), "argmax without out"
    assert backend.small.argmax(logits[:0].to(dev)).shape == (0,)


@pytest.mark.parametrize("batch,vocab", [(0, 50), (1, 7), (20, 50), (10, 1000)])
def test_sample_matches_reference(backend: Backend, gen: torch.Generator, batch: int, vocab: int) -> None:
    dev = backend.device.device()
    inputs = sampling_inputs(gen, batch, vocab)
    noise = exp_noise(gen, (batch, vocab))
    out = backend.small.sample(**{k: v.to(dev) for k, v in inputs.items()}, exp_noise=noise.to(dev))
    expected = ref_small.sample(**inputs, exp_noise=noise)
    assert out.dtype == torch.int64 and out.shape == (batch,)
    greedy = inputs["temperature"] == 0
    assert torch.equal(out.cpu()[greedy], inputs["logits"].argmax(dim=-1)[greedy]), (
        "greedy rows take the argmax"
    )
    assert torch.equal(out.cpu(), expected), "sampled tokens differ from the reference for the same noise"


@pytest.mark.parametrize("batch,vocab", [(0, 50), (1, 7), (20, 50), (10, 1000)])
def test_sampling_probs_matches_reference(
    backend: Backend, gen: torch.Generator, batch: int, vocab: int
) -> None:
    """The distribution `sample` draws from (speculative rejection sampling reads it): the
    reference's, zero on filtered tokens, each row summing to 1."""
    dev = backend.device.device()
    inputs = sampling_inputs(gen, batch, vocab)
    out = backend.small.sampling_probs(**{k: v.to(dev) for k, v in inputs.items()}).cpu()
    expected = ref_small.sampling_probs(**inputs)
    assert out.dtype == torch.float32 and out.shape == (batch, vocab)
    torch.testing.assert_close(
        out, expected, atol=1e-6, rtol=1e-5, msg="sampling_probs differ from the reference"
    )
    assert not out[expected == 0].any(), "a filtered-out token has probability"
    torch.testing.assert_close(out.sum(dim=-1), torch.ones(batch), atol=1e-5, rtol=0)


def test_sample_never_picks_filtered_tokens(backend: Backend, gen: torch.Generator) -> None:
    dev = backend.device.device()
    batch, vocab = 10, 40
    inputs = sampling_inputs(gen, batch, vocab)
    temp = inputs["temperature"]
    scaled = inputs["logits"] / torch.where(temp <= 0, 1.0, temp)[:, None]
    allowed = torch.isfinite(
        ref_small.filter_logits(scaled, inputs["top_k"], inputs["top_p"], inputs["min_p"])
    )
    seen = torch.zeros_like(allowed)
    dev_inputs = {k: v.to(dev) for k, v in inputs.items()}
    for _ in range(30):
        out = backend.small.sample(**dev_inputs, exp_noise=exp_noise(gen, (batch, vocab)).to(dev)).cpu()
        seen[torch.arange(batch), out] = True
    assert not (seen & ~allowed).any(), "a filtered-out token was sampled"
    assert (seen.sum(dim=-1) > 1).any(), "sampling rows never varied with the noise"


# The distribution the draws must follow. One vocabulary, probabilities at temperature 1:
DIST_PROBS = (0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02)
# (temperature, top_k, top_p, min_p, what it checks, the expected distribution over DIST_PROBS'
# ranks, worked out by hand). Filters act on the tempered distribution (vLLM, transformers):
# logits / T first, then top-k, top-p over the top-k survivors renormalised, then min-p. Top-p
# keeps the smallest set whose mass REACHES top_p: the token that crosses the threshold stays.
DIST_ROWS: list[tuple[float, int, float, float, str, tuple[float, ...]]] = [
    # cumulative 0.40, 0.65, 0.80: the third token crosses 0.7 and is kept (0.4, 0.25, 0.15) / 0.8
    (1.0, 0, 0.7, 0.0, "top-p keeps the token that crosses top_p", (0.5, 0.3125, 0.1875)),
    # top-3 renormalised (0.5, 0.3125, 0.1875): 0.5 + 0.3125 reaches 0.75, the third is dropped
    (1.0, 3, 0.75, 0.0, "top-p on the top-k survivors, renormalised", (0.6154, 0.3846)),
    # T=2: p ~ sqrt(p), ratios to the best 1, .79, .61, .50, .35, ...: min-p 0.45 keeps 4 tokens
    # (at T=1 the ratios are 1, .625, .375, ...: only 2 tokens)
    (2.0, 0, 1.0, 0.45, "temperature before min-p", (0.3445, 0.2723, 0.2109, 0.1722)),
    # T=0.5: p ~ p^2, cumulative .618, .860, ...: top-p 0.83 keeps 2 tokens
    # (at T=1, cumulative .40, .65, .80, .90: 4 tokens)
    (0.5, 0, 0.83, 0.0, "temperature before top-p", (0.7191, 0.2809)),
    # temperature with top-k (p ~ p^(1/0.7) over the top 2), and alone
    (0.7, 2, 1.0, 0.0, "temperature with top-k", (0.6618, 0.3382)),
    (1.3, 0, 1.0, 0.0, "temperature alone", (0.3391, 0.2362, 0.1594, 0.1167, 0.0685, 0.0462, 0.0338)),
]


def test_sample_distribution(backend: Backend, gen: torch.Generator) -> None:
    """4000 draws per setting (fresh exponential noise each) follow the tempered, filtered
    distribution: every kept token within 4.5 standard deviations of its probability, every
    filtered token never drawn. Token ids are shuffled so that rank and id differ."""
    dev = backend.device.device()
    n, vocab = 4000, len(DIST_PROBS)
    perm = torch.randperm(vocab, generator=gen)  # token perm[i] has the i-th largest probability
    base = torch.empty(vocab).scatter_(0, perm, torch.tensor(DIST_PROBS).log())
    rows = len(DIST_ROWS)
    settings = {
        "temperature": torch.tensor([r[0] for r in DIST_ROWS], dtype=torch.float32),
        "top_k": torch.tensor([r[1] for r in DIST_ROWS], dtype=torch.int64),
        "top_p": torch.tensor([r[2] for r in DIST_ROWS], dtype=torch.float32),
        "min_p": torch.tensor([r[3] for r in DIST_ROWS], dtype=torch.float32),
    }
    # the oracle agrees with the hand-worked distributions
    scaled = base.expand(rows, vocab) / settings["temperature"][:, None]
    kept = ref_small.filter_logits(scaled, settings["top_k"], settings["top_p"], settings["min_p"])
    expected = torch.softmax(kept.double(), dim=-1)[:, perm]  # by rank
    for r, row in enumerate(DIST_ROWS):
        want = torch.tensor(row[5] + (0.0,) * (vocab - len(row[5])), dtype=torch.float64)
        assert torch.allclose(expected[r], want, atol=1e-3), (row[4], expected[r].tolist())
    inputs = {k: v.repeat_interleave(n) for k, v in settings.items()}
    inputs["logits"] = base.expand(rows * n, vocab).contiguous()
    noise = exp_noise(gen, (rows * n, vocab))
    out = backend.small.sample(**{k: v.to(dev) for k, v in inputs.items()}, exp_noise=noise.to(dev)).cpu()
    assert out.dtype == torch.int64 and out.shape == (rows * n,)
    counts = torch.stack([torch.bincount(out[r * n : (r + 1) * n], minlength=vocab) for r in range(rows)])
    counts = counts[:, perm].double()  # by rank
    for r, row in enumerate(DIST_ROWS):
        p = expected[r]
        sigma = torch.sqrt(p * (1 - p) / n)
        bad = ((counts[r] / n - p).abs() > 4.5 * sigma) | ((p == 0) & (counts[r] > 0))
        if bad.any():
            raise AssertionError(
                f"sampling with temperature={row[0]} top_k={row[1]} top_p={row[2]} min_p={row[3]} "
                f"({row[4]}): {n} draws gave counts {counts[r].long().tolist()} by probability rank, "
                f"expected about {[round(float(q) * n) for q in p]}"
            )
    assert torch.equal(out, ref_small.sample(**inputs, exp_noise=noise)), "differs from the reference"


def test_sample_extreme_filters(backend: Backend, gen: torch.Generator) -> None:
    """Settings that leave only the best token (min_p=1, top_p=0, top_k=1, a tiny temperature)
    and ones that switch every filter off (top_k -1 or V, top_p 1, min_p 0)."""
    dev = backend.device.device()
    vocab = 37
    rows = [  # (temperature, top_k, top_p, min_p, only the argmax survives)
        (1.0, 0, 1.0, 1.0, True),
        (1.0, 0, 0.0, 0.0, True),
        (0.8, 1, 1.0, 0.0, True),
        (1.5, 1, 0.0, 1.0, True),
        (1e-5, 0, 1.0, 0.0, True),
        (1.0, -1, 1.0, 0.0, False),
        (1.0, vocab, 1.0, 0.0, False),
        (3.0, vocab - 1, 1.0, 0.0, False),
    ]
    logits = torch.randn((len(rows), vocab), generator=gen) * 2
    inputs = {
        "logits": logits,
        "temperature": torch.tensor([r[0] for r in rows], dtype=torch.float32),
        "top_k": torch.tensor([r[1] for r in rows], dtype=torch.int64),
        "top_p": torch.tensor([r[2] for r in rows], dtype=torch.float32),
        "min_p": torch.tensor([r[3] for r in rows], dtype=torch.float32),
    }
    only_best = torch.tensor([r[4] for r in rows])
    varied = torch.zeros(len(rows), dtype=torch.bool)
    first: torch.Tensor | None = None
    for _ in range(10):
        noise = exp_noise(gen, (len(rows), vocab))
        out = backend.small.sample(**{k: v.to(dev) for k, v in inputs.items()}, exp_noise=noise.to(dev)).cpu()
        assert torch.equal(out, ref_small.sample(**inputs, exp_noise=noise)), "differs from the reference"
        assert torch.equal(out[only_best], logits.argmax(dim=-1)[only_best]), "only the best token survives"
        first = out if first is None else first
        varied |= out != first
    assert varied[~only_best].all(), "rows without filters never varied with the noise"


def test_sample_after_token_bitmask(backend: Backend, gen: torch.Generator) -> None:
    """Logits with -inf (a grammar's bitmask applied first): never sample a disallowed token,
    including rows where one token is allowed; same tokens as the reference."""
    dev = backend.device.device()
    batch, vocab = 10, 70
    inputs = sampling_inputs(gen, batch, vocab)
    allowed = torch.rand((batch, vocab), generator=gen) < 0.3
    allowed[:, 0] |= ~allowed.any(dim=-1)  # at least one token per row
    allowed[3] = False
    allowed[3, 41] = True  # exactly one token
    allowed[8] = False
    allowed[8, 69] = True
    inputs["logits"] = inputs["logits"].masked_fill(~allowed, float("-inf"))
    for _ in range(5):
        noise = exp_noise(gen, (batch, vocab))
        out = backend.small.sample(**{k: v.to(dev) for k, v in inputs.items()}, exp_noise=noise.to(dev)).cpu()
        assert allowed[torch.arange(batch), out].all(), "sampled a token the bitmask disallowed"
        assert torch.equal(out, ref_small.sample(**inputs, exp_noise=noise)), "differs from the reference"


def noise_inputs(gen: torch.Generator, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) int64 seeds over the whole [0, 2**63) range (0 and 2**63 - 1 included) and offsets
    past 2**32 (only their low 32 bits enter the hash)."""
    seeds = torch.randint(0, 2**63 - 1, (batch,), generator=gen, dtype=torch.int64)
    offsets = torch.randint(0, 2**40, (batch,), generator=gen, dtype=torch.int64)
    if batch >= 2:
        seeds[0], seeds[1] = 0, 2**63 - 1
        offsets[0] = 0
    return seeds, offsets


@pytest.mark.parametrize("batch,vocab", [(0, 10), (1, 1), (2, 7), (5, 1000), (3, 2500)])
def test_exponential_noise_matches_reference(
    backend: Backend, gen: torch.Generator, batch: int, vocab: int
) -> None:
    """Same hash as the reference, so the same draws up to float32 rounding of -log(u)."""
    dev = backend.device.device()
    seeds, offsets = noise_inputs(gen, batch)
    noise = backend.small.exponential_noise(seeds.to(dev), offsets.to(dev), vocab)
    expected = ref_small.exponential_noise(seeds, offsets, vocab)
    assert noise.dtype == torch.float32 and noise.shape == (batch, vocab)
    # a few float32 ulps of -log(u); a different hash would differ by O(1)
    torch.testing.assert_close(noise.cpu(), expected, rtol=5e-7, atol=1e-12)


def test_exponential_noise_is_a_pure_function(backend: Backend, gen: torch.Generator) -> None:
    """A row depends on its (seed, offset) only: not on the batch around it, its place in the
    batch or earlier calls; other offsets or seeds give other draws."""
    dev = backend.device.device()
    vocab = 300
    seeds, offsets = noise_inputs(gen, 6)
    full = backend.small.exponential_noise(seeds.to(dev), offsets.to(dev), vocab).cpu()
    perm = torch.tensor([4, 0, 5, 2])
    part = backend.small.exponential_noise(seeds[perm].to(dev), offsets[perm].to(dev), vocab).cpu()
    assert torch.equal(part, full[perm]), "a row changed with the batch around it"
    again = backend.small.exponential_noise(seeds.to(dev), offsets.to(dev), vocab).cpu()
    assert torch.equal(again, full), "a second call drew other noise (hidden generator state?)"
    next_pos = backend.small.exponential_noise(seeds.to(dev), (offsets + 1).to(dev), vocab).cpu()
    other_seed = backend.small.exponential_noise((seeds ^ 1).to(dev), offsets.to(dev), vocab).cpu()
    for other, what in ((next_pos, "offset"), (other_seed, "seed")):
        same = (other == full).float().mean(dim=-1)
        assert (same < 0.05).all(), f"another {what} must give other draws (shared fraction {same.max():.3f})"


def test_exponential_noise_statistics(backend: Backend, gen: torch.Generator) -> None:
    """Exp(1): mean 1, P(noise > 1) = exp(-1), positive and finite; 262144 draws, bounds at
    about 4 standard deviations (deterministic for the fixed seeds)."""
    dev = backend.device.device()
    seeds, offsets = noise_inputs(gen, 64)
    noise = backend.small.exponential_noise(seeds.to(dev), offsets.to(dev), 4096).cpu().double()
    assert torch.isfinite(noise).all() and (noise > 0).all()
    n = noise.numel()
    assert abs(noise.mean().item() - 1.0) < 4 / math.sqrt(n), f"mean {noise.mean().item():.4f}"
    p = math.exp(-1)
    frac = (noise > 1).double().mean().item()
    assert abs(frac - p) < 4 * math.sqrt(p * (1 - p) / n), f"P(noise > 1) = {frac:.4f}, want {p:.4f}"
    assert abs((noise > 3).double().mean().item() - math.exp(-3)) < 0.003, "tail P(noise > 3)"
