"""Sampling: penalties, min_tokens, grammar masks, logprobs, then the backend's sample op.

Randomness comes from one torch.Generator per request (seeded by the request's seed, else from
the engine's seed) that draws the Exp(1) noise of that request's row only, so a seeded request
samples the same tokens whatever else shares the batch.
"""

from __future__ import annotations

import torch

from deepinfer.backend.ops import Backend
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
        if not p.has_penalties:
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
        if seq.num_output_tokens >= p.min_tokens:
            continue
        banned = list(p.stop_token_ids or [])
        if not p.ignore_eos:
            banned.extend(eos_token_ids)
        banned = [t for t in banned if t < logits.shape[1]]
        if banned:
            logits[row, banned] = float("-inf")


class Sampler:
    def __init__(self, backend: Backend, eos_token_ids: list[int]) -> None:
        self.backend = backend
        self.eos_token_ids = eos_token_ids

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[int], list[dict[int, Logprob] | None]]:
        """logits (S, V) float32, one row per sequence -> (token ids, logprobs or None per row)."""
        assert logits.shape[0] == len(seqs)
        device = logits.device
        raw = logits
        logits = logits.float().clone()
        apply_penalties(logits, seqs)
        apply_min_tokens(logits, seqs, self.eos_token_ids)
        grammars = [s.grammar for s in seqs]
        if any(g is not None for g in grammars):  # structured output: only what the grammar allows
            self.backend.small.apply_token_bitmask(logits, grammar_bitmask(grammars, logits.shape[1], device))

        params = [s.params for s in seqs]
        if all(p.greedy for p in params):  # the sample op's temperature-0 rule, without its sort
            tokens = logits.argmax(dim=-1)
            token_list = [int(t) for t in tokens.tolist()]
            return token_list, self._logprobs(raw, seqs, tokens, token_list)
        temperature = torch.tensor(  # 0 marks a greedy row for the sample op
            [0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32, device=device
        )
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
        noise = torch.ones_like(logits)  # (S, V); greedy rows ignore it
        for row, seq in enumerate(seqs):
            if not seq.params.greedy:
                noise[row].exponential_(generator=seq.generator)
        tokens = self.backend.small.sample(logits, temperature, top_k, top_p, min_p, noise)
        token_list = [int(t) for t in tokens.tolist()]
        return token_list, self._logprobs(raw, seqs, tokens, token_list)

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, seqs: list[Sequence], tokens: torch.Tensor, token_list: list[int]
    ) -> list[dict[int, Logprob] | None]:
        """Top-k log-probabilities of the raw logits (and the sampled token's), per row."""
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        result: list[dict[int, Logprob] | None] = [None] * len(seqs)
        if not rows:
            return result
        logp = torch.log_softmax(raw[rows].float(), dim=-1)  # (R, V)
        sampled_lp = logp.gather(1, tokens[rows].view(-1, 1)).squeeze(1)  # (R,)
        sampled_rank = (logp > sampled_lp[:, None]).sum(dim=1) + 1  # (R,)
        k_max = max(int(seqs[i].params.logprobs or 0) for i in rows)
        top_lp, top_ids = logp.topk(min(k_max, logp.shape[1]), dim=1) if k_max else (None, None)
        for j, i in enumerate(rows):
            entry: dict[int, Logprob] = {}
            k = int(seqs[i].params.logprobs or 0)
            if top_lp is not None and top_ids is not None:
                for r in range(k):
                    entry[int(top_ids[j, r])] = Logprob(float(top_lp[j, r]), r + 1)
            entry[token_list[i]] = Logprob(float(sampled_lp[j]), int(sampled_rank[j]))
            result[i] = entry
        return result
