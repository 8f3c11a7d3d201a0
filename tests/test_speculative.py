"""Speculative decoding with the checkpoint's MTP head (speculative_config): the outputs are those
of plain decoding, greedy and seeded sampling, through chunked prefill, preemption and prefix
caching; right drafts are accepted (fewer steps), wrong ones rejected; the head's incremental
drafts equal a from-scratch computation over the whole sequence; bad configurations are errors."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer import LLM, SamplingParams, StructuredOutputsParams
from deepinfer.models.loader import load_model
from deepinfer.models.random_checkpoint import tiny_config, write_random_checkpoint
from deepinfer.models.runner_util import PagedRunner, build_batch
from deepinfer.reference.backend import create_reference_backend

SPEC = {"method": "mtp", "num_speculative_tokens": 1}
PROMPTS = [[5 + (7 * i + 3 * j) % 120 for j in range(n)] for i, n in enumerate([3, 17, 40, 9, 66, 1])]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("mtp") / "ckpt", tiny_config(), seed=3)


def make(ckpt: Path, **kw: Any) -> LLM:
    args: dict[str, Any] = {"backend": "reference", "dtype": "float32", "block_size": 8, "max_model_len": 256}
    return LLM(str(ckpt), **{**args, **kw})


def run(llm: LLM, params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SEEDED = [SamplingParams(temperature=0.8, top_k=40, seed=i, max_tokens=24, ignore_eos=True) for i in range(6)]


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"max_num_batched_tokens": 16},  # chunked prefill, drafts dropped when the budget is short
        {"num_gpu_blocks_override": 16, "max_model_len": 128, "max_num_batched_tokens": 64},  # preemptions
        {"enable_prefix_caching": True},
    ],
    ids=["plain", "chunked", "preempting", "prefix-cache"],
)
def test_outputs_equal_plain_decoding(ckpt: Path, engine_args: dict[str, Any], k: int) -> None:
    plain = make(ckpt, **engine_args)
    spec = make(ckpt, speculative_config={**SPEC, "num_speculative_tokens": k}, **engine_args)
    assert run(spec, GREEDY) == run(plain, GREEDY)
    assert run(spec, SEEDED) == run(plain, SEEDED)
    assert spec.llm_engine.num_draft_tokens > 0
    if "num_gpu_blocks_override" in engine_args:
        assert spec.llm_engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("k", [1, 3])
def test_right_drafts_are_accepted_and_wrong_ones_rejected(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, k: int
) -> None:
    """Drafts from an oracle that knows plain decoding's output, one in four wrong: the output
    is unchanged, every right draft up to the first wrong one is accepted, and the run takes
    fewer steps."""
    plain = make(ckpt)
    expected = run(plain, GREEDY)
    by_prompt = {tuple(p): p + out for p, out in zip(PROMPTS, expected)}
    spec = make(ckpt, speculative_config={**SPEC, "num_speculative_tokens": k})
    engine = spec.llm_engine
    calls = {"n": 0, "right": 0}

    def oracle(seqs, spans, rows, wants):  # type: ignore[no-untyped-def]
        drafts = []
        for seq, want in zip(seqs, wants):
            full = by_prompt[tuple(seq.prompt_token_ids)]
            chain, prefix_right = [], True
            for i in range(want):
                n = seq.num_tokens + i
                calls["n"] += 1
                right = n < len(full) and calls["n"] % 4 != 0
                truth = full[n] if n < len(full) else 0
                prefix_right = prefix_right and right
                calls["right"] += prefix_right and n < len(full) - 1  # verifiable and acceptable
                chain.append((truth if right else (truth + 1) % 128, 1.0))
            drafts.append(chain)
        return drafts

    monkeypatch.setattr(engine.speculative, "propose", oracle)
    steps = {"n": 0}
    real_step = engine.step

    def counting_step():  # type: ignore[no-untyped-def]
        steps["n"] += 1
        return real_step()

    monkeypatch.setattr(engine, "step", counting_step)
    assert run(spec, GREEDY) == expected
    # every right draft after right ones is accepted, except when max_tokens ends the request
    # first; a wrong draft and all after it are rejected
    assert 0 < engine.num_accepted_tokens <= calls["right"]
    assert engine.num_accepted_tokens >= calls["right"] - k * len(PROMPTS)
    assert engine.num_draft_tokens > engine.num_accepted_tokens
    # plain decoding takes 24 steps for 24 tokens (the prefill step samples the first)
    assert 24 // (k + 1) <= steps["n"] < 24


def fresh_drafts(model: Any, tokens: list[int], k: int) -> list[int]:
    """k drafts after `tokens`, with the MTP head run from scratch (fresh caches): over every
    position, then chained on its own output and its previous draft."""
    backend = model.backend
    main = PagedRunner(model, backend, num_blocks=64, block_size=8)
    main.step([(0, tokens)], all_logits=True)
    assert main.last_hidden is not None
    mtp = PagedRunner(model, backend, num_blocks=64, block_size=8, seed=1)
    batch = build_batch(mtp.alloc, [(0, tokens[1:])], mtp.device, all_logits=True)
    h = model.forward_mtp(batch, main.last_hidden[:-1], mtp.kv_caches[:1])[-1:]
    drafts = [int(model.compute_logits(h).argmax())]
    for _ in range(k - 1):
        batch = build_batch(mtp.alloc, [(0, drafts[-1:])], mtp.device, all_logits=True)
        h = model.forward_mtp(batch, h, mtp.kv_caches[:1])
        drafts.append(int(model.compute_logits(h).argmax()))
    return drafts


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_drafts_equal_a_fresh_computation(ckpt: Path, monkeypatch: pytest.MonkeyPatch, k: int) -> None:
    """The head's drafts after incremental steps (chunked prefill, then decode, its own paged
    cache, chained drafts whose cache rows are rewritten later) equal the head run once over the
    whole sequence with fresh caches."""
    spec = make(ckpt, speculative_config={**SPEC, "num_speculative_tokens": k}, max_num_batched_tokens=24)
    runner = spec.llm_engine.speculative
    seen: list[tuple[list[int], list[int]]] = []
    real = runner.propose

    def record(seqs, spans, rows, wants):  # type: ignore[no-untyped-def]
        drafts = real(seqs, spans, rows, wants)
        for s, (_, e), chain, want in zip(seqs, spans, drafts, wants):
            if e == s.num_tokens - 1:
                assert len(chain) == want
                seen.append((list(s.token_ids), [d for d, _ in chain]))
        return drafts

    monkeypatch.setattr(runner, "propose", record)
    run(spec, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(seen) >= len(PROMPTS) * 5

    model = load_model(str(ckpt), create_reference_backend(), torch.float32)
    for tokens, drafts in seen[:: max(1, len(seen) // 12)]:
        assert fresh_drafts(model, tokens, len(drafts)) == drafts


def test_confidence_threshold_schedules_only_likely_drafts(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drafts the head is less sure of than min_draft_confidence are not verified; outputs stay."""
    expected = run(make(ckpt), GREEDY)
    spec = make(ckpt, speculative_config={**SPEC, "min_draft_confidence": 0.5})
    runner = spec.llm_engine.speculative
    real = runner.propose
    confident = {"n": 0, "all": 0}

    def sure_every_other(seqs, spans, rows, wants):  # type: ignore[no-untyped-def]
        out = []
        for i, chain in enumerate(real(seqs, spans, rows, wants)):
            confident["all"] += 1
            confident["n"] += i % 2 == 0
            out.append([(d, 0.9 if i % 2 == 0 else 0.1) for d, _ in chain])
        return out

    monkeypatch.setattr(runner, "propose", sure_every_other)
    assert run(spec, GREEDY) == expected
    assert 0 < spec.llm_engine.num_draft_tokens <= confident["n"] < confident["all"]


