"""DeepSeek-V4.1's Engram ops against oracles written here from their definitions (not the
reference code): the hashed n-gram lookup with Python's integers (exact: a gather), and the gate
into the residual streams in float64."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from deepinfer.backend.ops import Backend
from deepinfer.testing.helpers import oracle, randn
from deepinfer.testing.tolerances import assert_bitwise_equal, assert_close

INT64_MAX = 2**63 - 1


def _primes_above(start: int, count: int) -> list[int]:
    out: list[int] = []
    p = start
    while len(out) < count:
        p += 1
        if all(p % d for d in range(2, math.isqrt(p) + 1)):
            out.append(p)
    return out


def _rows_oracle(ids: list[list[int]], mult: list[int], sizes: list[int], heads: int) -> list[list[int]]:
    """Per token and head c (n-gram size n = c // heads + 2): the XOR of ids[r] * mult[r] for
    r < n, modulo the head's size, plus the sizes of the heads before it."""
    out = []
    for row in ids:
        cols = []
        for c, size in enumerate(sizes):
            n = c // heads + 2
            mix = 0
            for r in range(n):
                mix ^= row[r] * mult[r]
            cols.append(mix % size + sum(sizes[:c]))
        out.append(cols)
    return out


@pytest.mark.parametrize("where", ["device", "host"])
@pytest.mark.parametrize(
    "tokens,grams,heads,head_dim",
    [(0, 3, 2, 8), (1, 2, 1, 8), (7, 3, 3, 32), (33, 4, 2, 16), (5, 5, 1, 40)],
)
def test_engram_lookup(
    backend: Backend,
    dtype: torch.dtype,
    gen: torch.Generator,
    tokens: int,
    grams: int,
    heads: int,
    head_dim: int,
    where: str,
) -> None:
    """Ids below the hash vocabulary, multipliers as DeepSeek bounds them (products within int64),
    prime head sizes near the vocabulary, a table with spare rows past the heads'; the table on
    the device, or in pinned host memory where the backend claims it reads host tables."""
    if where == "host" and not backend.capabilities.reads_host_tables:
        pytest.skip(f"backend {backend.name!r} does not claim reads_host_tables")
    dev, hash_vocab = backend.device.device(), 1000
    sizes = _primes_above(97, (grams - 1) * heads)
    bound = (INT64_MAX // hash_vocab) // 2
    mult = (torch.randint(0, bound, (grams,), generator=gen, dtype=torch.int64) * 2 + 1).tolist()
    ids = torch.randint(0, hash_vocab, (tokens, grams), generator=gen, dtype=torch.int64)
    if tokens:
        ids[0] = hash_vocab - 1  # the largest products
    table = randn((sum(sizes) + 5, head_dim), dtype, dev, gen)
    if where == "host":
        table = backend.device.pinned_empty(tuple(table.shape), dtype).copy_(table.cpu())
    got = backend.small.engram_lookup(
        ids.to(dev),
        torch.tensor(mult, dtype=torch.int64, device=dev),
        torch.tensor(sizes, dtype=torch.int64, device=dev),
        table,
    )
    rows = torch.tensor(_rows_oracle(ids.tolist(), mult, sizes, heads), dtype=torch.int64).view(
        tokens, len(sizes)
    )
    want = table.cpu()[rows.reshape(-1)].reshape(tokens, len(sizes) * head_dim)
    assert got.dtype == dtype and got.device.type == torch.device(dev).type
    assert_bitwise_equal(got, want, what=f"engram_lookup (table on the {where})")


@pytest.mark.parametrize("where", ["device", "host"])
@pytest.mark.parametrize("tokens,grams,heads,head_dim", [(0, 3, 2, 32), (7, 3, 3, 32), (33, 4, 2, 64)])
def test_engram_lookup_fp8_rows(
    backend: Backend,
    dtype: torch.dtype,
    gen: torch.Generator,
    tokens: int,
    grams: int,
    heads: int,
    head_dim: int,
    where: str,
) -> None:
    """DeepSeek's published tables: e4m3 rows with a UE8M0 scale per 32 values (bytes 0, the
    subnormal 2^-127, 127 and 200 among them), dequantised by the lookup into `dtype`: equal,
    bit for bit, to the float64 product e4m3 * 2^(byte - 127) cast to it (the product is exact)."""
    if where == "host" and not backend.capabilities.reads_host_tables:
        pytest.skip(f"backend {backend.name!r} does not claim reads_host_tables")
    dev, hash_vocab = backend.device.device(), 1000
    sizes = _primes_above(97, (grams - 1) * heads)
    bound = (INT64_MAX // hash_vocab) // 2
    mult = (torch.randint(0, bound, (grams,), generator=gen, dtype=torch.int64) * 2 + 1).tolist()
    ids = torch.randint(0, hash_vocab, (tokens, grams), generator=gen, dtype=torch.int64)
    r = sum(sizes) + 5
    codes = (torch.randn((r, head_dim), generator=gen) * 40).to(torch.float8_e4m3fn)
    top = 128 if dtype == torch.float16 else 138  # float16 holds 448 * 2^0 at most
    scales = torch.randint(117, top, (r, head_dim // 32), generator=gen, dtype=torch.uint8)
    if dtype == torch.float32:  # float16's and bfloat16's ranges would flush or overflow these
        scales[0::7, 0], scales[1::7, 0], scales[2::7, 0] = 0, 200, 127
    table, scale_bytes = codes.to(dev), scales.to(dev)
    if where == "host":
        table = backend.device.pinned_empty((r, head_dim), torch.float8_e4m3fn).copy_(codes)
        scale_bytes = backend.device.pinned_empty((r, head_dim // 32), torch.uint8).copy_(scales)
    got = backend.small.engram_lookup(
        ids.to(dev),
        torch.tensor(mult, dtype=torch.int64, device=dev),
        torch.tensor(sizes, dtype=torch.int64, device=dev),
        table,
        scales=scale_bytes,
        dtype=dtype,
    )
    rows = torch.tensor(_rows_oracle(ids.tolist(), mult, sizes, heads), dtype=torch.int64).view(-1)
    exponent = scales.to(torch.float64).sub(127).clamp(min=-127)  # byte 0 is 2^-127
    values = codes.to(torch.float64) * torch.exp2(exponent).repeat_interleave(32, dim=1)
    want = values[rows].reshape(tokens, len(sizes) * head_dim).to(dtype)
    assert torch.isfinite(want).all() and torch.equal(want.double(), values[rows].reshape(want.shape))
    assert got.dtype == dtype and got.device.type == torch.device(dev).type
    assert_bitwise_equal(got, want, what=f"engram_lookup of FP8 rows (table on the {where})")


def _layer_tables(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, fp8: bool, host: bool, heads: list[int]
) -> list[dict[str, Any]]:
    """engram_lookup's keyword arguments of one table per entry of `heads` (3-grams, head
    width 32): float rows in `dtype`, or e4m3 rows with UE8M0 scales dequantised into it; on
    the device or in pinned host memory."""
    dev, hash_vocab, start, out = backend.device.device(), 1000, 97, []
    for h in heads:
        sizes = _primes_above(start, 2 * h)
        start = sizes[-1]
        bound = (INT64_MAX // hash_vocab) // 2
        mult = torch.randint(0, bound, (3,), generator=gen, dtype=torch.int64) * 2 + 1
        r = sum(sizes) + 3
        if fp8:
            table = (torch.randn((r, 32), generator=gen) * 40).to(torch.float8_e4m3fn)
            scales: torch.Tensor | None = torch.randint(120, 128, (r, 1), generator=gen, dtype=torch.uint8)
        else:
            table, scales = randn((r, 32), dtype, "cpu", gen), None
        if host:
            pin = backend.device.pinned_empty
            table = pin(tuple(table.shape), table.dtype).copy_(table)
            scales = None if scales is None else pin(tuple(scales.shape), scales.dtype).copy_(scales)
        else:
            table, scales = table.to(dev), None if scales is None else scales.to(dev)
        out.append(
            dict(
                multipliers=mult.to(dev),
                sizes=torch.tensor(sizes, device=dev),
                table=table,
                scales=scales,
                dtype=dtype,
            )
        )
    return out


@pytest.mark.parametrize("where", ["device", "host"])
@pytest.mark.parametrize("fp8", [False, True], ids=["float-rows", "fp8-rows"])
def test_engram_prefetch(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, fp8: bool, where: str
) -> None:
    """engram_prefetch, then engram_wait, against the backend's engram_lookup (checked above
    against the oracle): the same rows bit for bit, for three layers' tables fetched before
    unrelated work on the current stream (as a model fetches every layer's rows before its
    layers) and waited for in another order; where the backend captures graphs, the same inside
    one captured function, replayed on new ids written in place."""
    if where == "host" and not backend.capabilities.reads_host_tables:
        pytest.skip(f"backend {backend.name!r} does not claim reads_host_tables")
    small, dev = backend.small, backend.device.device()
    layers = _layer_tables(backend, dtype, gen, fp8, where == "host", heads=[2, 1, 3])
    ids = torch.randint(0, 1000, (9, 3), generator=gen, dtype=torch.int64).to(dev)
    want = [small.engram_lookup(ids, **kw) for kw in layers]
    pending = [small.engram_prefetch(ids, **kw) for kw in layers]
    other = randn((64, 64), torch.float32, dev, gen)
    other = other @ other  # work on the current stream between the prefetches and the waits
    got = {i: small.engram_wait(pending[i]) for i in (1, 2, 0)}
    for i, w in enumerate(want):
        assert_bitwise_equal(got[i], w, what=f"engram_wait of layer {i}'s prefetch ({where} table)")
    assert torch.isfinite(other).all()

    outs = [torch.empty_like(w) for w in want]

    def step() -> None:
        rows = [small.engram_prefetch(ids, **kw) for kw in layers]
        for i in (2, 0, 1):
            outs[i].copy_(small.engram_wait(rows[i]))

    graph = backend.device.capture_graph(step)
    if graph is None:
        return
    ids.copy_(torch.randint(0, 1000, (9, 3), generator=gen, dtype=torch.int64).to(dev))
    graph.replay()
    backend.device.synchronize()
    for i, kw in enumerate(layers):
        w = small.engram_lookup(ids, **kw)
        assert_bitwise_equal(
            outs[i], w, what=f"layer {i}'s prefetch in a graph replayed on new ids ({where} table)"
        )


@pytest.mark.parametrize("tokens,n,dm", [(0, 2, 16), (1, 4, 64), (9, 3, 40), (37, 2, 300)])
def test_engram_gate(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, tokens: int, n: int, dm: int
) -> None:
    """Gate logits of both signs and near zero (keys orthogonal-ish to the streams), values of
    another scale than the streams."""
    dev, eps = backend.device.device(), 1e-6
    streams = randn((tokens, n, dm), dtype, dev, gen, 2.0)
    kv = randn((tokens, n + 1, dm), dtype, dev, gen)
    weight = (1 + randn((n, dm), torch.float32, dev, gen, 0.2)).contiguous()
    before = (streams.clone(), kv.clone())
    got = backend.small.engram_gate(streams, kv, weight, eps)
    x, k, v, w = oracle(streams), oracle(kv[:, :n]), oracle(kv[:, n]), oracle(weight)
    xn = x / torch.sqrt((x**2).mean(-1, keepdim=True) + eps)
    kn = k / torch.sqrt((k**2).mean(-1, keepdim=True) + eps)
    a = (xn * w * kn).sum(-1) / math.sqrt(dm)
    root = torch.sqrt(torch.maximum(a.abs(), torch.full_like(a, 1e-6)))
    g = 1 / (1 + torch.exp(-torch.where(a < 0, -root, torch.where(a > 0, root, torch.zeros_like(a)))))
    assert got.dtype == dtype
    assert_close(got, x + g[..., None] * v[:, None, :], dtype, what="engram_gate")
    assert torch.equal(streams, before[0]) and torch.equal(kv, before[1]), "engram_gate changed its inputs"
