"""The block drafter and confidence-scheduled verification: outputs equal plain decoding token for
token (block drafter and MTP, greedy and seeded, with and without scheduling, verification graph
steps chained and not, with async scheduling and graphs between drafting steps); the scheduling
rule against a brute-force optimum; the engine never verifies more drafts than the step's budget
and drafts nothing at a batch that leaves none; drafter files round-trip and mismatches are
refused; training lowers the loss at toy size."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.speculative import draft_budget, schedule_drafts
from deepinfer.models.drafter import BlockDrafter, DrafterConfig, load_drafter
from deepinfer.reference.backend import create_reference_backend
from deepinfer.testing.checkpoints import (
    tiny_config,
    write_mirrored_mtp_checkpoint,
    write_random_checkpoint,
)

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5 + (7 * i + 3 * j) % 120 for j in range(n)] for i, n in enumerate([3, 17, 40, 9])]
GREEDY = [SamplingParams(temperature=0, max_tokens=8 + 3 * i, ignore_eos=True) for i in range(4)]
SEEDED = [
    SamplingParams(temperature=0.8, top_k=40, seed=i, max_tokens=8 + 3 * i, ignore_eos=True) for i in range(4)
]


def random_drafter(hidden_size: int, vocab_size: int, seed: int = 1) -> BlockDrafter:
    """A drafter with every weight random (none left at its zero initialisation)."""
    config = DrafterConfig(
        hidden_size=hidden_size, vocab_size=vocab_size, draft_hidden_size=32, intermediate_size=48,
        block_size=5, markov_rank=8,
    )  # fmt: skip
    drafter = BlockDrafter(config, create_reference_backend(), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return drafter


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_random_checkpoint(tmp_path_factory.mktemp("dspark") / "ckpt", tiny_config(), seed=3)
    random_drafter(64, 128).save(path)
    return path


@pytest.fixture(scope="module")
def mirrored(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint whose MTP head mostly drafts what the model samples (accepted drafts)."""
    return write_mirrored_mtp_checkpoint(tmp_path_factory.mktemp("mirrored") / "ckpt", seed=3)


def make(ckpt: Path, **kw: Any) -> LLM:
    args: dict[str, Any] = {"backend": "reference", "dtype": "float32", "block_size": 8, "max_model_len": 128}
    return LLM(str(ckpt), **{**args, **kw})


def run(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def expected(ckpt: Path) -> tuple[list[list[int]], list[list[int]]]:
    plain = make(ckpt, async_scheduling=False, enforce_eager=True)
    return run(plain, GREEDY), run(plain, SEEDED)


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "dspark", "num_speculative_tokens": 5},
        {"method": "dspark", "num_speculative_tokens": 3, "min_draft_confidence": 0.2},
        {
            "method": "dspark",
            "num_speculative_tokens": 5,
            "confidence_scheduling": True,
            "step_token_budget": 7,
        },
        {"method": "mtp", "num_speculative_tokens": 3},
        {"method": "mtp", "num_speculative_tokens": 2, "confidence_scheduling": True, "step_token_budget": 9},
    ],
    ids=["block-k5", "block-k3-threshold", "block-k5-scheduled", "mtp-k3", "mtp-k2-scheduled"],
)
def test_outputs_equal_plain_decoding(ckpt: Path, expected: Any, spec: dict[str, Any]) -> None:
    llm = make(ckpt, speculative_config=spec)  # async scheduling and (emulated) graphs on
    assert (run(llm, GREEDY), run(llm, SEEDED)) == expected
    assert llm.llm_engine.num_draft_tokens > 0
    decoder = llm.llm_engine.speculative
    assert decoder is not None
    assert decoder.num_graph_steps > 0  # both drafters' steps verify as graph replays
    # the prompts' prefill steps replayed prefill graphs that keep the hidden states the drafters
    # (and the MTP head's cache) start from
    assert llm.llm_engine.worker.num_prefill_graph_steps > 0


