"""Sampling on the device: logits processors, the draw, log-probabilities.

The draw needs nothing from the host but the per-row parameters the step's input copy already
carried (deepinfer.engine.inputs.SamplingInputs): temperature (0 = greedy), top-k, top-p, min-p,
and the noise of the exponential race, a pure function of (request seed, position sampled)
(backend.small.exponential_noise). So a seeded request samples the same tokens whatever shares
its batch, whether the step ran eagerly or as a graph replay, in one step or after a preemption.

Logits processors run between the forward and the draw, after the host has read the previous
step's tokens, in vLLM's order: allowed_token_ids, bad_words, logit_bias, penalties, min_tokens,
grammar masks; rows that need none cost nothing.

A request whose masks leave no token (allowed_token_ids, bad_words, min_tokens' ban on EOS and
stop tokens, its grammar) is refused when it is added where that can be known then
(check_token_sets; structured.check_first_tokens for a grammar), and otherwise found on the host
before the draw (rows with allowed_token_ids or a grammar: mark_dead_rows): the request gets
Sequence.error and finishes with finish_reason "error"; its row is drawn from zeros, never from
all -inf logits.

Log-probabilities (of sampled tokens, and of prompt tokens) come from the raw model logits, as
vLLM's default: the log-softmax over the whole vocabulary, before any processor or filter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer.backend.ops import Backend
from deepinfer.engine.inputs import SamplingInputs
from deepinfer.engine.outputs import Logprob
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.sequence import Sequence
from deepinfer.engine.structured import bitmask_tokens, grammar_bitmask


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


def _banned_mask(seq: Sequence, vocab: int, device: torch.device) -> torch.Tensor:
    """(V,) bool: True where a token is not in seq's allowed_token_ids."""
    mask = torch.ones(vocab, dtype=torch.bool)
    mask[torch.tensor(seq.params.allowed_token_ids or [], dtype=torch.long)] = False
    return mask.to(device)


def _dense_bias(seq: Sequence, vocab: int, device: torch.device) -> torch.Tensor:
    """(V,) float32: seq's logit_bias[t] at token t, 0 elsewhere."""
    bias = seq.params.logit_bias or {}
    dense = torch.zeros(vocab, dtype=torch.float32)
    dense[torch.tensor(list(bias), dtype=torch.long)] = torch.tensor(list(bias.values()), dtype=torch.float32)
    return dense.to(device)


def _cached(
    seq: Sequence,
    make: Callable[[Sequence, int, torch.device], torch.Tensor],
    vocab: int,
    device: torch.device,
) -> torch.Tensor:
    """make(seq, vocab, device): a device tensor derived from seq's parameters, made once per
    request (and device) and kept in seq.logits_state."""
    key = f"{make.__name__}@{device}"
    value = seq.logits_state.get(key)
    if value is None:
        value = seq.logits_state[key] = make(seq, vocab, device)
    return value


def apply_allowed_and_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """In place: tokens outside allowed_token_ids -> -inf, then + logit_bias. logits (S, V)."""
    vocab, device = logits.shape[1], logits.device
    for row, seq in enumerate(seqs):
        if seq.is_finished:
            continue
        if seq.params.allowed_token_ids is not None:
            logits[row].masked_fill_(_cached(seq, _banned_mask, vocab, device), float("-inf"))
        if seq.params.logit_bias:
            logits[row] += _cached(seq, _dense_bias, vocab, device)


def banned_bad_word_tokens(seq: Sequence) -> list[int]:
    """The last token of each tokenised bad word whose other tokens end the output so far
    (vLLM: only output tokens count; a one-token bad word is always banned)."""
    out = seq.num_output_tokens
    ids = seq.token_ids
    banned = []
    for word in seq.bad_words_token_ids:
        k = len(word) - 1
        if k <= out and (k == 0 or ids[len(ids) - k :] == word[:-1]):
            banned.append(word[-1])
    return banned


