"""Engine configuration: frozen dataclasses built from the arguments of `LLM(...)`.

The model's own configuration (from config.json) is `deepinfer.models.config.ModelConfig`.
Runtime state that depends on the model and the device (the resolved max_model_len, the number
of KV blocks) lives in the engine, never written back here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """ "auto" / None -> None (the checkpoint's dtype); a name or torch.dtype -> that dtype."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of: auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


MAX_SPECULATIVE_TOKENS = 8
# Tokens per KV block: Ascend's fused paged MLA attention (npu_fused_infer_attention_score)
# takes blocks of at most 1024 tokens; the CUDA (Triton) and reference kernels take any size, and
# larger blocks only waste memory (a request holds at least one block).
MAX_BLOCK_SIZE = 1024


@dataclass(frozen=True)
class EngineConfig:
    """What the user asked of the engine (vLLM's argument names).

    model: checkpoint directory (config.json, safetensors, tokenizer.json).
    backend: backend name or "auto" (see deepinfer.backend.registry).
    dtype: model dtype; "auto" keeps the checkpoint's.
    max_model_len: longest prompt + output in tokens; None = the model's max_position_embeddings.
    max_num_seqs: most requests in one step.
    max_num_batched_tokens: token budget of one step; longer prompts are prefilled in chunks.
    gpu_memory_utilization: share of the device's memory the engine may use in all; the KV pool
        gets what is left of that share after the model is loaded.
    num_gpu_blocks_override / kv_cache_memory_bytes: size the KV pool explicitly instead.
    block_size: tokens per KV block, 1..MAX_BLOCK_SIZE (1024).
    seed: seeds the per-request generators of requests that have no seed of their own.
    enable_prefix_caching: reuse KV blocks of identical prefixes (hashed per full block).
    batch_invariant: ask the backend for batch-invariant ops (results independent of batch).
    enable_expert_parallel: shard the routed experts over the ranks of the default
        torch.distributed group (one process per rank, already initialised, e.g. by torchrun);
        each rank serves its own requests with the full attention (attention data parallelism)
        and every rank must call generate the same number of times.
    distributed_timeout_s: with expert parallelism, the longest a rank waits for the others at
        the status exchange that starts each call and each step (so also the longest skew
        between the ranks' generate calls, and the longest step); a rank that does not come in
        time breaks the group, and every rank then raises RuntimeError saying which and why
        (deepinfer.parallel.rank_sync). A failure that a rank raises is known to every rank at
        the next step, without waiting.
    enforce_eager: never capture graphs (vLLM's name); by default decode steps replay graphs
        captured per batch-size bucket where the backend has graphs.
    async_scheduling: the host schedules and prepares step n+1 while the device runs step n;
        tokens reach the host one step late and outputs equal synchronous scheduling. Steps
        that carry speculative drafts, and expert-parallel ranks, run synchronously.
    speculative_config: {"method": "mtp", "num_speculative_tokens": k} drafts k tokens per step
        with the checkpoint's MTP head (run k times in a chain, as vLLM does past the checkpoint's
        one MTP layer) and verifies them with the model in the next step (vLLM's names;
        "deepseek_mtp" is accepted too). Outputs are those of plain decoding.
        "min_draft_confidence": p (default 0) schedules a draft for verification only when the
        head gives it probability >= p, so that unlikely drafts cost no verification work.
    """

    model: str
    backend: str = "auto"
    dtype: str | torch.dtype = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    block_size: int = 64
    seed: int = 0
    enable_prefix_caching: bool = False
    batch_invariant: bool = False
    speculative_config: dict[str, Any] | None = None
    enable_expert_parallel: bool = False
    enforce_eager: bool = False
    async_scheduling: bool = True
    distributed_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        def positive(name: str, value: int | None) -> None:
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        positive("max_model_len", self.max_model_len)
        positive("max_num_seqs", self.max_num_seqs)
        positive("max_num_batched_tokens", self.max_num_batched_tokens)
        positive("num_gpu_blocks_override", self.num_gpu_blocks_override)
        positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        positive("block_size", self.block_size)
        if self.block_size > MAX_BLOCK_SIZE:
            raise ValueError(
                f"block_size must be in 1..{MAX_BLOCK_SIZE} tokens (Ascend's fused paged MLA attention "
                f"takes blocks of at most {MAX_BLOCK_SIZE}), got {self.block_size}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        parse_dtype(self.dtype)
        _ = self.num_speculative_tokens, self.min_draft_confidence  # validate speculative_config
        if self.enable_expert_parallel and self.speculative_config is not None:
            raise ValueError("speculative_config cannot be combined with enable_expert_parallel yet")
        timeout = self.distributed_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 1e9:
            raise ValueError(f"distributed_timeout_s must be a positive number of seconds, got {timeout!r}")

    @property
    def num_speculative_tokens(self) -> int:
        """Draft tokens per step (0: no speculative decoding)."""
        spec = self.speculative_config
        if spec is None:
            return 0
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(spec).__name__}")
        unknown = set(spec) - {"method", "num_speculative_tokens", "min_draft_confidence"}
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {sorted(unknown)}")
        method = spec.get("method", "mtp")
        if method not in ("mtp", "deepseek_mtp"):
            raise ValueError(f"speculative_config: method {method!r} is not supported; use 'mtp'")
        k = spec.get("num_speculative_tokens", 1)
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config: num_speculative_tokens must be an integer in "
                f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        return k

    @property
    def min_draft_confidence(self) -> float:
        """Smallest MTP probability of a draft worth verifying (0: every draft)."""
        p = (self.speculative_config or {}).get("min_draft_confidence", 0.0)
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ValueError(f"speculative_config: min_draft_confidence must be in [0, 1], got {p!r}")
        return float(p)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return parse_dtype(self.dtype)
