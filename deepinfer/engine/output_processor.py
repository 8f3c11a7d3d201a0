"""Output processing: sampled tokens reach the host, are appended, detokenised and checked
against the stop conditions; finished requests free their blocks.

With async scheduling this runs one step late: while the device computes step n + 1, the host
reads step n's tokens (`SampledStep`, copied back without blocking and marked by an event).
A request that finished at step n was already scheduled in step n + 1: that row is ignored.

Failure isolation: an exception while one request's token is appended and checked (its grammar
rejects the token, its detokenisation or the decoding of its logprobs fails) finishes that
request alone with finish_reason "abort" (vLLM's name), its output as it was before that token;
the other requests go on, and the error is logged. What cannot be pinned on one request is not
isolated and fails the whole generate() call (the engine drops the requests in flight and keeps
serving): the forward, the logits processors and the draw (penalties, grammar bitmasks, top-k /
top-p), the copy of the tokens to the host, and the scheduler's and the KV-cache manager's own
bookkeeping.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.engine.outputs import CompletionOutput, Logprob, RequestOutput
from deepinfer.engine.sampler import LogprobTensors
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.sequence import Sequence
from deepinfer.engine.tokenizer import Tokenizer, find_stop

logger = logging.getLogger(__name__)


@dataclass
class SampledStep:
    """A step's sampled tokens on their way to the host: seqs[i] owns tokens[i] (a host tensor
    filled by a non-blocking copy, valid once `ready` has completed)."""

    seqs: list[Sequence]
    tokens: torch.Tensor
    logprobs: LogprobTensors | None
    ready: Any  # the backend's event, recorded after the copies


class OutputProcessor:
    def __init__(
        self, scheduler: Scheduler, tokenizer: Tokenizer | None, eos_token_ids: list[int], max_model_len: int
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def process(self, step: SampledStep) -> list[Sequence]:
        """Append each request's pending token; returns the requests that finished."""
        step.ready.synchronize()
        tokens = [int(t) for t in step.tokens[: len(step.seqs)].tolist()]
        entries = step.logprobs.entries(step.seqs, tokens) if step.logprobs is not None else {}
        finished: list[Sequence] = []
        for row, seq in enumerate(step.seqs):
            if seq.is_finished:
                continue  # it finished at the previous step; this row was computed in vain
            seq.num_pending = 0
            seq.pending_row = -1
            self.append_and_check(seq, tokens[row], entries.get(row), finished)
        return finished

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
        seq.token_ids.append(token)
        p = seq.params
        if lp is not None:
            if self.tokenizer is not None:
                lp = {t: Logprob(v.logprob, v.rank, self.tokenizer.decode([t], False)) for t, v in lp.items()}
            seq.output_logprobs.append(lp)
            seq.cumulative_logprob += lp[token].logprob
        if seq.grammar is not None and not seq.grammar.accept_token(token):
            raise RuntimeError(f"request {seq.request_id}: token {token} was sampled against its grammar")
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

    @staticmethod
    def to_output(seq: Sequence) -> RequestOutput:
        """The request's output so far. finished exactly when finish_reason is set: a request the
        engine dropped without one (abort_all) is reported as "abort"."""
        want_lp = seq.params.logprobs is not None
        reason = seq.finish_reason
        if reason is None and seq.is_finished:
            reason = "abort"
        completion = CompletionOutput(
            index=0,
            text=seq.output_text,
            token_ids=seq.output_token_ids,
            cumulative_logprob=seq.cumulative_logprob if want_lp else None,
            logprobs=seq.output_logprobs if want_lp else None,
            finish_reason=reason,
            stop_reason=seq.stop_reason,
        )
        return RequestOutput(
            seq.request_id, seq.prompt, seq.prompt_token_ids, [completion], finished=reason is not None
        )
