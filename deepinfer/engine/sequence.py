"""Sequence: one request's state as it moves through the engine."""

from __future__ import annotations

import time
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

from deepinfer.engine.outputs import PositionLogprobs, RequestMetrics
from deepinfer.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deepinfer.engine.images import ImageSpan
    from deepinfer.engine.tokenizer import IncrementalDetokenizer


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """A request: prompt + generated tokens, KV blocks, progress and stop state.

    token_ids holds the prompt followed by the output tokens the host has seen. With async
    scheduling one more token may be pending: sampled by a step still on the device, counted in
    num_tokens (the scheduler plans with it) and fed to the next step as a placeholder for row
    pending_row of the sampler's output, appended to token_ids once the host reads it.
    num_computed_tokens counts the tokens whose K rows are in the cache (or are written by a
    step already launched); after a preemption it returns to 0 and the whole prompt + output so
    far is recomputed (prefill) before the next token is sampled.

    A request with several completions (n > 1 or best_of) is several Sequences, one per
    completion (`index`), each sampled with its own seed; `group` lists them all, in index order,
    and is shared by them (a request of one completion: [self]).

    Prompt log-probabilities: prompt_logprobs holds the host's entries so far (None for position
    0, then one per prompt token); prompt_logprob_pos is the next prompt position whose
    log-probability a step has yet to compute (a recompute after preemption does not repeat
    the positions already launched).
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int = 0,
        detokenizer: IncrementalDetokenizer | None = None,
        max_total_tokens: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.params = params
        self.seed = seed  # int64: with the position sampled, it fixes the sampling noise
        # prompt + output never exceed this (max_tokens, max_model_len)
        self.max_total_tokens = max_total_tokens if max_total_tokens is not None else 2**62
        self.detokenizer = detokenizer
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None  # prefix-cache hits at the first admission
        self.num_preemptions = 0
        self.block_table: list[int] = []
        # group g's blocks, for a model with several KV cache groups (block_tables[0] is block_table)
        self.block_tables: list[list[int]] = [self.block_table]
        self.block_hashes: list[int] = []  # prefix-cache hashes of the full blocks, in order
        self.output_text = ""
        self.output_logprobs: list[PositionLogprobs] = []
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None  # finish_reason "error": why (a broken promise)
        self.images: list[ImageSpan] = []  # the prompt's images, in order (engine.images)
        self.grammar: Any = None  # xgrammar.GrammarMatcher of a structured-output request
        self.draft: list[int] = []  # speculative tokens after token_ids, verified next step
        self.num_pending = 0  # tokens sampled on the device, not yet in token_ids (0 or 1)
        self.pending_row = -1  # the sampler output row of the pending token
        self.index = 0  # which completion of its request this is
        self.group: list[Sequence] = [self]  # every completion of the request, in index order
        # the sampled tokens' log-probabilities are needed (logprobs, or best_of ranks completions)
        self.needs_logprob = params.logprobs is not None
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.prompt_logprob_pos = 1
        self.bad_words_token_ids: list[list[int]] = []  # the tokenised bad_words
        self.logits_state: dict[str, Any] = {}  # device tensors the sampler caches (bias, masks)
        self.metrics = RequestMetrics(arrival_time=time.time())

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens, the pending one included."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """Output tokens the host has seen."""
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt positions whose log-probability is still to be computed."""
        return self.prompt_logprobs is not None and self.prompt_logprob_pos < self.num_prompt_tokens

    @property
    def is_prefilling(self) -> bool:
        """More than one token to compute before the next sample (a prompt or a recompute)."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={len(self.block_table)}, {self.status.name})"
        )
