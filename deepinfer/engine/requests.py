"""Requests: what a generate call's prompts and sampling parameters become (Sequences), checked
against the model and the engine's limits, with their seeds and request ids; and what the
model directory says of requests (its tokenizer, EOS ids, generation_config.json's sampling
parameters)."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

from deepinfer.config import EngineConfig
from deepinfer.engine.images import ImageInputError, ImageSetup, ImageSpan
from deepinfer.engine.sampler import check_token_sets
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.sequence import Sequence, SequenceStatus
from deepinfer.engine.structured import StructuredOutputs, check_first_tokens
from deepinfer.engine.tokenizer import IncrementalDetokenizer, Tokenizer, read_json_file


def _ids(value: object) -> list[int]:
    """An eos_token_id field (int, list or tuple) as a list."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return []


def check_model_dir(path: str | Path) -> Path:
    """The checkpoint directory, or a clear FileNotFoundError."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"model directory {str(path)!r} has no config.json")
    return p


SEED_MASK = 2**64 - 1


def _int64(seed: int) -> int:
    """A seed in [-2**63, 2**64) as the int64 with the same low 64 bits."""
    seed &= SEED_MASK
    return seed - 2**64 if seed >= 2**63 else seed


def completion_seed(seed: int, index: int) -> int:
    """The int64 seed of completion `index` of a request seeded `seed` (n > 1, best_of): index 0
    keeps the request's seed (so it samples what the request with n=1 samples), the others a
    splitmix64 hash of (seed, index): independent noise, the same at every run."""
    if index == 0:
        return seed
    x = (seed + index * 0x9E3779B97F4A7C15) & SEED_MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & SEED_MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & SEED_MASK
    return _int64(x ^ (x >> 31))


def load_tokenizer(config: EngineConfig, model_dir: Path) -> Tokenizer | None:
    """The tokenizer of config.tokenizer (LLM(tokenizer=...)) or of the model directory, if any."""
    directory = Path(config.tokenizer) if config.tokenizer is not None else model_dir
    return Tokenizer(directory) if (directory / "tokenizer.json").is_file() else None


def resolve_max_model_len(requested: int | None, max_positions: int) -> int:
    """max_model_len as asked (default: the model's max_position_embeddings), or ValueError."""
    if requested is None:
        return max_positions
    if requested > max_positions:
        raise ValueError(
            f"max_model_len={requested} exceeds the model's max_position_embeddings={max_positions}"
        )
    return requested


def eos_token_ids(path: Path, model_config: Any, tokenizer: Tokenizer | None, vocab_size: int) -> list[int]:
    """EOS ids from the model config, the directory's generation_config.json and the tokenizer."""
    ids = _ids(getattr(model_config, "eos_token_id", None))
    gen = path / "generation_config.json"
    if gen.is_file():
        content = read_json_file(gen)
        if not isinstance(content, dict):
            raise ValueError(f"{gen} must hold a JSON object")
        ids += _ids(content.get("eos_token_id"))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted({i for i in ids if 0 <= i < vocab_size})


def default_sampling_params(config: EngineConfig) -> SamplingParams:
    """The sampling parameters of a generate() call that passes none, as the engine argument
    generation_config says (vLLM's): "vllm" = SamplingParams(); "auto" = the model
    directory's generation_config.json; a directory (or a .json file) = that one's. From
    the file: SamplingParams() with the temperature, top_p, top_k, min_p,
    repetition_penalty and max_new_tokens (as max_tokens) that the model directory's
    generation_config.json sets, read with transformers' GenerationConfig (only the values
    that differ from its defaults, as vLLM does); plain SamplingParams() without the file.
    Read at each call (a small file), a new object each time. ValueError naming the file
    if it cannot be read or holds a value SamplingParams refuses."""
    source = config.generation_config
    if source == "vllm":
        return SamplingParams()
    path = Path(config.model if source == "auto" else source)
    if not path.is_file():
        path = path / "generation_config.json"
    if not path.is_file():
        return SamplingParams()
    from transformers import GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(
            str(path.parent), config_file_name=path.name, local_files_only=True
        )
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} cannot be read: {exc}") from exc
    given = generation.to_diff_dict()
    names = {  # generation_config.json -> SamplingParams: what vLLM takes from the model
        "temperature": "temperature",
        "top_p": "top_p",
        "top_k": "top_k",
        "min_p": "min_p",
        "repetition_penalty": "repetition_penalty",
        "max_new_tokens": "max_tokens",
    }
    kwargs = {ours: given[theirs] for theirs, ours in names.items() if given.get(theirs) is not None}
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


