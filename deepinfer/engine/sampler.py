"""Sampling on the device: logits processors, the draw, log-probabilities.

The draw needs nothing from the host but the per-row parameters the step's input copy already
carried (deepinfer.engine.inputs.SamplingInputs): temperature (0 = greedy), top-k, top-p, min-p,
and the noise of the exponential race, a pure function of (request seed, position sampled)
(backend.small.exponential_noise). So a seeded request samples the same tokens whatever shares
its batch, whether the step ran eagerly or as a graph replay, in one step or after a preemption.

Logits processors that need the request's history (penalties, min_tokens, grammar masks) run
between the forward and the draw, after the host has read the previous step's tokens; rows
that need none cost nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer.backend.ops import Backend
from deepinfer.engine.inputs import SamplingInputs
from deepinfer.engine.outputs import Logprob
from deepinfer.engine.sequence import Sequence
from deepinfer.engine.structured import grammar_bitmask


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """In place, rows of requests with penalties. logits (S, V) float32.

    repetition (prompt and output tokens): logit / p if logit > 0 else logit * p;
    frequency and presence (output tokens): logit -= f * count + p * (count > 0)."""
    vocab = logits.shape[1]
    device = logits.device
    for row, seq in enumerate(seqs):
        p = seq.params
        if not p.has_penalties or seq.is_finished:
            continue
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            seen[torch.tensor(seq.token_ids, dtype=torch.long, device=device)] = True
            x = logits[row]
            penalised = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
            logits[row] = torch.where(seen, penalised, x)
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            out = seq.output_token_ids
            if out:
                counts.index_add_(
                    0, torch.tensor(out, dtype=torch.long, device=device), torch.ones(len(out), device=device)
                )
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()


def apply_min_tokens(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: list[int]) -> None:
    """In place: EOS and stop_token_ids cannot be sampled before min_tokens outputs."""
    for row, seq in enumerate(seqs):
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens or seq.is_finished:
            continue
        banned = list(p.stop_token_ids or [])
        if not p.ignore_eos:
            banned.extend(eos_token_ids)
        banned = [t for t in banned if t < logits.shape[1]]
        if banned:
            logits[row, banned] = float("-inf")


@dataclass
class LogprobTensors:
    """Device results for the rows that asked for log-probabilities (R of them), in row order:
    top (R, k) values and ids of the raw log-softmax, the sampled token's value and rank (R,)."""

    rows: list[int]
    top_values: torch.Tensor
    top_ids: torch.Tensor
    sampled: torch.Tensor
    rank: torch.Tensor

    def to_host(self, pinned_empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]) -> LogprobTensors:
        """Copies in host buffers from `pinned_empty` (the backend's), queued without waiting:
        valid once the step's event has completed."""

        def copy(t: torch.Tensor) -> torch.Tensor:
            return pinned_empty(tuple(t.shape), t.dtype).copy_(t, non_blocking=True)

        return LogprobTensors(
            self.rows, copy(self.top_values), copy(self.top_ids), copy(self.sampled), copy(self.rank)
        )

    def entries(self, seqs: list[Sequence], tokens: list[int]) -> dict[int, dict[int, Logprob]]:
        """Host side: row -> {token: Logprob} (the top-k of that request and the sampled one)."""
        out: dict[int, dict[int, Logprob]] = {}
        for j, row in enumerate(self.rows):
            entry: dict[int, Logprob] = {}
            for r in range(int(seqs[row].params.logprobs or 0)):
                entry[int(self.top_ids[j, r])] = Logprob(float(self.top_values[j, r]), r + 1)
            entry[tokens[row]] = Logprob(float(self.sampled[j]), int(self.rank[j]))
            out[row] = entry
        return out


class Sampler:
    def __init__(self, backend: Backend, eos_token_ids: list[int]) -> None:
        self.backend = backend
        self.eos_token_ids = eos_token_ids

    @staticmethod
    def needs_processing(seqs: list[Sequence]) -> bool:
        """Whether any row needs a logits processor (penalties, min_tokens, a grammar)."""
        return any(
            not s.is_finished and (s.params.has_penalties or s.grammar is not None or s.params.min_tokens > 0)
            for s in seqs
        )

    def process_logits(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Penalties, min_tokens and grammar masks, in place on rows 0..len(seqs)-1 of logits
        (S, V) float32 (rows past them are padding). Needs each request's history up to now."""
        rows = logits[: len(seqs)]
        apply_penalties(rows, seqs)
        apply_min_tokens(rows, seqs, self.eos_token_ids)
        grammars = [None if s.is_finished else s.grammar for s in seqs]
        if any(g is not None for g in grammars):  # structured output: only what the grammar allows
            self.backend.small.apply_token_bitmask(
                rows, grammar_bitmask(grammars, logits.shape[1], logits.device)
            )

    def draw(self, logits: torch.Tensor, params: SamplingInputs, greedy: bool, out: torch.Tensor) -> None:
        """Device only (graph-safe): one token per row of logits (S, V) float32 into out (S,)
        int64. greedy: every row is greedy (argmax, without the sample op's sort)."""
        if greedy:
            out.copy_(logits.argmax(dim=-1))
            return
        small = self.backend.small
        noise = small.exponential_noise(params.seeds, params.offsets, logits.shape[1])
        out.copy_(small.sample(logits, params.temperature, params.top_k, params.top_p, params.min_p, noise))

    @staticmethod
    def logprobs(raw: torch.Tensor, seqs: list[Sequence], tokens: torch.Tensor) -> LogprobTensors | None:
        """Top-k log-probabilities of the raw logits (and the sampled token's), on the device,
        for the rows whose request asked for them; None when none did."""
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None and not s.is_finished]
        if not rows:
            return None
        logp = torch.log_softmax(raw[rows].float(), dim=-1)  # (R, V)
        sampled = logp.gather(1, tokens[rows].view(-1, 1)).squeeze(1)  # (R,)
        rank = (logp > sampled[:, None]).sum(dim=1) + 1  # (R,)
        k_max = max(int(seqs[i].params.logprobs or 0) for i in rows)
        top_values, top_ids = logp.topk(min(k_max, logp.shape[1]), dim=1)
        return LogprobTensors(rows, top_values, top_ids, sampled, rank)

    def sample_now(
        self, logits: torch.Tensor, seqs: list[Sequence], offsets: list[int]
    ) -> tuple[list[int], dict[int, dict[int, Logprob]]]:
        """Synchronous sampling (speculative verification): logits (S, V) float32, one row per
        request in seqs, row i sampling position offsets[i] -> (tokens, logprob entries by row)."""
        device = logits.device
        raw = logits
        logits = logits.float().clone()
        self.process_logits(logits, seqs)
        ps = [s.params for s in seqs]

        def dev(values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        params = SamplingInputs(
            temperature=dev([0.0 if p.greedy else p.temperature for p in ps], torch.float32),
            top_k=dev([p.top_k for p in ps], torch.int64),
            top_p=dev([p.top_p for p in ps], torch.float32),
            min_p=dev([p.min_p for p in ps], torch.float32),
            seeds=dev([s.seed for s in seqs], torch.int64),
            offsets=dev(offsets, torch.int64),
        )
        tokens = torch.empty(len(seqs), dtype=torch.int64, device=device)
        self.draw(logits, params, all(p.greedy for p in ps), tokens)
        lp = self.logprobs(raw, seqs, tokens)
        token_list = [int(t) for t in tokens.tolist()]
        if lp is None:
            return token_list, {}
        return token_list, lp.to_host(lambda shape, dtype: torch.empty(shape, dtype=dtype)).entries(
            seqs, token_list
        )
