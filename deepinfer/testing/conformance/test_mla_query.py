"""attention.mla_query (MLA's absorbed query: [q_nope @ W_UK^T per head | rope(q_pe)]) against
the float64 reference."""

from __future__ import annotations

import pytest
import torch

from deepinfer.backend.ops import Backend
from deepinfer.backend.types import KVCacheSpec
from deepinfer.reference import gemm as ref_gemm
from deepinfer.reference import small as ref_small
from deepinfer.testing.conformance.test_memory import mla_rows
from deepinfer.testing.helpers import oracle, randn
from deepinfer.testing.tolerances import assert_bitwise_equal, assert_close, index_locator


def rope_table(max_pos: int, rot: int, base: float = 10000.0) -> torch.Tensor:
    """(P, R) float32 rows [cos | sin] of p * base^(-2i/R)."""
    inv = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=-1).float()


def expected_query(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    w_uk: torch.Tensor,
    positions: torch.Tensor,
    table: torch.Tensor,
    interleaved: bool,
) -> torch.Tensor:
    """The float64 reference on CPU copies: [per-head q_nope @ w_uk^T | rope(q_pe)] (T, H, C + R)."""
    latent = ref_gemm.batched_linear(oracle(q_nope).transpose(0, 1), oracle(w_uk)).transpose(0, 1)
    rotated = ref_small.rope(oracle(q_pe), positions.cpu(), table.cpu().double(), interleaved)
    return torch.cat([latent, rotated], dim=-1)


def query_inputs(
    t: int, h: int, n: int, c: int, r: int, dtype: torch.dtype, dev: torch.device, gen: torch.Generator,
    w_view: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """q (T, H, N + R) as the query projection returns it, w_uk (H, C, N) (w_view: a transposed
    slice of kv_b_proj's (H, N + V, C) rows, as a checkpoint holds it), unsorted positions, and
    the rope table."""
    q = randn((t, h, n + r), dtype, dev, gen)
    if w_view:
        w_uk = randn((h, n + 5, c), dtype, dev, gen, n**-0.5)[:, :n].transpose(1, 2)
    else:
        w_uk = randn((h, c, n), dtype, dev, gen, n**-0.5)
    positions = torch.randint(0, 700, (t,), generator=gen)
    return q, w_uk, positions.to(dev), rope_table(700, r).to(dev), positions


# (T, H, N, C, R): DeepSeek's N = 128, C = 512, R = 64 at decode and prefill sizes (V2-Lite has
# 16 heads), 64 and 65 rows on either side of where a backend may change tiles, then small odd
# widths
SHAPES = [
    (0, 16, 128, 512, 64),
    (1, 1, 128, 512, 64),
    (1, 16, 128, 512, 64),
    (7, 16, 128, 512, 64),
    (64, 1, 128, 512, 64),
    (65, 2, 128, 512, 64),
    (5, 3, 7, 33, 6),
    (19, 2, 24, 40, 8),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
def test_mla_query(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, shape: tuple[int, ...], interleaved: bool
) -> None:
    """q_nope and q_pe are column slices of one (T, H, N + R) projection output (strided views),
    positions are not sorted; the inputs must not change."""
    t, h, n, c, r = shape
    dev = backend.device.device()
    q, w_uk, positions, table, cpu_positions = query_inputs(t, h, n, c, r, dtype, dev, gen)
    before = q.cpu().clone()
    q_nope, q_pe = q[..., :n], q[..., n:]
    out = backend.attention.mla_query(q_nope, q_pe, w_uk, positions, table, interleaved)
    assert out.dtype == dtype, f"mla_query returned {out.dtype} for {dtype} inputs"
    expected = expected_query(q_nope, q_pe, w_uk, cpu_positions, table, interleaved)
    locate = index_locator(tuple(expected.shape), ("token", "head", "column"))
    assert_close(out, expected, dtype, what="mla_query", locate=locate, case=f"T, H, N, C, R = {shape}")
    assert_bitwise_equal(q.cpu(), before, what="mla_query's input q (must not change)")


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
def test_mla_query_strided_weight(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, interleaved: bool
) -> None:
    """w_uk a transposed slice of kv_b_proj's per-head rows (stride(-1) != 1)."""
    t, h, n, c, r = 6, 3, 24, 40, 8
    q, w_uk, positions, table, cpu_positions = query_inputs(
        t, h, n, c, r, dtype, backend.device.device(), gen, w_view=True
    )
    q_nope, q_pe = q[..., :n], q[..., n:]
    out = backend.attention.mla_query(q_nope, q_pe, w_uk, positions, table, interleaved)
    expected = expected_query(q_nope, q_pe, w_uk, cpu_positions, table, interleaved)
    assert_close(out, expected, dtype, what="mla_query (w_uk a strided view)")


# (T, H, N, C, R): one decode token, a few, more tokens than heads (a program writes several rows),
# past the 64 rows where a backend may stop fusing, no rope part, no tokens
CACHE_SHAPES = [
    (1, 16, 128, 512, 64),
    (7, 3, 24, 40, 8),
    (20, 2, 24, 40, 8),
    (70, 2, 16, 32, 8),
    (5, 3, 7, 33, 0),
    (0, 2, 16, 32, 8),
]


@pytest.mark.parametrize("shape", CACHE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
def test_mla_query_and_cache(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, shape: tuple[int, ...], interleaved: bool
) -> None:
    """The query is mla_query's and the stored rows write_mla_kv's (float64 references), with kv a
    column slice of a wider projection output, padding slots (-1) anywhere and every other slot
    untouched."""
    t, h, n, c, r = shape
    dev = backend.device.device()
    q, w_uk, positions, table, cpu_positions = query_inputs(t, h, n, c, r, dtype, dev, gen)
    q_nope, q_pe = q[..., :n], q[..., n:]
    nb, bs = 8, 16
    spec = KVCacheSpec(nb, bs, c, r, dtype)
    cache = backend.kv_cache.allocate(spec, 1)[0]
    all_slots = torch.arange(nb * bs)
    before = randn((nb * bs, c + r), dtype, "cpu", gen)
    backend.kv_cache.write_kv(cache, before.to(dev), all_slots.to(dev))
    slots = torch.randperm(nb * bs, generator=gen)[:t]
    slots[::3] = -1
    kv = randn((t, c + r + 3), dtype, "cpu", gen, 2.0)[:, 1 : 1 + c + r]
    w = (1 + randn((c,), torch.float32, "cpu", gen, 0.2)).to(dtype)

    out = backend.attention.mla_query_and_cache(
        q_nope, q_pe, w_uk, kv.to(dev), cache, w.to(dev), 1e-6, positions, table, interleaved, slots.to(dev)
    )  # fmt: skip
    expected = expected_query(q_nope, q_pe, w_uk, cpu_positions, table, interleaved)
    assert_close(out, expected, dtype, what="mla_query_and_cache's query", case=f"T, H, N, C, R = {shape}")
    stored = backend.kv_cache.read_kv(cache, all_slots.to(dev)).cpu()
    keep = slots >= 0
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert_bitwise_equal(stored[untouched], before[untouched], what="slots not written (padding rows kept)")
    rows = mla_rows(oracle(kv), oracle(w), cpu_positions, table.cpu().double(), c, interleaved)
    assert_close(stored[slots[keep]], rows[keep], dtype, what="mla_query_and_cache's cache rows")
