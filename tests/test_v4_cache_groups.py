"""DeepSeek-V4's cache groups: a ring of a fixed number of blocks per request for the per-token
caches (sliding window, compressor state): ceil((lookback + 1 + max backtrack) / BS), whatever
the length and the step sizes; entry caches growing at 1/m rows per token, all blocks returned at
finish and preemption; pool sizing across groups (the ring's step scratch included); decode
steps replayed from graphs
through the ring and entry tables (reference backend, and the cuda backend's kernels under the
Triton interpreter: tests/test_cuda_interpret.py)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest

from deepinfer import LLM, SamplingParams, envs
from deepinfer.engine.kv_cache import GroupedBlockManager, cdiv, fit_blocks, group_pool_blocks
from deepinfer.engine.ring import scratch_blocks
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.sequence import Sequence
from deepinfer.models.config import ModelConfig
from deepinfer.models.deepseek_v4 import cache_groups, ring_lookback
from deepinfer.models.forward_batch import KVCacheGroup
from deepinfer.testing.checkpoints import tiny_v4_config, write_random_v4_checkpoint

FLASH = Path(__file__).resolve().parents[1] / "model" / "deepseek-v4-flash" / "config.json"
BS = 64


def flash_config() -> ModelConfig:
    return ModelConfig.from_dict(json.loads(FLASH.read_text()))


@pytest.mark.parametrize("k,blocks", [(0, 2), (1, 3), (64, 3), (65, 4)])
def test_flash_groups(k: int, blocks: int) -> None:
    """V4-Flash (43 layers, D 512, window 128, CSA 4 with a 128-wide indexer, HCA 128): the ring
    holds the window (1 cache per layer), the compressor state (4 caches per CSA layer, 2 per
    HCA layer) and the indexer's state (1 per CSA layer), for 127 + 1 + k positions (k drafts
    per verification step): 2 blocks of 64 without drafts, 3 with 1 to 64, 4 with 65. A step
    of up to R - 127 tokens per request writes the ring in place. Entries: the CSA entries at
    1/4, the HCA entries at 1/128, the indexer keys at 1/4 in rows of 128 (not 512)."""
    config = flash_config()
    assert config.v4 is not None
    ratios = config.v4.compress_ratios
    csa, hca = ratios.count(4), ratios.count(128)
    assert ring_lookback(config.v4) == 127
    ring, e4, e128, i4 = cache_groups(config, BS, k)
    assert blocks == cdiv(127 + 1 + k, BS)
    assert (ring.name, ring.ring_blocks, ring.num_caches) == ("ring", blocks, 43 + 5 * csa + 2 * hca)
    assert (ring.ring_lookback, ring.ring_step_tokens(BS)) == (127, blocks * BS - 127)
    assert (e4.name, e4.ratio, e4.num_caches, e4.ring_blocks, e4.row_dim) == ("entries/4", 4, csa, 0, None)
    assert (e128.name, e128.ratio, e128.num_caches, e128.row_dim) == ("entries/128", 128, hca, None)
    assert (i4.name, i4.ratio, i4.num_caches, i4.ring_blocks, i4.row_dim) == ("index/4", 4, csa, 0, 128)


def test_mtp_layer_caches_join_the_groups(tmp_path: Path) -> None:
    """The MTP layer's caches are the last rows of the groups its kinds belong to: V4-Flash's
    (sliding window only) one more cache in the ring. Through the engine, a CSA MTP layer's (ring:
    window, compressor and indexer state; entries/4: entries; index/4: indexer keys) are
    allocated with their groups' pools and kept apart, as worker.mtp_caches."""
    config = flash_config()
    assert config.v4 is not None
    ratios = config.v4.compress_ratios
    csa, hca = ratios.count(4), ratios.count(128)
    ring, e4, e128, i4 = cache_groups(config, BS, mtp_layers=1)
    assert (ring.num_caches, ring.num_mtp_caches) == (43 + 5 * csa + 2 * hca + 1, 1)
    assert (e4.num_caches, e4.num_mtp_caches, e128.num_mtp_caches) == (csa, 0, 0)
    assert (i4.num_caches, i4.num_mtp_caches) == (csa, 0)

    types = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    raw = tiny_v4_config(layer_types=[*types, types[1]])  # the MTP layer: CSA
    root = write_random_v4_checkpoint(tmp_path / "v4", raw)
    llm = LLM(
        str(root), backend="reference", dtype="float32", block_size=4, max_model_len=64,
        max_num_batched_tokens=64, max_num_seqs=16,
        speculative_config={"method": "mtp", "num_speculative_tokens": 2},
    )  # fmt: skip
    engine = llm.llm_engine
    assert engine.worker.kv_groups is not None
    ring, e4, e8, i4 = engine.worker.kv_groups
    # D 16: CSA state 4 caches, indexer state (4 x 8 wide) 2; entries and indexer keys 1 each
    assert [g.num_mtp_caches for g in (ring, e4, e8, i4)] == [1 + 4 + 2, 1, 0, 1]
    assert len(engine.worker.kv_caches) == engine.model.num_kv_layers
    pools = [m.num_blocks for m in engine.block_manager.managers]  # type: ignore[union-attr]
    # ring: 7 + 1 + 2 rows -> 3 blocks, 5 tokens a step in place; the step scratch for T tokens a
    # step: T // 4 blocks plus 2 per request of more than 5 tokens; the ring's caches hold it after
    # the pool's blocks
    c = engine.config
    assert (ring.ring_blocks, ring.ring_step_tokens(4)) == (3, 5)
    t, seqs = c.max_num_batched_tokens, c.max_num_seqs
    assert (t, seqs) == (64, 16) and engine.worker.ring_scratch_blocks == t // 4 + 2 * min(seqs, t // 6) == 36
    ring_blocks = pools[0] + engine.worker.ring_scratch_blocks
    assert [c.spec.num_blocks for c in engine.worker.mtp_caches] == [ring_blocks] * 7 + [pools[1], pools[3]]
    assert [c.spec.head_dim for c in engine.worker.mtp_caches] == [16] * 8 + [8]  # the key: Di wide


