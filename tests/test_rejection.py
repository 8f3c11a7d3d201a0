"""Rejection-sampling verification (deepinfer.engine.rejection) against brute force: over many
fixed seeds the emitted tokens follow the target's distribution p whatever the drafter's q
(chi-square), acceptance is sum min(p, q), a one-hot q is plain sampling token for token, greedy
accepts exactly the argmax, and a request's draws do not depend on the batch. End to end on the
shipped tiny model: seeded speculative sampling emits plain seeded sampling's tokens (so their
distributions over seeds agree), greedy too."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.rejection import rejection_verify, target_probs, uniforms
from deepinfer.reference.backend import create_reference_backend

ROOT = Path(__file__).resolve().parents[1]
SMALL = create_reference_backend().small
P0 = torch.tensor([0.40, 0.25, 0.20, 0.10, 0.05], dtype=torch.float64)
P1 = torch.tensor([0.05, 0.15, 0.30, 0.30, 0.20], dtype=torch.float64)
Q0 = torch.tensor([0.10, 0.50, 0.05, 0.30, 0.05], dtype=torch.float64)  # far from P0
Q1 = torch.tensor([0.20, 0.20, 0.20, 0.20, 0.20], dtype=torch.float64)
N = 40000  # seeds


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit, its p-value (survival of chi2 with V - 1 dof)."""
    n = counts.sum().item()
    expected = probs * n
    stat = ((counts.double() - expected) ** 2 / expected).sum()
    dof = torch.tensor((probs.numel() - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, stat / 2))


