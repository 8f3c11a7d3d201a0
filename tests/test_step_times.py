"""Confidence scheduling from step times (deepinfer.engine.step_times): the chooser against a
brute-force search over every allocation of drafts, on synthetic curves (graph buckets and eager
steps past them, the drafter's cost in the verification steps); it falls back to plain steps
where drafting does not pay and drafts where it does; the observed acceptance, the back-off and
an episode's account against float math; the engine on injected curves: plain steps only, or
drafts verified, outputs equal plain decoding either way; drafters always wrong (eager, and in
chained verification graphs) back off to plain steps, one always right keeps drafting, one that
turns right is picked up again; the worker's measured curve covers every graph; the option's
policies."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import EngineConfig
from deepinfer.engine import drafters
from deepinfer.engine.step_times import (
    TIMED_STEPS,
    Acceptance,
    Backoff,
    Episode,
    StepTimes,
    choose_drafts,
    step_value,
)

ROOT = Path(__file__).resolve().parents[1]


def synthetic(
    buckets: list[int], k: int, knee: float, per_token: float, base: float = 1.0, drafter: float = 0.0
) -> StepTimes:
    """A roofline-like curve: flat (weight reads) up to `knee` tokens, then per_token ms each;
    the sampler a small cost per row, plus `drafter` ms (its next block) in verification steps."""
    forward, sampler = {}, {}
    for b in buckets:
        for w in range(k + 1):
            tokens = b * (1 + w)
            forward[(b, w)] = base + max(0.0, tokens - knee) * per_token + 0.01 * w
            sampler[(b, w)] = 0.002 * tokens + (drafter if w else 0.0)
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
    knee, per_token = rng.choice([2, 6, 12]), rng.choice([0.05, 0.3, 1.0])
    times = synthetic([1, 2, 4], k, knee, per_token, drafter=rng.choice([0.0, 0.2, 1.0]))
    conf = random_confidences(rng, rng.randint(1, 6), k)  # 5 and 6 requests: eager steps
    requests = len(conf) + rng.randint(0, 2)  # requests without drafts too
    counts = choose_drafts(times, conf, requests)
    assert all(0 <= n <= len(c) for n, c in zip(counts, conf))
    best = brute_force(times, conf, requests)
    got = step_value(times, conf, counts, requests)
    assert got == pytest.approx(best, rel=1e-9)
    assert got >= step_value(times, conf, [0] * len(conf), requests)  # never below a plain step
    # a probe only where drafts sure to be accepted could beat a plain step
    sure = [[1.0] * k] * min(requests, 4)
    plain = step_value(times, sure, [0] * len(sure), requests)
    can = brute_force(times, sure, requests) > plain * (1 + 1e-9) if requests <= 4 else False
    assert times.drafting_can_pay(requests, k) == can


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


def test_the_drafters_cost_decides() -> None:
    """Flat forwards (drafts cost nothing in the model's forward): sure-ish drafts pay while the
    drafter is cheap; a drafter that costs more than the tokens it is expected to add makes
    every step plain, and no probe is worth it where even sure drafts cannot pay."""
    conf = [[0.6, 0.3]] * 2  # 1.8 tokens expected per draft step and request, against 1
    cheap = synthetic([1, 2], 2, knee=1e9, per_token=0.0, drafter=0.5)
    assert choose_drafts(cheap, conf) == [2, 2] and cheap.drafting_can_pay(2, 2)
    dear = synthetic([1, 2], 2, knee=1e9, per_token=0.0, drafter=1.0)  # 1.8 / 2.03 < 1 / 1.004
    assert choose_drafts(dear, conf) == [0, 0] and dear.drafting_can_pay(2, 2)
    hopeless = synthetic([1, 2], 2, knee=1e9, per_token=0.0, drafter=3.0)  # 3 / 4 < 1
    assert not hopeless.drafting_can_pay(2, 2)
    # a probe step: its measured time, else a width-1 step's
    assert cheap.probe_ms(2) == pytest.approx(cheap.step_ms(2, 1, 4))
    assert StepTimes(cheap.forward, cheap.sampler, {2: 7.0}).probe_ms(1) == 7.0


def test_acceptance_scale_follows_the_observed_ratio() -> None:
    """The running sums against float math written out: decayed per verified draft, pulled to
    the prior by plain steps."""
    acc = Acceptance(window=4, prior=2.0, half_life=2.0)
    assert acc.scale == 1.0 and acc.calibrated([0.5, 0.25]) == [0.5, 0.25]
    obs, exp = 2.0, 2.0
    for drafts, expected, accepted in [(3, 2.4, 0), (2, 1.5, 1), (4, 3.0, 0)]:
        acc.verified(drafts, expected, accepted)
        d = 0.75**drafts
        obs, exp = d * obs + accepted, d * exp + expected
    assert acc.scale == pytest.approx(obs / exp)
    assert acc.calibrated([0.9, 0.1]) == pytest.approx([0.9 * obs / exp, 0.1 * obs / exp])
    assert Acceptance(prior=1.0).calibrated([0.9]) == [0.9]
    high = Acceptance(prior=1.0)
    high.verified(2, 0.5, 2)
    assert high.calibrated([0.9, 0.4]) == [1.0, pytest.approx(0.4 * high.scale)]  # capped at 1
    for _ in range(4):  # two half-lives: a quarter of the gap to the prior is left
        acc.plain_step()
    assert acc.observed == pytest.approx(2.0 + (obs - 2.0) / 4)
    assert acc.expected == pytest.approx(2.0 + (exp - 2.0) / 4)


def test_backoff_doubles_to_its_cap_and_resets() -> None:
    off = Backoff(cap=8)
    assert not off.waits()
    lengths = []
    for _ in range(5):
        off.failed()
        waited = 0
        while off.waits():
            waited += 1
        lengths.append(waited)
    assert lengths == [2, 4, 8, 8, 8]
    off.paid()
    assert not off.waits()
    off.failed()
    assert off.length == 2


def test_episode_pays_against_plain_steps_in_its_time() -> None:
    """A probe, then a step of width 2 that emits 10 tokens of 4 requests: plain steps would
    have emitted 4 x (probe ms + step ms) / plain ms tokens meanwhile."""
    for drafter in (0.0, 1.0):
        times = synthetic([1, 4], 2, knee=1e9, per_token=0.0, drafter=drafter)
        plain, probe, wide = times.plain_ms(4), times.probe_ms(4), times.step_ms(4, 2, 12)
        ep = Episode()
        ep.add(times, 4, 0, 4)
        ep.add(times, 4, 2, 10)
        assert ep.tokens == 14 and ep.plain_tokens == pytest.approx(4 * (probe + wide) / plain)
        # about 8.2 plain tokens with a free drafter, 16.2 with one as dear as a plain step
        assert ep.paid == (drafter == 0.0)
    # by the wall clock: 14 tokens against 4 requests x 5 ms / 1 ms per plain step, once timed
    ep = Episode(tokens=14.0)
    for n in range(1, TIMED_STEPS + 1):
        ep.timed(4, 5.0 / TIMED_STEPS, 1.0)
        assert ep.losing == (n == TIMED_STEPS) and ep.wall_plain_tokens == pytest.approx(
            20.0 * n / TIMED_STEPS
        )
    assert not ep.paid and not Episode(tokens=21.0, timed_steps=TIMED_STEPS, wall_plain_tokens=20.0).losing


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
    # the width-0 verification graphs (drafting, no draft verified) are the probes
    assert (
        set(times.probe) == {b for b, w in worker.verify_graphs.forwards if w == 0} == {b for b, _ in decode}
    )
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


LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_long() -> list[list[int]]:
    llm = LLM(str(ROOT / "model/tiny"), **ARGS)
    return [r.outputs[0].token_ids for r in llm.generate(PROMPTS, LONG, use_tqdm=False)]


def eager_with_oracle(
    plain_long: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
    right: list[bool],
    calls: list[int] | None = None,
) -> LLM:
    """An eager engine, scheduled on a flat curve whose drafter costs half a plain step, whose
    drafter is an oracle that knows plain decoding's output: its
    drafts are right while right[0] is True (a list, so a test may flip it), else one off;
    always confidence 0.9 per draft. calls[0] counts the drafter's calls."""
    spec = {"method": "dspark", "num_speculative_tokens": 3, "confidence_scheduling": True}
    llm = LLM(str(ROOT / "model/tiny"), speculative_config=spec, enforce_eager=True, **ARGS)
    engine = llm.llm_engine
    assert engine.speculative is not None
    engine.speculative.step_times = synthetic([1, 2, 4, 8], 3, knee=1e9, per_token=0.0, drafter=0.5)
    full = {tuple(p["prompt_token_ids"]): p["prompt_token_ids"] + out for p, out in zip(PROMPTS, plain_long)}

    def oracle(seqs, spans, rows, wants, limits):  # type: ignore[no-untyped-def]
        if calls is not None:
            calls[0] += 1
        out = []
        for seq, want in zip(seqs, wants):
            truth = full[tuple(seq.prompt_token_ids)]
            chain = []
            for i in range(want):
                n = seq.num_tokens + i
                token = truth[n] if n < len(truth) else 0
                chain.append((token if right[0] else (token + 1) % 8192, 0.9 ** (i + 1)))
            out.append(chain)
        return out

    monkeypatch.setattr(engine.worker, "propose", oracle)
    return llm


def record_steps(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each launched step drafted (verified drafts or ran the drafter)."""
    engine, kinds = llm.llm_engine, []
    real = engine._launch

    def launch(plan):  # type: ignore[no-untyped-def]
        kinds.append(plan.drafts)
        return real(plan)

    monkeypatch.setattr(engine, "_launch", launch)
    return kinds


def plain_runs(kinds: list[bool]) -> list[int]:
    """The lengths of the runs of plain steps between drafting steps."""
    runs, n = [], 0
    for drafted in kinds:
        if drafted and n:
            runs.append(n)
        n = 0 if drafted else n + 1
    return runs


def test_wrong_drafter_backs_off_to_plain_steps(
    plain_long: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drafts always rejected though the head is sure of them: the observed acceptance ends the
    first episode, then the runs of plain steps between probes grow (the back-off); the
    drafter runs in few steps; outputs equal plain decoding."""
    calls = [0]
    llm = eager_with_oracle(plain_long, monkeypatch, [False], calls)
    kinds = record_steps(llm, monkeypatch)
    engine, decoder = llm.llm_engine, llm.llm_engine.speculative
    assert decoder is not None
    got = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, LONG, use_tqdm=False)]
    assert got == plain_long
    assert engine.num_accepted_tokens == 0 and engine.num_draft_tokens > 0
    runs = plain_runs(kinds)
    assert len(runs) >= 3 and runs == sorted(runs) and runs[-1] > runs[0], kinds
    assert decoder.num_plain_steps == kinds.count(False) > 2 * kinds.count(True), kinds
    assert calls[0] == decoder.num_steps == kinds.count(True)
    assert decoder.num_probes == len(runs) + 1 and decoder.backoff.length >= 8


