"""Sampler: penalties, min_tokens, top-k / top-p / min-p, seeded per-request noise."""

from __future__ import annotations

import pytest
import torch

from deepinfer.backend.registry import get_backend
from deepinfer.engine.sampler import Sampler, apply_min_tokens, apply_penalties
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.sequence import Sequence
from deepinfer.reference.small import argmax_rows


def make_seq(prompt: list[int], output: list[int], seed: int | None = None, **kw: object) -> Sequence:
    params = SamplingParams(seed=seed, **kw)  # type: ignore[arg-type]
    s = Sequence("r", None, prompt, params, seed if seed is not None else 0)
    s.token_ids.extend(output)
    return s


def sample(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence], offset: int = 0) -> list[int]:
    """One token per row; every row samples position `offset` (its noise offset)."""
    return sampler.sample_now(logits, seqs, [offset] * len(seqs))[0]


@pytest.fixture(scope="module")
def sampler() -> Sampler:
    return Sampler(get_backend("reference"), eos_token_ids=[0])


def test_penalties_match_a_float64_oracle() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 10)
    prompt, out = [1, 2, 3], [3, 4, 4, 4, 7]
    s = make_seq(prompt, out, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25)
    plain = make_seq(prompt, out)
    got = logits.clone()
    apply_penalties(got, [s, plain])
    want = logits[0].double().clone()
    for t in set(prompt + out):
        want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
    for t in set(out):
        want[t] -= 0.5 * out.count(t) + 0.25
    torch.testing.assert_close(got[0].double(), want, rtol=0, atol=1e-6)
    assert torch.equal(got[1], logits[1])  # no penalties: row untouched


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(3, 8)
    early = make_seq([5], [6], min_tokens=3, stop_token_ids=[4])
    done = make_seq([5], [6, 6, 6], min_tokens=3, stop_token_ids=[4])
    ignore = make_seq([5], [], min_tokens=3, ignore_eos=True)
    apply_min_tokens(logits, [early, done, ignore], eos_token_ids=[0])
    assert logits[0, 0] == float("-inf") and logits[0, 4] == float("-inf")
    assert torch.isfinite(logits[1]).all()
    assert torch.isfinite(logits[2]).all()


def test_greedy_and_filters(sampler: Sampler) -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9, -1.0]] * 4)
    seqs = [
        make_seq([1], [], temperature=0),
        make_seq([1], [], seed=1, temperature=1.0, top_k=1),
        make_seq([1], [], seed=2, temperature=1.0, top_p=0.01),
        make_seq([1], [], seed=3, temperature=1.0, min_p=0.99),
    ]
    tokens, lps = sampler.sample_now(logits, seqs, [0] * 4)
    assert tokens == [1, 1, 1, 1]
    assert lps == {}


def test_sampling_frequencies_follow_the_softmax(sampler: Sampler) -> None:
    logits = torch.tensor([[1.0, 0.0, 2.0, -1.0, 0.5]])
    s = make_seq([1], [], seed=11, temperature=0.7, top_k=4)
    counts = torch.zeros(5)
    n = 3000
    for i in range(n):  # each draw at another position: independent noise
        counts[sample(sampler, logits, [s], offset=i)[0]] += 1
    probs = torch.softmax(logits[0].double() / 0.7, dim=0)
    probs[3] = 0  # outside top-4
    probs /= probs.sum()
    freq = counts.double() / n
    assert counts[3] == 0
    # 5 sigma of a binomial proportion.
    assert torch.all((freq - probs).abs() <= 5 * (probs * (1 - probs) / n).sqrt() + 1e-9)


def test_seeded_rows_do_not_depend_on_the_batch(sampler: Sampler) -> None:
    torch.manual_seed(1)
    logits = torch.randn(6, 50)

    def draw(rows: list[int]) -> list[int]:
        seqs = [make_seq([1], [], seed=100 + r, temperature=1.0) for r in rows]
        out: list[int] = []
        for i in range(20):
            out.extend(sample(sampler, logits[rows], seqs, offset=i)[: 1 if len(rows) > 1 else None])
        return out

    alone = draw([3])
    in_batch = [t for t in draw([3, 0, 1, 2, 4, 5])]
    assert alone == in_batch
    assert len(set(alone)) > 1  # really sampled


@pytest.mark.parametrize("vocab", [102400, 129280, 50, 1024, 4096 + 64, 97])
def test_argmax_rows_is_the_first_maximum(vocab: int) -> None:
    """The two-reduction greedy draw equals torch's argmax, ties (the first maximum wins, within
    a chunk and across chunks), -inf rows and widths without a power-of-two divisor included."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g)
    logits[1, vocab // 3] = logits[1, vocab - 1] = 9.0  # a tie across chunks: the first wins
    logits[2, :] = float("-inf")  # every token banned: torch's answer, index 0
    logits[3, 7] = logits[3, 8] = 9.0  # a tie inside one chunk
    logits[4, :] = 0.5  # all equal
    out = torch.full((5,), -1, dtype=torch.int64)
    argmax_rows(logits, out)
    assert out.tolist() == logits.argmax(dim=-1).tolist()
    assert out[1] == vocab // 3 and out[3] == 7 and out[4] == 0
