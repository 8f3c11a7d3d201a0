"""Confidence scheduling from step times (deepinfer.engine.step_times): the chooser against a
brute-force search over every allocation of drafts, on synthetic curves (graph buckets and eager
steps past them); it falls back to plain steps where drafting does not pay and drafts where it
does; the engine on injected curves: plain steps only, or drafts verified, outputs equal plain
decoding either way; the worker's measured curve covers every graph; the option's policies."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.config import EngineConfig
from deepinfer.engine.step_times import StepTimes, choose_drafts, step_value

ROOT = Path(__file__).resolve().parents[1]


def synthetic(buckets: list[int], k: int, knee: float, per_token: float, base: float = 1.0) -> StepTimes:
    """A roofline-like curve: flat (weight reads) up to `knee` tokens, then per_token ms each;
    the sampler a small cost per row."""
    forward, sampler = {}, {}
    for b in buckets:
        for w in range(k + 1):
            tokens = b * (1 + w)
            forward[(b, w)] = base + max(0.0, tokens - knee) * per_token + 0.01 * w
            sampler[(b, w)] = 0.002 * tokens
    return StepTimes(forward, sampler)


def brute_force(times: StepTimes, conf: list[list[float]], requests: int) -> float:
    return max(
        step_value(times, conf, list(counts), requests)
        for counts in itertools.product(*(range(len(c) + 1) for c in conf))
    )


def random_confidences(rng: random.Random, n: int, k: int) -> list[list[float]]:
    out = []
    for _ in range(n):
        c, run = [], 1.0
        for _ in range(rng.randint(0, k)):
            run *= rng.choice([rng.random(), 0.95, 0.5])  # ties and repeats included
            c.append(round(run, 2))
        out.append(c)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_chooser_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    k = rng.randint(1, 3)
    times = synthetic([1, 2, 4], k, knee=rng.choice([2, 6, 12]), per_token=rng.choice([0.05, 0.3, 1.0]))
    conf = random_confidences(rng, rng.randint(1, 6), k)  # 5 and 6 requests: eager steps
    requests = len(conf) + rng.randint(0, 2)  # requests without drafts too
    counts = choose_drafts(times, conf, requests)
    assert all(0 <= n <= len(c) for n, c in zip(counts, conf))
    best = brute_force(times, conf, requests)
    got = step_value(times, conf, counts, requests)
    assert got == pytest.approx(best, rel=1e-9)
    assert got >= step_value(times, conf, [0] * len(conf), requests)  # never below a plain step


def test_plain_steps_where_drafting_does_not_pay() -> None:
    # compute-bound at once: every verified token costs a plain token's time; acceptance < 1
    times = synthetic([1, 8, 32], 4, knee=0, per_token=1.0)
    conf = [[0.9, 0.8, 0.7, 0.6]] * 32
    assert choose_drafts(times, conf) == [0] * 32
    # a batch past the knee with weak drafts: plain
    times = synthetic([1, 8, 32], 4, knee=40, per_token=0.2)
    assert choose_drafts(times, [[0.3, 0.1, 0.05, 0.01]] * 32) == [0] * 32


def test_drafts_where_they_pay_by_rank() -> None:
    times = synthetic([1, 8, 32], 4, knee=64, per_token=0.2)
    # batch 1, flat curve: every draft pays
    assert choose_drafts(times, [[0.9, 0.8, 0.7, 0.6]]) == [4]
    # batch 8 at a knee of 64 tokens: width 4 costs 40 tokens (flat), all drafts
    assert choose_drafts(times, [[0.9, 0.8, 0.7, 0.6]] * 8) == [4] * 8
    # batch 32: width 1 (64 tokens) is flat, width 2 (96) is not and buys too little
    conf = [[0.9, 0.3, 0.2, 0.1]] * 32
    assert choose_drafts(times, conf) == [1] * 32
    # a knee between widths: width 2 only where its drafts are confident enough
    times = synthetic([1, 8], 2, knee=16, per_token=0.02)
    assert choose_drafts(times, [[0.9, 0.85]] * 8) == [2] * 8
    assert choose_drafts(times, [[0.9, 0.05]] * 8) == [1] * 8
    # past the largest graph (40 requests): eager, never drafting
    assert choose_drafts(synthetic([1, 8, 32], 2, knee=1e9, per_token=0.0), [[0.99, 0.98]] * 40) == [0] * 40


def test_step_times_refuses_bad_curves() -> None:
    with pytest.raises(ValueError, match="at least one"):
        StepTimes({}, {})
    with pytest.raises(ValueError, match="positive"):
        StepTimes({(1, 0): -1.0}, {})
    with pytest.raises(ValueError, match="width 3"):
        synthetic([1], 2, 4, 0.1).step_ms(1, 3, 4)


def test_schedule_option() -> None:
    def policy(spec: dict[str, object]) -> str | None:
        return EngineConfig(model=str(ROOT / "model/tiny"), speculative_config=spec).schedule_policy

    assert policy({"method": "dspark"}) is None
    assert policy({"method": "dspark", "confidence_scheduling": True}) == "measured"
    assert policy({"method": "dspark", "confidence_scheduling": True, "step_token_budget": 9}) == "budget"
    assert policy({"method": "dspark", "confidence_scheduling": True, "schedule": "budget"}) == "budget"
    with pytest.raises(ValueError, match="schedule must be one of"):
        policy({"method": "dspark", "confidence_scheduling": True, "schedule": "fastest"})


PROMPTS = [
    {"prompt_token_ids": [5 + (7 * i + 3 * j) % 120 for j in range(n)]} for i, n in enumerate([3, 17, 9])
]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ARGS = {"backend": "reference", "dtype": "float32", "max_model_len": 128, "max_num_seqs": 8}


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    llm = LLM(str(ROOT / "model/tiny"), **ARGS)
    return [r.outputs[0].token_ids for r in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("pays", [False, True], ids=["compute-bound", "flat"])
def test_engine_on_injected_curves(plain: list[list[int]], pays: bool) -> None:
    spec = {"method": "dspark", "num_speculative_tokens": 3, "confidence_scheduling": True}
    llm = LLM(str(ROOT / "model/tiny"), speculative_config=spec, **ARGS)
    decoder = llm.llm_engine.speculative
    assert decoder is not None and decoder.policy == "measured"
    buckets = sorted({b for b, _ in llm.llm_engine.worker.verify_graphs.forwards})
    # compute-bound: every row costs a plain token's time, no fixed part (no draft can pay)
    decoder.step_times = synthetic(buckets, 3, knee=0 if not pays else 1e9, per_token=1.0, base=float(pays))
    got = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == plain
    if pays:
        assert llm.llm_engine.num_draft_tokens > 0 and decoder.num_graph_steps > 0
    else:
        assert decoder.num_steps == 0 and llm.llm_engine.num_draft_tokens == 0


def test_worker_measures_every_graph(plain: list[list[int]]) -> None:
    """The curve covers every graph; measuring (replays over padding) leaves the engine's outputs
    those of plain decoding, with the curve the engine measures itself too."""
    spec = {"method": "dspark", "num_speculative_tokens": 2, "confidence_scheduling": True}
    llm = LLM(str(ROOT / "model/tiny"), speculative_config=spec, **{**ARGS, "max_num_seqs": 4})
    worker = llm.llm_engine.worker
    times = worker.measure_step_times(repeats=1)
    assert times is not None
    verify = {(b, w) for b, w in worker.verify_graphs.forwards if w > 0}
    decode = {(b, 0) for b in worker.decode_graphs.forwards}
    assert set(times.forward) == verify | decode == set(times.sampler)
    assert times.max_width == 2
    got = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == plain
    assert llm.llm_engine.speculative is not None and llm.llm_engine.speculative.step_times is not None


def test_engine_drafts_only_where_the_curve_pays(
    plain: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A curve flat at batch 1 and compute-bound above: while several requests run every step is
    plain; the last one left alone verifies drafts. Outputs equal plain decoding."""
    spec = {"method": "dspark", "num_speculative_tokens": 3, "confidence_scheduling": True}
    llm = LLM(str(ROOT / "model/tiny"), speculative_config=spec, **ARGS)
    engine = llm.llm_engine
    decoder = engine.speculative
    assert decoder is not None
    buckets = sorted({b for b, _ in engine.worker.verify_graphs.forwards})
    forward = {(b, w): (1.0 + 0.01 * w if b == 1 else float(b * (1 + w))) for b in buckets for w in range(4)}
    decoder.step_times = StepTimes(forward, {})
    seen: list[tuple[int, int]] = []  # (requests running, drafts verified) per scheduled step
    real = engine.scheduler.schedule

    def record():  # type: ignore[no-untyped-def]
        batch = real()
        seen.append((len(batch), sum(batch.num_draft_tokens)))
        return batch

    monkeypatch.setattr(engine.scheduler, "schedule", record)
    lengths = [4, 6, 12]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    got = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == [p[:n] for p, n in zip(plain, lengths)]
    assert all(drafts == 0 for n, drafts in seen if n > 1), seen
    assert engine.num_draft_tokens > 0  # the last request alone