def test_bad_speculative_configs(ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="min_draft_confidence must be in"):
        make(ckpt, speculative_config={**SPEC, "min_draft_confidence": 1.5})
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be an integer in \[1, 8\], got 9"):
        make(ckpt, speculative_config={"method": "mtp", "num_speculative_tokens": 9})
    with pytest.raises(ValueError, match="method 'eagle' is not supported"):
        make(ckpt, speculative_config={"method": "eagle"})
    with pytest.raises(ValueError, match="unknown keys"):
        make(ckpt, speculative_config={"method": "mtp", "model": "x"})
    no_mtp = write_random_checkpoint(tmp_path / "plain", tiny_config(num_nextn_predict_layers=0))
    with pytest.raises(ValueError, match="has no MTP layer"):
        make(no_mtp, speculative_config=SPEC)


def test_max_model_len_stop_tokens_and_grammars_with_drafts(tmp_path: Path) -> None:
    """Drafts near the end of the context, stop tokens and a grammar: same outputs as plain."""
    from tiny_model import TINY as tiny  # the random tiny model's tokenizer (978 tokens)

    ckpt = write_random_checkpoint(tmp_path / "c", tiny_config(vocab_size=978), seed=4)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, ckpt / name)
    plain = make(ckpt, max_model_len=48)
    spec = make(ckpt, max_model_len=48, speculative_config=SPEC)

    def both(prompts: list[Any], params: SamplingParams) -> list[list[int]]:
        outs = []
        for llm in (plain, spec):
            outs.append([r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)])
        assert outs[0] == outs[1]
        return outs[0]

    # prompts ending 1, 2 and 10 tokens before max_model_len: generation runs into the limit
    long = [{"prompt_token_ids": [3 + i % 900 for i in range(n)]} for n in (47, 46, 38)]
    out = both(long, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert [len(t) for t in out] == [1, 2, 10]
    first = both(["Hello"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    stop = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[first[5]])
    assert both(["Hello"], stop)[0][-1] == first[5]

    pytest.importorskip("xgrammar")
    so = StructuredOutputsParams(regex="[a-z]{2,6}-[0-9]{1,3}")
    both(["Hello", "The weather"], SamplingParams(temperature=0, max_tokens=16, structured_outputs=so))
    assert spec.llm_engine.num_draft_tokens > 0


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="the cuda backend's kernels in the Triton interpreter: tests/test_cuda_interpret.py runs it",
)
def test_cuda_backend_outputs_equal_plain_decoding(ckpt: Path) -> None:
    """Verification rows (1 + k query tokens next to decode rows) through the cuda kernels."""
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [{"prompt_token_ids": t} for t in PROMPTS[:3]]
    outs = []
    for spec in (None, {**SPEC, "num_speculative_tokens": 3}):
        llm = make(ckpt, backend="cuda", max_model_len=128, speculative_config=spec)
        assert llm.llm_engine.backend.name == "cuda"
        outs.append([r.outputs[0].token_ids for r in llm.generate(prompts, p, use_tqdm=False)])
    assert outs[0] == outs[1]


@pytest.mark.skipif(
    "torch_npu" not in sys.modules,
    reason="the ascend backend on the torch_npu simulation: tests/test_ascend_conformance.py runs it",
)
def test_ascend_backend_outputs_equal_plain_decoding(tmp_path: Path) -> None:
    """Verification rows through the ascend backend's fused ops (simulated), bfloat16."""
    ckpt = write_random_checkpoint(tmp_path / "c", tiny_config(torch_dtype="bfloat16"), seed=3)
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [{"prompt_token_ids": t} for t in PROMPTS[:3]]
    outs = []
    for spec in (None, {**SPEC, "num_speculative_tokens": 3}):
        llm = make(ckpt, backend="ascend", dtype="bfloat16", block_size=16, speculative_config=spec)
        assert llm.llm_engine.backend.name == "ascend"
        outs.append([r.outputs[0].token_ids for r in llm.generate(prompts, p, use_tqdm=False)])
    assert outs[0] == outs[1]
