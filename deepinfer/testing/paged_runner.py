"""A minimal paged-KV driver for tests and tools: builds ForwardBatch objects for chosen requests
over a simple block allocator and runs the model. The engine's model runner does this for real.

Blocks are handed out from a shuffled free list, so block tables are deliberately not contiguous.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from deepinfer.backend.ops import Backend
from deepinfer.backend.types import AttentionMetadata, PagedKVCache
from deepinfer.models.deepseek import DeepseekForCausalLM
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer.models.deepseek_v41 import DeepseekV41ForCausalLM
from deepinfer.models.forward_batch import ForwardBatch


@dataclass
class _Request:
    blocks: list[int] = field(default_factory=list)
    length: int = 0  # tokens already in the cache


class BlockAllocator:
    """Fixed pool of `num_blocks` KV blocks; requests grow one block at a time."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.block_size = block_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.requests: dict[int, _Request] = {}

    def append_slots(self, rid: int, n: int) -> tuple[list[int], list[int]]:
        """Reserve `n` more tokens for request `rid` -> (positions, slots)."""
        req = self.requests.setdefault(rid, _Request())
        positions = list(range(req.length, req.length + n))
        while len(req.blocks) * self.block_size < req.length + n:
            if not self.free:
                raise RuntimeError("KV block pool exhausted")
            req.blocks.append(self.free.pop())
        slots = [req.blocks[p // self.block_size] * self.block_size + p % self.block_size for p in positions]
        req.length += n
        return positions, slots

    def release(self, rid: int) -> None:
        self.free.extend(self.requests.pop(rid).blocks)


def build_batch(
    alloc: BlockAllocator,
    chunks: Sequence[tuple[int, Sequence[int]]],
    device: torch.device,
    all_logits: bool = False,
) -> ForwardBatch:
    """One step for `chunks` = [(request id, new token ids)]: reserves their slots and builds the
    batch. logits_indices: every row when all_logits, else each request's last row."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    query_lens: list[int] = []
    logits_rows: list[int] = []
    for rid, tokens in chunks:
        pos, slot = alloc.append_slots(rid, len(tokens))
        start = len(ids)
        ids += list(tokens)
        positions += pos
        slots += slot
        seq_lens.append(alloc.requests[rid].length)
        query_lens.append(len(tokens))
        logits_rows += list(range(start, len(ids))) if all_logits else [len(ids) - 1]
    max_blocks = max((len(alloc.requests[rid].blocks) for rid, _ in chunks), default=0)
    table = torch.zeros((len(chunks), max(max_blocks, 1)), dtype=torch.int32)
    for b, (rid, _) in enumerate(chunks):
        blocks = alloc.requests[rid].blocks
        table[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)

    def lt(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return ForwardBatch(
        input_ids=lt(ids),
        positions=lt(positions),
        slot_mapping=lt(slots),
        attn=AttentionMetadata.build(table.to(device), seq_lens, query_lens),
        logits_indices=lt(logits_rows),
    )


class PagedRunner:
    """Runs a model over its own paged caches: `step` takes [(request id, new tokens)] and returns
    the logits of the rows build_batch selects (S, V) float32."""

    def __init__(
        self,
        model: DeepseekForCausalLM | DeepseekV4ForCausalLM | DeepseekV41ForCausalLM,
        backend: Backend,
        num_blocks: int = 64,
        block_size: int = 4,
        seed: int = 0,
        kv_format: str = "auto",
    ) -> None:
        self.model, self.backend = model, backend
        self.device = backend.device.device()
        self.alloc = BlockAllocator(num_blocks, block_size, seed)
        spec = replace(model.kv_cache_spec(num_blocks, block_size), kv_format=kv_format)
        self.kv_caches: list[PagedKVCache] = []  # each group's caches at its rows' width and dtype
        for g in model.kv_cache_groups(block_size):
            self.kv_caches += backend.kv_cache.allocate(g.cache_spec(spec), g.num_caches)
        self.last_batch: ForwardBatch | None = None
        self.last_hidden: torch.Tensor | None = None

    @torch.inference_mode()
    def step(self, chunks: Sequence[tuple[int, Sequence[int]]], all_logits: bool = False) -> torch.Tensor:
        batch = build_batch(self.alloc, chunks, self.device, all_logits)
        hidden = self.model(batch, self.kv_caches)
        self.last_batch, self.last_hidden = batch, hidden
        return self.model.compute_logits(hidden[batch.logits_indices])
