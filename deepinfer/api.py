"""The offline API, with vLLM's names: LLM, SamplingParams, RequestOutput, CompletionOutput.

    from deepinfer import LLM, SamplingParams
    llm = LLM(model="model/tiny")
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
    print(out[0].outputs[0].text)

Bad input: every request of a generate() call is validated (and tokenised) before any work
starts; the first bad one raises ValueError / TypeError naming its index, and nothing of that
call is run. The LLM object stays usable for the next call, and so it does after an error in
the middle of a call (the requests in flight are dropped).

Threads: one LLM may be called from several threads; its calls run one at a time, each as if
it were alone. A call entered while another call on the same LLM runs in the same thread (from
a signal handler, or a callback inside the first call) is refused with a RuntimeError before it
touches the engine: the first call goes on undisturbed.

Sizes: a request's n / best_of completions run together, so each is at most max_num_seqs; a
call's sequences (every completion of every prompt) must fit in the host memory available, by
an estimate made before any is built. Expert parallelism: an error on any rank raises on every rank (see
deepinfer.parallel.rank_sync). data_parallel_size=N starts N worker processes and serves each
call over them (deepinfer.entrypoints.data_parallel).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from deepinfer.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence, beam_score
from deepinfer.engine.args import engine_config, resolve_engine_config
from deepinfer.engine.images import chat_prompt
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.outputs import CompletionOutput, Logprob, RequestOutput
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.structured import StructuredOutputsParams
from deepinfer.engine.tokenizer import ChatMessage, Tokenizer
from deepinfer.entrypoints.data_parallel import DataParallelEngine, external_launch
from deepinfer.log import TokenRates, configure_logging, progress_bar
from deepinfer.metrics import CallStats, Metric
from deepinfer.model_config import ServedModelConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]

PromptType = str | dict[str, Any]
# The keys of a prompt dict deepinfer serves (vLLM's TextPrompt / TokensPrompt hold more).
PROMPT_KEYS = ("prompt", "prompt_token_ids", "multi_modal_data")

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


# Host bytes a Sequence costs beyond its token lists (the object, its lists and dicts, metrics),
# and per token of its lists (two lists of Python ints: prompt_token_ids and token_ids), measured
# with tracemalloc on CPython 3.11 and rounded up.
SEQUENCE_BYTES = 4096
SEQUENCE_TOKEN_BYTES = 2 * 8 + 2 * 32


def _one_call_at_a_time(method: Callable[Concatenate[LLM, P], R]) -> Callable[Concatenate[LLM, P], R]:
    """The engine serves one call at a time: a call from another thread waits for it; one from
    the thread already inside a call (a signal handler, a callback) is refused."""

    @functools.wraps(method)
    def serialised(self: LLM, /, *args: P.args, **kwargs: P.kwargs) -> R:
        me = threading.get_ident()
        if self._caller == me:
            raise RuntimeError(
                f"LLM.{method.__name__}() was called while another call on the same LLM is running in this "
                "thread (from a signal handler or a callback?); the engine serves one call at a time: "
                "call it after the first returns, or from another thread (which waits its turn)"
            )
        with self._lock:
            self._caller = me
            try:
                return method(self, *args, **kwargs)
            finally:
                self._caller = None

    return serialised


def _available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_request_sizes(prompts: list[PromptType], params: list[SamplingParams], max_num_seqs: int) -> None:
    """Before any Sequence is built: each prompt dict holds only what deepinfer serves (its
    multi_modal_data is checked per request, engine.images), n / best_of of each request at
    most max_num_seqs, and the call's sequences within the host memory available (an estimate;
    ValueError naming the prompt)."""
    total = 0
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        extra = (
            sorted(str(k) for k, v in prompt.items() if k not in PROMPT_KEYS and v is not None)
            if isinstance(prompt, dict)
            else []
        )
        if extra:
            raise ValueError(
                f"prompt {i}: {', '.join(map(repr, extra))} not supported: a prompt dict holds 'prompt' "
                "(text) and/or 'prompt_token_ids' only (deepinfer serves text prompts: no multi-modal data, "
                "processor kwargs, cache salt or prompt embeddings)"
            )
        if not isinstance(p, SamplingParams):
            continue  # make_sequences names the wrong type
        n, best_of = getattr(p, "n", 1), getattr(p, "best_of", None)
        count = best_of if isinstance(best_of, int) else n
        if isinstance(count, int) and count > max_num_seqs:
            name = "best_of" if isinstance(best_of, int) else "n"
            raise ValueError(
                f"prompt {i}: {name}={count} is more than max_num_seqs={max_num_seqs}: a request's "
                f"completions run together; lower {name} or raise the engine's max_num_seqs"
            )
        length = len(prompt) if isinstance(prompt, str) else 0
        if isinstance(prompt, dict):
            ids, text = prompt.get("prompt_token_ids"), prompt.get("prompt")
            length = len(ids) if isinstance(ids, (list, tuple)) else len(text) if isinstance(text, str) else 0
        total += (count if isinstance(count, int) else 1) * (SEQUENCE_BYTES + SEQUENCE_TOKEN_BYTES * length)
    available = _available_host_bytes()
    if available is not None and total > available // 2:
        raise ValueError(
            f"this call's {len(prompts)} requests need about {total / 2**30:.3g} GiB of host memory for "
            f"their sequences, more than half the {available / 2**30:.3g} GiB available; split the call "
            "or lower n"
        )


def check_lora_request(lora_request: object) -> None:
    """vLLM's lora_request: None (or a list of None, one per prompt) is no adapter; anything else
    is an error, since deepinfer serves the checkpoint's own weights only."""
    if lora_request is None or (
        isinstance(lora_request, (list, tuple)) and all(r is None for r in lora_request)
    ):
        return
    raise ValueError(
        f"lora_request={lora_request!r}: LoRA adapters are not supported (deepinfer serves the checkpoint's "
        "own weights); pass lora_request=None, or merge the adapter into the weights first"
    )


