"""Sequence: one request's state as it moves through the engine."""

from __future__ import annotations

from enum import Enum, auto
from typing import TYPE_CHECKING, Any

from deepinfer.engine.outputs import Logprob
from deepinfer.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
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
        self.num_cached_tokens = 0  # prefix-cache hits at the last admission
        self.num_preemptions = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # prefix-cache hashes of the full blocks, in order
        self.output_text = ""
        self.output_logprobs: list[dict[int, Logprob]] = []
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.grammar: Any = None  # xgrammar.GrammarMatcher of a structured-output request
        self.draft: list[int] = []  # speculative tokens after token_ids, verified next step
        self.num_pending = 0  # tokens sampled on the device, not yet in token_ids (0 or 1)
        self.pending_row = -1  # the sampler output row of the pending token

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
