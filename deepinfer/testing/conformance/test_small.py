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
    "shape", [(0, 64), (1, 129), (7, 257), (3, 2, 64)], ids=lambda s: "x".join(map(str, s))
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
@pytest.mark.parametrize("tokens,heads,rot", [(0, 2, 64), (1, 1, 64), (9, 3, 64), (5, 4, 8)])
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


@pytest.mark.parametrize("shape", [(0, 16), (1, 2), (9, 74)], ids=lambda s: "x".join(map(str, s)))
def test_silu_and_mul(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, shape: tuple[int, int]
) -> None:
    x = randn(shape, dtype, backend.device.device(), gen, 2.0)
    y = backend.small.silu_and_mul(x)
    assert y.dtype == dtype
    assert_close(y, ref_small.silu_and_mul(oracle(x)), dtype, what="silu_and_mul")


@pytest.mark.parametrize("batch,vocab", [(0, 64), (1, 1), (5, 100), (3, 64), (2, 33)])
def test_apply_token_bitmask(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, batch: int, vocab: int
) -> None:
    dev = backend.device.device()
    logits = randn((batch, vocab), dtype, dev, gen)
    words = math.ceil(vocab / 32)
    bitmask = torch.randint(-(2**31), 2**31, (batch, words), generator=gen, dtype=torch.int64).to(torch.int32)
    expected = oracle(logits)
    ref_small.apply_token_bitmask(expected, bitmask)
    out = backend.small.apply_token_bitmask(logits, bitmask.to(dev))  # type: ignore[func-returns-value]
    assert out is None, "apply_token_bitmask works in place"
    assert torch.equal(logits.cpu().double(), expected), "masked logits differ from the reference"


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