def test_index_keys_rows_are_di_wide(tmp_path: Path) -> None:
    """The indexer keys' group holds rows Di wide, not D: through the engine (tiny random V4, D
    16, Di 8, float32), the index/4 caches are allocated 8 wide, every other cache 16, and the
    pool grows by D / 4 values per token per CSA layer for its entries and Di / 4 for its keys
    (D / 8 per HCA layer). V4-Flash (bfloat16): 6,584 bytes per token over its growing caches,
    where D-wide keys took 10,424."""
    root = write_random_v4_checkpoint(tmp_path / "v4", tiny_v4_config(max_position_embeddings=128))
    llm = LLM(
        str(root), backend="reference", dtype="float32", block_size=4, max_model_len=64,
        max_num_batched_tokens=32, max_num_seqs=2,
    )  # fmt: skip
    engine = llm.llm_engine
    assert engine.worker.kv_groups is not None
    assert [(g.name, g.row_dim) for g in engine.worker.kv_groups] == [
        ("ring", None),
        ("entries/4", None),
        ("entries/8", None),
        ("index/4", 8),
    ]
    widths = [c.spec.head_dim for c in engine.worker.kv_caches]
    first = sum(g.num_caches for g in engine.worker.kv_groups[:-1])
    assert widths == [16] * first + [8] * engine.worker.kv_groups[-1].num_caches
    assert engine.worker.kv_groups[-1].num_caches == 1  # one CSA layer
    # 64 more tokens (16 blocks): 4 more blocks of entries/4 and index/4, 2 of entries/8
    grown = engine.worker.kv_pool_bytes(32 + 16) - engine.worker.kv_pool_bytes(32)
    assert grown == 64 * 4 * (16 // 4 + 16 // 8 + 8 // 4)

    config = flash_config()
    assert config.v4 is not None
    csa, hca = config.v4.compress_ratios.count(4), config.v4.compress_ratios.count(128)

    def growing_bytes_per_token(groups: list[KVCacheGroup]) -> float:
        return sum(g.num_caches * (g.row_dim or 512) * 2 / g.ratio for g in groups if not g.ring_blocks)

    groups = cache_groups(config, BS)
    assert growing_bytes_per_token(groups) == csa * (1024 + 256) / 4 + hca * 1024 / 128 == 6_584
    wide = [dataclasses.replace(g, row_dim=None) for g in groups]
    assert growing_bytes_per_token(wide) == 10_424


@pytest.mark.parametrize("window,k", [(128, 0), (128, 5), (6, 0), (6, 3), (3, 0), (3, 2)])
def test_ring_covers_what_a_step_reads(window: int, k: int) -> None:
    """R = ring rows >= lookback + 1 + k: a step writing [start, end) in place (at most R -
    lookback tokens, 1 + k at least) overwrites only positions older than end - R, none of
    which it reads (its first query's window, and the state rows pooled by the first entry
    closing in the step)."""
    raw = tiny_v4_config(sliding_window=window)
    config = ModelConfig.from_dict(raw)
    assert config.v4 is not None
    ring = cache_groups(config, 4, k)[0]
    rows = ring.ring_blocks * 4
    chunk = ring.ring_step_tokens(4)
    assert chunk >= 1 + k and rows == cdiv(ring_lookback(config.v4) + 1 + k, 4) * 4
    m_csa, m_hca = config.v4.csa_ratio, config.v4.hca_ratio
    for start in range(0, 40):
        end = start + chunk
        oldest_read = min(start - (window - 1), (start // m_csa - 1) * m_csa, (start // m_hca) * m_hca)
        assert oldest_read >= end - rows, (start, oldest_read, end - rows)


def drive(bm: GroupedBlockManager, seq: Sequence, sched: Scheduler, total: int) -> list[tuple[int, ...]]:
    """Prefill seq in chunks and decode it to `total` tokens (one made-up token per step);
    (tokens in the cache, blocks of each group) after each step."""
    sched.add(seq)
    seen = []
    while seq.num_computed_tokens < total:
        batch = sched.schedule()
        assert batch.seqs == [seq]
        sched.advance(batch)
        if seq.num_computed_tokens == seq.num_tokens and seq.num_tokens < total:
            seq.token_ids.append(7)  # the sampled token
        seen.append((seq.num_computed_tokens, *(len(t) for t in seq.block_tables)))
    return seen


@pytest.mark.parametrize("k", [0, 3])
def test_ring_constant_entries_grow_to_10k_tokens(k: int) -> None:
    """One V4-Flash-shaped request to 10,000 tokens (a 9,000-token prompt in chunks of the step's
    8,192-token budget, then 1,000 decode steps), k drafts per verification step: its ring
    stays at ceil((127 + 1 + k) / 64) blocks from its first step on (no cap on its tokens per
    step: the long chunks go through step scratch), its entry groups hold cdiv(L // m, 64)
    blocks; finishing returns every block."""
    groups = cache_groups(flash_config(), BS, k)
    blocks = cdiv(127 + 1 + k, BS)
    pools = group_pool_blocks(groups, cdiv(10_000, BS), max_num_seqs=1)
    bm = GroupedBlockManager(groups, pools, BS)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=8192)
    seq = Sequence("0", None, [3] * 9000, SamplingParams(max_tokens=1000), max_total_tokens=10_000)
    seen = drive(bm, seq, sched, 10_000)
    assert seen[0][0] == 8192  # the whole budget in one step
    for tokens, ring, e4, e128, i4 in seen:
        assert ring == blocks
        assert e4 == i4 == cdiv(tokens // 4, BS) and e128 == cdiv(tokens // 128, BS)
    assert seen[-1] == (10_000, blocks, 40, 2, 40)
    assert pools[0] == blocks  # one ring; the step scratch is the engine's, for all requests
    # the engine's step scratch, for all requests: T // BS + 2 per long request (more than
    # R - 127 tokens) of the step
    assert scratch_blocks(8192, 1, BS, groups[0].ring_step_tokens(BS)) == 8192 // BS + 2
    assert (
        scratch_blocks(8192, 256, BS, 1) == 128 + 512 and scratch_blocks(8192, 256, BS, 65) == 128 + 2 * 124
    )
    sched.finish(seq)
    assert bm.num_free_blocks == bm.num_blocks and all(not t for t in seq.block_tables)


def test_preemption_returns_every_group() -> None:
    """Two requests in an entry pool for one: the later one is preempted (all of its groups
    freed, its ring included) and recomputed once the first finishes."""
    groups = [KVCacheGroup("ring", 3, ring_blocks=2), KVCacheGroup("entries/4", 2, ratio=4)]
    pools = group_pool_blocks(groups, num_blocks=8, max_num_seqs=2)  # ring 4, entries 2 + 2
    assert pools == [4, 4]
    bm = GroupedBlockManager(groups, pools, block_size=4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64, max_tokens_per_request=8)
    a = Sequence("a", None, [1] * 40, SamplingParams(max_tokens=1))
    b = Sequence("b", None, [2] * 40, SamplingParams(max_tokens=1))
    sched.add(a)
    sched.add(b)
    preempted = []
    while a.num_computed_tokens < 40:
        batch = sched.schedule()
        preempted += batch.preempted
        sched.advance(batch)
        held = sum(len(t) for s in sched.running for t in s.block_tables)
        assert held + bm.num_free_blocks == bm.num_blocks
    assert preempted == [b] and b.block_tables == [[], []] and len(a.block_tables[0]) == 2
    sched.finish(a)
    batch = sched.schedule()  # b again, from its first token
    assert batch.seqs == [b] and batch.num_new_tokens == [8] and len(b.block_tables[0]) == 2
    sched.finish(b)
    assert bm.num_free_blocks == bm.num_blocks


def test_pool_sizing() -> None:
    """A ring per request slot; growing groups sized for the tokens plus, at ratio > 1, one
    partial block per request slot; fit_blocks finds the largest pool within a budget."""
    groups = [
        KVCacheGroup("ring", 5, ring_blocks=3),
        KVCacheGroup("entries/4", 2, ratio=4),
        KVCacheGroup("entries/128", 1, ratio=128),
    ]
    assert group_pool_blocks(groups, 1000, max_num_seqs=8) == [24, 250 + 8, 8 + 8]

    def pool_bytes(n: int) -> int:
        return sum(b * g.num_caches * 100 for g, b in zip(groups, group_pool_blocks(groups, n, 8)))

    # 1001..1004 blocks of tokens take one more block of entries/4 (2 caches of 100 bytes)
    assert fit_blocks(pool_bytes(1000) + 199, pool_bytes, 10**6) == 1000
    assert fit_blocks(pool_bytes(1000) + 200, pool_bytes, 10**6) == 1004
    assert fit_blocks(pool_bytes(1000), pool_bytes, 500) == 500
    assert fit_blocks(pool_bytes(0) - 1, pool_bytes, 10**6) == 0


@pytest.mark.parametrize("budget", [7, 64])
def test_engine_request_ring_is_constant(tmp_path: Path, budget: int) -> None:
    """Through the engine (tiny random V4, blocks of 4, window 6, ratios 4 and 8: a look-back of
    7 rows; steps of 7 or 64 tokens, up to 8 times the ring): a 300-token request keeps its ring
    (2 blocks: 7 + 1 rows) at every step while its entry blocks grow at 1/4 and 1/8 of its
    tokens; the ring's caches hold 2 rings and the step scratch, nothing that grows with a
    request; every block is free at the end."""
    root = write_random_v4_checkpoint(tmp_path / "v4", tiny_v4_config(max_position_embeddings=512))
    llm = LLM(
        str(root), backend="reference", dtype="float32", block_size=4, max_model_len=320,
        max_num_batched_tokens=budget, max_num_seqs=2,
    )  # fmt: skip
    engine = llm.llm_engine
    seq = engine.make_sequence(
        {"prompt_token_ids": [(5 * i) % 120 + 2 for i in range(280)]},
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    )
    engine.add(seq)
    seen = []
    while engine.has_unfinished():
        engine.step()
        if not seq.is_finished:
            seen.append((seq.num_computed_tokens, *(len(t) for t in seq.block_tables)))
    assert len(seen) > 280 // budget and seen[-1][0] >= 290
    for tokens, ring, e4, e8, i4 in seen:
        assert ring == 2
        assert e4 == i4 == cdiv(tokens // 4, 4) and e8 == cdiv(tokens // 8, 4)
    assert engine.worker.ring_scratch_blocks == scratch_blocks(budget, 2, 4, 1) == budget // 4 + 4
    assert engine.worker.kv_caches[0].spec.num_blocks == 2 * 2 + engine.worker.ring_scratch_blocks
    assert len(seq.output_token_ids) == 20
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


# cuda under the Triton interpreter (tests/test_cuda_interpret.py), or on a GPU with
# DEEPINFER_TEST_BACKEND=cuda (real CUDA graphs)
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
GRAPH_BACKEND = envs.read().test_backend or ("cuda" if INTERPRET else "reference")


def test_engine_decode_graphs_equal_eager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny random V4 (window 6, ratios 4 and 8, blocks of 4), prompts past the window over
    many entries, a 13-token step budget (chunked prefill) and a pool of 64 tokens (preemption):
    decode graph replays (padded to their buckets, entries closing inside them) give the eager
    engine's greedy tokens, on the backend under test."""
    root = write_random_v4_checkpoint(tmp_path / "v4", tiny_v4_config(max_position_embeddings=128))
    prompts = [[(7 * i + 3 * j) % 120 + 2 for i in range(n)] for j, n in enumerate((44, 9, 7, 36, 5))]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 12, 14, 4, 10)]
    outs, preempted = {}, 0
    for eager in (True, False):
        llm = LLM(
            str(root), backend=GRAPH_BACKEND, dtype="float32", block_size=4, max_model_len=64,
            max_num_batched_tokens=13, max_num_seqs=4, num_gpu_blocks_override=16, enforce_eager=eager,
        )  # fmt: skip
        graphs = llm.llm_engine.worker.decode_graphs
        seen: list[tuple[int, int]] = []
        real = graphs.bucket_for

        def spy(batch: Any, real: Any = real, seen: list[tuple[int, int]] = seen) -> int | None:
            bucket: int | None = real(batch)
            if bucket is not None:
                seen.append((len(batch), bucket))
            return bucket

        monkeypatch.setattr(graphs, "bucket_for", spy)
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outs[eager] = [list(r.outputs[0].token_ids) for r in res]
        preempted += llm.llm_engine.scheduler.num_preemptions
        assert bool(seen) != eager and (eager or any(b < bucket for b, bucket in seen)), seen
        bm = llm.llm_engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    assert preempted > 0, "the pool was meant to force preemption"
    assert outs[False] == outs[True]