def test_right_drafter_keeps_drafting(plain_long: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    llm = eager_with_oracle(plain_long, monkeypatch, [True])
    kinds = record_steps(llm, monkeypatch)
    engine = llm.llm_engine
    got = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, LONG, use_tqdm=False)]
    assert got == plain_long
    assert all(kinds) and engine.speculative is not None and engine.speculative.num_probes == 1
    # 3 drafts per step, all right: about 40 / 4 steps per request, against 40 plain steps
    assert engine.num_accepted_tokens > 0.6 * 3 * 40 and len(kinds) < 20


def test_drafter_that_turns_right_is_picked_up(
    plain_long: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a call of wrong drafts (backed off), the drafts turn right: after the back-off a
    probe finds them (the observed acceptance trusted again by degrees over the plain steps),
    and the steps draft again: most of the next call's tokens are accepted drafts."""
    right = [False]
    llm = eager_with_oracle(plain_long, monkeypatch, right)
    engine = llm.llm_engine
    llm.generate(PROMPTS, LONG, use_tqdm=False)
    assert engine.num_accepted_tokens == 0 and engine.speculative is not None
    assert engine.speculative.backoff.length >= 8
    right[0] = True
    for _ in range(2):
        kinds = record_steps(llm, monkeypatch)
        got = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, LONG, use_tqdm=False)]
        assert got == plain_long
    assert engine.num_accepted_tokens > 3 * 40 / 2 and kinds.count(True) > 4 * kinds.count(False), kinds