def test_scheduled_mixes_plain_graph_steps_and_drafting_steps(
    ckpt: Path, expected: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """step_token_budget 4: while 4 requests run, no draft fits (plain steps, graph replays, async);
    once one finishes, the others draft. Outputs stay those of plain decoding."""
    spec = {
        "method": "dspark",
        "num_speculative_tokens": 4,
        "confidence_scheduling": True,
        "step_token_budget": 4,
    }
    llm = make(ckpt, speculative_config=spec)
    engine = llm.llm_engine
    replays = {"n": 0}
    real = engine.worker.decode_graphs.bucket_for

    def spy(batch: Any) -> int | None:
        bucket = real(batch)
        replays["n"] += bucket is not None
        return bucket

    monkeypatch.setattr(engine.worker.decode_graphs, "bucket_for", spy)
    assert engine.async_scheduling and engine.worker.decode_graphs
    assert run(llm, GREEDY) == expected[0]
    assert replays["n"] > 0 and engine.speculative is not None and engine.speculative.num_steps > 0
    assert engine.num_draft_tokens > 0


@pytest.mark.parametrize("method", ["dspark", "mtp"])
@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"max_model_len": 40},
        {"num_gpu_blocks_override": 40},
        {"num_gpu_blocks_override": 10, "max_model_len": 64},
    ],
    ids=["default", "max-model-len-40", "small-kv-pool", "preempting"],
)
def test_chained_verification_steps_equal_plain_decoding(
    ckpt: Path, mirrored: Path, engine_args: dict[str, Any], method: str
) -> None:
    """Chained steps (the host reads step N while step N + 1, prepared on the device, runs)
    against plain decoding and against the same engine unchained, for the block drafter and the
    MTP head (one whose drafts are mostly accepted): greedy and seeded, stop tokens,
    min_tokens-free stops at different steps, requests reaching max_model_len, a KV pool too
    small to cover every request's chain (shorter chains, the MTP head's rows past the blocks
    left unwritten) and one that preempts."""
    ckpt = mirrored if method == "mtp" else ckpt
    params = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=40, seed=3, max_tokens=23, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[PROMPTS[0][0] + 1, 7, 9, 11]),
        SamplingParams(temperature=0.9, seed=5, max_tokens=17, ignore_eos=True),
    ]
    plain = make(ckpt, async_scheduling=False, enforce_eager=True, **engine_args)
    want = run(plain, params)
    spec = {"method": method, "num_speculative_tokens": 3, "min_draft_confidence": 0.05}
    outs, chained = [], []
    for overlap in (True, False):
        llm = make(ckpt, speculative_config=spec, **engine_args)
        engine = llm.llm_engine
        assert engine.speculative is not None
        engine.speculative.overlap = overlap
        launches = {"chained": 0}
        real = engine.worker.verify_launch

        def count(batch, *args, real=real, launches=launches):  # type: ignore[no-untyped-def]
            launches["chained"] += batch is None
            return real(batch, *args)

        engine.worker.verify_launch = count  # type: ignore[method-assign]
        outs.append(run(llm, params))
        chained.append(launches["chained"])
        assert engine.speculative.chain is None and not engine.has_unfinished()
        if engine_args.get("num_gpu_blocks_override") == 10:
            assert engine.scheduler.num_preemptions > 0
        assert method == "dspark" or engine.num_accepted_tokens > 0
    assert outs[0] == want and outs[1] == want
    assert chained[0] > 0 and chained[1] == 0


