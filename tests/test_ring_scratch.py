"""Step scratch for ring caches (deepinfer.engine.ring): requests stepping through their rings by
steps of any length (long ones through scratch blocks, short ones in place, verification steps
rolled back), on real caches of the reference backend whose rows hold their position: every row
a step reads (its look-back and its own positions) holds that position, and after each step the
ring holds the last R positions written (those kept), as if every row had been written in
place."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.backend.types import KVCacheSpec
from deepinfer.engine.ring import RingScratch, scratch_blocks
from deepinfer.models.forward_batch import KVCacheGroup
from deepinfer.reference.backend import create_reference_backend


@pytest.mark.parametrize("bs,lookback,k", [(4, 7, 0), (4, 15, 3), (2, 8, 2), (8, 5, 1)])
def test_steps_of_any_length_read_their_positions(bs: int, lookback: int, k: int) -> None:
    backend = create_reference_backend()
    n = -(-(lookback + 1 + k) // bs)
    group = KVCacheGroup("ring", 2, ring_blocks=n, ring_lookback=lookback)
    reqs, budget = 3, 48
    pool = n * reqs
    scratch = scratch_blocks(budget, reqs, bs, group.ring_step_tokens(bs))
    ring = RingScratch(group, bs, first_block=pool, num_blocks=scratch)
    caches = backend.kv_cache.allocate(KVCacheSpec(pool + scratch, bs, 2, 0, torch.float32), 2)
    rings = [list(range(r * n, (r + 1) * n))[::-1] for r in range(reqs)]  # any block order
    rows = n * bs
    rng = random.Random(bs * 100 + lookback)
    done = [0] * reqs  # positions computed per request
    high = [0] * reqs  # past the last position written (rejected drafts' rows replaced older ones)
    long_steps = 0

    def label(p: int) -> list[float]:  # cache c's row of position p
        return [float(p), float(-p - 1)]

    def rows_at(slots: list[int], c: int) -> list[list[float]]:
        got = backend.kv_cache.read_kv(caches[c], torch.tensor(slots, dtype=torch.int64))
        return [[v - c for v in row] for row in got.tolist()]

    for _ in range(60):
        # each request: a long step (up to what the budget leaves), or a verification step
        spans, left = [], budget
        for r in range(reqs):
            q = 1 + k if rng.random() < 0.5 else rng.randint(1, max(1, left // 2))
            q = min(q, left)
            spans.append((done[r], done[r] + q))
            left -= q
        tables, copies = ring.tables(rings, spans)
        long_steps += sum(e - s > ring.step_tokens for s, e in spans)
        copies.before(backend, caches)
        for c, cache in enumerate(caches):  # the forward's writes, then its reads
            slots = [t[p // bs] * bs + p % bs for t, (s, e) in zip(tables, spans) for p in range(s, e)]
            values = [[v + c for v in label(p)] for s, e in spans for p in range(s, e)]
            backend.kv_cache.write_kv(cache, torch.tensor(values), torch.tensor(slots, dtype=torch.int64))
            for t, (s, e) in zip(tables, spans):
                read = list(range(max(0, s - lookback), e))
                assert rows_at([t[p // bs] * bs + p % bs for p in read], c) == [label(p) for p in read]
        copies.after(backend, caches)
        for r, (s, e) in enumerate(spans):
            done[r], high[r] = e, max(high[r], e)
            if e - s == 1 + k and k and rng.random() < 0.5:  # drafts rejected: back to s + 1 .. e
                done[r] = rng.randint(s + 1, e)
            kept = range(max(0, high[r] - rows), done[r])  # the ring's rows: the last R written
            for c in range(len(caches)):
                slots = [rings[r][(p // bs) % n] * bs + p % bs for p in kept]
                assert rows_at(slots, c) == [label(p) for p in kept]
    assert long_steps > 20 and min(done) > 4 * rows


def test_in_place_steps_use_the_ring_alone() -> None:
    """Steps of at most R - lookback tokens: the ring's blocks (column c = ring[c % n]), no copy."""
    group = KVCacheGroup("ring", 1, ring_blocks=3, ring_lookback=9)
    ring = RingScratch(group, 4, first_block=100, num_blocks=8)
    assert ring.step_tokens == 3
    tables, copies = ring.tables([[5, 1, 7]], [(20, 23)])
    assert tables == [[5, 1, 7, 5, 1, 7]] and not copies


def test_long_step_table_and_copies() -> None:
    """A 9-token step from position 14 (blocks of 4, ring of 3 blocks, look-back 5): columns 3..5
    in scratch, the older ones in the ring; rows 12, 13 copied in, positions 14..22 (the last
    R = 12 positions written) copied back to their ring rows; columns asked past the step's go
    to the ring."""
    group = KVCacheGroup("ring", 1, ring_blocks=3, ring_lookback=5)
    ring = RingScratch(group, 4, first_block=30, num_blocks=5)
    tables, copies = ring.tables([[5, 1, 7]], [(14, 23)], columns=[7])
    assert tables == [[5, 1, 7, 30, 31, 32, 5]]
    assert copies.into == ([5 * 4 + 0, 5 * 4 + 1], [30 * 4 + 0, 30 * 4 + 1])
    src, dst = copies.back
    assert src == [30 * 4 + 2, 30 * 4 + 3, *range(31 * 4, 31 * 4 + 4), *range(32 * 4, 32 * 4 + 3)]
    assert dst == [5 * 4 + 2, 5 * 4 + 3, *range(1 * 4, 1 * 4 + 4), *range(7 * 4, 7 * 4 + 3)]
    with pytest.raises(RuntimeError, match="step scratch"):
        ring.tables([[5, 1, 7], [2, 3, 4]], [(14, 23), (0, 9)])  # 3 + 3 scratch blocks > 5
