"""LLMEngine: requests in, one step at a time (schedule, run, postprocess), outputs out.

A step: the scheduler picks the work, the runner lays it out on the device and launches the
forward (a graph replay for decode steps), the host then processes the PREVIOUS step's tokens
(async scheduling: they were copied back while this step's forward was queued), and the draw
of this step is launched with every request's history up to date. Without async scheduling the
step's own tokens are processed right away. Steps with speculative drafts run synchronously
(deepinfer.engine.speculative).

Expert-parallel ranks schedule their step before the status exchange that starts it
(deepinfer.parallel.rank_sync), where each says how many decode rows it asks for: when every
rank's step is a decode batch that fits a graph (or no forward), every rank replays the graph of
the smallest bucket that holds the largest batch (an idle rank with every row padding), its MoE
exchanges of fixed shapes captured inside; otherwise every rank runs eagerly, with the
host-sized exchanges.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepinfer.backend.ops import Backend
from deepinfer.backend.registry import get_backend
from deepinfer.backend.types import BackendOptions
from deepinfer.config import EngineConfig
from deepinfer.engine.args import backend_choice_reason
from deepinfer.engine.inputs import PreparedStep
from deepinfer.engine.kv_cache import (
    BlockManager,
    GroupedBlockManager,
    cdiv,
    fit_blocks,
    group_pool_blocks,
    memory_budget,
)
from deepinfer.engine.model_runner import (
    MAX_VERIFY_GRAPH_BATCH,
    ModelRunner,
    graph_buckets,
    prefill_graph_shapes,
)
from deepinfer.engine.output_processor import OutputProcessor, SampledStep
from deepinfer.engine.ring import scratch_blocks
from deepinfer.engine.sampler import PromptLogprobs, Sampler, check_token_sets
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.scheduler import ScheduledBatch, Scheduler
from deepinfer.engine.sequence import Sequence
from deepinfer.engine.speculative import (
    SpeculativeDecoder,
    accept_and_draft,
    block_drafts,
    chain_next_inputs,
    mtp_drafts,
)
from deepinfer.engine.structured import StructuredOutputs, check_first_tokens
from deepinfer.engine.tokenizer import IncrementalDetokenizer, Tokenizer, read_json_file
from deepinfer.log import configure_logging
from deepinfer.models.forward_batch import KVCacheGroup
from deepinfer.parallel.expert_parallel import ExpertParallel
from deepinfer.parallel.rank_sync import EAGER

logger = logging.getLogger(__name__)


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


@dataclass
class PlannedStep:
    """Expert parallelism: a step scheduled before the status exchange, and the graph bucket the
    ranks agreed on there (None: eager forwards)."""

    batch: ScheduledBatch
    bucket: int | None = None


class LLMEngine:
    """Owns the backend, the model, the KV pool, the scheduler, the runner and the sampler."""

    def __init__(self, config: EngineConfig, model: Any = None, backend: Backend | None = None) -> None:
        """Load config.model (a checkpoint directory) on the backend config.backend names.
        `model` (with the `backend` it was built on) may pass an already built model, e.g. random
        weights for benchmarks; the directory then only supplies the tokenizer, if it has one."""
        configure_logging()
        self.config = config
        logger.info("engine arguments (those not at their defaults): %s", config.changed())
        self.expert_parallel = (
            ExpertParallel.from_torch_distributed(2 if config.enable_two_batch_overlap else 1)
            if config.enable_expert_parallel
            else None
        )
        if backend is None:
            device_index = int(os.environ.get("LOCAL_RANK", "0")) if self.expert_parallel else 0
            options = BackendOptions(
                device_index=device_index,
                batch_invariant=config.batch_invariant,
                max_model_len=config.max_model_len,
            )
            backend = get_backend(config.backend, options)
            if logger.isEnabledFor(logging.INFO):
                logger.info("backend %s: %s", backend.name, backend_choice_reason(config.backend))
        self.backend = backend
        if model is None:
            from deepinfer.models.loader import load_model

            path = check_model_dir(config.model)
            model = load_model(str(path), self.backend, config.torch_dtype, self.expert_parallel)
        else:
            path = Path(config.model)
        tok_dir = Path(config.tokenizer) if config.tokenizer is not None else path  # LLM(tokenizer=...)
        self.tokenizer: Tokenizer | None = (
            Tokenizer(tok_dir) if (tok_dir / "tokenizer.json").is_file() else None
        )
        self.model = model
        mc = model.config
        self.vocab_size: int = mc.vocab_size
        self.max_model_len = self._resolve_max_model_len(config.max_model_len, mc.max_position_embeddings)
        self.eos_token_ids = self._eos_ids(path, mc)

        self.num_speculative_tokens = config.num_speculative_tokens
        method = config.speculative_method
        drafter = getattr(model, "drafter", None) if method == "dspark" else None
        if method == "mtp" and getattr(model, "num_mtp_layers", 0) < 1:
            raise ValueError(
                f"speculative_config asks for MTP drafts but {config.model} has no MTP layer "
                "(num_nextn_predict_layers is 0, or its weights are missing)"
            )
        if method == "dspark" and drafter is None:
            raise ValueError(
                f"speculative_config asks for the block drafter (method 'dspark') but {config.model} "
                "has none (no drafter_config.json + drafter.safetensors; train/train_drafter.py makes them)"
            )
        if drafter is not None and self.num_speculative_tokens > drafter.block_size:
            raise ValueError(
                f"speculative_config: num_speculative_tokens={self.num_speculative_tokens} exceeds the "
                f"block drafter's block_size {drafter.block_size}"
            )
        # Graphs and async scheduling serve decoding steps (steps with drafts replay verification
        # graphs, chained: deepinfer.engine.speculative). Expert-parallel ranks replay graphs
        # together (module docstring), except in batch-invariant mode: a token's MoE sum is added
        # in another order in a graph step (fixed_exchange) than in an eager one, and which one a
        # step is depends on the others.
        invariant_ep = self.expert_parallel is not None and config.batch_invariant
        use_graphs = not invariant_ep and not config.enforce_eager and backend.capabilities.supports_graphs
        use_graphs = use_graphs and getattr(model, "supports_graphs", True)
        if config.enable_prefix_caching and not getattr(model, "supports_prefix_caching", True):
            raise ValueError(
                f"enable_prefix_caching is not supported for {config.model} ({mc.model_type}): its "
                "compressed KV entries depend on tokens past the shared prefix; run it with "
                "enable_prefix_caching=False"
            )
        self.async_scheduling = config.async_scheduling
        bs = config.block_size
        # A model with several cache groups (DeepSeek-V4's ring and entry caches): its ring holds
        # what a step reads before its first token plus the 1 + k positions of a verification
        # step (rejected drafts are rewritten in place, never past a row a later step still
        # reads); a request computing more tokens in a step (a prefill chunk, a recompute) runs
        # over step-scratch blocks (deepinfer.engine.ring), a pool sized from the step's token
        # budget, so no cap on a request's tokens per step. Its MTP layer's caches are rows of
        # the same groups: paged, freed and rolled back alike.
        self.kv_groups: list[KVCacheGroup] | None = None
        self.ring_scratch_blocks = 0
        if hasattr(model, "kv_cache_groups"):
            mtp_layers = 1 if method == "mtp" else 0
            self.kv_groups = model.kv_cache_groups(bs, self.num_speculative_tokens, mtp_layers)
            ring = self.kv_groups[0]
            if ring.ring_blocks:  # its long requests compute more than ring_step_tokens each
                self.ring_scratch_blocks = scratch_blocks(
                    config.max_num_batched_tokens, config.max_num_seqs, bs, ring.ring_step_tokens(bs)
                )
            if method is not None:  # its speculative steps run eagerly (no verification graphs yet)
                use_graphs = False
        self.sampler = Sampler(self.backend, self.eos_token_ids)
        self.runner = ModelRunner(
            model, self.backend, self.sampler, bs, config.max_num_seqs, config.max_num_batched_tokens,
            self.max_model_len, self.num_speculative_tokens, self.kv_groups, config.max_prefill_graph_tokens,
        )  # fmt: skip
        buckets = graph_buckets(config.max_num_seqs) if use_graphs else []
        verify_buckets = self._verify_buckets(buckets, method)
        # Short prefill steps replay graphs too, where one cache group is paged per sequence and
        # no expert-parallel exchange needs the ranks' agreement (with a speculative decoder the
        # graphs keep the hidden states it drafts from).
        prefill_shapes: list[tuple[int, int]] = []
        if buckets and self.kv_groups is None and self.expert_parallel is None:
            most = config.max_prefill_graph_tokens
            prefill_shapes = prefill_graph_shapes(max(buckets), most, self.max_model_len)
        # Graphs hold one forward's activations of the largest bucket (or verify or prefill step)
        # in their pool.
        reserves = [self.runner.decode_memory_bytes(max(buckets)) or 0] if buckets else []
        if verify_buckets:
            width = self.num_speculative_tokens
            reserves.append(self.runner.decode_memory_bytes(max(verify_buckets), width) or 0)
        if prefill_shapes:
            b, q = max(prefill_shapes, key=lambda s: (s[0] * s[1], s[1]))
            reserves.append(self.runner.decode_memory_bytes(b, q - 1, prefill=True) or 0)
        graph_reserve = max(reserves, default=0)
        num_blocks = self._num_kv_blocks(graph_reserve)
        logger.info(
            "KV cache: %d tokens (%d blocks of %d), %.1f MiB; %.2f requests of max_model_len=%d at once",
            num_blocks * bs, num_blocks, bs, self._kv_pool_bytes(num_blocks) / 2**20,
            num_blocks * bs / self.max_model_len, self.max_model_len,
        )  # fmt: skip
        self.block_manager: BlockManager | GroupedBlockManager
        if self.kv_groups is None:
            self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching)
            spec = model.kv_cache_spec(num_blocks, bs)
            self.runner.kv_caches = self.backend.kv_cache.allocate(spec, model.num_kv_layers)
        else:  # one pool per group, the model's caches in group order
            pools = group_pool_blocks(self.kv_groups, num_blocks, config.max_num_seqs)
            self.block_manager = GroupedBlockManager(self.kv_groups, pools, bs)
            self.runner.kv_caches = []
            for i, (group, n) in enumerate(zip(self.kv_groups, pools)):
                scratch = self.ring_scratch_blocks if i == 0 else 0  # after the ring pool's blocks
                spec = group.cache_spec(model.kv_cache_spec(n + scratch, bs))
                caches = self.backend.kv_cache.allocate(spec, group.num_caches)
                own = group.num_caches - group.num_mtp_caches  # then the MTP head's
                self.runner.kv_caches += caches[:own]
                self.runner.mtp_caches += caches[own:]
                mib = n * bs * spec.bytes_per_token * group.num_caches / 2**20
                logger.info(
                    "KV cache group %s: %d caches of %d-wide rows, %d blocks, %.1f MiB (a row per %d tokens, "
                    "ring %d blocks)",
                    group.name, group.num_caches, spec.head_dim, n, mib, group.ratio, group.ring_blocks,
                )  # fmt: skip
                if scratch:
                    logger.info(
                        "KV cache group %s/scratch: %d caches, %d blocks, %.1f MiB (steps longer than "
                        "%d tokens per request)",
                        group.name, group.num_caches, scratch, mib * scratch / n,
                        group.ring_step_tokens(bs),
                    )  # fmt: skip
                    self.runner.set_ring_scratch(n, scratch)
        if method == "mtp" and self.kv_groups is None:  # the MTP head's cache: same blocks and tables
            self.runner.mtp_caches = self.backend.kv_cache.allocate(spec, 1)
        self.graph_memory_bytes = 0  # what capturing the graphs took, measured on devices that count
        if buckets:
            counts = self.backend.device.peak_memory_bytes() is not None
            free_before, _ = self.backend.device.memory_info()
            start = time.perf_counter()
            self.runner.capture_graphs(buckets)
            if verify_buckets:
                draft = (
                    functools.partial(block_drafts, drafter, model.embed_tokens, model.lm_head)
                    if drafter is not None
                    else functools.partial(mtp_drafts, model, self.runner.mtp_caches, bs)
                )
                self.runner.capture_verify_graphs(
                    verify_buckets,
                    functools.partial(accept_and_draft, draft),
                    functools.partial(chain_next_inputs, bs, config.min_draft_confidence),
                )
            self.runner.capture_prefill_graphs(prefill_shapes, keep_hidden=method is not None)
            self.backend.device.synchronize()
            if counts:
                self.graph_memory_bytes = max(free_before - self.backend.device.memory_info()[0], 0)
            logger.info(
                "captured decode graphs for %d batch sizes up to %d%s%s in %.1f s: %.0f MiB "
                "(%.0f MiB reserved)",
                len(self.runner.graphs), max(buckets),
                f", verification graphs for {len(self.runner.verify_graphs)} (batch, drafts) shapes"
                if self.runner.verify_graphs else "",
                f", prefill graphs for {len(self.runner.prefill_graphs)} (requests, tokens) shapes"
                if self.runner.prefill_graphs else "",
                time.perf_counter() - start, self.graph_memory_bytes / 2**20, graph_reserve / 2**20,
            )  # fmt: skip
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.outputs = OutputProcessor(self.scheduler, self.tokenizer, self.eos_token_ids, self.max_model_len)
        self.speculative: SpeculativeDecoder | None = None
        if self.num_speculative_tokens:
            self.speculative = SpeculativeDecoder(
                self.runner, self.scheduler, self.sampler, self.outputs, self.num_speculative_tokens,
                config.min_draft_confidence, self.max_model_len, drafter, config.step_token_budget,
            )  # fmt: skip
        self.in_flight: SampledStep | None = None  # the last step's tokens, not yet processed
        self.planned: PlannedStep | None = None  # expert parallelism: the next step, scheduled
        # two pinned buffers: a step's tokens land in one while the host reads the other's
        self._host_tokens = [
            self.backend.device.pinned_empty((self.runner.max_rows,), torch.int64) for _ in range(2)
        ]
        self._host_turn = 0
        self._structured: StructuredOutputs | None = None  # made at the first structured request
        self._seed_rng = random.Random(config.seed)
        self._next_id = 0

    @property
    def num_draft_tokens(self) -> int:
        return self.speculative.num_draft_tokens if self.speculative else 0

    @property
    def num_accepted_tokens(self) -> int:
        return self.speculative.num_accepted_tokens if self.speculative else 0

    # ------------------------------------------------------------------ setup

    def _verify_buckets(self, buckets: list[int], method: str | None) -> list[int]:
        """The graph buckets whose speculative steps replay verification graphs: those up to
        MAX_VERIFY_GRAPH_BATCH requests, unless a step's padding drafts (up to k positions past
        max_model_len) would leave the rope table, or the MTP head's chained drafts need graphs
        that compute attention lengths and the backend's cannot."""
        if method is None or not buckets:
            return []
        positions = getattr(self.model, "rope_positions", self.model.config.max_position_embeddings)
        if self.max_model_len + self.num_speculative_tokens > positions:
            logger.info(
                "speculative steps run eagerly: max_model_len + num_speculative_tokens (%d) exceeds "
                "the rope table's %d positions; a smaller max_model_len lets them replay graphs",
                self.max_model_len + self.num_speculative_tokens, positions,
            )  # fmt: skip
            return []
        if method == "mtp" and not self.backend.device.graph_lengths_on_device:
            logger.info(
                "MTP steps run eagerly: the %s backend's graphs cannot compute attention lengths "
                "(DeviceOps.graph_lengths_on_device), which the MTP head's chained drafts need",
                self.backend.name,
            )
            return []
        return [b for b in buckets if b <= MAX_VERIFY_GRAPH_BATCH]

    @staticmethod
    def _resolve_max_model_len(requested: int | None, max_positions: int) -> int:
        if requested is None:
            return max_positions
        if requested > max_positions:
            raise ValueError(
                f"max_model_len={requested} exceeds the model's max_position_embeddings={max_positions}"
            )
        return requested

    def _eos_ids(self, path: Path, mc: Any) -> list[int]:
        """EOS ids from the model config, generation_config.json and the tokenizer."""
        ids = _ids(getattr(mc, "eos_token_id", None))
        gen = path / "generation_config.json"
        if gen.is_file():
            content = read_json_file(gen)
            if not isinstance(content, dict):
                raise ValueError(f"{gen} must hold a JSON object")
            ids += _ids(content.get("eos_token_id"))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return sorted({i for i in ids if 0 <= i < self.vocab_size})

    def _kv_pool_bytes(self, num_blocks: int) -> int:
        """Device bytes of a KV cache of num_blocks blocks of tokens: every cache (the MTP head's
        included); with several cache groups, each group's pool (group_pool_blocks) at its row
        width (KVCacheGroup.cache_spec) and a ring group's step scratch."""
        bs = self.config.block_size
        spec = self.model.kv_cache_spec(1, bs)
        if self.kv_groups is None:
            layers: int = self.model.num_kv_layers + (1 if self.config.speculative_method == "mtp" else 0)
            per_layer: int = spec.bytes_per_token * bs  # a block of one cache
            return num_blocks * per_layer * layers
        pools = group_pool_blocks(self.kv_groups, num_blocks, self.config.max_num_seqs)
        pools[0] += self.ring_scratch_blocks
        # a block of one cache of group g: BS rows of its own width
        per_cache: list[int] = [g.cache_spec(spec).bytes_per_token * bs for g in self.kv_groups]
        return sum(n * b * g.num_caches for g, n, b in zip(self.kv_groups, pools, per_cache))

    def _num_kv_blocks(self, graph_reserve: int) -> int:
        """KV blocks (of tokens; a model with several cache groups sizes each group's pool from
        this number, group_pool_blocks): as asked, or what the memory share holds once
        `graph_reserve` bytes are set aside for the graphs' memory pool."""
        from deepinfer.engine.kv_cache import check_kv_pool_fits

        c, bs = self.config, self.config.block_size
        free, total = self.backend.device.memory_info()
        if c.num_gpu_blocks_override is not None:
            num_blocks = c.num_gpu_blocks_override
            source = f"num_gpu_blocks_override={num_blocks}"
        else:
            if c.kv_cache_memory_bytes is not None:
                budget = c.kv_cache_memory_bytes
                source = f"kv_cache_memory_bytes={c.kv_cache_memory_bytes}"
            else:
                budget = memory_budget(free - graph_reserve, total, c.gpu_memory_utilization)
                source = f"gpu_memory_utilization={c.gpu_memory_utilization}"
            # Never more than every request slot at full length could use.
            most = c.max_num_seqs * cdiv(self.max_model_len, bs)
            num_blocks = fit_blocks(budget, self._kv_pool_bytes, most)
        # Before anything is allocated: the pool in device memory, the block manager in host memory.
        on_host = self.backend.device.device().type == "cpu"
        pool_blocks = num_blocks
        if self.kv_groups is not None:
            pool_blocks = sum(group_pool_blocks(self.kv_groups, num_blocks, c.max_num_seqs))
            pool_blocks += self.ring_scratch_blocks
        bytes_per_block = cdiv(self._kv_pool_bytes(num_blocks), max(pool_blocks, 1))
        check_kv_pool_fits(pool_blocks, bytes_per_block, bs, free - graph_reserve, on_host, source)
        if num_blocks * bs < self.max_model_len:
            fixed = ""
            if self.kv_groups is not None:
                fixed = (
                    f" beside {self._kv_pool_bytes(0)} bytes of per-request-slot caches (max_num_seqs) "
                    "and step scratch"
                )
            raise ValueError(
                f"the KV cache holds {num_blocks * bs} tokens ({num_blocks} blocks of {bs}, "
                f"{self._kv_pool_bytes(1) - self._kv_pool_bytes(0)} bytes each{fixed}), fewer than "
                f"max_model_len={self.max_model_len}; lower max_model_len, or give the cache more memory "
                "(gpu_memory_utilization, kv_cache_memory_bytes, num_gpu_blocks_override)"
            )
        return num_blocks

    # ------------------------------------------------------------------ requests

    def make_sequence(self, prompt: str | dict[str, Any] | list[int], params: SamplingParams) -> Sequence:
        """Validate and tokenise one request (ValueError / TypeError if it cannot be served).

        The sampling parameters are validated as they are now (their fields may have changed
        since construction) and the request keeps its own copy (SamplingParams.for_request)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        params = params.for_request()
        text: str | None
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
        bad_words = self._bad_words_token_ids(params.bad_words) if params.bad_words else []
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
            seq.needs_logprob = params.logprobs is not None or params.num_sequences > params.n
            group.append(seq)
        self._next_id += 1
        return group[0]

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
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
        seqs = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                seqs.append(self.make_sequence(prompt, p))
            except (ValueError, TypeError) as exc:
                self._seed_rng.setstate(state)
                self._next_id = next_id
                raise type(exc)(f"prompt {i}: {exc}") from exc
        return seqs

    def default_sampling_params(self) -> SamplingParams:
        """The sampling parameters of a generate() call that passes none, as the engine argument
        generation_config says (vLLM's): "vllm" = SamplingParams(); "auto" = the model
        directory's generation_config.json; a directory (or a .json file) = that one's. From
        the file: SamplingParams() with the temperature, top_p, top_k, min_p,
        repetition_penalty and max_new_tokens (as max_tokens) that the model directory's
        generation_config.json sets, read with transformers' GenerationConfig (only the values
        that differ from its defaults, as vLLM does); plain SamplingParams() without the file.
        Read at each call (a small file), a new object each time. ValueError naming the file
        if it cannot be read or holds a value SamplingParams refuses."""
        source = self.config.generation_config
        if source == "vllm":
            return SamplingParams()
        path = Path(self.config.model if source == "auto" else source)
        if not path.is_file():
            path = path / "generation_config.json"
        if not path.is_file():
            return SamplingParams()
        from transformers import GenerationConfig

        try:
            config = GenerationConfig.from_pretrained(
                str(path.parent), config_file_name=path.name, local_files_only=True
            )
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path} cannot be read: {exc}") from exc
        given = config.to_diff_dict()
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

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None

    def abort_all(self) -> None:
        """Drop every request (after an error in a step): finish_reason "abort"."""
        self.in_flight = None
        self.planned = None
        if self.speculative is not None:
            self.speculative.chain = None
        for seq in self.scheduler.abort_all():
            if seq.finish_reason is None:
                seq.finish_reason = "abort"

    # ------------------------------------------------------------------ the step

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Schedule, launch, process the previous step's tokens, launch the draw. Returns the
        sequences that finished (with async scheduling, those of the previous step)."""
        spec = self.speculative
        if spec is not None and spec.chain is not None:  # chained verification steps
            return spec.chain_step()
        if spec is not None and spec.wants_step():  # drafts: a synchronous step
            finished = self._process_in_flight()  # every token on the host first
            spec.limit_drafts()
            batch = self.scheduler.schedule()
            if len(batch) == 0:  # the in-flight tokens finished every request
                assert not self.scheduler.has_unfinished(), "scheduler made no progress"
                return finished
            spans = self.runner.prompt_logprob_spans(batch)
            done = spec.step(batch)
            if spans:  # from the step's hidden states, which the speculative decoder keeps
                assert spec.hidden is not None
                prompt_lp = self.runner.prompt_logprobs(spans, spec.hidden)
                assert prompt_lp is not None
                self.outputs.add_prompt_logprobs(prompt_lp, done)
            return finished + done
        if spec is not None:  # confidence scheduling left no room for drafts: a plain step
            spec.drop_drafts()
        if self.planned is None:
            batch, eager, bucket = self.scheduler.schedule(), False, None
        else:  # expert parallelism: scheduled before the status exchange, which chose the forward
            batch, bucket = self.planned.batch, self.planned.bucket
            eager, self.planned = bucket is None, None
        if len(batch) == 0:  # only requests whose last token is still in flight are left
            assert self.in_flight is not None, "scheduler made no progress"
            return self._process_in_flight()
        step, logits, hidden = self.runner.forward(batch, eager, bucket)
        spans = self.runner.prompt_logprob_spans(batch)
        prompt_lp = None
        if spans:  # such steps run eagerly (ModelRunner.bucket_for): their hidden states are here
            assert hidden is not None, "a step with prompt log-probabilities replayed a graph"
            prompt_lp = self.runner.prompt_logprobs(spans, hidden)
        self.scheduler.advance(batch)
        finished = self._process_in_flight()
        if step.sampling_seqs or prompt_lp is not None:
            self.in_flight = self._launch_draw(step, logits, prompt_lp)
            if not self.async_scheduling:
                finished += self._process_in_flight()
        return finished

    def _process_in_flight(self) -> list[Sequence]:
        if self.in_flight is None:
            return []
        step, self.in_flight = self.in_flight, None
        return self.outputs.process(step)

    def _launch_draw(
        self, step: PreparedStep, logits: torch.Tensor, prompt_lp: PromptLogprobs | None = None
    ) -> SampledStep:
        """Logits processors (with every history up to date), the draw, and the copy of the
        tokens (and of the step's prompt log-probabilities) to the host, all queued without
        waiting for the device."""
        seqs = step.sampling_seqs
        pinned = self.backend.device.pinned_empty
        host, lp_host = self._host_tokens[self._host_turn][:0], None
        if seqs:
            raw = logits
            if self.sampler.needs_processing(seqs):
                if any(s.needs_logprob for s in seqs):
                    raw = logits.clone()  # log-probabilities come from the raw logits
                self.sampler.process_logits(logits, seqs)
            tokens = self.runner.draw(step, logits, greedy=all(s.params.greedy for s in seqs))
            for row, seq in enumerate(seqs):
                if not seq.is_finished:
                    seq.num_pending, seq.pending_row = 1, row
            lp = self.sampler.logprobs(raw, seqs, tokens)
            host = self._host_tokens[self._host_turn][: tokens.shape[0]]
            self._host_turn ^= 1
            self.backend.device.to_host(tokens, host)
            lp_host = lp.to_host(pinned) if lp is not None else None
        prompt_host = prompt_lp.to_host(pinned) if prompt_lp is not None else None
        ready = self.backend.device.new_event()
        ready.record()
        return SampledStep(seqs, host, lp_host, ready, prompt_host)

    to_output = staticmethod(OutputProcessor.to_output)

    def all_ranks(self, flag: bool, error: BaseException | None = None) -> bool:
        """The start of a generate call: whether it starts on every expert-parallel rank (this
        rank's flag without expert parallelism). A rank that cannot start passes flag=False and
        its error: the other ranks raise RuntimeError naming that rank and error, and it gets
        False. RuntimeError if the ranks' group is broken, or breaks because a rank does not
        come within distributed_timeout_s (deepinfer.parallel.rank_sync)."""
        if self.expert_parallel is None:
            return flag
        if flag:
            error = None
        elif error is None:
            error = RuntimeError("no reason given")
        return self.expert_parallel.sync.start_call(self.config.distributed_timeout_s, error)

    def run_to_completion(self, seqs: Iterable[Sequence], progress: Any = None) -> None:
        """Add seqs and step until every request is done. On any error (or Ctrl-C) the
        requests still in flight are dropped (reported as "abort"), so the engine is ready for
        the next call.

        Expert parallelism: the ranks step together, each step after a status exchange, until
        none has requests left; a rank without any runs forwards with no tokens, for the MoE
        exchanges (graph replays of padding rows when the others replay graphs). A step that
        raises on one rank raises on every rank at the next exchange, naming that rank and its
        error (deepinfer.parallel.rank_sync)."""
        for seq in seqs:
            self.add(seq)
        sync = self.expert_parallel.sync if self.expert_parallel is not None else None
        try:
            if sync is not None and sync.exchanges_per_forward is None:  # count a forward's exchanges
                sync.run_forward(self.runner.run_idle, self.runner.run_idle)
            while True:
                busy = self.has_unfinished()
                if sync is None:
                    if not busy:
                        break
                    finished = self.step()
                else:
                    rows = sync.start_step(busy, functools.partial(self._plan_step, busy))
                    if rows is None:  # no rank has requests left
                        break
                    bucket = self._agreed_bucket(rows)

                    def idle(bucket: int | None = bucket) -> None:
                        self.runner.run_idle(bucket)

                    if not busy:  # the other ranks still step: this one joins their MoE exchanges
                        sync.run_forward(idle, idle)
                        continue
                    assert self.planned is not None
                    self.planned.bucket = bucket
                    finished = sync.run_forward(self.step, idle)
                if progress is not None and finished:
                    progress.update(len(finished))
        except BaseException:
            self.abort_all()
            raise

    def _plan_step(self, busy: bool) -> int:
        """Expert parallelism, before the status exchange: schedule this rank's step (when busy)
        -> the rows it asks for: its decode batch size where a graph serves it, 0 for no forward
        of its own, EAGER for a step that needs eager forwards (or on a rank without graphs)."""
        self.planned = PlannedStep(self.scheduler.schedule()) if busy else None
        if not self.runner.graphs:
            return EAGER
        if self.planned is None or len(self.planned.batch) == 0:  # idle, or only tokens in flight
            return 0
        batch = self.planned.batch
        return len(batch) if self.runner.bucket_for(batch) is not None else EAGER

    def _agreed_bucket(self, rows: list[int]) -> int | None:
        """The graph bucket every expert-parallel rank replays this step, from every rank's rows
        (each rank decides the same); None: eager forwards (some rank's step needs them, or no
        rank has a forward of its own)."""
        if EAGER in rows or max(rows) == 0:
            return None
        return min(b for b in self.runner.graphs if b >= max(rows))
