"""Scheduler + block manager under random load: prefix caching, preemption, tiny budgets and
pools, abort in the middle. The model is bookkeeping: each KV slot a step writes records the
prefix that produced it (a cached row depends on every earlier token), every step checks that
the slots its requests attend to hold their own prefixes, and the next token is a hash of the
sequence, so outputs must equal those of a roomy run without caching. After every step the
block reference counts must equal the block tables that hold them."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from deepinfer.engine.kv_cache import BlockManager
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.sequence import Sequence


def next_token(tokens: list[int]) -> int:
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 2654435761) % 997


def check_blocks(bm: BlockManager, sched: Scheduler) -> None:
    refs = Counter(b for s in sched.running for b in s.block_table)
    assert all(not s.block_table for s in sched.waiting)
    for block in bm.blocks:
        assert block.ref_count == refs[block.block_id], f"block {block.block_id}"
        assert (block.ref_count == 0) == (block.block_id in bm.free)
    for h, block_id in bm.cached.items():
        assert bm.blocks[block_id].hash == h
    for s in sched.running:
        assert len(set(s.block_table)) == len(s.block_table)
        for i, block_id in enumerate(s.block_table):  # a shared cached block holds s's own tokens
            block = bm.blocks[block_id]
            if block.hash is not None:
                assert block.token_ids == tuple(s.token_ids[i * bm.block_size : (i + 1) * bm.block_size])


def workload(seed: int, max_len: int) -> list[Sequence]:
    rng = random.Random(seed)
    vocab = rng.choice([2, 1000])  # 2: equal blocks after different prefixes are common
    bases = [[rng.randrange(vocab) for _ in range(rng.randrange(1, max_len // 2))] for _ in range(3)]
    seqs = []
    for i in range(10):
        base = rng.choice(bases)
        cut = rng.randrange(len(base) + 1)
        tail = [rng.randrange(vocab) for _ in range(rng.randrange(10))]
        prompt = (base[:cut] + tail)[: max_len - 2] or [1]
        params = SamplingParams(temperature=0, max_tokens=rng.randrange(1, max_len - len(prompt)))
        seqs.append(Sequence(str(i), None, prompt, params))
    return seqs


def run(
    seqs: list[Sequence], bm: BlockManager, budget: int, max_seqs: int, max_len: int, abort_at: int = -1
) -> tuple[list[list[int]], int]:
    sched = Scheduler(bm, max_seqs, budget)
    for s in seqs:
        sched.add(s)
    bs = bm.block_size
    kv: dict[int, int] = {}  # slot -> hash of the prefix whose last token wrote it
    step = 0
    while sched.has_unfinished():
        batch = sched.schedule()
        assert len(batch) > 0 and batch.num_tokens <= budget and len(batch) <= max_seqs
        for s, n in zip(batch.seqs, batch.num_new_tokens):
            assert n >= 1 and len(s.block_table) * bs >= s.num_computed_tokens + n
            slots = [s.block_table[p // bs] * bs + p % bs for p in range(s.num_computed_tokens + n)]
            for p, slot in enumerate(slots[: s.num_computed_tokens]):  # attended to
                assert kv.get(slot) == hash(tuple(s.token_ids[: p + 1])), f"request {s.request_id} pos {p}"
            for p, slot in enumerate(slots[s.num_computed_tokens :], s.num_computed_tokens):  # written
                kv[slot] = hash(tuple(s.token_ids[: p + 1]))
        sched.advance(batch)
        step += 1
        if step == abort_at:
            sched.abort_all()
            break
        for s in list(batch.seqs):
            if s.num_computed_tokens == s.num_tokens:
                s.token_ids.append(next_token(s.token_ids))
                if s.num_output_tokens >= (s.params.max_tokens or 0) or s.num_tokens >= max_len:
                    sched.finish(s)
        check_blocks(bm, sched)
    check_blocks(bm, sched)
    assert bm.num_free_blocks == bm.num_blocks
    return [s.output_token_ids for s in seqs], sched.num_preemptions


@pytest.mark.parametrize("seed", range(40))
def test_random_load_matches_a_roomy_run(seed: int) -> None:
    rng = random.Random(1000 + seed)
    bs, num_blocks = rng.choice([1, 2, 3, 4, 8]), rng.randrange(4, 16)
    budget, max_seqs = rng.choice([1, 2, 3, 5, 8, 16, 64]), rng.randrange(1, 6)
    max_len = num_blocks * bs
    want, _ = run(workload(seed, max_len), BlockManager(500, bs), 4096, 64, max_len)
    for caching in (False, True):
        bm = BlockManager(num_blocks, bs, enable_prefix_caching=caching)
        got, _ = run(workload(seed, max_len), bm, budget, max_seqs, max_len)
        assert got == want, f"prefix caching {caching}"
    # Abort in the middle: every block comes back, cached content stays consistent.
    bm = BlockManager(num_blocks, bs, enable_prefix_caching=True)
    run(workload(seed, max_len), bm, budget, max_seqs, max_len, abort_at=rng.randrange(1, 20))