def test_verification_graphs_at_the_rope_tables_end(
    ckpt: Path, expected: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """max_model_len at max_position_embeddings (512): a verification graph's padding drafts sit
    past it, in the rope table's padding rows, so steps replay graphs. Without those rows they
    would leave the table: speculative steps then run eagerly (decode graphs stay)."""
    import deepinfer.models.deepseek as deepseek_model

    spec = {"method": "dspark", "num_speculative_tokens": 3}
    for padding in (deepseek_model.SPECULATIVE_PADDING_POSITIONS, 0):
        monkeypatch.setattr(deepseek_model, "SPECULATIVE_PADDING_POSITIONS", padding)
        llm = make(ckpt, max_model_len=512, speculative_config=spec)
        engine = llm.llm_engine
        assert engine.worker.decode_graphs and bool(engine.worker.verify_graphs) == (padding > 0)
        assert run(llm, GREEDY) == expected[0]
        assert engine.speculative is not None and (engine.speculative.num_graph_steps > 0) == (padding > 0)
        assert engine.num_draft_tokens > 0


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="the cuda backend's kernels in the Triton interpreter: tests/test_cuda_interpret.py runs it",
)
def test_cuda_backend_verification_graphs_equal_plain_decoding(ckpt: Path) -> None:
    """Verification graph steps (every request padded to 1 + width rows, acceptance and the next
    block on the device) through the cuda kernels, against the cuda backend's plain decoding."""
    outs, graph_steps = [], 0
    for spec in (None, {"method": "dspark", "num_speculative_tokens": 3}):
        llm = make(ckpt, backend="cuda", speculative_config=spec)
        assert llm.llm_engine.backend.name == "cuda"
        short = [dataclasses.replace(p, max_tokens=6) for p in (GREEDY[:2] + SEEDED[:2])]
        outs.append(run(llm, short))
        decoder = llm.llm_engine.speculative
        graph_steps = decoder.num_graph_steps if decoder is not None else 0
    assert outs[0] == outs[1]
    assert graph_steps > 0


def test_schedule_drafts_takes_the_most_confident_prefixes() -> None:
    """Against brute force: the counts are prefixes, within the budget, and no other choice of
    prefixes within the budget has a larger total confidence (expected accepted drafts)."""
    rng = random.Random(0)
    for _ in range(200):
        conf = []
        for _ in range(rng.randint(1, 4)):
            c = sorted((round(rng.random(), 2) for _ in range(rng.randint(0, 4))), reverse=True)
            conf.append(c)
        budget = rng.randint(0, 10)
        counts = schedule_drafts(conf, budget)
        assert all(0 <= n <= len(c) for n, c in zip(counts, conf))
        assert sum(counts) <= budget
        best = max(
            sum(sum(c[:n]) for c, n in zip(conf, choice))
            for choice in itertools.product(*(range(len(c) + 1) for c in conf))
            if sum(choice) <= budget
        )
        got = sum(sum(c[:n]) for c, n in zip(conf, counts))
        assert got == pytest.approx(best)
        assert sum(counts) == min(budget, sum(len(c) for c in conf))
    assert schedule_drafts([[0.9, 0.5], [0.7]], None) == [2, 1]
    assert schedule_drafts([[0.9, 0.5], [0.7]], 2) == [1, 1]
    assert draft_budget(64, 1) == 63 and draft_budget(64, 64) == 0 and draft_budget(64, 128) == 0
    assert draft_budget(None, 128) is None


