"""Block manager: allocation, freeing, prefix caching by block hash."""

from __future__ import annotations

import pytest

from deepinfer.engine.kv_cache import BlockManager, num_blocks_from_memory
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.sequence import Sequence


def seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, None, tokens, SamplingParams(temperature=0))


def test_allocate_grows_by_blocks_and_frees_everything() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(list(range(10)))
    assert bm.allocate(s, 10)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    s.num_computed_tokens = 10
    assert bm.allocate(s, 2)  # tokens 10, 11 fit in block 3
    assert len(s.block_table) == 3
    s.num_computed_tokens = 12
    assert bm.allocate(s, 1)  # token 12 opens block 4
    assert len(s.block_table) == 4
    assert len(set(s.block_table)) == 4
    bm.free_sequence(s)
    assert bm.num_free_blocks == 8 and s.block_table == []


def test_allocate_is_all_or_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    a, b = seq(list(range(8)), "a"), seq(list(range(8)), "b")
    assert bm.allocate(a, 8)
    assert not bm.allocate(b, 8)  # needs 2, one free
    assert b.block_table == [] and bm.num_free_blocks == 1


def test_prefix_cache_hit_shares_blocks_and_leaves_one_token() -> None:
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = seq(list(range(12)), "a")
    assert bm.match_prefix(a) == []
    assert bm.allocate(a, 12)
    a.num_computed_tokens = 12
    bm.cache_full_blocks(a)
    # Same first 8 tokens, different third block.
    b = seq([*range(8), 99, 98, 97, 96, 95], "b")
    hits = bm.match_prefix(b)
    assert hits == a.block_table[:2]
    assert bm.allocate(b, b.num_tokens - 8, hits)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] not in a.block_table
    assert bm.blocks[hits[0]].ref_count == 2
    # Identical prompt: all 3 blocks are cached, but the last token must be recomputed.
    c = seq(list(range(12)), "c")
    assert bm.match_prefix(c) == a.block_table[:2]
    # A hash collision guard: different tokens never match.
    d = seq([1, *range(1, 12)], "d")
    assert bm.match_prefix(d) == []


def test_freed_cached_blocks_are_reused_until_evicted() -> None:
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    a = seq(list(range(9)), "a")
    assert bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    first_two = a.block_table[:2]
    bm.free_sequence(a)
    assert bm.num_free_blocks == 4
    b = seq(list(range(9)), "b")
    hits = bm.match_prefix(b)
    assert hits == first_two
    assert bm.allocate(b, 1, hits)
    assert bm.num_free_blocks == 1
    bm.free_sequence(b)
    # Fill the pool with other content: the cached blocks get evicted.
    c = seq(list(range(100, 116)), "c")
    assert bm.allocate(c, 16)
    assert bm.match_prefix(seq(list(range(9)), "d")) == []


def test_revived_blocks_count_against_free_space() -> None:
    bm = BlockManager(num_blocks=3, block_size=2, enable_prefix_caching=True)
    a = seq([1, 2, 3, 4, 5], "a")
    assert bm.allocate(a, 5)
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    bm.free_sequence(a)
    b = seq([1, 2, 3, 4, 7, 8, 9, 10], "b")
    hits = bm.match_prefix(b)
    assert len(hits) == 2
    # 2 revived + 2 new > 3 free: refused, nothing taken.
    assert not bm.allocate(b, 4, hits)
    assert bm.num_free_blocks == 3 and b.block_table == []


def test_num_blocks_from_memory() -> None:
    gib = 1 << 30
    # 10 GiB total, 2 GiB in use, 0.5 -> 3 GiB for the cache.
    assert num_blocks_from_memory(8 * gib, 10 * gib, 0.5, gib // 4) == 12
    assert num_blocks_from_memory(4 * gib, 10 * gib, 0.5, 1024) == 0


def test_empty_pool_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        BlockManager(0, 16)
