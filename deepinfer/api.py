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
it were alone. Expert parallelism: an error on any rank raises on every rank (see
deepinfer.parallel.rank_sync).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch
from tqdm.auto import tqdm

from deepinfer.config import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine, check_model_dir
from deepinfer.engine.outputs import CompletionOutput, Logprob, RequestOutput
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.structured import StructuredOutputsParams
from deepinfer.engine.tokenizer import Tokenizer

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]

PromptType = str | dict[str, Any]

P = ParamSpec("P")
R = TypeVar("R")


def _one_call_at_a_time(method: Callable[Concatenate[LLM, P], R]) -> Callable[Concatenate[LLM, P], R]:
    """The engine serves one call at a time: a call from another thread waits for it."""

    @functools.wraps(method)
    def serialised(self: LLM, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with self._lock:
            return method(self, *args, **kwargs)

    return serialised


class LLM:
    """An offline engine over one checkpoint directory. Arguments: see EngineConfig."""

    def __init__(
        self,
        model: str,
        *,
        backend: str = "auto",
        dtype: str | torch.dtype = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        gpu_memory_utilization: float = 0.9,
        num_gpu_blocks_override: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        block_size: int = 64,
        seed: int = 0,
        enable_prefix_caching: bool = False,
        batch_invariant: bool = False,
        speculative_config: dict[str, Any] | None = None,
        enable_expert_parallel: bool = False,
        enforce_eager: bool = False,
        async_scheduling: bool = True,
        distributed_timeout_s: float = 300.0,
    ) -> None:
        check_model_dir(model)
        config = EngineConfig(
            model=str(model),
            backend=backend,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            gpu_memory_utilization=gpu_memory_utilization,
            num_gpu_blocks_override=num_gpu_blocks_override,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            block_size=block_size,
            seed=seed,
            enable_prefix_caching=enable_prefix_caching,
            batch_invariant=batch_invariant,
            speculative_config=speculative_config,
            enable_expert_parallel=enable_expert_parallel,
            enforce_eager=enforce_eager,
            async_scheduling=async_scheduling,
            distributed_timeout_s=distributed_timeout_s,
        )
        self.llm_engine = LLMEngine(config)
        self._lock = threading.RLock()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an engine built directly (e.g. around a random-weight model for benchmarks)."""
        llm = cls.__new__(cls)
        llm.llm_engine = engine
        llm._lock = threading.RLock()
        return llm

    def get_tokenizer(self) -> Tokenizer:
        if self.llm_engine.tokenizer is None:
            raise ValueError(f"{self.llm_engine.config.model} has no tokenizer.json")
        return self.llm_engine.tokenizer

    @_one_call_at_a_time
    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate completions; outputs come back in prompt order.

        prompts: a string, {"prompt": str}, {"prompt_token_ids": [...]}, or a list of those.
        sampling_params: one for all prompts, or one per prompt (default: the model's
            generation_config.json, else SamplingParams(); see LLMEngine.default_sampling_params).
        """
        engine = self.llm_engine
        try:
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
            seqs = engine.make_sequences(prompts, params)
        except BaseException as exc:
            engine.all_ranks(False, exc)  # expert parallelism: the other ranks raise too, naming exc
            raise
        if not engine.all_ranks(True):  # raises, naming the rank, where another could not start
            raise RuntimeError("generate failed on another expert-parallel rank")
        with tqdm(total=len(seqs), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True) as bar:
            engine.run_to_completion(seqs, bar)
        return [engine.to_output(seq) for seq in seqs]

    @_one_call_at_a_time
    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or a
        list of conversations, formatted with the checkpoint's chat template."""
        prompts: list[PromptType] = []
        try:
            tok = self.get_tokenizer()
            conversations = messages if messages and isinstance(messages[0], list) else [messages]
            for conv in conversations:
                text = tok.apply_chat_template(conv, add_generation_prompt, chat_template)  # type: ignore[arg-type]
                ids = tok.encode(text, add_special_tokens=False)
                prompts.append({"prompt": text, "prompt_token_ids": ids})
        except BaseException as exc:
            self.llm_engine.all_ranks(False, exc)  # expert parallelism: as a call of generate would
            raise
        return self.generate(prompts, sampling_params, use_tqdm)