@pytest.mark.parametrize("method", ["dspark", "mtp"])
def test_engine_never_verifies_more_than_the_budget(
    ckpt: Path, mirrored: Path, expected: Any, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """No step verifies more drafts than its budget, scheduled or chained (ranked on the device),
    for the block drafter and the MTP head (one whose drafts are mostly accepted)."""
    if method == "mtp":
        ckpt = mirrored
        expected = [run(make(ckpt, async_scheduling=False, enforce_eager=True), GREEDY)]
    spec = {
        "method": method,
        "num_speculative_tokens": 3,
        "confidence_scheduling": True,
        "step_token_budget": 6,
    }
    llm = make(ckpt, speculative_config=spec)
    engine = llm.llm_engine
    decoder = engine.speculative
    assert decoder is not None
    seen: list[tuple[int, int | None, int]] = []
    real = engine.scheduler.schedule

    def record() -> Any:
        batch = real()
        running = len(engine.scheduler.running) + len(engine.scheduler.waiting)
        seen.append((sum(batch.num_draft_tokens), decoder.last_budget, running))
        return batch

    monkeypatch.setattr(engine.scheduler, "schedule", record)
    chained: list[tuple[int, int | None]] = []  # chained steps bypass the scheduler
    real_append = decoder._append_verified

    def record_chained(seqs, num_drafts, *rest):  # type: ignore[no-untyped-def]
        if decoder.chain is not None:
            chained.append((sum(num_drafts), decoder.budget()))
        return real_append(seqs, num_drafts, *rest)

    monkeypatch.setattr(decoder, "_append_verified", record_chained)
    assert run(llm, GREEDY) == expected[0]
    drafted = [(n, b) for n, b, _ in seen if n] + [(n, b) for n, b in chained if n]
    assert drafted, "no step verified drafts"
    assert all(b is not None and n <= b for n, b in drafted)
    assert max(n for n, _ in drafted) > 1
    assert any(n for n, _ in chained), "no chained step verified drafts"


def test_no_budget_no_drafts(ckpt: Path, expected: Any) -> None:
    """A budget no larger than the batch: every step is a plain step."""
    spec = {
        "method": "dspark",
        "num_speculative_tokens": 5,
        "confidence_scheduling": True,
        "step_token_budget": 4,
    }
    llm = make(ckpt, speculative_config=spec, max_num_seqs=4)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    same_length = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = make(ckpt, async_scheduling=False, enforce_eager=True)
    want = [r.outputs[0].token_ids for r in plain.generate(prompts, same_length, use_tqdm=False)]
    got = [r.outputs[0].token_ids for r in llm.generate(prompts, same_length, use_tqdm=False)]
    assert got == want
    assert llm.llm_engine.speculative is not None and llm.llm_engine.speculative.num_steps == 0
    assert llm.llm_engine.num_draft_tokens == 0


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_block_drafts_are_the_drafters_greedy_block(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, eager: bool
) -> None:
    """The engine's block drafts equal the drafter run by hand on the model's hidden state of the
    token before the last and the last token, over a fresh computation of the whole sequence:
    from eager steps (propose), and from verification graph replays (acceptance and drafting
    on the device)."""
    from deepinfer.models.loader import load_model
    from deepinfer.testing.paged_runner import PagedRunner

    spec = {"method": "dspark", "num_speculative_tokens": 4}
    llm = make(ckpt, speculative_config=spec, enforce_eager=eager)
    engine = llm.llm_engine
    decoder = engine.speculative
    assert decoder is not None
    seen: list[tuple[list[int], list[int], list[float]]] = []
    real, real_verify = decoder._keep_confident, engine.worker.verify_launch
    replays = {"n": 0}

    def record(seq, chain):  # type: ignore[no-untyped-def]
        chain = list(chain)
        seen.append((list(seq.token_ids), [d for d, _ in chain], [c for _, c in chain]))
        real(seq, chain)

    def count(*args, **kw):  # type: ignore[no-untyped-def]
        replays["n"] += 1
        return real_verify(*args, **kw)

    monkeypatch.setattr(decoder, "_keep_confident", record)
    monkeypatch.setattr(engine.worker, "verify_launch", count)
    run(llm, GREEDY[:1] * 4)
    assert len(seen) > 8
    assert (replays["n"] > 0) == (not eager)
    model: Any = load_model(str(ckpt), create_reference_backend(), torch.float32)
    for tokens, drafts, conf in seen[:: max(1, len(seen) // 6)]:
        main = PagedRunner(model, model.backend, num_blocks=32, block_size=8)
        main.step([(0, tokens[:-1])], all_logits=True)
        assert main.last_hidden is not None
        want, want_conf = model.drafter.draft(
            main.last_hidden[-1:], torch.tensor(tokens[-1:]), model.embed_tokens, model.lm_head, len(drafts)
        )
        assert want[0].tolist() == drafts
        assert want_conf[0].tolist() == pytest.approx(conf, abs=1e-5)
        assert all(a >= b for a, b in itertools.pairwise(conf))


def test_drafter_files_round_trip_and_mismatches_are_refused(ckpt: Path, tmp_path: Path) -> None:
    backend = create_reference_backend()
    d = random_drafter(64, 128, seed=5)
    d.save(tmp_path)
    back = load_drafter(tmp_path, backend, tiny_config_obj(), torch.float32)
    for (name, a), (_, b) in zip(d.named_parameters(), back.named_parameters()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="hidden_size=64 does not match the model's 48"):
        load_drafter(tmp_path, backend, tiny_config_obj(hidden_size=48), torch.float32)
    with pytest.raises(ValueError, match="block drafter's block_size 5"):
        make(ckpt, speculative_config={"method": "dspark", "num_speculative_tokens": 6})
    no_drafter = write_random_checkpoint(tmp_path / "plain", tiny_config())
    with pytest.raises(ValueError, match="has none"):
        make(no_drafter, speculative_config={"method": "dspark", "num_speculative_tokens": 2})


def tiny_config_obj(**overrides: Any) -> Any:
    from deepinfer.models.config import ModelConfig

    return ModelConfig.from_dict(tiny_config(**overrides))


def test_training_lowers_the_loss_at_toy_size(tmp_path: Path) -> None:
    """train/train_drafter.py --toy on a random model with a tokenizer trained on the same
    corpus: the loss falls, and the drafter it writes is attached by the loader."""
    sys.path.insert(0, str(ROOT / "train"))
    import train_drafter
    from train_tiny import stdlib_files, train_tokenizer

    model_dir = write_random_checkpoint(tmp_path / "m", tiny_config(vocab_size=384), seed=3)
    train, _, _ = stdlib_files(6)
    train_tokenizer([t for _, t in train], 384).save(str(model_dir / "tokenizer.json"))
    log = train_drafter.main(["--model", str(model_dir), "--out", str(model_dir), "--toy", "--device", "cpu",
                              "--steps", "20"])  # fmt: skip
    held = log["held_out"]  # the same held-out anchors before and after training
    assert held["loss_after"] < held["loss_before"] - 0.3
    assert 1.0 <= log["held_out"]["mean_accepted_length"] <= 6.0
    llm = LLM(str(model_dir), backend="reference", dtype="float32", max_model_len=64,
              speculative_config={"method": "dspark", "num_speculative_tokens": 5})  # fmt: skip
    out = llm.generate(
        [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 6


def test_bench_spec_small_run(ckpt: Path, tmp_path: Path) -> None:
    """bench/bench_spec.py at a CPU size: a row per configuration and batch, table and plot."""
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_spec

    args = "--small --backend reference --dtype float32 --batches 1 3 --new-tokens 5 --prompt-len 6"
    args += " --mtp-k 1 --block-k 2 6 --repeats 1 --min-seconds 0 --schedule budget"  # no timing decides
    rows = bench_spec.main(["--model", str(ckpt), "--out", str(tmp_path), *args.split()])
    assert [(r["drafter"], r["k"], r["scheduled"], r["batch"]) for r in rows] == [
        (d, k, s, b) for d, k in (("dspark", 2), ("mtp", 1)) for s in (False, True) for b in (1, 3)
    ]
    for r in rows:
        assert r["device"] == "cpu" and r["plain_tok_s"] > 0 and r["spec_tok_s"] > 0
        assert 1.0 <= r["mean_accepted"] <= 1 + r["k"]
        assert 0 < r["graph_steps"] <= 1  # both drafters' decode steps replay verification graphs
        assert r["plain_fastest_tok_s"] >= r["plain_tok_s"]  # the fastest plain call, the median's
    assert json.loads((tmp_path / "spec.json").read_text()) == rows
    table = (tmp_path / "spec.md").read_text()
    assert table.count("\n| mtp |") == 4 and "dspark k=6: the drafter's block size is 5" in table
    assert (tmp_path / "spec.svg").read_text().count("<polyline") == 4
