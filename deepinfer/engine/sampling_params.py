"""SamplingParams: how one request is decoded (vLLM's names and defaults)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from deepinfer.engine.structured import StructuredOutputsParams

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): logits / temperature would
# overflow float32 for the tiniest ones, and argmax is the limit of sampling anyway.
GREEDY_TEMPERATURE = 1e-5
# torch.Generator.manual_seed takes seeds in [-2**63, 2**64).
SEED_MIN, SEED_END = -(2**63), 2**64


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """Decoding parameters of one request. Invalid values raise ValueError at construction.

    temperature: 0 = greedy (so is anything below 1e-5, as in vLLM); otherwise logits /
        temperature before filtering.
    top_p: keep the smallest set of tokens whose probability reaches top_p, in (0, 1].
    top_k: keep the k most likely tokens; 0 or -1 = off.
    min_p: drop tokens whose probability is below min_p * the top probability, in [0, 1].
    seed: per-request seed; the tokens then do not depend on the other requests in the batch.
    max_tokens: most tokens to generate (None: up to max_model_len).
    min_tokens: no EOS / stop_token_ids before this many tokens.
    stop: string(s) that end generation; the stop string is not included in the text.
    include_stop_str_in_output: keep the stop string (or the text of the EOS / stop token) at
        the end of the text.
    stop_token_ids: token ids that end generation (kept in token_ids).
    ignore_eos: keep generating after EOS.
    logprobs: return the log-probabilities of this many most likely tokens (and of the sampled
        one) at each generated position; None = off. Taken from the raw model logits.
    presence_penalty, frequency_penalty: subtracted from the logits of tokens already generated
        (once / per occurrence), each in [-2, 2].
    repetition_penalty: > 1 discourages tokens seen in the prompt or output (logit / p if
        positive, * p if negative); 1 = off.
    skip_special_tokens: leave special tokens out of the text.
    structured_outputs: constrain the output to a JSON schema, a regex, a choice of strings or
        an EBNF grammar (StructuredOutputsParams; needs xgrammar).
    n, best_of: vLLM's completions per prompt; only 1 is supported (send a prompt several times,
        with different seeds, for several completions).

    Text: a stop string is cut from the text; EOS and stop_token_ids are kept in token_ids but
    their own text is left out, unless include_stop_str_in_output (as in vLLM). A stop string counts
    only once it ends after the first min_tokens tokens, as EOS and stop_token_ids only may be
    sampled from token min_tokens + 1 on.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    n: int = 1
    best_of: int | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        def number(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            return float(value)

        if number("temperature") < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < number("top_p") <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 = off), got {self.top_k!r}")
        if not 0.0 <= number("min_p") <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed < SEED_END):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64) or None, got {self.seed!r}")
        for name in ("n", "best_of"):
            value = getattr(self, name)
            if value is None and name == "best_of":
                continue
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
            if value != 1:
                raise ValueError(
                    f"{name}={value}: several completions per prompt are not supported; "
                    "send the prompt that many times (with different seeds) instead"
                )
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 (or None), got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        self.stop_strings = self._check_stop(self.stop)
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids
            ):
                raise ValueError(
                    f"stop_token_ids must be a list of token ids >= 0, got {self.stop_token_ids!r}"
                )
            self.stop_token_ids = list(self.stop_token_ids)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be an integer >= 0 (or None), got {self.logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= number(name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams, "
                f"got {type(self.structured_outputs).__name__}"
            )
        if self.structured_outputs is not None and self.min_tokens:
            raise ValueError(
                "min_tokens cannot be combined with structured_outputs: the grammar decides where "
                "the output ends (it may allow only EOS before min_tokens)"
            )
        if number("repetition_penalty") <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")

    @staticmethod
    def _check_stop(stop: object) -> tuple[str, ...]:
        if stop is None:
            return ()
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        if any(s == "" for s in stop):
            raise ValueError("stop strings must not be empty")
        return tuple(stop)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
