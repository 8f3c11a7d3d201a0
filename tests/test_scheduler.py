"""Scheduler: token budget, max_num_seqs, chunked prefill, decodes first, preemption by recompute.

The model is replaced by bookkeeping: each sampled token is a function of the sequence so far, so
a recompute after preemption must reproduce the same tokens."""

from __future__ import annotations

from deepinfer.engine.kv_cache import BlockManager
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.sequence import Sequence


def make(rid: str, prompt_len: int, max_tokens: int) -> Sequence:
    return Sequence(
        rid, None, list(range(1, prompt_len + 1)), SamplingParams(temperature=0, max_tokens=max_tokens)
    )


def run(sched: Scheduler, seqs: list[Sequence], budget: int, max_seqs: int) -> list[list[tuple[str, int]]]:
    for s in seqs:
        sched.add(s)
    steps = []
    while sched.has_unfinished():
        batch = sched.schedule()
        assert len(batch) > 0
        assert batch.num_tokens <= budget
        assert len(batch) <= max_seqs
        # Decodes first: no prefilling request precedes a decoding one among running requests.
        kinds = [n == 1 and s.num_computed_tokens > 0 for s, n in zip(batch.seqs, batch.num_new_tokens)]
        assert kinds == sorted(kinds, reverse=True) or not any(kinds)
        bs = sched.block_manager.block_size
        for s, n in zip(batch.seqs, batch.num_new_tokens):
            assert len(s.block_table) * bs >= s.num_computed_tokens + n
        steps.append([(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)])
        sched.advance(batch)
        for s in list(batch.seqs):
            if s.num_computed_tokens == s.num_tokens:
                s.token_ids.append(sum(s.token_ids) % 1000)  # deterministic "model"
                if s.num_output_tokens >= (s.params.max_tokens or 0):
                    sched.finish(s)
    return steps


def test_chunked_prefill_under_budget() -> None:
    bm = BlockManager(64, 8)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16)
    a = make("a", 40, 3)
    steps = run(sched, [a], 16, 4)
    # 40 prompt tokens in chunks of 16, 16, 8, then 2 decodes.
    assert steps == [[("a", 16)], [("a", 16)], [("a", 8)], [("a", 1)], [("a", 1)]]
    assert a.num_output_tokens == 3
    assert bm.num_free_blocks == 64


def test_max_num_seqs_and_decodes_first() -> None:
    bm = BlockManager(64, 8)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=12)
    seqs = [make("a", 4, 4), make("b", 20, 2), make("c", 3, 2)]
    steps = run(sched, seqs, 12, 2)
    assert steps[0] == [("a", 4), ("b", 8)]
    # a decodes before b's next prefill chunk; c waits for a free slot.
    assert steps[1] == [("a", 1), ("b", 11)]
    assert all(s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert "c" not in {rid for rid, _ in steps[0] + steps[1]}


def test_preemption_by_recompute_keeps_outputs() -> None:
    def outputs(num_blocks: int) -> tuple[list[list[int]], int]:
        bm = BlockManager(num_blocks, 4)
        sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=32)
        seqs = [make(str(i), 5 + 3 * i, 12) for i in range(6)]
        run(sched, seqs, 32, 8)
        assert bm.num_free_blocks == num_blocks  # everything freed at the end
        return [s.output_token_ids for s in seqs], sched.num_preemptions

    roomy, n_roomy = outputs(200)
    tight, n_tight = outputs(9)  # 36 tokens: the longest request (32) fits alone, not with others
    assert n_roomy == 0 and n_tight > 0
    assert tight == roomy


def test_abort_all_frees_blocks() -> None:
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8)
    for i in range(3):
        sched.add(make(str(i), 6, 4))
    sched.advance(sched.schedule())
    assert bm.num_free_blocks < 16
    dropped = sched.abort_all()
    assert len(dropped) == 3 and not sched.has_unfinished() and bm.num_free_blocks == 16
