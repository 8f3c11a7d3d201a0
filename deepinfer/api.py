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
import threading
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from tqdm.auto import tqdm

from deepinfer.engine.args import engine_config, resolve_engine_config
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.outputs import CompletionOutput, Logprob, RequestOutput
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.structured import StructuredOutputsParams
from deepinfer.engine.tokenizer import ChatMessage, Tokenizer
from deepinfer.entrypoints.data_parallel import DataParallelEngine, external_launch
from deepinfer.log import configure_logging

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]

PromptType = str | dict[str, Any]

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
    """Before any Sequence is built: each prompt dict holds only what deepinfer serves (no
    multi_modal_data yet), n / best_of of each request at most max_num_seqs, and the call's
    sequences within the host memory available (an estimate; ValueError naming the prompt)."""
    total = 0
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            raise ValueError(
                f"prompt {i}: multi_modal_data is not supported yet (deepinfer serves text prompts only; "
                "image input is planned with the vision tower)"
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

    @_one_call_at_a_time
    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate completions; outputs come back in prompt order, one RequestOutput per prompt
        (with n CompletionOutputs where SamplingParams.n > 1).

        prompts: a string, {"prompt": str}, {"prompt_token_ids": [...]}, or a list of those.
        sampling_params: one for all prompts, or one per prompt (default: the model's
            generation_config.json, else SamplingParams(); see LLMEngine.default_sampling_params).
        """
        return self._generate(lambda: prompts, sampling_params, use_tqdm)

    def _generate(
        self,
        prompts: Callable[[], PromptType | Seq[PromptType]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        """generate() over the prompts `prompts` returns: an error there fails the call on every
        expert-parallel rank (LLMEngine.start_call)."""
        if self.data_parallel is not None:
            dp_prompts, params = self._requests(prompts(), sampling_params, self.data_parallel)
            return self.data_parallel.generate(dp_prompts, params, use_tqdm)
        engine = self.llm_engine
        seqs = engine.start_call(
            lambda: engine.make_sequences(*self._requests(prompts(), sampling_params, engine))
        )
        # a request with n > 1 (or best_of) completions runs as that many sequences (seq.group)
        every = [s for seq in seqs for s in seq.group]
        desc = "Processed prompts" if len(every) == len(seqs) else "Processed completions"
        with tqdm(total=len(every), desc=desc, disable=not use_tqdm, dynamic_ncols=True) as bar:
            engine.run_to_completion(every, bar)
        return [engine.to_output(seq) for seq in seqs]

    @staticmethod
    def _requests(
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None,
        engine: LLMEngine | DataParallelEngine,
    ) -> tuple[list[PromptType], list[SamplingParams]]:
        """generate()'s arguments as one list of prompts and one of sampling params."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
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
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages, OpenAI
        style: content may be a list of {"type": "text", "text": ...} parts, an assistant tool-call
        turn may have content None) or to a list of conversations.

        Each is rendered by the tokenizer's apply_chat_template (get_tokenizer(); the template is
        chat_template, else the checkpoint's: chat_template.jinja or tokenizer_config.json) with
        add_generation_prompt, continue_final_message (continue the last assistant message; needs
        add_generation_prompt=False), tools (JSON schemas) and chat_template_kwargs (the template's
        own variables, e.g. DeepSeek's thinking switch), as transformers and vLLM do.
        """

        def rendered() -> list[PromptType]:
            tok = self._tokenizer()
            if tok is None:
                raise ValueError(f"{self._model_name()} has no tokenizer.json")
            conversations = messages if messages and isinstance(messages[0], list) else [messages]
            prompts: list[PromptType] = []
            for conv in conversations:
                text, ids = tok.apply_chat_template(
                    conv,  # type: ignore[arg-type]
                    chat_template=chat_template,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    tools=tools,
                    chat_template_kwargs=chat_template_kwargs,
                )
                prompts.append({"prompt": text, "prompt_token_ids": ids})
            return prompts

        return self._generate(rendered, sampling_params, use_tqdm)
