"""Greedy generation through the engine equals transformers' greedy generate on the same weights
(reference backend, float32), under chunked prefill, preemption and prefix caching."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_model import TINY

from deepinfer import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        TINY, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


def random_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(n)] for n in lengths]


def engine_greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts  # prompt order kept
    for o in outs:
        assert o.outputs[0].finish_reason == "length"
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_matches_transformers_with_chunked_prefill_and_preemption(hf_model: torch.nn.Module) -> None:
    # 9 prompts, 3..150 tokens; a step budget of 40 tokens (most prompts take several chunks)
    # and a pool of 12 blocks of 16 = 192 tokens, far less than the 9 requests need together.
    lengths = [3, 150, 17, 40, 64, 65, 100, 7, 129]
    prompts = random_prompts(lengths, hf_model.config.vocab_size, seed=0)
    llm = LLM(
        str(TINY),
        backend="reference",
        dtype="float32",
        block_size=16,
        num_gpu_blocks_override=12,
        max_model_len=192,
        max_num_batched_tokens=40,
        max_num_seqs=8,
    )
    got = engine_greedy(llm, prompts)
    engine = llm.llm_engine
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    assert engine.block_manager.num_free_blocks == 12
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_greedy(hf_model, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"


def test_greedy_matches_transformers_with_prefix_caching(hf_model: torch.nn.Module) -> None:
    vocab = hf_model.config.vocab_size
    (base,) = random_prompts([90], vocab, seed=1)
    tails = random_prompts([5, 1, 30, 12, 0, 47, 3, 20], vocab, seed=2)
    # Shared prefixes of several lengths (block-aligned and not), one prompt equal to a prefix.
    cuts = [90, 64, 33, 80, 48, 16, 90, 70]
    prompts = [base[:c] + t for c, t in zip(cuts, tails)]
    llm = LLM(
        str(TINY),
        backend="reference",
        dtype="float32",
        block_size=16,
        num_gpu_blocks_override=16,
        max_model_len=256,
        max_num_batched_tokens=48,
        max_num_seqs=4,
        enable_prefix_caching=True,
    )
    first = engine_greedy(llm, prompts)
    engine = llm.llm_engine
    hits_first = engine.block_manager.num_prefix_hits
    assert hits_first > 0, "prompts sharing prefixes were meant to hit the prefix cache"
    # A second pass finds more of its prefixes cached and must give the same tokens.
    second = engine_greedy(llm, prompts)
    assert engine.block_manager.num_prefix_hits > hits_first
    assert second == first
    for prompt, tokens in zip(prompts, first):
        assert tokens == hf_greedy(hf_model, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"


def test_seeded_sampling_is_unchanged_by_chunking_and_preemption() -> None:
    prompts = random_prompts([3, 150, 17, 40, 64, 65, 100, 7, 129], 978, seed=3)
    params = [
        SamplingParams(temperature=0.9, top_k=40, seed=i, max_tokens=10, ignore_eos=True) for i in range(9)
    ]

    def run(**kw: int) -> tuple[list[list[int]], int]:
        llm = LLM(str(TINY), backend="reference", dtype="float32", block_size=16, batch_invariant=True, **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.llm_engine.scheduler.num_preemptions

    roomy, n_roomy = run(
        max_model_len=192, num_gpu_blocks_override=200, max_num_batched_tokens=2048, max_num_seqs=16
    )
    tight, n_tight = run(
        max_model_len=192, num_gpu_blocks_override=12, max_num_batched_tokens=40, max_num_seqs=8
    )
    assert n_roomy == 0 and n_tight > 0
    assert tight == roomy
