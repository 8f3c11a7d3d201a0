"""Step scratch for a ring cache group (KVCacheGroup.ring_blocks, DeepSeek-V4's window and
compressor state): what lets a request compute more tokens in one step than its ring can take.

A request's ring holds R = n * BS rows (n ring blocks), position p at row p mod R (column c of
its block table is ring block c % n). A step computing positions [s, e) reads [s - L, e)
(L = KVCacheGroup.ring_lookback). Written in place, its rows replace positions [s - R, e - R),
which it must not read: e - s <= R - L (KVCacheGroup.ring_step_tokens). Decode, verification
and draft steps (1 + max backtrack tokens at most; the ring is sized for them) stay within that
and use the ring alone: their tables and slots are what graphs capture.

A longer step of a request (a prefill chunk, a recompute after preemption) runs over step-scratch
blocks, a shared pool after the ring pool in the same cache tensors; with c0 = s // BS and
c1 = (e - 1) // BS:
  table    column c < c0: ring block c % n (the lookback); c0 <= c <= c1: scratch block c - c0
           (columns past c1, when asked for: the ring again)
  before   rows [c0 * BS, s) of the first column (written by earlier steps): ring -> scratch
  forward  its rows go to scratch through the slot mapping, and nothing in the ring changes
  after    positions [max(s, e - R), e): scratch -> ring row p mod R, so that the ring holds
           [e - R, e), exactly what writing every row in place, in order, would have left.
The copies are row copies (read_kv / write_kv) of the group's caches, model and MTP layers
alike, queued on the device with the step: the next step may hand out the same scratch blocks.
Scratch per step: a request computing q tokens spans at most q // BS + 2 columns, so a step of
T tokens needs at most T // BS blocks plus 2 per long request (scratch_blocks): V4-Flash with
T = 8192, BS = 64 and 256 request slots, 128 + 512 blocks for all requests, where rings of
127 + 512 rows took 10 blocks per request slot (2,560) and rings of 127 + 1 take 2 (512).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from deepinfer.backend.ops import Backend
from deepinfer.backend.types import PagedKVCache
from deepinfer.models.forward_batch import KVCacheGroup


def scratch_blocks(
    max_num_batched_tokens: int, max_num_seqs: int, block_size: int, step_tokens: int = 0
) -> int:
    """Step-scratch blocks that the longest steps need: T // BS plus 2 per long request (the
    columns of a request computing q tokens: at most q // BS + 2), a long request computing
    more than step_tokens tokens (KVCacheGroup.ring_step_tokens)."""
    t = max_num_batched_tokens
    return t // block_size + 2 * min(max_num_seqs, t // (step_tokens + 1))


@dataclass
class RingCopies:
    """Row copies of the ring group's caches around one step: slots src -> dst, before the
    forward (`into`: ring -> scratch) and after it (`back`: scratch -> ring)."""

    into: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))
    back: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))

    def __bool__(self) -> bool:
        return bool(self.into[0] or self.back[0])

    def before(self, backend: Backend, caches: Sequence[PagedKVCache]) -> None:
        copy_rows(backend, caches, *self.into)

    def after(self, backend: Backend, caches: Sequence[PagedKVCache]) -> None:
        copy_rows(backend, caches, *self.back)


def copy_rows(backend: Backend, caches: Sequence[PagedKVCache], src: list[int], dst: list[int]) -> None:
    """Rows at slots src -> slots dst of every cache (each source read before any write)."""
    if not src:
        return
    device = backend.device.device()
    s = torch.tensor(src, dtype=torch.int64).to(device, non_blocking=True)
    d = torch.tensor(dst, dtype=torch.int64).to(device, non_blocking=True)
    for cache in caches:
        backend.kv_cache.write_kv(cache, backend.kv_cache.read_kv(cache, s), d)


class RingScratch:
    """Block tables and copies of a ring group for one step (module docstring).
    first_block, num_blocks: the scratch pool's block ids [first, first + num)."""

    def __init__(self, group: KVCacheGroup, block_size: int, first_block: int, num_blocks: int) -> None:
        assert group.ring_blocks > 0
        self.block_size = block_size
        self.rows = group.ring_blocks * block_size  # R
        self.step_tokens = group.ring_step_tokens(block_size)
        self.first_block, self.num_blocks = first_block, num_blocks

    def tables(
        self,
        rings: Sequence[list[int]],
        spans: Sequence[tuple[int, int]],
        columns: Sequence[int] | None = None,
    ) -> tuple[list[list[int]], RingCopies]:
        """Request b computes positions spans[b] = [s, e) with ring blocks rings[b]: its block table
        (columns[b] columns, default ceil(e / BS)) and the step's copies."""
        bs, rows = self.block_size, self.rows
        copies = RingCopies()
        tables: list[list[int]] = []
        used = 0
        for b, (ring, (s, e)) in enumerate(zip(rings, spans)):
            n = len(ring)
            cols = -(-e // bs) if columns is None else columns[b]
            if e - s <= self.step_tokens:
                tables.append([ring[c % n] for c in range(cols)])
                continue
            c0, c1 = s // bs, (e - 1) // bs
            if used + c1 - c0 + 1 > self.num_blocks:
                raise RuntimeError(
                    f"the ring's step scratch ({self.num_blocks} blocks) is short of what this step's "
                    f"long requests need (more than max_num_batched_tokens?)"
                )
            scratch = list(range(self.first_block + used, self.first_block + used + c1 - c0 + 1))
            used += len(scratch)
            tables.append([scratch[c - c0] if c0 <= c <= c1 else ring[c % n] for c in range(cols)])
            copies.into[0].extend(ring[c0 % n] * bs + r for r in range(s % bs))
            copies.into[1].extend(scratch[0] * bs + r for r in range(s % bs))
            for p in range(max(s, e - rows), e):
                copies.back[0].append(scratch[p // bs - c0] * bs + p % bs)
                copies.back[1].append(ring[(p // bs) % n] * bs + p % bs)
        return tables, copies
