"""What `LLM.generate` returns (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    """Log-probability of one token at one position; rank 1 = most likely. decoded_token: the
    token's text (None with detokenize=False or without a tokenizer)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# One position's log-probabilities: {token_id: Logprob} (the top-k and the token actually there).
PositionLogprobs = dict[int, Logprob]


@dataclass
class RequestMetrics:
    """When a request went through the engine (vLLM's RequestMetrics), in seconds since the epoch
    (time.time()).

    arrival_time: the request was validated and queued (generate() was called).
    first_scheduled_time: a step first computed some of its tokens.
    first_token_time / last_token_time: the host received its first / latest output token.
    finished_time: it finished (or was aborted).
    time_in_queue: first_scheduled_time - arrival_time.
    scheduler_time, model_forward_time, model_execute_time: not measured (None), kept for code
    that reads vLLM's names.
    For a request with several completions (n > 1): the earliest first_* and the latest last
    token and finish over its completions.
    """

    arrival_time: float
    last_token_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time_in_queue: float | None = None
    finished_time: float | None = None
    scheduler_time: float | None = None
    model_forward_time: float | None = None
    model_execute_time: float | None = None


@dataclass
class CompletionOutput:
    """One generated completion.

    index: its place among the request's completions, 0 .. n-1 (with best_of > n, the best
        first: highest cumulative_logprob).
    text: the generated text ("" with detokenize=False).
    finish_reason: "stop" (EOS, a stop token or a stop string), "length" (max_tokens or
    max_model_len), "abort" (dropped: an error in its own processing, or in the step it was
    part of), "error" (a promise the request asked for could not be kept: its structured
    output violates the schema or regex, or no token was left to sample; `error` says why) or
    None while unfinished. stop_reason: the stop string or stop token id that ended it, None
    for EOS or length.
    error: why the completion finished with "error" (None otherwise).
    cumulative_logprob: the sum of the sampled tokens' log-probabilities (from the raw model
        logits); None unless logprobs was asked for or best_of > n.
    logprobs: per generated token, {token_id: Logprob} for the top-`logprobs` tokens and the
    sampled one (every token with logprobs=-1); None when not requested.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The result of one request: its prompt and its completion(s), in vLLM's field order.

    prompt_token_ids: the prompt as computed (after truncate_prompt_tokens).
    prompt_logprobs: with SamplingParams.prompt_logprobs, one entry per prompt token: None for
        the first, then {token_id: Logprob} for the top-k tokens at that position and the prompt
        token itself (its log-probability given the tokens before it); else None.
    outputs: n CompletionOutputs, index 0 .. n-1.
    metrics: timestamps (RequestMetrics). num_cached_tokens: prompt tokens served from the
        prefix cache when the request was first scheduled.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = field(default=None)
