"""rms_norm, rope, silu_and_mul, token bitmask and sampling against the reference."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.backend.ops import Backend
from deepinfer.reference import small as ref_small
from deepinfer.testing.helpers import oracle, randn
from deepinfer.testing.tolerances import assert_close


@pytest.mark.parametrize(
    "shape", [(0, 64), (1, 129), (7, 257), (3, 2, 64), (2, 7168)], ids=lambda s: "x".join(map(str, s))
)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, shape: tuple[int, ...], with_residual: bool
) -> None:
    dev = backend.device.device()
    x = randn(shape, dtype, dev, gen, 2.0)
    w = (1 + randn((shape[-1],), torch.float32, "cpu", gen, 0.1)).to(dtype).to(dev)
    res = randn(shape, dtype, dev, gen) if with_residual else None
    y, h = backend.small.rms_norm(x, w, 1e-6, res)
    ry, rh = ref_small.rms_norm(oracle(x), oracle(w), 1e-6, None if res is None else oracle(res))
    assert y.dtype == dtype
    assert_close(y, ry, dtype, what="rms_norm y")
    if res is None:
        assert h is None
    else:
        assert h is not None and rh is not None and h.dtype == dtype
        assert_close(h, rh, dtype, what="rms_norm residual sum")


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
    y, h = backend.small.rms_norm(x, w, 1e-6, res)
    ry, rh = ref_small.rms_norm(oracle(x), oracle(w), 1e-6, None if res is None else oracle(res))
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
    y, h = backend.small.rms_norm(x, w, 1e-5, res)
    ry, rh = ref_small.rms_norm(oracle(x), oracle(w), 1e-5, oracle(res))
    assert y.dtype == dtype and h is not None and rh is not None and h.dtype == dtype
    assert_close(y, ry, dtype, what="rms_norm y (float32 weight)")
    assert_close(h, rh, dtype, what="rms_norm h (float32 weight)")


def test_rms_norm_residual_aliasing(backend: Backend, dtype: torch.dtype, gen: torch.Generator) -> None:
    """residual may be the very tensor x (h = 2x); inputs are never modified."""
    dev = backend.device.device()
    x = randn((5, 96), dtype, dev, gen)
    w = (1 + randn((96,), torch.float32, "cpu", gen, 0.1)).to(dtype).to(dev)
    before = bits(x)
    y, h = backend.small.rms_norm(x, w, 1e-6, x)
    ry, rh = ref_small.rms_norm(oracle(before), oracle(w), 1e-6, oracle(before))
    assert h is not None and rh is not None
    assert_close(y, ry, dtype, what="rms_norm y (residual is x)")
    assert_close(h, rh, dtype, what="rms_norm residual sum (residual is x)")
    assert torch.equal(bits(x), before), "rms_norm modified x / residual"
    # a residual stream held in a wider buffer, as x: both views of one tensor
    buf = randn((4, 2, 64), dtype, dev, gen)
    snapshot = bits(buf)
    y, h = backend.small.rms_norm(buf[:, 0], w[:64], 1e-6, buf[:, 1])
    ry, rh = ref_small.rms_norm(oracle(snapshot[:, 0]), oracle(w[:64]), 1e-6, oracle(snapshot[:, 1]))
    assert h is not None and rh is not None
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
