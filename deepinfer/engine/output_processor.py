"""Output processing: sampled tokens reach the host, are appended, detokenised and checked
against the stop conditions; finished requests free their blocks.

With async scheduling this runs one step late: while the device computes step n + 1, the host
reads step n's tokens (`SampledStep`, copied back without blocking and marked by an event).
A request that finished at step n was already scheduled in step n + 1: that row is ignored.

Failure isolation: an exception while one request's token is appended and checked (its grammar
rejects the token, its detokenisation or the decoding of its logprobs fails) finishes that
request alone with finish_reason "abort" (vLLM's name), its output as it was before that token;
the other requests go on, and the error is logged. A request whose promise cannot be kept
finishes with finish_reason "error" and the reason in CompletionOutput.error: the sampler found
no token its masks allow (Sequence.error set before the draw), its grammar rejects the sampled
token, or its finished structured output fails validation (deepinfer.engine.structured).
What cannot be pinned on one request is not isolated and fails the whole generate() call
(the engine drops the requests in flight and keeps serving): the forward, the logits
processors and the draw (penalties, grammar bitmasks, top-k / top-p), the copy of the tokens
to the host, and the scheduler's and the KV-cache manager's own bookkeeping.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.engine.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from deepinfer.engine.sampler import LogprobTensors, PromptLogprobs
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.sequence import Sequence
from deepinfer.engine.structured import validate_output
from deepinfer.engine.tokenizer import Tokenizer, find_stop

logger = logging.getLogger(__name__)


@dataclass
class SampledStep:
    """A step's sampled tokens on their way to the host: seqs[i] owns tokens[i] (a host tensor
    filled by a non-blocking copy, valid once `ready` has completed), with their log-probabilities
    and the prompt log-probabilities the step computed (a step may have only those)."""

    seqs: list[Sequence]
    tokens: torch.Tensor
    logprobs: LogprobTensors | None
    ready: Any  # the backend's event, recorded after the copies
    prompt_logprobs: PromptLogprobs | None = None


class OutputProcessor:
    def __init__(
        self, scheduler: Scheduler, tokenizer: Tokenizer | None, eos_token_ids: list[int], max_model_len: int
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._token_text: dict[int, str] = {}  # token id -> its text, for Logprob.decoded_token

    def process(self, step: SampledStep) -> list[Sequence]:
        """Record the step's prompt log-probabilities, append each request's pending token;
        returns the requests that finished."""
        step.ready.synchronize()
        finished: list[Sequence] = []
        if step.prompt_logprobs is not None:
            self.add_prompt_logprobs(step.prompt_logprobs, finished)
        tokens = [int(t) for t in step.tokens[: len(step.seqs)].tolist()]
        entries = step.logprobs.entries(step.seqs, tokens) if step.logprobs is not None else {}
        for row, seq in enumerate(step.seqs):
            if seq.is_finished:
                continue  # it finished at the previous step; this row was computed in vain
            seq.num_pending = 0
            seq.pending_row = -1
            self.append_and_check(seq, tokens[row], entries.get(row), finished)
        return finished

    def add_prompt_logprobs(self, prompt_logprobs: PromptLogprobs, finished: list[Sequence]) -> None:
        """Append a step's prompt log-probabilities (in prompt order: the steps that computed
        them are processed in order) to their requests. A request whose entries fail to decode
        is aborted alone (and added to finished)."""
        for seq, first, entries in prompt_logprobs.entries():
            if seq.finish_reason == "abort" or seq.prompt_logprobs is None:
                continue
            assert len(seq.prompt_logprobs) == first, "prompt log-probabilities out of order"
            try:
                seq.prompt_logprobs.extend(self.decoded(seq, e) for e in entries)
            except Exception as exc:  # one request's failure must not fail the others' step
                now = (len(seq.token_ids), len(seq.output_logprobs), seq.cumulative_logprob, seq.output_text)
                self.abort(seq, now, exc)
                if not seq.is_finished:
                    self.scheduler.finish(seq)
                    finished.append(seq)

    def decoded(self, seq: Sequence, entry: PositionLogprobs) -> PositionLogprobs:
        """entry with each token's text (decoded_token), unless seq has detokenize=False."""
        if self.tokenizer is None or not seq.params.detokenize:
            return entry
        texts = self._token_text
        for t in entry:
            if t not in texts:
                texts[t] = self.tokenizer.decode([t], False)
        return {t: Logprob(v.logprob, v.rank, texts[t]) for t, v in entry.items()}

    def append_and_check(
        self, seq: Sequence, token: int, lp: dict[int, Logprob] | None, finished: list[Sequence]
    ) -> None:
        """append(); a request that finished is dropped from the scheduler and added to finished.
        If appending fails, the request alone is aborted (see the module docstring)."""
        before = (len(seq.token_ids), len(seq.output_logprobs), seq.cumulative_logprob, seq.output_text)
        try:
            done = self.append(seq, token, lp)
        except Exception as exc:  # one request's failure must not fail the others' step
            self.abort(seq, before, exc)
            done = True
        if done:
            self.scheduler.finish(seq)
            finished.append(seq)
        else:
            self.scheduler.block_manager.cache_full_blocks(seq)

    @staticmethod
    def abort(seq: Sequence, before: tuple[int, int, float, str], exc: Exception) -> None:
        """Finish seq with "abort": its output back to what it was before the failing token
        (`before`: number of token_ids and of logprob entries, cumulative logprob, text)."""
        num_tokens, num_logprobs, cumulative, text = before
        del seq.token_ids[num_tokens:]
        del seq.output_logprobs[num_logprobs:]
        seq.cumulative_logprob, seq.output_text = cumulative, text
        seq.finish_reason, seq.stop_reason = "abort", None
        logger.warning("request %s aborted: %s: %s", seq.request_id, type(exc).__name__, exc, exc_info=exc)

    def append(self, seq: Sequence, token: int, lp: dict[int, Logprob] | None) -> bool:
        """Add a sampled token, detokenise, check stop conditions. True if seq finished."""
        if seq.error is not None:  # the sampler left it no token: the drawn one is meaningless
            seq.finish_reason, seq.stop_reason = "error", None
            return True
        if seq.grammar is not None and not seq.grammar.accept_token(token):
            seq.error = f"token {token} was sampled against the request's grammar"
            seq.finish_reason = "error"
            return True
        seq.token_ids.append(token)
        now = time.time()
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now
        seq.metrics.last_token_time = now
        p = seq.params
        if lp is not None:
            if p.logprobs is not None:  # else only the cumulative log-probability (best_of)
                seq.output_logprobs.append(self.decoded(seq, lp))
            seq.cumulative_logprob += lp[token].logprob
        n_out = seq.num_output_tokens
        # Nothing stops the request within its first min_tokens tokens (the sampler bans EOS and
        # stop_token_ids there; a stop string must end after them), as in vLLM.
        may_stop = n_out > p.min_tokens
        if may_stop and not p.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif may_stop and p.stop_token_ids and token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif seq.grammar is not None and seq.grammar.is_terminated():  # accepted its end (EOS)
            seq.finish_reason = "stop"
        if seq.finish_reason is not None:
            # The stopping token stays in token_ids; its text only with include_stop_str_in_output.
            if seq.detokenizer is not None:
                if p.include_stop_str_in_output:
                    seq.output_text += seq.detokenizer.step(token)
                seq.output_text += seq.detokenizer.flush()
            self._validate_structured(seq)
            return True
        new_text = seq.detokenizer.step(token) if seq.detokenizer else ""
        seq.output_text += new_text
        if may_stop and p.stop_strings and new_text:
            hit = find_stop(seq.output_text, len(new_text), p.stop_strings)
            if hit is not None:
                end = hit[0] + (len(hit[1]) if p.include_stop_str_in_output else 0)
                seq.output_text = seq.output_text[:end]
                seq.finish_reason, seq.stop_reason = "stop", hit[1]
                return True
        if (p.max_tokens is not None and n_out >= p.max_tokens) or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
            if seq.detokenizer is not None:
                seq.output_text += seq.detokenizer.flush()
            return True
        return False

    def _validate_structured(self, seq: Sequence) -> None:
        """A structured output whose grammar completed, checked against the schema or regex it
        promised: a violation turns finish_reason "stop" into "error" (CompletionOutput.error)."""
        so = seq.params.structured_outputs
        if so is None or seq.grammar is None or not seq.grammar.is_terminated():
            return
        if seq.detokenizer is not None and not seq.params.include_stop_str_in_output:
            text = seq.output_text
        elif self.tokenizer is not None:
            ids = [t for t in seq.output_token_ids if t not in self.eos_token_ids]
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        else:
            return
        problem = validate_output(so, text)
        if problem is not None:
            seq.finish_reason, seq.stop_reason, seq.error = "error", None, f"structured output: {problem}"
            logger.warning("request %s: %s", seq.request_id, seq.error)

    @staticmethod
    def to_output(seq: Sequence) -> RequestOutput:
        """The output so far of the request seq heads (its completions: seq.group). finished
        exactly when every completion has a finish_reason: a request the engine dropped without
        one (abort_all) is reported as "abort". With best_of > n, the n completions of highest
        cumulative log-probability, best first."""
        group = seq.group
        completions = [OutputProcessor._completion(s) for s in group]
        n = seq.params.n
        if len(completions) > n:  # best_of: rank by the sampled tokens' log-probabilities
            completions.sort(key=lambda c: -(c.cumulative_logprob or 0.0))
            completions = completions[:n]
        for i, c in enumerate(completions):
            c.index = i
        return RequestOutput(
            seq.request_id,
            seq.prompt,
            seq.prompt_token_ids,
            list(seq.prompt_logprobs) if seq.prompt_logprobs is not None else None,
            completions,
            finished=all(s.finish_reason is not None or s.is_finished for s in group),
            metrics=OutputProcessor._metrics(group),
            num_cached_tokens=seq.num_cached_tokens,
        )

    @staticmethod
    def _completion(seq: Sequence) -> CompletionOutput:
        want_lp = seq.params.logprobs is not None
        reason = seq.finish_reason
        if reason is None and seq.is_finished:
            reason = "abort"
        return CompletionOutput(
            index=seq.index,
            text=seq.output_text,
            token_ids=seq.output_token_ids,
            cumulative_logprob=seq.cumulative_logprob if seq.needs_logprob else None,
            logprobs=list(seq.output_logprobs) if want_lp else None,
            finish_reason=reason,
            stop_reason=seq.stop_reason,
            error=seq.error,
        )

    @staticmethod
    def _metrics(group: list[Sequence]) -> RequestMetrics:
        """The request's metrics from its completions': earliest first_*, latest last / finish."""
        ms = [s.metrics for s in group]

        def pick(values: list[float | None], f: Any) -> float | None:
            known = [v for v in values if v is not None]
            return f(known) if known else None

        m = RequestMetrics(arrival_time=ms[0].arrival_time)
        m.first_scheduled_time = pick([x.first_scheduled_time for x in ms], min)
        m.first_token_time = pick([x.first_token_time for x in ms], min)
        m.last_token_time = pick([x.last_token_time for x in ms], max)
        if all(x.finished_time is not None for x in ms):
            m.finished_time = pick([x.finished_time for x in ms], max)
        if m.first_scheduled_time is not None:
            m.time_in_queue = m.first_scheduled_time - m.arrival_time
        return m
