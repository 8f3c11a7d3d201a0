"""CausalLM: what the engine's worker needs of a model, and nothing more.

A model declares its KV caches as cache groups (KVCacheGroup: caches paged by one block table
per request), so the worker has one allocation path and one block manager for every model:
DeepSeek-V2/V3 declare one full-attention group, DeepSeek-V4 a ring and its compressed-entry
groups. The capability flags say which engine features the model supports; the worker reads
them instead of probing the model.

Symbols: T tokens in the step, S rows that need logits, V vocab, Dm hidden (DeepSeek-V4's
hidden states are (T, N, Dm) streams).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from deepinfer.backend.types import KVCacheSpec, PagedKVCache
from deepinfer.models.config import ModelConfig
from deepinfer.models.forward_batch import ForwardBatch, KVCacheGroup

if TYPE_CHECKING:
    from deepinfer.models.dflash import DFlashHeads
    from deepinfer.models.drafter import BlockDrafter


class CausalLM(Protocol):
    """A decoder over paged KV caches, with optional draft heads.

    Capability flags:
      supports_graphs           decode steps may be captured and replayed as graphs
      supports_prefill_graphs   short prefill steps too (one cache group paged per request)
      supports_drafts_with_graphs  graphs stay on with a speculative decoder (else its steps,
                                and every other, run eagerly)
      supports_prefix_caching   a cached prefix restores the caches exactly: a full block's rows
                                depend on its tokens and the ones before (one group), or the
                                groups follow GroupedBlockManager's rule (a ring and growing
                                groups of compressed entries: DeepSeek-V4)
      token_history             previous tokens of each computed token the forward reads
                                (ForwardBatch.token_history); 0: none
      rope_positions            positions the rope table holds (speculative padding drafts may
                                sit up to k positions past max_model_len)
      num_mtp_layers            multi-token-prediction layers loaded (0: none)
      hidden_shape              one token's hidden state (what verification graphs keep per row)
      drafter                   the block drafter saved beside the checkpoint, if any
      dflash                    the DFlash drafter, when loaded: its caches (dflash_caches of
                                forward's, in num_kv_layers) are injected into by forward
    """

    config: ModelConfig
    embed_tokens: torch.Tensor  # (V, Dm)
    lm_head: torch.Tensor  # (V, Dm)
    drafter: BlockDrafter | None
    supports_graphs: bool
    supports_prefill_graphs: bool
    supports_drafts_with_graphs: bool
    supports_prefix_caching: bool
    token_history: int

    @property
    def dflash(self) -> DFlashHeads | None: ...

    @property
    def rope_positions(self) -> int: ...

    @property
    def num_mtp_layers(self) -> int: ...

    @property
    def hidden_shape(self) -> tuple[int, ...]:
        """One token's hidden state as forward returns it: (Dm,); DeepSeek-V4's (N, Dm) streams."""
        ...

    @property
    def num_kv_layers(self) -> int:
        """The caches forward() takes: every cache of kv_cache_groups but the MTP layers'."""
        ...

    def dflash_caches(self, kv_caches: Sequence[PagedKVCache]) -> list[PagedKVCache]:
        """The DFlash drafter's caches among forward's kv_caches (its layers')."""
        ...

    def kv_cache_spec(self, num_blocks: int, block_size: int) -> KVCacheSpec:
        """One cache of num_blocks blocks (a group narrows its rows: KVCacheGroup.cache_spec)."""
        ...

    def use_kv_cache_dtype(self, kv_cache_dtype: str) -> None:
        """The format of the caches kv_cache_groups declares from now on (EngineConfig's
        kv_cache_dtype; check_kv_cache_dtype with the model's choices)."""
        ...

    def kv_cache_groups(
        self, block_size: int, max_backtrack: int = 0, mtp_layers: int = 0
    ) -> list[KVCacheGroup]:
        """The cache groups, in the order forward() takes their caches, for verification steps of
        at most max_backtrack drafts, holding the caches of the first mtp_layers MTP layers too
        (each group's last num_mtp_caches)."""
        ...

    def forward(self, batch: ForwardBatch, kv_caches: Sequence[PagedKVCache]) -> torch.Tensor:
        """The final hidden states of every token of the batch: (T, Dm)."""
        ...

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden (S, Dm) rows of forward's output -> logits (S, V) float32 (into `out`)."""
        ...

    def forward_mtp(
        self, batch: ForwardBatch, hidden: torch.Tensor, kv_caches: Sequence[PagedKVCache], depth: int = 0
    ) -> torch.Tensor:
        """MTP layer `depth`: batch.input_ids hold token i + 1 of each row, hidden (T, Dm) the
        model's hidden state of token i -> (T, Dm); compute_mtp_logits of it predicts i + 2."""
        ...

    def compute_mtp_logits(self, hidden: torch.Tensor, depth: int = 0) -> torch.Tensor:
        """hidden (S, Dm) rows of forward_mtp's output -> logits (S, V) float32."""
        ...


def check_kv_cache_dtype(kv_cache_dtype: str, choices: tuple[str, ...], model_type: str) -> None:
    """ValueError naming the value and the choices unless kv_cache_dtype is one of them."""
    if kv_cache_dtype not in choices:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not supported for {model_type}; choose one of {choices}"
        )
