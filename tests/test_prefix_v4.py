"""Prefix caching of DeepSeek-V4 (GroupedBlockManager with several cache groups): a request whose
prompt shares a cached prefix gives the tokens and log-probabilities of a cold run (an engine
without prefix caching on the same weights: the oracle), computing only the tokens after the
prefix. Tiny random V4 (a sliding-window, a CSA (m = 4) and an HCA (m = 8) layer, window 6: ring
lookback 7, a ring of 8 rows), blocks of 4 tokens (an entries/4 block closes every 16 tokens, an
entries/8 block every 32), reference backend, float32. The hit of a prompt sharing S tokens with
a cached one is the largest multiple of 4 at most min(S, prompt length - 1): asserted exactly
(num_prefix_hits, RequestOutput.num_cached_tokens) where no cached block can have been evicted
(pools of ROOMY blocks: of tokens, and of retained ring rows)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.testing.checkpoints import tiny_v4_config, write_random_v4_checkpoint

BS = 4
NEW_TOKENS = 6
# shared prefix lengths below, at and above the window (6), the ring lookback (7) and rows (8),
# an HCA entry (8), an entries/4 block (16 tokens) and an entries/8 block (32)
SHARED = (3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 15, 16, 17, 23, 24, 25, 31, 32, 33, 40, 47, 48, 49)
ARGS: dict[str, Any] = {
    "backend": "reference", "dtype": "float32", "block_size": BS, "max_model_len": 128, "max_num_seqs": 4,
}  # fmt: skip
ROOMY = 1024  # blocks of tokens: more than every test's requests take, nothing evicted


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_v4_checkpoint(tmp_path_factory.mktemp("v4") / "v4", tiny_v4_config())


@pytest.fixture(scope="module")
def cold(root: Path) -> LLM:
    return LLM(str(root), **ARGS, max_num_batched_tokens=64)


Result = tuple[list[int], list[float]]


def results(outs: list[Any]) -> list[Result]:
    """Each RequestOutput's greedy tokens and their log-probabilities."""
    res = []
    for o in outs:
        c = o.outputs[0]
        assert c.logprobs is not None
        res.append((list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]))
    return res


def run(llm: LLM, prompts: list[list[int]], **params: Any) -> list[Result]:
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0, **params)
    return results(llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False))


def assert_equal(got: list[Result], want: list[Result]) -> None:
    for (tokens, lps), (cold_tokens, cold_lps) in zip(got, want, strict=True):
        assert tokens == cold_tokens
        assert lps == pytest.approx(cold_lps, abs=1e-4)


def diverging(base: list[int], shared: int, rng: random.Random, tail: int = 10) -> list[int]:
    """base's first `shared` tokens, then `tail` others (the first unlike base's next)."""
    first = rng.choice([t for t in range(2, 128) if shared >= len(base) or t != base[shared]])
    return base[:shared] + [first] + [rng.randrange(2, 128) for _ in range(tail - 1)]


def expected_hit(shared: int, length: int) -> int:
    return min(shared, length - 1) // BS * BS


def hits(llm: LLM) -> int:
    return llm.llm_engine.block_manager.num_prefix_hits


def all_blocks_free(llm: LLM) -> bool:
    bm = llm.llm_engine.block_manager
    return bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("budget", [64, 7, 5], ids=["whole", "chunked-7", "chunked-5"])
def test_shared_prefixes_equal_cold_runs(root: Path, cold: LLM, budget: int) -> None:
    """A 60-token prompt cached, then one prompt per shared length S (each alone in its call):
    its hit is S floored to a block, its tokens and log-probabilities a cold run's; with step
    budgets of 7 and 5 tokens both the cached prompt and the later ones go in chunks that cut
    blocks, windows and compression blocks anywhere (chunks longer than the ring takes in place
    through step scratch), and the step after a hit starts on a block boundary."""
    rng = random.Random(budget)
    base = [rng.randrange(2, 128) for _ in range(60)]
    prompts = [diverging(base, s, rng) for s in SHARED]
    want = run(cold, prompts)
    warm = LLM(
        str(root),
        **ARGS,
        max_num_batched_tokens=budget,
        num_gpu_blocks_override=ROOMY,
        prefix_ring_blocks=ROOMY,
        enable_prefix_caching=True,
    )
    assert_equal(run(warm, [base]), run(cold, [base]))  # the cache warmed
    assert hits(warm) == 0
    for s, prompt, w in zip(SHARED, prompts, want):
        before = hits(warm)
        assert_equal(run(warm, [prompt]), [w])
        assert hits(warm) - before == expected_hit(s, len(prompt)), f"shared {s}"
    assert all_blocks_free(warm)


