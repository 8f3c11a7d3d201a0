"""The worker: the device side of a step, with one owner.

It sizes and allocates the KV pools of every cache group the model declares (a ring group's
step scratch included), captures and replays the graphs (deepinfer.engine.graphs), owns the step
inputs and the pinned step buffers, runs the forward and the draw, and calls the drafter after a
verification forward. The engine keeps requests, scheduling and outputs; it calls

  Worker(config, model, backend, sampler, max_model_len, expert_parallel)
  forward(batch)          -> ForwardOutput, launched (a graph replay where one serves the batch)
  draw(launched)          -> SampledStep: the draw and the copy of its tokens to the host, queued
  verify_launch / verify_read   a verification step's two graph replays, and its results
  propose(...)            the drafter's proposals after an eager verification forward
  idle(bucket)            an expert-parallel rank's forward over no tokens
  rows_asked / agreed_bucket    the expert-parallel ranks' agreement on a step's graph

Decode steps of up to the largest bucket's requests replay graphs padded to the bucket; logits
processors that need the host (penalties, grammars) run between the forward and the draw. Input
ids that are placeholders for tokens still on the device (async scheduling) are resolved from
sampled_ids as the first op of the forward: one gather from the token table, the identity over
the vocabulary followed by sampled_ids, which a placeholder's negative id reaches from its end
(resolve_placeholders); a model's token history (ForwardBatch.token_history) is resolved the same
way.

Expert parallelism: a graph step's MoE layers exchange fixed-size buffers with the other ranks
(ForwardBatch.fixed_exchange), captured in the graph; every rank replays the same bucket at the
same step (agreed_bucket), an idle rank with every row padding (idle). The ranks capture
together: each capture's warm-up run exchanges with the others.

A ring cache group (DeepSeek-V4's window and compressor state) keeps a fixed number of rows per
request; an eager step in which a request computes more tokens than its ring takes runs over
step-scratch blocks, copied from and back to the ring around the forward (deepinfer.engine.ring).

Prompt log-probabilities need the logits of every prompt position a step computes, not only of
the sampled rows: steps that compute some run eagerly (or keep their hidden states), and the LM
head runs over those rows of the step's final hidden states (in chunks).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from typing import Any, NamedTuple

import torch

from deepinfer.backend.kv_formats_mla import fp8_row_bytes
from deepinfer.backend.ops import Backend, GraphRunner
from deepinfer.backend.types import AttentionMetadata, KVCacheSpec, PagedKVCache
from deepinfer.config import EngineConfig
from deepinfer.engine.drafters import (
    BlockProposer,
    DFlashProposer,
    Drafts,
    MTPProposer,
    Proposer,
    accept_and_draft,
    chain_next_inputs,
)
from deepinfer.engine.graphs import (
    DecodeGraphs,
    PendingVerify,
    PrefillGraphs,
    VerifyGraphs,
    VerifyResult,
    graph_buckets,
    prefill_graph_shapes,
)
from deepinfer.engine.inputs import PreparedStep, StepInputs
from deepinfer.engine.kv_cache import cdiv, check_kv_pool_fits, fit_blocks, group_pool_blocks, memory_budget
from deepinfer.engine.output_processor import SampledStep
from deepinfer.engine.ring import RingScratch, copy_rows, scratch_blocks
from deepinfer.engine.sampler import (
    LOGPROB_CHUNK_ELEMENTS,
    LogprobTensors,
    PromptLogprobs,
    Sampler,
    num_top_logprobs,
    token_logprobs,
)
from deepinfer.engine.scheduler import ScheduledBatch
from deepinfer.engine.sequence import Sequence
from deepinfer.engine.step_times import StepTimes
from deepinfer.models.config_vision import NUM_IMAGE_IDS as IMAGE_IDS
from deepinfer.models.forward_batch import ForwardBatch
from deepinfer.models.interface import CausalLM
from deepinfer.parallel.exchanges import current_log
from deepinfer.parallel.rank_sync import DRAFTS, EAGER

logger = logging.getLogger(__name__)


def token_table(vocab_size: int, max_rows: int, device: torch.device) -> torch.Tensor:
    """(V + R,) int64: [0, 1, .., V - 1 | sampled ids of rows 0 .. R - 1]. The last R entries
    are the sampler's output (Worker.sampled_ids is that view). A vision-language model's V
    counts its image ids past the vocabulary (models.config_vision), kept as they are."""
    table = torch.zeros(vocab_size + max_rows, dtype=torch.int64, device=device)
    table[:vocab_size] = torch.arange(vocab_size, device=device)
    return table


def resolve_placeholders(input_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """ids in [0, V) as they are; a placeholder r - R (R = the table's sampled rows, so -R .. -1)
    -> sampled_ids[r] (the token the previous step sampled in row r, not yet seen by the host):
    table[ids] in ONE gather, a negative index counting from the table's end. Device only."""
    return table[input_ids]


def check_model_features(config: EngineConfig, model: CausalLM) -> None:
    """ValueError where the engine arguments ask for what the model cannot do."""
    method, k = config.speculative_method, config.num_speculative_tokens
    if method == "mtp" and model.num_mtp_layers < 1:
        raise ValueError(
            f"speculative_config asks for MTP drafts but {config.model} has no MTP layer "
            "(num_nextn_predict_layers is 0, or its weights are missing)"
        )
    if method == "dspark" and model.drafter is None:
        raise ValueError(
            f"speculative_config asks for the block drafter (method 'dspark') but {config.model} "
            "has none (no drafter_config.json + drafter.safetensors; train/train_drafter.py makes them)"
        )
    if method == "dspark" and model.drafter is not None and k > model.drafter.block_size:
        raise ValueError(
            f"speculative_config: num_speculative_tokens={k} exceeds the block drafter's block_size "
            f"{model.drafter.block_size}"
        )
    if method == "dflash" and model.dflash is None:
        raise ValueError(
            f"speculative_config asks for the DFlash drafter (method 'dflash') but {config.model} has "
            "none loaded (DIR/dflash/config.json + model.safetensors; train/train_dflash.py makes them)"
        )
    if method == "dflash" and model.dflash is not None and k > model.dflash.block_size:
        raise ValueError(
            f"speculative_config: num_speculative_tokens={k} exceeds the DFlash drafter's block_size "
            f"{model.dflash.block_size}"
        )
    if method is not None and model.token_history:
        raise ValueError(
            f"speculative decoding is not supported for {config.model}: its forward reads each token's "
            f"{model.token_history} previous tokens (Engram n-grams), which drafted steps do not pass yet"
        )
    if config.enable_prefix_caching and not model.supports_prefix_caching:
        raise ValueError(
            f"enable_prefix_caching is not supported for {config.model} ({model.config.model_type}): its "
            "compressed KV entries depend on tokens past the shared prefix; run it with "
            "enable_prefix_caching=False"
        )


MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")  # latent caches of the FP8 rows (kv_formats_mla)


def kv_cache_format(config: EngineConfig, model: CausalLM, backend: Backend) -> str:
    """The KVCacheSpec.kv_format of an MLA model's latent caches for config.kv_cache_dtype
    ("fp8_e4m3" is "fp8"; the model's use_kv_cache_dtype has checked the value); "auto" for
    other models, whose caches' formats are their own (kv_cache_groups). ValueError where the
    latent widths or the backend cannot keep FP8 rows."""
    value = config.kv_cache_dtype
    if value == "auto" or model.config.model_type not in MLA_MODEL_TYPES:
        return "auto"
    fp8_row_bytes(model.config.kv_lora_rank, model.config.qk_rope_head_dim)  # widths the rows hold
    if not backend.capabilities.supports_fp8_kv_cache:
        raise ValueError(
            f"kv_cache_dtype={value!r}: the {backend.name} backend cannot keep FP8 latent caches "
            "(Capabilities.supports_fp8_kv_cache); use kv_cache_dtype='auto' or another backend"
        )
    return "fp8"


class ForwardOutput(NamedTuple):
    """A launched forward: its inputs, logits (rows, V) float32 on the device (1 + draft rows per
    sampling request in batch order, then padding rows), the final hidden states (T, Dm;
    DeepSeek-V4: its (T, N, Dm) streams) of an eager step (None for a graph replay: they stay
    inside the graph), and the prompt log-probabilities the step computed (on the device)."""

    step: PreparedStep
    logits: torch.Tensor
    hidden: torch.Tensor | None
    prompt_logprobs: PromptLogprobs | None = None


class Worker:
    """The KV pools, the step inputs and buffers, the graphs, the forward, the draw, the drafter."""

    def __init__(
        self,
        config: EngineConfig,
        model: CausalLM,
        backend: Backend,
        sampler: Sampler,
        max_model_len: int,
        expert_parallel: bool = False,
    ) -> None:
        """Size the KV pools from the memory left once the graphs' pool is set aside (or as
        config asks), allocate them, capture the graphs. ValueError where config asks for
        what the model cannot do."""
        check_model_features(config, model)
        self.config, self.model, self.backend, self.sampler = config, model, backend, sampler
        self.block_size = bs = config.block_size
        self.max_model_len = max_model_len
        self.device = backend.device.device()
        self.vocab_size: int = model.config.vocab_size
        self.max_rows = graph_buckets(config.max_num_seqs)[-1]  # max_num_seqs, padded to a bucket
        self.k = k = config.num_speculative_tokens
        method = config.speculative_method
        # A ring group (DeepSeek-V4) holds what a step reads before its first token plus the
        # 1 + k positions of a verification step (rejected drafts are rewritten in place, never
        # past a row a later step still reads); a request computing more tokens in a step (a
        # prefill chunk, a recompute) runs over step-scratch blocks (deepinfer.engine.ring), a
        # pool sized from the step's token budget. MTP caches are rows of the same groups.
        model.use_kv_cache_dtype(config.kv_cache_dtype)  # ValueError naming the model's choices
        self.kv_format = kv_cache_format(config, model, backend)
        self.kv_groups = model.kv_cache_groups(bs, k, 1 if method == "mtp" else 0)
        ring = self.kv_groups[0]
        # prefix caching of several groups keeps ring rows of cached token blocks in a pool of its
        # own (GroupedBlockManager): one block per block of tokens the cache holds
        self.ring_prefix = config.enable_prefix_caching and len(self.kv_groups) > 1
        if self.ring_prefix and method is not None:
            raise ValueError(
                f"enable_prefix_caching with speculative decoding is not supported for {config.model} "
                f"({model.config.model_type}): its drafts' rows in the ring are not restored from the "
                "prefix cache; run it with one of the two"
            )
        self.ring_scratch_blocks = 0
        if ring.ring_blocks:  # its long requests compute more than ring_step_tokens each
            self.ring_scratch_blocks = scratch_blocks(
                config.max_num_batched_tokens, config.max_num_seqs, bs, ring.ring_step_tokens(bs)
            )
        # a verification graph step of the largest verify bucket: B x (1 + K) tokens
        verify_rows = self.max_rows * (1 + k)
        most = max(config.max_num_batched_tokens, verify_rows, config.max_prefill_graph_tokens)
        self.inputs = StepInputs(
            backend, bs, most, self.max_rows, max_model_len, k, self.kv_groups, model.token_history
        )
        # ids past the vocabulary that prompts hold: a vision tower's image ids (identity too)
        known = self.vocab_size + (IMAGE_IDS if getattr(model, "encode_images", None) else 0)
        self.token_table = token_table(known, self.max_rows, self.device)
        self.sampled_ids = self.token_table[known:]  # (R,): placeholders read it
        self.kv_caches: list[PagedKVCache] = []
        self.mtp_caches: list[PagedKVCache] = []
        self.decode_graphs = DecodeGraphs(backend.device)
        self.prefill_graphs = PrefillGraphs(backend.device)
        self.verify_graphs = VerifyGraphs(backend.device, k)
        self.num_prefill_graph_steps = 0  # steps that replayed one
        self.hidden: torch.Tensor | None = None  # the last forward's that kept them (keep_hidden)
        buckets, verify_buckets, prefill_shapes = self._graph_plan(expert_parallel)
        logger.debug(
            "graph plan: decode batch sizes %s, verification batch sizes %s, prefill (requests, tokens) "
            "shapes %s%s",
            buckets or "none", verify_buckets or "none", prefill_shapes or "none",
            " (enforce_eager)" if config.enforce_eager else "",
        )  # fmt: skip
        reserve = self._graph_reserve(buckets, verify_buckets, prefill_shapes)
        self.num_blocks = self._num_kv_blocks(reserve)
        logger.info(
            "KV cache: %d tokens (%d blocks of %d), %.1f MiB; %.2f requests of max_model_len=%d at once",
            self.num_blocks * bs, self.num_blocks, bs, self.kv_pool_bytes(self.num_blocks) / 2**20,
            self.num_blocks * bs / max_model_len, max_model_len,
        )  # fmt: skip
        self.pool_blocks = self._allocate(self.num_blocks)  # per group: the blocks handed out
        self.proposer = self._proposer()
        self.num_proposals = 0  # propose() calls: a step that made none runs idle_draft (expert parallelism)
        if expert_parallel and isinstance(self.proposer, MTPProposer):
            self.proposer.fixed_calls = k  # every rank's drafting step: k head forwards (idle_draft)
        self.graph_memory_bytes = 0  # what capturing the graphs took, measured on devices that count
        if buckets:
            self._capture(buckets, verify_buckets, prefill_shapes, reserve)
        # two pinned buffers: a step's tokens land in one while the host reads the other's
        self._host_tokens = [backend.device.pinned_empty((self.max_rows,), torch.int64) for _ in range(2)]
        self._host_turn = 0

    # ------------------------------------------------------------------ setup

    def _graph_plan(self, expert_parallel: bool) -> tuple[list[int], list[int], list[tuple[int, int]]]:
        """The decode buckets, verification buckets and prefill shapes to capture. Expert-parallel
        ranks replay graphs together, except in batch-invariant mode: a token's MoE sum is added
        in another order in a graph step (fixed_exchange) than in an eager one, and which one a
        step is depends on the others. Short prefill steps replay graphs where the model pages
        one cache group per sequence and no expert-parallel exchange needs the ranks' agreement
        (with a speculative decoder the graphs keep the hidden states it drafts from)."""
        c, model = self.config, self.model
        use_graphs = not (expert_parallel and c.batch_invariant) and not c.enforce_eager
        use_graphs = use_graphs and self.backend.capabilities.supports_graphs and model.supports_graphs
        if c.speculative_method is not None and not model.supports_drafts_with_graphs:
            use_graphs = False
        buckets = graph_buckets(c.max_num_seqs) if use_graphs else []
        shapes: list[tuple[int, int]] = []
        if buckets and model.supports_prefill_graphs and not expert_parallel:
            shapes = prefill_graph_shapes(max(buckets), c.max_prefill_graph_tokens, self.max_model_len)
        return buckets, self._verify_buckets(buckets, expert_parallel), shapes

    def _verify_buckets(self, buckets: list[int], expert_parallel: bool = False) -> list[int]:
        """The graph buckets whose speculative steps replay verification graphs: every decode
        bucket (up to max_num_seqs; _graph_reserve sets their memory aside), unless a step's
        padding drafts (up to k positions past max_model_len) would leave the rope table, the MTP
        head's chained drafts need graphs that compute attention lengths and the backend's
        cannot, or the ranks are expert-parallel."""
        method = self.config.speculative_method
        if method is None or not buckets:
            return []
        if expert_parallel:  # the ranks agree on eager steps with drafts (rows_asked: DRAFTS)
            logger.info(
                "speculative steps run eagerly with expert parallelism: the ranks do not replay "
                "verification graphs together yet (plain decoding steps replay decode graphs)"
            )
            return []
        positions = self.model.rope_positions
        if self.max_model_len + self.k > positions:
            logger.info(
                "speculative steps run eagerly: max_model_len + num_speculative_tokens (%d) exceeds "
                "the rope table's %d positions; a smaller max_model_len lets them replay graphs",
                self.max_model_len + self.k, positions,
            )  # fmt: skip
            return []
        if method == "mtp" and not self.backend.device.graph_lengths_on_device:
            logger.info(
                "MTP steps run eagerly: the %s backend's graphs cannot compute attention lengths "
                "(DeviceOps.graph_lengths_on_device), which the MTP head's chained drafts need",
                self.backend.name,
            )
            return []
        return buckets

    def _graph_reserve(
        self, buckets: list[int], verify_buckets: list[int], prefill_shapes: list[tuple[int, int]]
    ) -> int:
        """Graphs hold one forward's activations of the largest bucket (or verify or prefill
        step) in their pool: the bytes set aside for it, plus the verification graphs' logits,
        hidden-state and sampled-token copies of their largest step, outside the pool
        (VerifyGraphs.capture; where the device counts its memory)."""
        reserves = [self._step_memory_bytes(max(buckets)) or 0] if buckets else []
        buffers = 0
        if verify_buckets:
            rows = max(verify_buckets) * (1 + self.k)
            step = self._step_memory_bytes(max(verify_buckets), self.k)
            reserves.append(step or 0)
            if step is not None:
                hidden = math.prod(self.model.hidden_shape) * self.model.embed_tokens.element_size()
                buffers = rows * (4 * self.vocab_size + hidden + 8)
        if prefill_shapes:
            b, q = max(prefill_shapes, key=lambda s: (s[0] * s[1], s[1]))
            reserves.append(self._step_memory_bytes(b, q - 1, prefill=True) or 0)
        return max(reserves, default=0) + buffers

    def _step_memory_bytes(self, bucket: int, width: int | None = None, prefill: bool = False) -> int | None:
        """Device memory one decode forward + draw of `bucket` requests (of 1 + width tokens
        each: a verification step; with `prefill`, a prefill graph step's forward) takes beyond
        its inputs (measured on a one-block cache; None where the device has no peak counter)."""
        dev = self.backend.device
        dev.synchronize()
        dev.reset_peak_memory()
        base = dev.peak_memory_bytes()
        if base is None:
            return None
        spec = self.kv_spec(1)
        caches = [  # each group's own (its rows' width and dtype), the MTP head's left out
            c
            for g in self.kv_groups
            for c in self.backend.kv_cache.allocate(g.cache_spec(spec), g.num_caches - g.num_mtp_caches)
        ]
        real, self.kv_caches = self.kv_caches, caches
        try:
            step = self.inputs.prepare(ScheduledBatch(), bucket, width, prefill)
            _, logits = self.logits(step.forward)
            if not prefill:
                out = torch.empty_like(logits[:, 0], dtype=torch.int64)
                self.sampler.draw(logits, step.sampling, False, out)
            dev.synchronize()
            peak = dev.peak_memory_bytes()
        finally:
            self.kv_caches = real
        del caches, step, logits
        assert peak is not None
        return peak - base

    def kv_spec(self, num_blocks: int) -> KVCacheSpec:
        """The model's cache spec of num_blocks blocks, in the format kv_cache_dtype asks for."""
        spec = self.model.kv_cache_spec(num_blocks, self.block_size)
        return dataclasses.replace(spec, kv_format=self.kv_format) if self.kv_format != "auto" else spec

    def kv_pool_bytes(self, num_blocks: int) -> int:
        """Device bytes of a KV cache of num_blocks blocks of tokens: each group's pool
        (group_pool_blocks) at its row width (KVCacheGroup.cache_spec), every cache of it (the
        MTP head's included), a ring group's step scratch too."""
        bs, groups = self.block_size, self.kv_groups
        spec = self.kv_spec(1)
        pools = group_pool_blocks(groups, num_blocks, self.config.max_num_seqs)
        pools[0] += self.ring_scratch_blocks + self.ring_prefix_blocks(num_blocks)
        # a block of one cache of group g: BS rows of its own width
        per_cache: list[int] = [g.cache_spec(spec).bytes_per_token * bs for g in groups]
        return sum(n * b * g.num_caches for g, n, b in zip(groups, pools, per_cache))

    def _num_kv_blocks(self, graph_reserve: int) -> int:
        """KV blocks of tokens (each group's pool is sized from this number: group_pool_blocks):
        as asked, or what the memory share holds once `graph_reserve` bytes are set aside for the
        graphs' memory pool."""
        c, bs = self.config, self.block_size
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
            num_blocks = fit_blocks(budget, self.kv_pool_bytes, most)
        # Before anything is allocated: the pool in device memory, the block manager in host memory.
        on_host = self.device.type == "cpu"
        pool_blocks = (
            sum(group_pool_blocks(self.kv_groups, num_blocks, c.max_num_seqs))
            + self.ring_scratch_blocks
            + self.ring_prefix_blocks(num_blocks)
        )
        bytes_per_block = cdiv(self.kv_pool_bytes(num_blocks), max(pool_blocks, 1))
        logger.debug(
            "KV sizing: %d blocks of %d tokens from %s (device memory %d free of %d bytes, %d set aside "
            "for graphs; at most %d blocks: max_num_seqs=%d at max_model_len=%d); pools of every group: "
            "%d blocks, %d bytes each",
            num_blocks, bs, source, free, total, graph_reserve, c.max_num_seqs * cdiv(self.max_model_len, bs),
            c.max_num_seqs, self.max_model_len, pool_blocks, bytes_per_block,
        )  # fmt: skip
        check_kv_pool_fits(pool_blocks, bytes_per_block, bs, free - graph_reserve, on_host, source)
        if num_blocks * bs < self.max_model_len:
            fixed = self.kv_pool_bytes(0)  # a ring group's per-request-slot caches and scratch
            beside = f" beside {fixed} bytes of per-request-slot caches (max_num_seqs) and step scratch"
            raise ValueError(
                f"the KV cache holds {num_blocks * bs} tokens ({num_blocks} blocks of {bs}, "
                f"{self.kv_pool_bytes(1) - fixed} bytes each{beside if fixed else ''}), fewer than "
                f"max_model_len={self.max_model_len}; lower max_model_len, or give the cache more memory "
                "(gpu_memory_utilization, kv_cache_memory_bytes, num_gpu_blocks_override)"
            )
        return num_blocks

    def ring_prefix_blocks(self, num_blocks: int) -> int:
        """Blocks of the ring's prefix pool (prefix caching of several groups; else none) for a
        cache of num_blocks blocks of tokens: config.prefix_ring_blocks, default the fewest ring
        blocks whose bytes reach those of the growing groups' pools, a ring's blocks at least
        (the rows before one prefix's end; V4-Flash: about one ring
        block per 29 blocks of tokens, its ring rows taking 189 caches a token where its entries
        take 6.5 of the same width)."""
        if not self.ring_prefix:
            return 0
        if self.config.prefix_ring_blocks is not None:
            return self.config.prefix_ring_blocks
        bs, groups = self.block_size, self.kv_groups
        spec = self.kv_spec(1)
        block = [g.cache_spec(spec).bytes_per_token * bs * g.num_caches for g in groups]
        pools = group_pool_blocks(groups, num_blocks, self.config.max_num_seqs)
        growing = sum(n * b for n, b in zip(pools[1:], block[1:]))
        return max(groups[0].ring_blocks, cdiv(growing, block[0]))  # a ring's worth at least

    def _allocate(self, num_blocks: int) -> list[int]:
        """One pool per group, the model's caches in group order (then the MTP head's, apart);
        the ring group's step scratch after its pool's blocks, then its prefix pool -> each
        group's pool blocks (self.ring_prefix_pool: the prefix pool's first block and count)."""
        bs = self.block_size
        pools = group_pool_blocks(self.kv_groups, num_blocks, self.config.max_num_seqs)
        self.group_caches: list[list[PagedKVCache]] = []
        self.ring_prefix_pool = (pools[0] + self.ring_scratch_blocks, self.ring_prefix_blocks(num_blocks))
        for i, (group, n) in enumerate(zip(self.kv_groups, pools)):
            scratch = self.ring_scratch_blocks + self.ring_prefix_pool[1] if i == 0 else 0
            spec = group.cache_spec(self.kv_spec(n + scratch))
            caches = self.backend.kv_cache.allocate(spec, group.num_caches)
            self.group_caches.append(caches)
            own = group.num_caches - group.num_mtp_caches
            self.kv_caches += caches[:own]
            self.mtp_caches += caches[own:]
            mib = n * bs * spec.bytes_per_token * group.num_caches / 2**20
            logger.info(
                "KV cache group %s: %d caches of %d-wide rows, %d blocks, %.1f MiB (a row per %d tokens, "
                "ring %d blocks)",
                group.name, group.num_caches, spec.head_dim, n, mib, group.ratio, group.ring_blocks,
            )  # fmt: skip
            if self.ring_scratch_blocks and i == 0:
                scratch = self.ring_scratch_blocks
                logger.info(
                    "KV cache group %s/scratch: %d caches, %d blocks, %.1f MiB (steps longer than "
                    "%d tokens per request)",
                    group.name, group.num_caches, scratch, mib * scratch / n, group.ring_step_tokens(bs),
                )  # fmt: skip
                self.inputs.ring = RingScratch(group, bs, n, scratch)
            if self.ring_prefix_pool[1] and i == 0:
                kept = self.ring_prefix_pool[1]
                logger.info(
                    "KV cache group %s/prefix: %d caches, %d blocks, %.1f MiB (ring rows of cached prefixes)",
                    group.name, group.num_caches, kept, mib * kept / n,
                )  # fmt: skip
        return pools

    def ring_caches(self, mtp: bool = False) -> list[PagedKVCache]:
        """The ring group's caches: the model's (kv_caches' first ones), or the MTP layers'."""
        ring = self.kv_groups[0]
        if not ring.ring_blocks:
            return []
        if mtp:
            return self.mtp_caches[: ring.num_mtp_caches]
        return self.kv_caches[: ring.num_caches - ring.num_mtp_caches]

    def _proposer(self) -> Proposer | None:
        """The drafter that proposes a speculative step's drafts (None without one)."""
        method, model = self.config.speculative_method, self.model
        if method == "dspark" and model.drafter is not None:
            return BlockProposer(model.drafter, model)
        if method == "dflash" and model.dflash is not None:  # its caches follow the model's
            caches = model.dflash_caches(self.kv_caches)
            return DFlashProposer(model.dflash, model, caches, self.block_size, self.kv_groups)
        if method == "mtp":
            return MTPProposer(
                model, self.backend, self.mtp_caches, self.block_size, self.k, self.kv_groups,
                self.inputs.ring, self.ring_caches(mtp=True),
            )  # fmt: skip
        return None

    def _capture(
        self, buckets: list[int], verify_buckets: list[int], shapes: list[tuple[int, int]], reserve: int
    ) -> None:
        """Capture the decode graphs, then the verification and prefill graphs in their pool."""
        dev = self.backend.device
        counts = dev.peak_memory_bytes() is not None
        free_before, _ = dev.memory_info()
        start = time.perf_counter()

        def prepare(bucket: int, width: int | None, prefill: bool) -> PreparedStep:
            return self.inputs.prepare(ScheduledBatch(), bucket, width, prefill)

        self.decode_graphs.capture(
            buckets, prepare, self.logits, self.sampler.draw, self.vocab_size, self.sampled_ids
        )
        pool, logits = self.decode_graphs.pool(), self.decode_graphs.logits
        if verify_buckets and pool is not None and self.proposer is not None:
            accept = functools.partial(accept_and_draft, self.proposer.graph_draft())
            chain = functools.partial(chain_next_inputs, self.block_size, self.config.min_draft_confidence)
            self.verify_graphs.capture(
                verify_buckets, prepare, self.logits, self.sampler.draw, accept, chain, pool, self.vocab_size,
                self.model.embed_tokens.new_zeros((1, *self.model.hidden_shape)),
            )  # fmt: skip
        if shapes and pool is not None and logits is not None:
            hidden = None
            if self.config.speculative_method is not None:  # the drafter's: kept
                size = (max(b * q for b, q in shapes), self.model.config.hidden_size)
                hidden = torch.zeros(size, dtype=self.model.embed_tokens.dtype, device=self.device)
            self.prefill_graphs.capture(shapes, prepare, self.logits, logits, pool, hidden)
        dev.synchronize()
        if counts:
            self.graph_memory_bytes = max(free_before - dev.memory_info()[0], 0)
        logger.info(
            "captured decode graphs for %d batch sizes up to %d%s%s in %.1f s: %.0f MiB (%.0f MiB reserved)",
            len(self.decode_graphs), max(buckets),
            f", verification graphs for {len(self.verify_graphs)} (batch, drafts) shapes"
            if self.verify_graphs else "",
            f", prefill graphs for {len(self.prefill_graphs)} (requests, tokens) shapes"
            if self.prefill_graphs else "",
            time.perf_counter() - start, self.graph_memory_bytes / 2**20, reserve / 2**20,
        )  # fmt: skip

    # ------------------------------------------------------------------ the forward

    def logits(
        self, fb: ForwardBatch, out: torch.Tensor | None = None, every_row: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Device only: the forward of one step -> (hidden (T, Dm), logits (S, V) float32 at
        fb.logits_indices), written into `out` when given. every_row: the step's logits rows are
        its tokens in order (a decode graph step), so no row gather."""
        history = fb.token_history
        fb = dataclasses.replace(
            fb,
            input_ids=resolve_placeholders(fb.input_ids, self.token_table),
            token_history=None if history is None else resolve_placeholders(history, self.token_table),
        )
        hidden = self.model.forward(fb, self.kv_caches)  # (T, Dm), or V4's (T, N, Dm)
        rows = hidden if every_row else hidden[fb.logits_indices]
        logits: torch.Tensor = self.model.compute_logits(rows, out)
        return hidden, logits

    @torch.inference_mode()
    def forward(
        self, batch: ScheduledBatch, bucket: int | None = None, eager: bool = False, keep_hidden: bool = False
    ) -> ForwardOutput:
        """Launch one step's forward (before the scheduler counts its tokens as computed): a graph
        replay for a decode batch that fits a bucket, or for a short prefill step that fits a
        prefill graph, unless `eager` (expert-parallel ranks that agreed on eager forwards).
        `bucket`: the graph to replay (the one the expert-parallel ranks agreed on); default:
        the decode graphs' choice. keep_hidden: the step's hidden states are returned (T, Dm,
        packed as the eager forward's) and kept (self.hidden, for the drafter): eager, or a
        prefill graph that keeps them; the prompt log-probabilities' rows are taken first then,
        as any step that serves the batch returns them."""
        assert not (keep_hidden and bucket is not None), "decode graphs keep no hidden states"
        spans = prompt_logprob_spans(batch) if keep_hidden else None
        out = self._launch(
            batch, bucket, eager or (keep_hidden and self.prefill_graphs.hidden is None), keep_hidden
        )
        if spans is None:  # a step with prompt log-probabilities runs eagerly: its hidden states are here
            spans = prompt_logprob_spans(batch)
        if spans:
            assert out.hidden is not None, "a step with prompt log-probabilities replayed a graph"
            out = out._replace(prompt_logprobs=self.prompt_logprobs(spans, out.hidden))
        if keep_hidden:
            self.hidden = out.hidden
        return out

    def _launch(
        self, batch: ScheduledBatch, bucket: int | None, eager: bool, keep_hidden: bool
    ) -> ForwardOutput:
        images = self._image_inputs(batch)
        if images is not None:  # a step with image spans runs eagerly (its embeddings vary)
            eager, bucket = True, None
        if not eager and bucket is None:
            bucket = None if keep_hidden else self.decode_graphs.bucket_for(batch)
            shape = self.prefill_graphs.shape_for(batch, self.max_model_len) if bucket is None else None
            if shape is not None:
                return self._prefill_graph(batch, shape, keep_hidden)
        if eager:
            bucket = None
        step = self.inputs.prepare(batch, bucket)
        self._restore(batch)
        if bucket is None:
            copies = step.ring_copies
            if copies is not None:  # step scratch: ring -> scratch, the forward, scratch -> ring
                copies.before(self.backend, self.ring_caches())
            fb = step.forward
            if images is not None:
                fb = dataclasses.replace(fb, image_embeds=images[0], image_mask=images[1])
            hidden, logits = self.logits(fb)
            if copies is not None:
                copies.after(self.backend, self.ring_caches())
            self._retain(step)
            return ForwardOutput(step, logits, hidden)
        assert self.decode_graphs.logits is not None and len(batch) <= bucket
        self._replay(bucket)
        self._retain(step)
        return ForwardOutput(step, self.decode_graphs.logits[:bucket], None)

    def _image_inputs(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's image rows: (embeds (Ti, Dm), mask (T,) bool of the positions they take),
        the vision tower run once over every image whose span the step's tokens overlap (a
        chunk holds whole spans, engine.scheduler.whole_images, but a prefix-cache hit may end
        inside one: its rows from there on); None when the step has none."""
        found: list[tuple[int, Any, int, int]] = []  # (step row, span, first, end row of the span)
        row = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            for span in seq.images:
                lo, hi = max(span.start, start), min(span.end, start + n)
                if lo < hi:
                    found.append((row + lo - start, span, lo - span.start, hi - span.start))
            row += n
        if not found:
            return None
        encode = getattr(self.model, "encode_images", None)
        if encode is None:
            raise ValueError(f"{type(self.model).__name__} has no vision tower: it cannot take images")
        spans = encode([span.image.pixels for _, span, _, _ in found])
        mask = torch.zeros(row, dtype=torch.bool)
        for at, _, a, b in found:
            mask[at : at + b - a] = True
        embeds = torch.cat([e[a:b] for (_, _, a, b), e in zip(found, spans)])
        return embeds, mask.to(self.device)

    def _restore(self, batch: ScheduledBatch) -> None:
        """Before the step's forward: the prefix hits' rows into the admitted requests' blocks
        (StepCopies.restore), every group's caches, the MTP head's too."""
        for g, (src, dst) in batch.copies.restore.items():
            copy_rows(self.backend, self.group_caches[g], src, dst)

    def _retain(self, step: PreparedStep) -> None:
        """After the step's forward: the ring rows of its token blocks to retain (StepCopies.
        retain), read through the step's tables (ring or step scratch), into the prefix pool."""
        retain = step.batch.copies.retain
        if not retain:
            return
        bs = self.block_size
        src: list[int] = []
        dst: list[int] = []
        for b, t, block in retain:
            column = step.tables[b][t]
            src.extend(range(column * bs, (column + 1) * bs))
            dst.extend(range(block * bs, (block + 1) * bs))
        copy_rows(self.backend, self.group_caches[0], src, dst)

    def _prefill_graph(
        self, batch: ScheduledBatch, shape: tuple[int, int], keep_hidden: bool
    ) -> ForwardOutput:
        logits = self.decode_graphs.logits
        assert logits is not None
        step = self.inputs.prepare(batch, shape[0], shape[1] - 1, prefill=True)
        assert not batch.copies, "prefill graphs page one cache group: no prefix copies"
        self.prefill_graphs[shape].replay()
        self.num_prefill_graph_steps += 1
        hidden = None
        if keep_hidden:  # request i's rows start at i * q: packed again
            assert self.prefill_graphs.hidden is not None
            rows, q = self.prefill_graphs.hidden, shape[1]
            parts = [rows[i * q : i * q + n] for i, n in enumerate(batch.num_new_tokens)]
            hidden = parts[0] if len(parts) == 1 else torch.cat(parts)
        return ForwardOutput(step, logits[: len(step.sampling_seqs)], hidden)

    def _replay(self, bucket: int) -> None:
        """Replay the forward graph of `bucket`; its MoE exchanges (expert parallelism) all ran."""
        self.decode_graphs[bucket].replay()
        log = current_log()
        if log is not None:
            log.replayed()

    @torch.inference_mode()
    def prompt_logprobs(
        self, spans: list[tuple[Sequence, int, int, int]], hidden: torch.Tensor
    ) -> PromptLogprobs:
        """Device: the log-probabilities of the prompt positions `spans` (prompt_logprob_spans)
        from the step's final hidden states (T, Dm): the LM head over those rows, in chunks of
        rows, the raw log-softmax, the prompt token's value and rank and the top-k."""
        rows = torch.cat([hidden[r : r + count] for _, _, count, r in spans])  # (R, Dm)
        targets: list[int] = []
        for seq, first, count, _ in spans:
            targets.extend(seq.prompt_token_ids[first : first + count])
        target = torch.tensor(targets, dtype=torch.int64).to(self.device, non_blocking=True)
        k = max(num_top_logprobs(seq.params.prompt_logprobs, self.vocab_size) for seq, *_ in spans)
        chunk = max(1, LOGPROB_CHUNK_ELEMENTS // self.vocab_size)
        parts = [
            token_logprobs(self.model.compute_logits(rows[i : i + chunk]), target[i : i + chunk], k)
            for i in range(0, rows.shape[0], chunk)
        ]
        values = LogprobTensors([], *(torch.cat(t) for t in zip(*parts)))
        return PromptLogprobs([(seq, first, count) for seq, first, count, _ in spans], values)

    # ------------------------------------------------------------------ the draw

    @torch.inference_mode()
    def draw(self, out: ForwardOutput) -> SampledStep | None:
        """Logits processors (with every history up to date), the draw into sampled_ids (a
        persistent view the next step's placeholders read), and the copy of the tokens (and of
        the step's prompt log-probabilities) to the host, all queued without waiting for the
        device. None: the step samples nothing and computed no prompt log-probabilities."""
        step, logits, seqs = out.step, out.logits, out.step.sampling_seqs
        if not seqs and out.prompt_logprobs is None:
            return None
        pinned = self.backend.device.pinned_empty
        host, lp_host = self._host_tokens[self._host_turn][:0], None
        if seqs:
            raw = logits
            if self.sampler.needs_processing(seqs):
                if any(s.needs_logprob for s in seqs):
                    raw = logits.clone()  # log-probabilities come from the raw logits
                self.sampler.process_logits(logits, seqs)
            rows, greedy = step.num_rows, all(s.params.greedy for s in seqs)
            if step.bucket is not None:
                self.decode_graphs.draws[(step.bucket, greedy)].replay()
            else:
                self.sampler.draw(logits, step.sampling, greedy, self.sampled_ids[:rows])
            tokens = self.sampled_ids[:rows]
            for row, seq in enumerate(seqs):
                if not seq.is_finished:
                    seq.num_pending, seq.pending_row = 1, row
            lp = self.sampler.logprobs(raw, seqs, tokens)
            host = self._host_tokens[self._host_turn][: tokens.shape[0]]
            self._host_turn ^= 1
            self.backend.device.to_host(tokens, host)
            lp_host = lp.to_host(pinned) if lp is not None else None
        prompt = out.prompt_logprobs
        ready = self.backend.device.new_event()
        ready.record()
        return SampledStep(seqs, host, lp_host, ready, prompt.to_host(pinned) if prompt is not None else None)

    # ------------------------------------------------------------------ speculative steps

    @torch.inference_mode()
    def verify_launch(
        self, batch: ScheduledBatch | None, bucket: int, width: int, greedy: bool, rows: int
    ) -> PendingVerify:
        """Launch one verification step (two graph replays) and the copy of its results to the
        host, without waiting. batch None: a chained step, whose inputs the previous step of the
        same (bucket, width) wrote on the device. `rows`: the real requests."""
        if batch is not None:
            self.inputs.prepare(batch, bucket, width)
        return self.verify_graphs.launch(bucket, width, greedy, rows)

    @torch.inference_mode()
    def measure_step_times(self, repeats: int = 5) -> StepTimes | None:
        """Confidence scheduling's step-time curve (deepinfer.engine.step_times): every captured
        verification graph (bucket, width >= 1) and decode graph (width 0), its forward and its
        sampler (the draw; for verification also acceptance and drafting) replayed `repeats`
        times each, the median ms; the width-0 verification graphs beside decode graphs are the
        probes (drafting, no draft verified). Their inputs are those of the capture (padding: no
        cache row is written): all padding, prepared before each graph's replays as for its
        capture. None without verification graphs (eager steps only)."""
        dev = self.backend.device
        verify, decode = self.verify_graphs, self.decode_graphs
        if not verify.forwards:
            return None

        def median_ms(graph: GraphRunner) -> float:
            times = []
            for _ in range(repeats):
                dev.synchronize()
                start = time.perf_counter()
                graph.replay()
                dev.synchronize()
                times.append((time.perf_counter() - start) * 1e3)
            return sorted(times)[len(times) // 2]

        forward: dict[tuple[int, int], float] = {}
        sampler: dict[tuple[int, int], float] = {}
        probe: dict[int, float] = {}

        def measure(
            bucket: int, width: int | None, graph: GraphRunner, draw: GraphRunner
        ) -> tuple[float, float]:
            self.inputs.prepare(ScheduledBatch(), bucket, width, False)
            return median_ms(graph), median_ms(draw)

        for (b, w), graph in verify.forwards.items():
            times = measure(b, w, graph, verify.finishes[(b, w, False)])
            if w > 0 or not decode.forwards:  # width 0: the decode graph where there is one
                forward[(b, w)], sampler[(b, w)] = times
            else:
                probe[b] = sum(times)
        for b, graph in decode.forwards.items():
            forward[(b, 0)], sampler[(b, 0)] = measure(b, None, graph, decode.draws[(b, False)])
        dev.synchronize()
        return StepTimes(forward, sampler, probe)

    def verify_read(self, pending: PendingVerify) -> VerifyResult:
        """Wait for a launched verification step's results."""
        return self.verify_graphs.read(pending)

    def set_chain_limits(self, limits: list[int], budget: int) -> None:
        """The cache-write limits and the draft budget of the next verification steps
        (VerifyGraphs.set_limits)."""
        self.verify_graphs.set_limits(limits, budget)

    def propose(
        self,
        seqs: list[Sequence],
        spans: list[tuple[int, int]],
        hidden_rows: list[int],
        num_drafts: list[int],
        limits: list[int],
    ) -> list[Drafts]:
        """The drafter's proposals after an eager forward that kept its hidden states
        (Proposer.propose)."""
        assert self.proposer is not None and self.hidden is not None
        self.num_proposals += 1
        return self.proposer.propose(seqs, spans, hidden_rows, num_drafts, limits, self.hidden)

    # ------------------------------------------------------------------ expert parallelism

    def rows_asked(self, batch: ScheduledBatch | None, drafts: bool = False) -> int:
        """Before the status exchange, a rank's planned step (None: idle) -> the rows it asks for:
        its decode batch size where a graph serves it, 0 for no forward of its own, EAGER for a
        step that needs eager forwards (or on a rank without graphs), DRAFTS for a step with
        drafts (eager: verification graphs are off with expert parallelism)."""
        if drafts and batch is not None and len(batch):
            return DRAFTS
        if not self.decode_graphs:
            return EAGER
        if batch is None or len(batch) == 0:  # idle, or only tokens in flight
            return 0
        return len(batch) if self.decode_graphs.bucket_for(batch) is not None else EAGER

    def agreed_bucket(self, rows: list[int]) -> int | None:
        """The graph bucket every expert-parallel rank replays this step, from every rank's rows
        (each rank decides the same); None: eager forwards (some rank's step needs them, or no
        rank has a forward of its own)."""
        if min(rows) < 0 or max(rows) == 0:  # EAGER or DRAFTS
            return None
        return self.decode_graphs.smallest(max(rows))

    @torch.inference_mode()
    def idle(self, bucket: int | None = None) -> None:
        """A forward pass over no tokens: with expert parallelism a rank without requests still
        takes part in every MoE layer's exchange while the other ranks step. `bucket`: the graph
        step the ranks agreed on, replayed with every row padding; None: an eager forward."""
        if bucket is not None:
            self.inputs.prepare(ScheduledBatch(), bucket)
            self._replay(bucket)
            return
        empty = torch.zeros((0,), dtype=torch.int64, device=self.device)
        tables = torch.zeros((0, 1), dtype=torch.int32, device=self.device)
        fb = ForwardBatch(
            input_ids=empty, positions=empty, slot_mapping=empty,
            attn=AttentionMetadata.build(tables, [], []), logits_indices=empty,
        )  # fmt: skip
        self.model.forward(fb, self.kv_caches)

    @property
    def draft_exchanges(self) -> bool:
        """Whether the drafter's forwards make MoE exchanges: the MTP head's layers (their experts
        are split over the ranks too); the block and DFlash drafters hold all of theirs."""
        return isinstance(self.proposer, MTPProposer) and self.proposer.fixed_calls is not None

    @torch.inference_mode()
    def idle_draft(self, calls: int | None = None) -> None:
        """The MTP head's forwards over no tokens, as many as a drafting step makes (`calls`,
        default k): the exchanges of a rank whose step drafts nothing while another's does."""
        empty = torch.zeros((0,), dtype=torch.int64, device=self.device)
        tables = torch.zeros((0, 1), dtype=torch.int32, device=self.device)
        fb = ForwardBatch(
            input_ids=empty, positions=empty, slot_mapping=empty,
            attn=AttentionMetadata.build(tables, [], []), logits_indices=empty,
        )  # fmt: skip
        hidden = self.model.embed_tokens.new_zeros((0, *self.model.hidden_shape))
        for _ in range(self.k if calls is None else calls):
            self.model.forward_mtp(fb, hidden, self.mtp_caches)


def prompt_logprob_spans(batch: ScheduledBatch) -> list[tuple[Sequence, int, int, int]]:
    """Before the step's scheduled tokens count as computed: the prompt positions whose
    log-probability the step's hidden states give, as (seq, first position, count, hidden row
    of the token before it), and marks them launched (seq.prompt_logprob_pos). Position p
    (0 < p < prompt length) is the step's if it computes position p - 1."""
    spans = []
    row = 0
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        if seq.wants_prompt_logprobs:
            start = seq.num_computed_tokens
            first = seq.prompt_logprob_pos
            assert first > start, "a prompt position's logits were skipped (prefix cache?)"
            last = min(start + n, seq.num_prompt_tokens - 1)
            if last >= first:
                spans.append((seq, first, last - first + 1, row + first - 1 - start))
                seq.prompt_logprob_pos = last + 1
        row += n
    return spans
