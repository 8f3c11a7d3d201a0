"""SamplingParams: how one request is decoded (vLLM's names and defaults).

Validation happens from the object as it is when a request is added, not only at construction:
vLLM's own examples change fields afterwards (`sp.stop = [...]`, `sp.n = 3`). `validate()` checks
every field (type, range, finiteness); the constructor calls it, and so does the engine for each
request it adds, which then runs with its own checked copy (`for_request()`): values derived from
the fields (the stop strings) are those of that moment, and later changes to the caller's object
reach the next request, never one already in flight.
"""

from __future__ import annotations

import copy
import math
import numbers
from dataclasses import KW_ONLY, dataclass, fields
from enum import Enum
from typing import Any

from deepinfer.engine.structured import StructuredOutputsParams
from deepinfer.engine.tokenizer import lone_surrogate

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): logits / temperature would
# overflow float32 for the tiniest ones, and argmax is the limit of sampling anyway.
GREEDY_TEMPERATURE = 1e-5
# torch.Generator.manual_seed takes seeds in [-2**63, 2**64).
SEED_MIN, SEED_END = -(2**63), 2**64
# The sampler holds top_k in int64 and temperatures and penalties in float32: a value past these
# would overflow there (and e.g. -inf / inf logits turn into NaN), so it is refused up front.
INT64_MAX = 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32
# A request's logit_bias values are clamped to this range (vLLM's and OpenAI's [-100, 100]): a
# bias of 3.4e38 on every token would turn the logits into inf - inf = NaN.
LOGIT_BIAS_LIMIT = 100.0
UNSEEDED = -1  # seed=-1 means no seed of the request's own (vLLM)


def _is_int(x: object) -> bool:
    """An integer (Python's or numpy's), but not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _short(value: object) -> str:
    """repr(value), cut to 200 characters (a bad logit_bias may hold a whole vocabulary)."""
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _is_number(x: object) -> bool:
    """A finite real number (not a bool)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