def draw(probs: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """n draws from probs (V,) by a generator of its own: the drafter sampling from q."""
    return torch.multinomial(
        probs.float(), n, replacement=True, generator=torch.Generator().manual_seed(seed)
    )


def verify(
    q: tuple[torch.Tensor, torch.Tensor] | None, seed_base: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """N requests (seeds seed_base ..), two drafts each, rows p = (P0, P1, P1)."""
    probs = torch.stack([P0, P1, P1]).float()[None].expand(N, 3, 5).contiguous()
    if q is None:  # a deterministic drafter: always drafts tokens 1 then 2
        drafts, draft_probs = torch.tensor([[1, 2]]).expand(N, 2), None
    else:
        drafts = torch.stack([draw(q[0], N, 1 + seed_base), draw(q[1], N, 2 + seed_base)], dim=1)
        draft_probs = torch.stack(q).float()[None].expand(N, 2, 5).contiguous()
    seeds = torch.arange(seed_base, seed_base + N, dtype=torch.int64)
    positions = torch.tensor([[10, 11, 12]]).expand(N, 3)
    valid = torch.ones(N, 2, dtype=torch.bool)
    return rejection_verify(SMALL, probs, drafts, valid, seeds, positions, draft_probs)


@pytest.mark.parametrize("q", [(Q0, Q1), (P0, P1), None], ids=["q-far", "q-equals-p", "one-hot"])
def test_emitted_tokens_follow_the_target(q: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    tokens, accepted = verify(q)
    first = torch.bincount(tokens[:, 0], minlength=5)
    assert chi_square_pvalue(first, P0) > 1e-3, f"first token counts {first.tolist()} vs p {P0.tolist()}"
    on = accepted >= 1  # row 1's token is emitted when draft 0 was accepted
    second = torch.bincount(tokens[on, 1], minlength=5)
    assert chi_square_pvalue(second, P1) > 1e-3, f"second token counts {second.tolist()} vs p {P1.tolist()}"
    # acceptance of draft 0: sum_x min(p, q) (one-hot q at token 1: p(1)); 6 sigma
    rate = float(torch.minimum(P0, q[0]).sum()) if q is not None else float(P0[1])
    sigma = math.sqrt(rate * (1 - rate) / N)
    assert abs(on.double().mean().item() - rate) < 6 * sigma + 1e-9
    if q is not None and q[0] is P0:
        assert on.all(), "q = p accepts every draft"


def test_one_hot_is_plain_sampling_token_for_token() -> None:
    """q one-hot: every row's token is plain sampling's draw at that position (Sampler.draw's
    exponential race with the request's noise), accepted while it equals the draft."""
    tokens, accepted = verify(None)
    probs = torch.stack([P0, P1, P1]).float()
    for j in range(3):
        noise = SMALL.exponential_noise(torch.arange(N), torch.full((N,), 10 + j), 5)
        plain = SMALL.sample(
            probs[j].log()[None].expand(N, 5).contiguous(), torch.ones(N), torch.zeros(N, dtype=torch.int64),
            torch.ones(N), torch.zeros(N), noise,
        )  # fmt: skip
        assert torch.equal(tokens[:, j], plain)
    expect = (tokens[:, 0] == 1).long() * (1 + (tokens[:, 1] == 2).long())
    assert torch.equal(accepted, expect)


def test_greedy_accepts_exactly_the_argmax() -> None:
    logits = torch.randn(6, 3, 11, generator=torch.Generator().manual_seed(0))
    flat = logits.view(-1, 11)
    zeros = torch.zeros(flat.shape[0])
    probs = target_probs(SMALL, flat, zeros, zeros.long(), torch.ones_like(zeros), zeros).view(6, 3, 11)
    best = logits.argmax(-1)  # (6, 3)
    drafts = best[:, :2].clone()
    drafts[1, 0] = (best[1, 0] + 1) % 11  # rejects at draft 0
    drafts[2, 1] = (best[2, 1] + 1) % 11  # rejects at draft 1
    valid = torch.ones(6, 2, dtype=torch.bool)
    valid[3, 1] = False  # padding
    positions = torch.arange(3)[None].expand(6, 3)
    for q in (None, probs[:, :2].clone()):  # a greedy drafter's q is one-hot at its draft
        if q is not None:
            q = torch.zeros_like(q).scatter_(2, drafts[..., None], 1.0)
        tokens, accepted = rejection_verify(SMALL, probs, drafts, valid, torch.arange(6), positions, q)
        assert accepted.tolist() == [2, 0, 1, 1, 2, 2]
        for b, a in enumerate(accepted.tolist()):
            assert tokens[b, : a + 1].tolist() == best[b, : a + 1].tolist()


def test_draws_do_not_depend_on_the_batch() -> None:
    tokens, accepted = verify((Q0, Q1))
    rows = torch.tensor([7, 3, 999, 5])
    u_all = uniforms(SMALL, torch.arange(N), torch.tensor([[10, 11]]).expand(N, 2), 1)
    u_few = uniforms(SMALL, rows, torch.tensor([[10, 11]]).expand(4, 2), 1)
    assert torch.equal(u_all[rows], u_few)
    assert ((u_all > 0) & (u_all < 1)).all()
    # the same requests in a smaller, reordered batch
    probs = torch.stack([P0, P1, P1]).float()[None].expand(4, 3, 5).contiguous()
    drafts = torch.stack([draw(Q0, N, 1), draw(Q1, N, 2)], dim=1)[rows]
    q = torch.stack([Q0, Q1]).float()[None].expand(4, 2, 5).contiguous()
    positions = torch.tensor([[10, 11, 12]]).expand(4, 3)
    few, acc = rejection_verify(SMALL, probs, drafts, torch.ones(4, 2, dtype=torch.bool), rows, positions, q)
    assert torch.equal(few, tokens[rows]) and torch.equal(acc, accepted[rows])


@pytest.fixture(scope="module")
def tiny() -> tuple[LLM, LLM]:
    args = {"backend": "reference", "dtype": "float32", "max_model_len": 128, "max_num_seqs": 64}
    spec = {"method": "dspark", "num_speculative_tokens": 3}
    return LLM(str(ROOT / "model/tiny"), **args), LLM(
        str(ROOT / "model/tiny"), speculative_config=spec, **args
    )


def test_tiny_model_seeded_and_greedy_match_plain(tiny: tuple[LLM, LLM]) -> None:
    """Over 64 seeds, the tokens after the first (those verified steps emit) of seeded speculative
    sampling are plain seeded sampling's; their distributions agree a fortiori. Greedy too."""
    plain, spec = tiny
    prompt = [{"prompt_token_ids": [5, 17, 33, 2, 9]}] * 64
    seeded = [SamplingParams(temperature=0.9, seed=s, max_tokens=6, ignore_eos=True) for s in range(64)]
    want = [r.outputs[0].token_ids for r in plain.generate(prompt, seeded, use_tqdm=False)]
    got = [r.outputs[0].token_ids for r in spec.generate(prompt, seeded, use_tqdm=False)]
    assert got == want
    assert len({tuple(t[1:3]) for t in want}) > 4, "the seeds should spread the sampled tokens"
    assert spec.llm_engine.num_draft_tokens > 0
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert [r.outputs[0].token_ids for r in spec.generate(prompt[:4], greedy, use_tqdm=False)] == [
        r.outputs[0].token_ids for r in plain.generate(prompt[:4], greedy, use_tqdm=False)
    ]