def test_requests_sharing_and_diverging_in_one_call(root: Path, cold: LLM) -> None:
    """One call of prompts that share prefixes of several lengths with the ones before them (a
    tree: a common trunk, branches off branches), one request at a time (max_num_seqs 1) so that
    each finds every earlier one cached: each one's num_cached_tokens is its longest shared
    prefix with an earlier prompt, floored to a block; outputs are a cold run's. Then the same
    prompts again, all at once: every one a hit of its prompt's full blocks."""
    rng = random.Random(3)
    trunk = [rng.randrange(2, 128) for _ in range(40)]
    prompts = [trunk]
    for s in (5, 12, 16, 21, 32, 33, 38):
        parents = [q for q in prompts if len(q) > s]
        prompts.append(diverging(parents[rng.randrange(len(parents))], s, rng, tail=rng.randrange(3, 20)))
    want = run(cold, prompts)
    warm = LLM(
        str(root), **(ARGS | {"max_num_seqs": 1}), max_num_batched_tokens=13, num_gpu_blocks_override=ROOMY,
        prefix_ring_blocks=ROOMY, enable_prefix_caching=True,
    )  # fmt: skip
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = warm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert_equal(results(outs), want)

    def lcp(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    for k, (p, o) in enumerate(zip(prompts, outs)):
        shared = max([lcp(p, q) for q in prompts[:k]], default=0)
        assert all(lcp(p, q) < len(q) for q in prompts[:k]), "no prompt extends an earlier one"
        assert o.num_cached_tokens == expected_hit(shared, len(p)), f"prompt {k}"
    assert hits(warm) == sum(o.num_cached_tokens or 0 for o in outs)
    again = LLM(
        str(root),
        **ARGS,
        max_num_batched_tokens=64,
        num_gpu_blocks_override=ROOMY,
        prefix_ring_blocks=ROOMY,
        enable_prefix_caching=True,
    )
    run(again, prompts)
    before = hits(again)
    assert_equal(run(again, prompts), want)
    assert hits(again) - before == sum((len(p) - 1) // BS * BS for p in prompts)


def test_preemption_with_a_tight_pool(root: Path, cold: LLM) -> None:
    """Six requests sharing a 24-token prefix, a 30-token step budget, a pool of 20 blocks of
    tokens (entries of 80 tokens, plus a partial block per request slot; the requests need up to
    420) and 20 blocks of retained ring rows: requests are preempted (their rings and entries
    freed) and recomputed, the recompute itself a hit on what is still cached, and cached blocks
    are evicted; the outputs stay a cold run's, in the first call and in the repeat."""
    rng = random.Random(5)
    trunk = [rng.randrange(2, 128) for _ in range(24)]
    prompts = [diverging(trunk, 24, rng, tail=rng.randrange(20, 40)) for _ in range(6)]
    want = run(cold, prompts)
    warm = LLM(
        str(root), **(ARGS | {"max_model_len": 80}), max_num_batched_tokens=30, num_gpu_blocks_override=20,
        prefix_ring_blocks=20, enable_prefix_caching=True,
    )  # fmt: skip
    assert_equal(run(warm, prompts), want)
    assert warm.llm_engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    first = hits(warm)
    assert first > 0
    assert_equal(run(warm, prompts), want)
    assert hits(warm) > first
    assert all_blocks_free(warm)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_multi_turn_hits_the_generated_tokens(root: Path, cold: LLM, async_scheduling: bool) -> None:
    """The next turn (prompt + output + a new message) hits every full block of what the first
    turn computed, generated tokens included (with async scheduling a block whose last token was
    still on the device when its step launched is retained and cached once the host reads it)."""
    rng = random.Random(11)
    first = [rng.randrange(2, 128) for _ in range(21)]
    warm = LLM(
        str(root), **ARGS, max_num_batched_tokens=64, enable_prefix_caching=True,
        async_scheduling=async_scheduling, prefix_ring_blocks=ROOMY,
    )  # fmt: skip
    out = run(warm, [first])[0][0]
    second = first + out + [rng.randrange(2, 128) for _ in range(5)]
    before = hits(warm)
    assert_equal(run(warm, [second]), run(cold, [second]))
    computed = len(first) + len(out) - 1  # the last token was sampled, never computed
    assert hits(warm) - before == computed // BS * BS


def test_ring_prefix_pool_default_and_a_small_one(root: Path, cold: LLM) -> None:
    """The ring's prefix pool defaults to the fewest blocks whose bytes reach the entry pools'
    (the ring's rows take many caches a token, the entries few), after the rings and the step
    scratch in the ring's caches, and is counted in the KV bytes. A pool of 4 blocks keeps the
    ring rows of the last 4 token blocks computed only (a step short of blocks keeps its latest
    ones): a prompt hits only where the rows before its prefix's end survive; outputs are a cold
    run's."""
    warm = LLM(
        str(root), **ARGS, max_num_batched_tokens=64, num_gpu_blocks_override=100, enable_prefix_caching=True
    )
    w = warm.llm_engine.worker
    groups, spec = w.kv_groups, w.model.kv_cache_spec(1, BS)
    per_block = [g.cache_spec(spec).bytes_per_token * BS * g.num_caches for g in groups]
    growing = sum(n * b for n, b in zip(w.pool_blocks[1:], per_block[1:]))
    first, count = w.ring_prefix_pool
    assert (count - 1) * per_block[0] < growing <= count * per_block[0]
    assert first == w.pool_blocks[0] + w.ring_scratch_blocks
    assert w.kv_caches[0].spec.num_blocks == first + count
    plain = LLM(str(root), **ARGS, max_num_batched_tokens=64, num_gpu_blocks_override=100)
    assert w.kv_pool_bytes(100) - plain.llm_engine.worker.kv_pool_bytes(100) == count * per_block[0]

    rng = random.Random(8)
    base = [rng.randrange(2, 128) for _ in range(60)]
    small = LLM(
        str(root), **ARGS, max_num_batched_tokens=64, num_gpu_blocks_override=ROOMY, prefix_ring_blocks=4,
        enable_prefix_caching=True,
    )  # fmt: skip
    run(small, [base])
    prompts = [diverging(base, s, rng) for s in (57, 30, 12)]
    want = run(cold, prompts)
    got = []
    for prompt, expect in zip(prompts, want):
        before = hits(small)
        assert_equal(run(small, [prompt]), [expect])
        got.append(hits(small) - before)
    # the pool keeps the last 4 token blocks computed: base's 12..15 (15 completed by its decode
    # steps) serve the hit at 56; that request's own blocks then replace them, and the prompts
    # sharing 30 and 12 tokens miss
    assert got == [56, 0, 0]


def test_prompt_logprobs_limit_the_hit(root: Path, cold: LLM) -> None:
    """Prompt log-probabilities: no cached block hides a prompt position whose log-probability is
    asked for, so the repeat of a prompt that asks for them computes it all; they equal a cold
    run's. A plain repeat is a hit."""
    rng = random.Random(2)
    prompt = [rng.randrange(2, 128) for _ in range(30)]
    warm = LLM(str(root), **ARGS, max_num_batched_tokens=64, enable_prefix_caching=True)
    run(warm, [prompt])
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=0)
    got = warm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    want = cold.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert got.num_cached_tokens == 0 and got.prompt_logprobs is not None and want.prompt_logprobs is not None
    for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
        assert a is not None and b is not None
        assert {t: v.logprob for t, v in a.items()} == pytest.approx(
            {t: v.logprob for t, v in b.items()}, abs=1e-4
        )
    before = hits(warm)
    run(warm, [prompt])
    assert hits(warm) - before == 28


def test_reset_prefix_cache_and_speculative_refusal(root: Path, tmp_path: Path) -> None:
    """reset_prefix_cache forgets the ring's retained rows and every cached entry block: the repeat
    is a miss. Prefix caching with speculative decoding is refused, naming the model."""
    rng = random.Random(4)
    prompt = [rng.randrange(2, 128) for _ in range(20)]
    warm = LLM(str(root), **ARGS, max_num_batched_tokens=64, enable_prefix_caching=True)
    run(warm, [prompt])
    assert warm.reset_prefix_cache()
    run(warm, [prompt])
    assert hits(warm) == 0
    types = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    mtp = write_random_v4_checkpoint(tmp_path / "mtp", tiny_v4_config(layer_types=[*types, types[1]]))
    with pytest.raises(ValueError, match="enable_prefix_caching with speculative decoding is not supported"):
        LLM(
            str(mtp), **ARGS, enable_prefix_caching=True,
            speculative_config={"method": "mtp", "num_speculative_tokens": 2},
        )  # fmt: skip
