"""attention.varlen_attention (DeepSeek-V4.1's vision tower: bidirectional attention inside each
image) against a float64 oracle written here from the definition: per segment, per head, the
full softmax over that segment's keys, nothing across segments."""

from __future__ import annotations

import pytest
import torch

from deepinfer.backend.ops import Backend
from deepinfer.testing.helpers import oracle, randn
from deepinfer.testing.tolerances import assert_close, index_locator


def _varlen_oracle(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], scale: float
) -> torch.Tensor:
    out = torch.zeros((*q.shape[:2], v.shape[-1]), dtype=torch.float64)
    start = 0
    for n in lens:
        for h in range(q.shape[1] if n else 0):
            s = q[start : start + n, h] @ k[start : start + n, h].T * scale  # (n, n)
            p = torch.exp(s - s.max(dim=-1, keepdim=True).values)
            out[start : start + n, h] = (p / p.sum(dim=-1, keepdim=True)) @ v[start : start + n, h]
        start += n
    return out


@pytest.mark.parametrize(
    "lens,heads,d,dv,q_scale",
    [
        ((1,), 1, 16, 16, 1.0),  # one patch: its own value
        ((5, 0, 17), 2, 32, 32, 1.0),  # an empty segment between two
        ((64, 3, 129), 3, 64, 64, 1.0),  # block edges: 64, 129 rows
        ((40, 40), 2, 72, 40, 8.0),  # Dv < D, large logits (the running max matters)
        ((), 2, 16, 16, 1.0),  # no rows at all
    ],
)
def test_varlen_attention(
    backend: Backend,
    dtype: torch.dtype,
    gen: torch.Generator,
    lens: tuple[int, ...],
    heads: int,
    d: int,
    dv: int,
    q_scale: float,
) -> None:
    dev, t = backend.device.device(), sum(lens)
    qkv = randn((t, heads, 2 * d + dv), dtype, dev, gen)  # q, k, v: strided slices of one buffer
    q, k, v = qkv[..., :d] * q_scale, qkv[..., d : 2 * d], qkv[..., 2 * d :]
    cu = torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    scale = d**-0.5
    got = backend.attention.varlen_attention(q, k, v, cu.to(dev), max(lens, default=0), scale=scale)
    assert got.shape == (t, heads, dv) and got.dtype == dtype
    want = _varlen_oracle(oracle(q), oracle(k), oracle(v), list(lens), scale)
    case = f"segments {list(lens)}, heads {heads}, D {d}, Dv {dv}, q x{q_scale}"
    assert_close(
        got,
        want,
        dtype,
        what="varlen_attention",
        locate=index_locator(got.shape, ("row", "head", "col")),
        case=case,
    )


def test_varlen_attention_segments_are_independent(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator
) -> None:
    """Changing one segment's keys leaves every other segment's rows as they were, bit for bit."""
    dev, h, d = backend.device.device(), 2, 32  # segments of 9, 14, 6 rows
    q, k, v = (randn((29, h, d), dtype, dev, gen) for _ in range(3))
    cu = torch.tensor([0, 9, 23, 29], dtype=torch.int32, device=dev)
    a = backend.attention.varlen_attention(q, k, v, cu, 14, scale=0.2)
    k2, v2 = k.clone(), v.clone()
    k2[9:23] = randn((14, h, d), dtype, dev, gen)
    v2[9:23] = randn((14, h, d), dtype, dev, gen)
    b = backend.attention.varlen_attention(q, k2, v2, cu, 14, scale=0.2)
    assert torch.equal(a[:9], b[:9]) and torch.equal(a[23:], b[23:])
    assert not torch.equal(a[9:23], b[9:23])
