"""Model runner: one ForwardBatch per step on the device, the model, logits where tokens are sampled."""

from __future__ import annotations

from typing import Any

import torch

from deepinfer.backend.ops import Backend
from deepinfer.backend.types import AttentionMetadata, PagedKVCache
from deepinfer.engine.scheduler import ScheduledBatch
from deepinfer.models.forward_batch import ForwardBatch


def build_forward_batch(batch: ScheduledBatch, block_size: int, device: torch.device) -> ForwardBatch:
    """Lay the scheduled tokens out back to back; a request samples when its last token is in.

    Request b computes tokens [start, start + n) of its sequence, start = num_computed_tokens;
    token p of it goes to slot block_table[p // BS] * BS + p % BS.
    """
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        input_ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        table = seq.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        seq_lens.append(end)
        if end == seq.num_tokens:
            logits_indices.append(len(input_ids) - 1)
    max_blocks = max(len(s.block_table) for s in batch.seqs)
    block_tables = torch.zeros((len(batch.seqs), max_blocks), dtype=torch.int32)  # (B, MB)
    for b, seq in enumerate(batch.seqs):
        block_tables[b, : len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)

    def dev(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

    return ForwardBatch(
        input_ids=dev(input_ids),
        positions=dev(positions),
        slot_mapping=dev(slots),
        attn=AttentionMetadata.build(block_tables.to(device), seq_lens, list(batch.num_new_tokens)),
        logits_indices=dev(logits_indices),
    )


class ModelRunner:
    """Runs the model over the paged KV caches it owns."""

    def __init__(self, model: Any, backend: Backend, kv_caches: list[PagedKVCache], block_size: int) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = backend.device.device()

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Compute the scheduled tokens; -> logits (S, V) float32 for the requests that sample,
        in batch order."""
        fb = build_forward_batch(batch, self.block_size, self.device)
        hidden = self.model.forward(fb, self.kv_caches)  # (T, Dm)
        if fb.logits_indices.numel() == 0:
            return torch.empty((0, self.model.config.vocab_size), dtype=torch.float32, device=self.device)
        logits: torch.Tensor = self.model.compute_logits(hidden[fb.logits_indices])  # (S, V)
        return logits.float()