def apply_bad_words(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """In place: each row's banned_bad_word_tokens -> -inf."""
    for row, seq in enumerate(seqs):
        if seq.bad_words_token_ids and not seq.is_finished:
            banned = banned_bad_word_tokens(seq)
            if banned:
                logits[row, banned] = float("-inf")


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


def min_tokens_banned(params: SamplingParams, eos_token_ids: list[int]) -> set[int]:
    """The tokens min_tokens bans from the first min_tokens outputs: stop_token_ids, and EOS
    unless ignore_eos."""
    banned = set(params.stop_token_ids or [])
    if not params.ignore_eos:
        banned.update(eos_token_ids)
    return banned


def check_token_sets(params: SamplingParams, eos_token_ids: list[int], bad_words: list[list[int]]) -> None:
    """At add time: ValueError when allowed_token_ids leave no token to sample, because
    one-token bad_words ban all of them, or because they are only EOS / stop tokens and
    min_tokens bans those."""
    if params.allowed_token_ids is None:
        return
    allowed = set(params.allowed_token_ids) - {w[0] for w in bad_words if len(w) == 1}
    if not allowed:
        raise ValueError("allowed_token_ids leave no token to sample: bad_words ban every one of them")
    if params.min_tokens and allowed <= min_tokens_banned(params, eos_token_ids):
        raise ValueError(
            f"allowed_token_ids leave no token to sample: they hold only EOS / stop_token_ids, which "
            f"min_tokens={params.min_tokens} bans until {params.min_tokens} tokens are generated"
        )


def mark_dead_rows(
    seqs: list[Sequence], grammar_mask: torch.Tensor | None, eos_token_ids: list[int], vocab: int
) -> list[int]:
    """Host side, before the draw: the rows (with allowed_token_ids or a grammar) whose masks
    leave no token; each such request gets Sequence.error. grammar_mask: the step's host bitmask
    (rows, ceil(V / 32)) int32, or None."""
    dead = []
    for row, seq in enumerate(seqs):
        p = seq.params
        if seq.is_finished or seq.error is not None or (p.allowed_token_ids is None and seq.grammar is None):
            continue
        ok = torch.ones(vocab, dtype=torch.bool)
        if p.allowed_token_ids is not None:
            ok &= ~_cached(seq, _banned_mask, vocab, torch.device("cpu"))
        if grammar_mask is not None and seq.grammar is not None:
            ok &= bitmask_tokens(grammar_mask[row], vocab)
        banned = banned_bad_word_tokens(seq) if seq.bad_words_token_ids else []
        if seq.num_output_tokens < p.min_tokens:
            banned += min_tokens_banned(p, eos_token_ids)
        ok[[t for t in banned if t < vocab]] = False
        if not ok.any():
            causes = [
                name
                for name, given in (
                    ("allowed_token_ids", p.allowed_token_ids is not None),
                    ("bad_words", bool(banned) and bool(seq.bad_words_token_ids)),
                    ("min_tokens", seq.num_output_tokens < p.min_tokens),
                    ("the structured-output grammar", seq.grammar is not None),
                )
                if given
            ]
            seq.error = (
                f"no token is left to sample after {seq.num_output_tokens} output tokens: "
                f"{' and '.join(causes)} ban every token"
            )
            dead.append(row)
    return dead


def num_top_logprobs(k: int | None, vocab_size: int) -> int:
    """Top tokens an entry lists for a logprobs / prompt_logprobs value: None -> 0, -1 -> all."""
    if k is None:
        return 0
    return vocab_size if k < 0 else min(k, vocab_size)


# Rows of logits whose log-softmax is taken at once (bounds the (rows, V) temporaries).
LOGPROB_CHUNK_ELEMENTS = 2**24


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device: log-softmax of logits (R, V) -> top (R, k) values and ids, then the value (R,)
    and rank (R,) (1 + tokens strictly more likely) of tokens (R,) int64."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (R, V)
    value = logp.gather(1, tokens.view(-1, 1)).squeeze(1)  # (R,)
    rank = (logp > value[:, None]).sum(dim=1) + 1  # (R,)
    top_values, top_ids = logp.topk(min(k, logp.shape[1]), dim=1)
    return top_values, top_ids, value, rank


@dataclass
class LogprobTensors:
    """Log-probability results, R rows, in row order: top (R, k) values and ids of the raw
    log-softmax, the value and rank (R,) of the token at each row (the sampled one, or the
    prompt token). rows: the owner of each row (a sampled row; for prompt log-probabilities,
    see PromptLogprobs)."""

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

    def position(self, j: int, k: int, token: int) -> dict[int, Logprob]:
        """Host side: row j's entry: its top k tokens, then `token` (the row's own)."""
        ids = self.top_ids[j, :k].tolist()
        values = self.top_values[j, :k].tolist()
        entry = {t: Logprob(v, r + 1) for r, (t, v) in enumerate(zip(ids, values))}
        entry[token] = Logprob(float(self.sampled[j]), int(self.rank[j]))
        return entry

    def entries(self, seqs: list[Sequence], tokens: list[int]) -> dict[int, dict[int, Logprob]]:
        """Host side: row -> {token: Logprob} (the top-k of that request and the sampled one)."""
        vocab = self.top_values.shape[1]  # at least the largest k asked for
        return {
            row: self.position(j, num_top_logprobs(seqs[row].params.logprobs, vocab), tokens[row])
            for j, row in enumerate(self.rows)
        }


@dataclass
class PromptLogprobs:
    """One step's prompt log-probabilities, on their way to the host: spans[i] = (seq, first
    position, count): rows [sum of the previous counts, + count) of `values` hold seq's prompt
    positions first .. first + count - 1 (the log-probability of the token there given the ones
    before it)."""

    spans: list[tuple[Sequence, int, int]]
    values: LogprobTensors

    def to_host(self, pinned_empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]) -> PromptLogprobs:
        return PromptLogprobs(self.spans, self.values.to_host(pinned_empty))

    def entries(self) -> list[tuple[Sequence, int, list[dict[int, Logprob]]]]:
        """Host side: (seq, first position, its entries) per span."""
        out = []
        j = 0
        vocab = self.values.top_values.shape[1]
        for seq, first, count in self.spans:
            k = num_top_logprobs(seq.params.prompt_logprobs, vocab)
            tokens = seq.prompt_token_ids[first : first + count]
            out.append((seq, first, [self.values.position(j + i, k, t) for i, t in enumerate(tokens)]))
            j += count
        return out


