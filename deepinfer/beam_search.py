"""Beam search as vLLM's `LLM.beam_search` runs it (vllm.beam_search, BeamSearchParams in
vllm.sampling_params): each step asks the engine for the 2 * beam_width most likely next tokens
of every live beam (one generate() call, max_tokens=1, logprobs=2 * beam_width), extends each
beam by each of them, moves the candidates that end in EOS to the finished ones, and keeps the
beam_width best of the rest; at the end the beam_width best of the finished and live beams are
returned. A beam's score is its cumulative log-probability / length ** length_penalty, the
length counting the prompt and leaving a final EOS out (transformers' rule, as in vLLM)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from deepinfer.engine.outputs import Logprob


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams. beam_width >= 1 beams of at most max_tokens >= 1 new tokens;
    temperature scales the logits the candidates are drawn from (0 = the most likely ones);
    ignore_eos keeps a beam going past EOS; length_penalty the exponent of the length in the
    score. include_stop_str_in_output: vLLM's field, here as there without effect on
    LLM.beam_search (it returns the whole text)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")


@dataclass
class BeamSearchSequence:
    """One beam: tokens = the prompt's then the generated ones; logprobs = per generated token,
    the candidates of that step ({token id: Logprob}); text = the decoded tokens (prompt
    included), set on the returned beams."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    lora_request: None = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The beam_width best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(
    tokens: list[int], cum_logprob: float, eos_token_id: int | None, length_penalty: float
) -> float:
    """cum_logprob / length ** length_penalty, a final EOS left out of the length (vLLM's
    get_beam_search_score)."""
    length = len(tokens) - (1 if tokens and tokens[-1] == eos_token_id else 0)
    return float(cum_logprob / length**length_penalty)