@pytest.mark.parametrize("drafting_ms", [10.0, 1.1], ids=["host-bound-drafting", "cheap-drafting"])
def test_wall_clock_decides_episodes(
    plain_long: list[list[int]], monkeypatch: pytest.MonkeyPatch, drafting_ms: float
) -> None:
    """Right drafts that pay on the curve, on a clock where a plain step takes 1 ms and a
    drafting step drafting_ms (host time the curve does not see): at 10 ms (12 tokens against
    30 from plain steps meanwhile) episodes end after their timed steps and back off; at 1.1 ms
    drafting goes on. Outputs equal plain decoding either way."""
    llm = eager_with_oracle(plain_long, monkeypatch, [True])
    engine, decoder = llm.llm_engine, llm.llm_engine.speculative
    assert decoder is not None
    now = [0.0]
    decoder.clock = lambda: now[0]
    kinds: list[bool] = []
    real = engine._launch

    def launch(plan):  # type: ignore[no-untyped-def]
        kinds.append(plan.drafts)
        now[0] += (drafting_ms if plan.drafts else 1.0) * 1e-3
        return real(plan)

    monkeypatch.setattr(engine, "_launch", launch)
    got = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, LONG, use_tqdm=False)]
    assert got == plain_long
    if drafting_ms > 2:
        seen = "".join(".D"[k] for k in kinds)
        episodes = [len(run) for run in seen.split(".") if run]
        assert len(episodes) >= 3 and max(episodes) <= TIMED_STEPS + 1, seen  # cut once timed
        runs = plain_runs(kinds)
        assert runs == sorted(runs) and runs[-1] > runs[0] and decoder.backoff.length >= 4, seen
        assert decoder.plain_ms == {3: pytest.approx(1.0)}
    else:
        assert kinds.count(True) > 4 * kinds.count(False) and engine.num_accepted_tokens > 60, kinds