def check_priority(priority: object, num_prompts: int) -> None:
    """vLLM's priority: one int per prompt (or one int for all). The scheduler has no priority
    policy (first come, first served, as vLLM's default policy "fcfs", which refuses priorities
    other than 0): equal priorities order nothing and are accepted, different ones are an error."""
    if priority is None:
        return
    values = [priority] if isinstance(priority, int) else priority
    if not isinstance(values, (list, tuple)) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in values
    ):
        raise TypeError(f"priority must be an int or a list of ints, one per prompt, got {priority!r}")
    if not isinstance(priority, int) and len(values) != num_prompts:
        raise ValueError(f"got {num_prompts} prompts but {len(values)} priorities")
    if len(set(values)) > 1:
        raise ValueError(
            f"priority: got different priorities ({sorted(set(values))}); deepinfer schedules a call's "
            "requests first come, first served and has no priority scheduling (vLLM's "
            "scheduling_policy='priority'): pass equal priorities, or none"
        )


class LLM:
    """An offline engine over one checkpoint (a directory, or a Hugging Face repo id in the local
    hub cache).

    Keyword arguments: the engine arguments, with vLLM's names (tokenizer, revision, backend,
    dtype, quantization, max_model_len, max_num_seqs, max_num_batched_tokens,
    gpu_memory_utilization, kv_cache_memory_bytes, block_size, seed, enable_prefix_caching,
    enforce_eager, speculative_config, enable_expert_parallel, generation_config, max_logprobs,
    trust_remote_code=False, tensor_parallel_size=1, enable_chunked_prefill=True, ...). Their one
    definition, with help and checks, is deepinfer.config.EngineConfig; `deepinfer generate
    --help` lists them and docs/vllm.md compares them with vLLM's. An unknown name is an error
    naming the nearest supported one; a bad value a ValueError naming the argument.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        configure_logging()
        config = resolve_engine_config(engine_config(model, kwargs, "LLM()"))
        self._lock = threading.Lock()
        self._caller: int | None = None  # the thread inside a call
        self._stats: CallStats | None = None  # get_metrics()'s counters, from the first call
        self._engine: LLMEngine | None = None
        # data_parallel_size > 1: the engines run in worker processes (deepinfer.entrypoints.data_parallel)
        self.data_parallel: DataParallelEngine | None = None
        if config.distributed_executor_backend == "external_launcher":  # this process is one rank
            self._engine = LLMEngine(config, backend=external_launch(config))
        elif config.data_parallel_size > 1:
            self.data_parallel = DataParallelEngine(config, LLM.from_engine)
        else:
            self._engine = LLMEngine(config)

    @classmethod
    def from_engine(cls, engine: LLMEngine | DataParallelEngine) -> LLM:
        """Wrap an engine built directly (e.g. around a random-weight model for benchmarks), or
        the calling side of data-parallel workers."""
        configure_logging()
        llm = cls.__new__(cls)
        llm._engine, llm.data_parallel = None, None
        if isinstance(engine, DataParallelEngine):
            llm.data_parallel = engine
        else:
            llm._engine = engine
        llm._lock = threading.Lock()
        llm._caller = None
        llm._stats = None
        return llm

    @property
    def llm_engine(self) -> LLMEngine:
        """This process's engine (RuntimeError with data_parallel_size > 1: the engines are in the
        worker processes; `data_parallel` is their calling side)."""
        if self._engine is None:
            raise RuntimeError(
                "with data_parallel_size > 1 the engines run in worker processes: this LLM has no "
                "llm_engine (its data_parallel attribute drives them)"
            )
        return self._engine

    def _tokenizer(self) -> Tokenizer | None:
        return self.data_parallel.tokenizer if self.data_parallel is not None else self.llm_engine.tokenizer

    def _model_name(self) -> str:
        engine = self.data_parallel if self.data_parallel is not None else self.llm_engine
        return engine.config.model

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        """The checkpoint's Hugging Face tokenizer: transformers' AutoTokenizer over its files
        (fast, local files only, no remote code), the one the engine encodes prompts with."""
        tok = self._tokenizer()
        if tok is None:
            raise ValueError(f"{self._model_name()} has no tokenizer.json")
        return tok.hf_tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters generate() and chat() use when given none (vLLM's): as the
        engine argument generation_config says, the model's generation_config.json (temperature,
        top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens) over
        SamplingParams(); a new object at each call, so a script may change its fields."""
        engine = self.data_parallel if self.data_parallel is not None else self.llm_engine
        return engine.default_sampling_params()

    @_one_call_at_a_time
    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
        priority: int | Seq[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions; outputs come back in prompt order, one RequestOutput per prompt
        (with n CompletionOutputs where SamplingParams.n > 1).

        prompts: a string, {"prompt": str}, {"prompt_token_ids": [...]}, or a list of those.
        sampling_params: one for all prompts, or one per prompt (default:
            get_default_sampling_params(): the model's generation_config.json, else SamplingParams()).
        use_tqdm: show a progress bar; or a callable that makes it (vLLM's: a tqdm class, a partial).
        lora_request: None only (vLLM's LoRA adapters: deepinfer has none; see check_lora_request).
        priority: one int per prompt (or one for all), accepted when all equal: the scheduler
            serves a call's requests first come, first served (see check_priority).
        """
        check_lora_request(lora_request)
        return self._generate(lambda: prompts, sampling_params, use_tqdm, priority)

    def _generate(
        self,
        prompts: Callable[[], PromptType | Seq[PromptType]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None,
        use_tqdm: bool | Callable[..., Any],
        priority: int | Seq[int] | None = None,
    ) -> list[RequestOutput]:
        """generate() over the prompts `prompts` returns: an error there fails the call on every
        expert-parallel rank (LLMEngine.start_call)."""
        if not isinstance(use_tqdm, bool) and not callable(use_tqdm):
            progress_bar(use_tqdm, 0, "")  # the TypeError naming it, before any work
        if self.data_parallel is not None:
            dp_prompts, params = self._requests(prompts(), sampling_params, self.data_parallel, priority)
            outputs = self.data_parallel.generate(dp_prompts, params, use_tqdm)
            self._record(outputs, self.data_parallel.config.enable_prefix_caching)
            return outputs
        engine = self.llm_engine
        seqs = engine.start_call(
            lambda: engine.make_sequences(*self._requests(prompts(), sampling_params, engine, priority))
        )
        # a request with n > 1 (or best_of) completions runs as that many sequences (seq.group)
        every = [s for seq in seqs for s in seq.group]
        desc = "Processed prompts" if len(every) == len(seqs) else "Processed completions"
        with progress_bar(use_tqdm, len(every), desc) as bar:
            engine.run_to_completion(every, TokenRates(bar).done)
        outputs = [engine.to_output(seq) for seq in seqs]
        self._record(outputs, engine.config.enable_prefix_caching)
        return outputs

    def _record(self, outputs: list[RequestOutput], prefix_caching: bool) -> None:
        """Add a finished call to get_metrics()'s counters (and, with disable_log_stats=False, log
        its throughput at INFO, as vLLM's stat logger does)."""
        engine: Any = self.data_parallel if self.data_parallel is not None else self.llm_engine
        self._call_stats(engine).record(outputs, prefix_caching)
        if not engine.config.disable_log_stats and outputs:
            starts = [o.metrics.arrival_time for o in outputs if o.metrics is not None]
            ends = [o.metrics.finished_time for o in outputs if o.metrics and o.metrics.finished_time]
            elapsed = max(ends) - min(starts) if starts and ends else 0.0
            prompt = sum(len(o.prompt_token_ids or []) for o in outputs)
            generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
            logger.info(
                "%d requests in %.2f s: prompt throughput %.1f tokens/s, generation throughput %.1f "
                "tokens/s, prefix cache hits %d tokens",
                len(outputs), elapsed, prompt / max(elapsed, 1e-9), generated / max(elapsed, 1e-9),
                sum(o.num_cached_tokens or 0 for o in outputs),
            )  # fmt: skip

    def _call_stats(self, engine: Any) -> CallStats:
        if self._stats is None:  # its token histograms' buckets go up to max_model_len
            limit = getattr(engine, "max_model_len", None) or engine.config.max_model_len
            self._stats = CallStats(limit or 1)
        return self._stats

    @property
    def model_config(self) -> ServedModelConfig:
        """vLLM's llm.model_config (also llm.llm_engine.model_config): the served model's
        max_model_len, dtype, hf_config, vocabulary size, ... (deepinfer.model_config). One
        engine only (not data_parallel_size > 1)."""
        return self.llm_engine.model_config

    def get_metrics(self) -> list[Metric]:
        """vLLM's: the engine's metrics as vllm.v1.metrics.reader's types (deepinfer.metrics:
        Counter, Gauge, Histogram; also in deepinfer.v1.metrics.reader), vLLM's names: token,
        request, preemption and prefix-cache counters, the KV cache's use, and histograms of
        time to first token, latency, queue time and token counts over this LLM's calls."""
        engine: Any = self.data_parallel if self.data_parallel is not None else self.llm_engine
        stats = self._call_stats(engine)
        if self.data_parallel is not None:
            return stats.metrics(engine.config.model, 0.0, engine.num_preemptions, None)
        blocks = engine.block_manager
        usage = 1.0 - blocks.num_free_blocks / blocks.num_blocks if blocks.num_blocks else 0.0
        spec = (engine.num_draft_tokens, engine.num_accepted_tokens) if engine.speculative else None
        return stats.metrics(engine.config.model, usage, engine.scheduler.num_preemptions, spec)

    @staticmethod
    def _requests(
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None,
        engine: LLMEngine | DataParallelEngine,
        priority: int | Seq[int] | None = None,
    ) -> tuple[list[PromptType], list[SamplingParams]]:
        """generate()'s arguments as one list of prompts and one of sampling params."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        check_priority(priority, len(prompts))
        if sampling_params is None:
            sampling_params = engine.default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        check_request_sizes(prompts, params, engine.config.max_num_seqs)
        return prompts, params

    @_one_call_at_a_time
    def chat(
        self,
        messages: list[ChatMessage] | list[list[ChatMessage]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        priority: int | Seq[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages, OpenAI
        style: content may be a list of {"type": "text", "text": ...} parts, an assistant tool-call
        turn may have content None) or to a list of conversations.

        Each is rendered by the tokenizer's apply_chat_template (get_tokenizer(); the template is
        chat_template, else the checkpoint's: chat_template.jinja or tokenizer_config.json) with
        add_generation_prompt, continue_final_message (continue the last assistant message; needs
        add_generation_prompt=False), tools (JSON schemas) and chat_template_kwargs (the template's
        own variables, e.g. DeepSeek's thinking switch), as transformers and vLLM do.

        chat_template_content_format (vLLM's): how a message's list of content parts reaches the
        template: "string" = its text parts joined by newlines, "openai" = the list of parts as
        given, "auto" = "openai" where the template loops over a content (Tokenizer
        .apply_chat_template), else "string". A part that is not text is an error naming its type.
        An assistant turn's tool-call arguments given as a JSON string (OpenAI's wire format) reach
        the template parsed, as in vLLM. lora_request and priority: as in generate().
        """
        check_lora_request(lora_request)

        def rendered() -> list[PromptType]:
            tok = self._tokenizer()
            if tok is None:
                raise ValueError(f"{self._model_name()} has no tokenizer.json")
            conversations = messages if messages and isinstance(messages[0], list) else [messages]
            prompts: list[PromptType] = []
            dp = self.data_parallel
            setup = dp.images if dp is not None else self.llm_engine.requests.images
            for conv in conversations:
                prompt = chat_prompt(
                    tok,
                    setup,
                    conv,
                    chat_template=chat_template,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    tools=tools,
                    chat_template_kwargs=chat_template_kwargs,
                    content_format=chat_template_content_format,
                )
                prompts.append(prompt)
            return prompts

        return self._generate(rendered, sampling_params, use_tqdm, priority)

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget the prefix cache, so that the next call computes every prompt token
        (e.g. between timed runs). True once done, False while a call holds blocks."""
        return self.llm_engine.reset_prefix_cache()

    def _generative_only(self, method: str, instead: str) -> ValueError:
        return ValueError(
            f"LLM.{method}() is not supported: deepinfer's engine is generative only (DeepSeek causal "
            f"language models; no pooling, embedding, classification or scoring runner); {instead}"
        )

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's pooling call: an error (the engine is generative only)."""
        raise self._generative_only("encode", "use generate() or chat()")

    def embed(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's embedding call: an error (the engine is generative only)."""
        raise self._generative_only("embed", "use an embedding model with another engine")

    def classify(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's classification call: an error (the engine is generative only)."""
        raise self._generative_only(
            "classify", "to score labels, compare their log-probabilities (SamplingParams(logprobs=...))"
        )

    def score(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's cross-encoder scoring call: an error (the engine is generative only)."""
        raise self._generative_only(
            "score", "the log-likelihood of a text is in SamplingParams(prompt_logprobs=0)'s prompt_logprobs"
        )

    def reward(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's reward-model call: an error (the engine is generative only)."""
        raise self._generative_only("reward", "use generate() or chat()")

    def _prompt_ids(self, index: int, prompt: object) -> list[int]:
        """A beam search prompt's token ids (a text prompt encoded as generate() encodes it)."""
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        tok = self._tokenizer()
        if not isinstance(text, str) or tok is None:
            raise TypeError(
                f"prompt {index}: a prompt is a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}} "
                f"(text needs the model's tokenizer), got {type(prompt).__name__}"
            )
        return tok.encode(text)

    def beam_search(
        self,
        prompts: Seq[PromptType],
        params: BeamSearchParams,
        lora_request: Any = None,
        use_tqdm: bool | Callable[..., Any] = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (deepinfer.beam_search says how): one BeamSearchOutput per prompt
        (a string, {"prompt": text} or {"prompt_token_ids": [...]}), its beam_width best beams
        first. Each step is one generate() call over the live beams of concurrency_limit prompts
        at a time (None: all); logprobs=2 * beam_width must be within the engine's max_logprobs.
        A beam that reaches max_model_len is finished."""
        check_lora_request(lora_request)
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if concurrency_limit is not None and (
            not isinstance(concurrency_limit, int) or concurrency_limit < 1
        ):
            raise ValueError(f"concurrency_limit must be an integer >= 1 or None, got {concurrency_limit!r}")
        hf = self.get_tokenizer()
        eos = hf.eos_token_id
        engine: Any = self.data_parallel if self.data_parallel is not None else self.llm_engine
        max_len = getattr(engine, "max_model_len", None) or engine.config.max_model_len
        width = params.beam_width
        step = SamplingParams(logprobs=2 * width, max_tokens=1, temperature=params.temperature)

        def key(beam: BeamSearchSequence) -> float:
            return beam_score(beam.tokens, beam.cum_logprob, eos, params.length_penalty)

        starts = [self._prompt_ids(i, prompt) for i, prompt in enumerate(prompts)]
        outputs = []
        group = concurrency_limit or max(1, len(starts))
        for first in range(0, len(starts), group):
            live = [[BeamSearchSequence(tokens=ids)] for ids in starts[first : first + group]]
            done: list[list[BeamSearchSequence]] = [[] for _ in live]
            with progress_bar(use_tqdm, params.max_tokens, "Beam search") as bar:
                for _ in range(params.max_tokens):
                    for beams, finished in zip(live, done):  # a beam with no room left is finished
                        finished += [b for b in beams if max_len is not None and len(b.tokens) >= max_len]
                        beams[:] = [b for b in beams if max_len is None or len(b.tokens) < max_len]
                    batch = [b for beams in live for b in beams]
                    if not batch:
                        break
                    results = iter(
                        self.generate([{"prompt_token_ids": b.tokens} for b in batch], step, use_tqdm=False)
                    )
                    for beams, finished in zip(live, done):
                        candidates = []
                        for beam in beams:
                            out = next(results).outputs[0]
                            if not out.logprobs:  # aborted or failed: the beam ends here
                                continue
                            position = out.logprobs[0]
                            for token_id, lp in position.items():
                                child = BeamSearchSequence(
                                    tokens=[*beam.tokens, token_id],
                                    logprobs=[*beam.logprobs, position],
                                    cum_logprob=beam.cum_logprob + lp.logprob,
                                )
                                if token_id == eos and not params.ignore_eos:
                                    finished.append(child)
                                else:
                                    candidates.append(child)
                        beams[:] = sorted(candidates, key=key, reverse=True)[:width]
                    bar.update(1)
            for beams, finished in zip(live, done):
                best = sorted(finished + beams, key=key, reverse=True)[:width]
                for beam in best:
                    beam.text = str(hf.decode(beam.tokens))
                outputs.append(BeamSearchOutput(sequences=best))
        return outputs