class Requests:
    """Turns prompts into Sequences for one engine: its tokenizer, vocabulary and max_model_len,
    a seed stream (EngineConfig.seed) for requests without a seed, and request ids."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: list[int],
        images: ImageSetup | None = None,
    ) -> None:
        """images: how this model takes images (None: a model without a vision tower refuses
        multi_modal_data)."""
        self.config, self.tokenizer, self.images = config, tokenizer, images
        self.vocab_size, self.max_model_len, self.eos_token_ids = vocab_size, max_model_len, eos_token_ids
        self._structured: StructuredOutputs | None = None  # made at the first structured request
        self._seed_rng = random.Random(config.seed)
        self._next_id = 0
        self._prefetched: dict[int, Any] = {}  # a call's images, processed (ImageSetup.prefetch)

    def make_sequence(self, prompt: str | dict[str, Any] | list[int], params: SamplingParams) -> Sequence:
        """Validate and tokenise one request (ValueError / TypeError if it cannot be served).

        The sampling parameters are validated as they are now (their fields may have changed
        since construction) and the request keeps its own copy (SamplingParams.for_request)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        params = params.for_request()
        text: str | None
        mm = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if (
            isinstance(prompt, dict)
            and "prompt_token_ids" not in prompt
            and isinstance(prompt.get("prompt"), str)
        ):
            prompt = prompt["prompt"]  # {"prompt": text}, vLLM's TextPrompt
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"{self.config.model} has no tokenizer.json: pass {{'prompt_token_ids': [...]}}"
                )
            if prompt == "":
                raise ValueError("the prompt is empty")
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
        else:
            raise TypeError(
                "a prompt must be a string, {'prompt': str} or {'prompt_token_ids': [...]}, "
                f"got {type(prompt).__name__}"
            )
        if not isinstance(ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise TypeError("prompt_token_ids must be a list of ints")
        if params.truncate_prompt_tokens is not None:  # the last k tokens (-1: those leaving room)
            ids = ids[len(ids) - params.prompt_tokens_kept(len(ids), self.max_model_len) :]
        if len(ids) == 0:
            raise ValueError("the prompt is empty (no tokens)")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        spans: list[ImageSpan] = []
        if mm is not None:
            if self.images is None:
                raise ValueError(
                    f"multi_modal_data: {self.config.model} has no vision tower (no vision_config in its "
                    "config.json); it takes text prompts only"
                )
            ids, spans = self.images.expand(list(ids), mm, self._prefetched)
        if len(ids) > self.max_model_len:  # one of exactly max_model_len gets one token (vLLM)
            raise ValueError(
                f"the prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}"
            )
        bad = [t for t in params.stop_token_ids or [] if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        for name, value in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
            if value is None:
                continue
            if value > self.vocab_size:
                raise ValueError(f"{name}={value} exceeds the vocabulary size {self.vocab_size}")
            limit, wanted = self.config.max_logprobs, self.vocab_size if value == -1 else value
            if limit >= 0 and wanted > limit:  # -1 asks for the whole vocabulary (vLLM's rule)
                raise ValueError(
                    f"{name}={value} is more than max_logprobs={limit}; raise the engine's "
                    "max_logprobs (LLM(max_logprobs=...), -1 = no limit)"
                )
        for name, ids_ in (
            ("logit_bias", list(params.logit_bias or ())),
            ("allowed_token_ids", params.allowed_token_ids or []),
        ):
            bad = [t for t in ids_ if t >= self.vocab_size]
            if bad:
                raise ValueError(
                    f"{name}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
                )
        if params.top_k >= self.vocab_size:
            params.top_k = 0  # keeps every token: off (and small enough for any backend's kernel)
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model directory has none")
        bad_words = self.bad_words_token_ids(params.bad_words) if params.bad_words else []
        check_token_sets(params, self.eos_token_ids, bad_words)
        grammar = None
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured output needs a tokenizer; this model directory has none")
            if self._structured is None:
                self._structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_token_ids)
            grammar = self._structured.matcher(params.structured_outputs)
            check_first_tokens(grammar, self.vocab_size, params.allowed_token_ids)

        seed = _int64(params.seed) if params.seed is not None else self._seed_rng.getrandbits(63)
        limit = self.max_model_len if params.max_tokens is None else len(ids) + params.max_tokens
        group: list[Sequence] = []
        for i in range(params.num_sequences):  # n > 1 / best_of: one sequence per completion
            child = params
            if i > 0 and params.prompt_logprobs is not None:  # the first completion reports them
                child = dataclasses.replace(params, prompt_logprobs=None)
            detok = (
                IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
                if self.tokenizer and params.detokenize
                else None
            )
            request_id = str(self._next_id) if i == 0 else f"{i}_{self._next_id}"  # vLLM's child ids
            seq = Sequence(
                request_id,
                text,
                list(ids),
                child,
                completion_seed(seed, i),
                detok,
                min(limit, self.max_model_len),
            )
            if grammar is not None:  # each completion walks the grammar on its own
                assert self._structured is not None and params.structured_outputs is not None
                seq.grammar = grammar if i == 0 else self._structured.matcher(params.structured_outputs)
            seq.index, seq.group, seq.bad_words_token_ids = i, group, bad_words
            seq.images = spans
            seq.needs_logprob = params.logprobs is not None or params.num_sequences > params.n
            group.append(seq)
        self._next_id += 1
        return group[0]

    def _refused(self, prompt: Any, params: SamplingParams, error: str) -> Sequence:
        """A request whose image cannot be served: finished before it starts, finish_reason
        "error" and the reason in CompletionOutput.error; the other requests run."""
        text = (
            prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
        )
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        seq = Sequence(str(self._next_id), text if isinstance(text, str) else None, list(ids or []), params)
        self._next_id += 1
        seq.finish_reason, seq.error, seq.status = "error", error, SequenceStatus.FINISHED
        seq.group = [seq]
        return seq

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's tokenisation of bad_words: each word alone and after a space (a word at the
        start of the text and inside it), the second only where it gives as many tokens and
        another first token."""
        if self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer; this model directory has none")
        out: list[list[int]] = []
        for word in words:
            alone = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if not alone or not spaced:
                raise ValueError(f"bad_words: {word!r} gives no tokens")
            out.append(alone)
            if spaced[0] != alone[0] and len(spaced) == len(alone):
                out.append(spaced)
        bad = [t for word_ids in out for t in word_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"bad_words: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return out

    def make_sequences(self, prompts: list[Any], params: list[SamplingParams]) -> list[Sequence]:
        """make_sequence for every request, all or nothing: the first bad request raises with
        its index ("prompt 3: ..."), and the engine's seed stream and request ids are left as
        they were, so a failed call does not change what the next one generates."""
        state, next_id = self._seed_rng.getstate(), self._next_id
        seqs: list[Sequence] = []
        if self.images is not None:  # every image of the call at once, on the host threads
            self._prefetched = self.images.prefetch(prompts)
        try:
            return self._make_all(prompts, params, seqs, state, next_id)
        finally:
            self._prefetched = {}

    def _make_all(
        self, prompts: list[Any], params: list[SamplingParams], seqs: list[Sequence], state: Any, next_id: int
    ) -> list[Sequence]:
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                seqs.append(self.make_sequence(prompt, p))
            except ImageInputError as exc:  # this request only: it finishes with the error
                seqs.append(self._refused(prompt, p, f"prompt {i}: {exc}"))
            except (ValueError, TypeError) as exc:
                self._seed_rng.setstate(state)
                self._next_id = next_id
                raise type(exc)(f"prompt {i}: {exc}") from exc
        return seqs