class Sampler:
    def __init__(self, backend: Backend, eos_token_ids: list[int]) -> None:
        self.backend = backend
        self.eos_token_ids = eos_token_ids

    @staticmethod
    def needs_processing(seqs: list[Sequence]) -> bool:
        """Whether any row needs a logits processor (allowed_token_ids, bad_words, logit_bias,
        penalties, min_tokens, a grammar)."""
        return any(
            not s.is_finished and (s.params.has_logits_processors or s.grammar is not None) for s in seqs
        )

    def process_logits(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """allowed_token_ids, bad_words, logit_bias, penalties, min_tokens and grammar masks, in
        place on rows 0..len(seqs)-1 of logits (S, V) float32 (rows past them are padding).
        Needs each request's history up to now."""
        rows = logits[: len(seqs)]
        apply_allowed_and_bias(rows, seqs)
        apply_bad_words(rows, seqs)
        apply_penalties(rows, seqs)
        apply_min_tokens(rows, seqs, self.eos_token_ids)
        grammars = [None if s.is_finished else s.grammar for s in seqs]
        mask = None
        if any(g is not None for g in grammars):  # structured output: only what the grammar allows
            mask = grammar_bitmask(grammars, logits.shape[1])
            self.backend.small.apply_token_bitmask(rows, mask.to(logits.device))
        dead = mark_dead_rows(seqs, mask, self.eos_token_ids, logits.shape[1])
        if dead:  # finished with an error at output processing: draw from something finite
            rows[dead] = 0.0

    def draw(self, logits: torch.Tensor, params: SamplingInputs, greedy: bool, out: torch.Tensor) -> None:
        """Device only (graph-safe): one token per row of logits (S, V) float32 into out (S,)
        int64. greedy: every row is greedy (argmax, without the sample op's sort)."""
        if greedy:
            self.backend.small.argmax(logits, out)
            return
        small = self.backend.small
        noise = small.exponential_noise(params.seeds, params.offsets, logits.shape[1])
        out.copy_(small.sample(logits, params.temperature, params.top_k, params.top_p, params.min_p, noise))

    @staticmethod
    def logprobs(raw: torch.Tensor, seqs: list[Sequence], tokens: torch.Tensor) -> LogprobTensors | None:
        """Top-k log-probabilities of the raw logits (and the sampled token's), on the device,
        for the rows whose request needs them (logprobs, or best_of's ranking); None when none
        does."""
        rows = [i for i, s in enumerate(seqs) if s.needs_logprob and not s.is_finished]
        if not rows:
            return None
        vocab = raw.shape[1]
        k_max = max(num_top_logprobs(seqs[i].params.logprobs, vocab) for i in rows)
        return LogprobTensors(rows, *token_logprobs(raw[rows], tokens[rows], k_max))

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
