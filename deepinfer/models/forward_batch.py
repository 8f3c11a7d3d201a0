"""ForwardBatch: everything one model step needs, built once per step by the model runner."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.backend.types import AttentionMetadata


@dataclass(frozen=True)
class ForwardBatch:
    """One step's inputs, on the backend's device. Requests are laid out back to back (ragged).

    input_ids       (T,) int64   token ids of this step (prefill chunks and decode tokens)
    positions       (T,) int64   absolute position of each token in its request
    slot_mapping    (T,) int64   KV-cache slot each token's K row is written to (-1 = none)
    attn            paged-attention metadata (block tables, lengths, query offsets)
    logits_indices  (S,) int64   rows of the final hidden states that need logits
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    attn: AttentionMetadata
    logits_indices: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
