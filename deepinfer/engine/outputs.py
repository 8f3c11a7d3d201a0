"""What `LLM.generate` returns (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Logprob:
    """Log-probability of one token at one position; rank 1 = most likely."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated completion.

    finish_reason: "stop" (EOS, a stop token or a stop string), "length" (max_tokens or
    max_model_len), "abort" (dropped: an error in its own processing, or in the step it was
    part of) or None while unfinished. stop_reason: the stop string or stop token id
    that ended it, None for EOS or length.
    logprobs: per generated token, {token_id: Logprob} for the top-`logprobs` tokens and the
    sampled one; None when not requested.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The result of one request: its prompt and its completion(s)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