def test_wrong_drafts_end_verification_chains(
    plain_long: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Verification graphs, chained: the block drafter inside them replaced by one that drafts a
    token plain decoding never emits, sure of it. Chains stop once the observed acceptance says
    their drafts do not pay; the back-off then keeps most steps plain (the decode graphs);
    outputs equal plain decoding."""
    unused = min(set(range(4, 8192)) - {t for out in plain_long for t in out})

    def wrong(drafter, embed, lm_head, fb, sampled, hidden, accepted, limit, k):  # type: ignore[no-untyped-def]
        b = sampled.shape[0]
        conf = torch.full((b, k), 0.9).cumprod(dim=1).to(sampled.device)
        return torch.full((b, k), unused, dtype=torch.int64, device=sampled.device), conf

    monkeypatch.setattr(drafters, "block_drafts", wrong)
    spec = {"method": "dspark", "num_speculative_tokens": 3, "confidence_scheduling": True}
    llm = LLM(str(ROOT / "model/tiny"), speculative_config=spec, **ARGS)
    engine, decoder = llm.llm_engine, llm.llm_engine.speculative
    assert decoder is not None
    buckets = sorted({b for b, _ in engine.worker.verify_graphs.forwards})
    decoder.step_times = synthetic(buckets, 3, knee=1e9, per_token=0.0, drafter=0.5)
    kinds = record_steps(llm, monkeypatch)
    replays = {"n": 0}
    real = engine.worker.decode_graphs.bucket_for

    def spy(batch):  # type: ignore[no-untyped-def]
        bucket = real(batch)
        replays["n"] += bucket is not None
        return bucket

    monkeypatch.setattr(engine.worker.decode_graphs, "bucket_for", spy)
    got = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, LONG, use_tqdm=False)]
    assert got == plain_long
    assert engine.num_accepted_tokens == 0 and engine.num_draft_tokens > 0
    assert decoder.num_graph_steps > 0 and decoder.num_plain_steps > 2 * decoder.num_steps, kinds
    assert (
        replays["n"] >= decoder.num_plain_steps - 1
    )  # the plain steps replay decode graphs (but the prefill)
    runs = plain_runs(kinds)
    assert runs == sorted(runs) and runs[-1] > runs[0], kinds