class RequestOutputKind(Enum):
    """vLLM's: what a streaming engine reports per step. Offline calls return final outputs."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(slots=True)
class SamplingParams:
    """Decoding parameters of one request. Invalid values raise ValueError, naming the field and
    the value, at construction and again when a request is added (fields may change in between;
    setting a field that does not exist is an AttributeError, as in vLLM). The first sixteen
    fields (n ... prompt_logprobs) may be given by position, in vLLM's order; the rest by keyword.

    temperature: 0 = greedy (so is anything below 1e-5, as in vLLM); otherwise logits /
        temperature before filtering. At most float32's largest value.
    top_p: keep the smallest set of tokens whose probability reaches top_p, in (0, 1].
    top_k: keep the k most likely tokens; 0 or -1 = off; below 2**63 (a k past the vocabulary
        keeps every token).
    min_p: drop tokens whose probability is below min_p * the top probability, in [0, 1].
    seed: per-request seed in [-2**63, 2**64); the tokens then do not depend on the other
        requests in the batch. -1 (or None) = unseeded: the engine's seed stream picks one (vLLM).
    max_tokens: most tokens to generate, >= 1 (None: up to max_model_len).
    min_tokens: no EOS / stop_token_ids before this many tokens, in [0, max_tokens].
    stop: string(s) that end generation; the stop string is not included in the text.
    include_stop_str_in_output: keep the stop string (or the text of the EOS / stop token) at
        the end of the text.
    stop_token_ids: token ids that end generation (kept in token_ids), each in [0, vocab size).
    ignore_eos: keep generating after EOS.
    logprobs: return the log-probabilities of this many most likely tokens (and of the sampled
        one) at each generated position, in [0, vocab size]; -1 = the whole vocabulary; None =
        off. Taken from the raw model logits (before penalties, biases and masks).
    prompt_logprobs: the same for each prompt token (the log-probability of the token given the
        tokens before it, and the top-k there); the first prompt token gets None. Requests
        with prompt_logprobs do not read the prefix cache (every prompt position is computed).
    presence_penalty, frequency_penalty: subtracted from the logits of tokens already generated
        (once / per occurrence), each in [-2, 2].
    repetition_penalty: > 1 discourages tokens seen in the prompt or output (logit / p if
        positive, * p if negative); 1 = off; a normal float32 (about 1.2e-38 to 3.4e38).
    skip_special_tokens: leave special tokens out of the text.
    structured_outputs: constrain the output to a JSON schema, a regex, a choice of strings or
        an EBNF grammar (StructuredOutputsParams; needs xgrammar). Not with min_tokens.
    n: completions returned per prompt, >= 1. Each is sampled independently, with its own seed
        derived from the request's (completion 0 uses the request's seed itself, so it equals
        the n=1 request with that seed).
    best_of: completions generated, >= n (None: n); the n with the highest cumulative
        log-probability are returned, best first.
    logit_bias: {token id: bias} added to the logits before sampling (finite biases, clamped to
        [-100, 100] as vLLM does).
    allowed_token_ids: only these token ids may be sampled (a non-empty list).
    bad_words: words that may not be generated: each word is tokenised (alone and after a
        space, as vLLM does) and the last token of a tokenisation is banned whenever the output
        so far ends with its other tokens.
    truncate_prompt_tokens: keep only the last k prompt tokens (k >= 1); -1 = as many as leave
        room for max_tokens within max_model_len (an error when max_tokens alone fills it);
        None = keep the whole prompt.
    detokenize: False = no text (token ids only; no stop strings, logprobs without
        decoded_token).
    spaces_between_special_tokens: vLLM's flag for its slow-tokenizer detokeniser; a bool. The
        text comes from the fast tokenizer's decoder either way, as in vLLM's fast detokeniser.
    output_kind: vLLM's RequestOutputKind; LLM.generate returns each request's final output
        whatever it says (vLLM's LLM sets FINAL_ONLY).
    logits_processors: None only: per-request logits processors are an error, as in vLLM V1
        (logit_bias, allowed_token_ids, bad_words and structured_outputs cover their uses).
    extra_args: a dict for plugins; no part of the engine reads it (as vLLM's in-tree code).

    Text: a stop string is cut from the text; EOS and stop_token_ids are kept in token_ids but
    their own text is left out, unless include_stop_str_in_output (as in vLLM). A stop string counts
    only once it ends after the first min_tokens tokens, as EOS and stop_token_ids only may be
    sampled from token min_tokens + 1 on.
    """

    # vLLM's order, so that positional arguments mean what they mean there (SamplingParams(2) is
    # n=2); the fields after prompt_logprobs differ between vLLM versions: keywords only.
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    _: KW_ONLY
    detokenize: bool = True
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    best_of: int | None = None
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logits_processors: Any = None
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.seed == UNSEEDED:
            self.seed = None  # vLLM's rule
        self.validate()
        if isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)

    def validate(self) -> None:
        """Check every field as it is now; ValueError naming the first bad field and its value.
        Limits that depend on the model (token ids and logprobs below the vocabulary size, a
        tokenizer for stop strings) are the engine's to check when it adds the request."""

        def number(name: str) -> float:
            value = getattr(self, name)
            if not _is_number(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            return float(value)

        def integer(name: str, what: str, low: int, high: int | None = None, none_ok: bool = False) -> None:
            value = getattr(self, name)
            if value is None and none_ok:
                return
            if not _is_int(value) or value < low or (high is not None and value > high):
                raise ValueError(f"{name} must be {what}, got {value!r}")

        temperature = number("temperature")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if temperature > FLOAT32_MAX:
            raise ValueError(
                f"temperature must be at most {FLOAT32_MAX:.4g} (float32), got {self.temperature!r}"
            )
        if not 0.0 < number("top_p") <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        integer("top_k", "an integer in [-1, 2**63) (0 or -1 = off)", -1, INT64_MAX)
        if not 0.0 <= number("min_p") <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        integer("seed", "an integer in [-2**63, 2**64) or None", SEED_MIN, SEED_END - 1, none_ok=True)
        integer("n", "an integer >= 1", 1)
        integer("best_of", f"an integer >= n ({self.n}) or None", self.n, none_ok=True)
        integer("max_tokens", "an integer >= 1 (or None)", 1, none_ok=True)
        integer("min_tokens", "an integer >= 0", 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens!r}) must not exceed max_tokens ({self.max_tokens!r})"
            )
        self._check_stop(self.stop)
        ids = self.stop_token_ids
        if ids is not None and (
            not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids)
        ):
            raise ValueError(f"stop_token_ids must be a list of token ids >= 0, got {ids!r}")
        for name in (
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "detokenize",
            "spaces_between_special_tokens",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not self.detokenize and self.stop_strings:
            raise ValueError(
                f"stop strings need detokenize=True (they are matched in the text), got stop={self.stop!r}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            integer(name, "an integer >= -1 (-1 = the whole vocabulary) or None", -1, none_ok=True)
        self._check_logits_processors()
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.logits_processors:
            raise ValueError(
                "per-request logits_processors are not supported (nor in vLLM V1): use logit_bias, "
                "allowed_token_ids, bad_words or structured_outputs"
            )
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict or None, got {type(self.extra_args).__name__}")
        value = self.truncate_prompt_tokens
        if value is not None and (not _is_int(value) or (value < 1 and value != -1)):
            raise ValueError(
                f"truncate_prompt_tokens must be an integer >= 1, -1 (max_model_len) or None, got {value!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= number(name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not FLOAT32_TINY <= number("repetition_penalty") <= FLOAT32_MAX:
            raise ValueError(
                "repetition_penalty must be > 0 (1 = off) and a normal float32, "
                f"got {self.repetition_penalty!r}"
            )
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams, "
                f"got {type(self.structured_outputs).__name__}"
            )
        if self.structured_outputs is not None and self.min_tokens:
            raise ValueError(
                "min_tokens cannot be combined with structured_outputs: the grammar decides where the "
                f"output ends (it may allow only EOS before min_tokens); got min_tokens={self.min_tokens!r}"
            )

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's clone)."""
        return copy.deepcopy(self)

    @classmethod
    def from_optional(cls, **kwargs: Any) -> SamplingParams:
        """vLLM's from_optional: SamplingParams(**kwargs) with the arguments that are None left
        to their defaults."""
        return cls(**{k: v for k, v in kwargs.items() if v is not None})

    def for_request(self) -> SamplingParams:
        """validate(), then a copy of the fields as they are now: what one request runs with.
        Numbers become Python ints / floats (numpy's too), stop and stop_token_ids new lists, so
        later changes to this object (or to its lists) do not reach the request."""
        self.validate()
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            values[name] = float(values[name])
        for name in (
            "top_k",
            "seed",
            "max_tokens",
            "min_tokens",
            "logprobs",
            "n",
            "best_of",
            "prompt_logprobs",
            "truncate_prompt_tokens",
        ):
            if values[name] is not None:
                values[name] = int(values[name])
        if values["seed"] == UNSEEDED:
            values["seed"] = None
        values["stop"] = list(self.stop_strings) or None
        if self.stop_token_ids is not None:
            values["stop_token_ids"] = [int(t) for t in self.stop_token_ids]
        if self.logit_bias is not None:
            values["logit_bias"] = {
                int(t): min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(b)))
                for t, b in self.logit_bias.items()
            }
        if self.allowed_token_ids is not None:
            values["allowed_token_ids"] = [int(t) for t in self.allowed_token_ids]
        if self.bad_words is not None:
            values["bad_words"] = list(self.bad_words)
        if self.extra_args is not None:
            values["extra_args"] = dict(self.extra_args)
        return SamplingParams(**values)

    def _check_logits_processors(self) -> None:
        """logit_bias, allowed_token_ids, bad_words (the token ids' upper bound is the engine's)."""
        bias = self.logit_bias
        if bias is not None and (
            not isinstance(bias, dict)
            or not all(_is_int(t) and t >= 0 for t in bias)
            or not all(_is_number(b) and abs(b) <= FLOAT32_MAX for b in bias.values())
        ):
            raise ValueError(
                f"logit_bias must be a dict of token id (>= 0) -> finite bias, got {_short(bias)}"
            )
        ids = self.allowed_token_ids
        if ids is not None and (
            not isinstance(ids, (list, tuple)) or not ids or not all(_is_int(t) and t >= 0 for t in ids)
        ):
            raise ValueError(
                f"allowed_token_ids must be a non-empty list of token ids >= 0, got {_short(ids)}"
            )
        words = self.bad_words
        if words is not None and (
            not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words)
        ):
            raise ValueError(f"bad_words must be a list of non-blank strings, got {_short(words)}")
        for i, word in enumerate(words or ()):
            problem = lone_surrogate(word)
            if problem:
                raise ValueError(f"bad_words[{i}] holds {problem}; it is not valid Unicode text")

    @staticmethod
    def _check_stop(stop: object) -> None:
        if stop is None:
            return
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        if any(s == "" for s in stop):
            raise ValueError(f"stop strings must not be empty, got {stop!r}")
        for i, s in enumerate(stop):
            problem = lone_surrogate(s)
            if problem:
                raise ValueError(f"stop[{i}] holds {problem}; it is not valid Unicode text")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The stop strings, from `stop` as it is now (a string is one stop string)."""
        stop = self.stop
        if stop is None:
            return ()
        return (stop,) if isinstance(stop, str) else tuple(stop)

    def prompt_tokens_kept(self, num_prompt_tokens: int, max_model_len: int) -> int:
        """How many of a prompt's last tokens truncate_prompt_tokens keeps. -1: those that leave
        room for max_tokens (one token when None) within max_model_len; ValueError when the
        prompt is too long and max_tokens leaves no room for any."""
        k = self.truncate_prompt_tokens
        if k is None:
            return num_prompt_tokens
        if k != -1:
            return min(k, num_prompt_tokens)
        room = max_model_len - (self.max_tokens or 1)
        if num_prompt_tokens > room and room < 1:
            raise ValueError(
                f"truncate_prompt_tokens=-1: max_tokens={self.max_tokens} leaves no room for the prompt "
                f"within max_model_len={max_model_len}; lower max_tokens or pass truncate_prompt_tokens=k"
            )
        return min(num_prompt_tokens, room)

    @property
    def num_sequences(self) -> int:
        """Completions generated for the request: best_of, or n."""
        return self.n if self.best_of is None else self.best_of

    @property
    def has_logits_processors(self) -> bool:
        """Whether the logits need processing before the draw (besides temperature and the
        top-k / top-p / min-p filters)."""
        return (
            self.has_penalties
            or self.min_tokens > 0
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or bool(self.bad_words)
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
