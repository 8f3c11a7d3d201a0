"""ForwardBatch: everything one model step needs, built once per step by the worker; and
KVCacheGroup, how a model with several kinds of cache (DeepSeek-V4) asks the engine to page them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from deepinfer.backend.types import AttentionMetadata, KVCacheSpec


@dataclass(frozen=True)
class KVCacheGroup:
    """Caches paged by one block table per request: a block id names the same block in each
    cache of the group; each group has its own pool of blocks.

    name         for logs and benchmarks ("ring", "entries/4", ...)
    num_caches   caches in the group, each of rows `row_dim` wide
    ratio        one row per `ratio` tokens: 1 = a row per token; m = compressed entries (row w
                 holds entry w, pooled from tokens [w*m, (w+1)*m))
    ring_blocks  0: the table grows with the sequence (row r in block r // BS of the table);
                 n > 0: every request holds a ring of n blocks whatever its length, token row p in
                 block (p // BS) % n of the ring, so only the last n * BS positions are kept
    ring_lookback  a ring's: the positions before a step's first token that the step reads. A
                 request computing at most ring_step_tokens tokens writes them into its ring in
                 place; a longer step writes them to step-scratch blocks (deepinfer.engine.ring)
    num_mtp_caches  of the num_caches, the last ones that belong to the MTP head (speculative
                 decoding): paged, freed and rolled back with the model's, kept apart by the engine
    row_dim      values per cache row; None: the model's KVCacheSpec width (head_dim). The engine
                 allocates the group's caches (and counts their bytes) at this width
    dtype        the caches' element dtype; None: the model's KVCacheSpec dtype (uint8: rows of
                 quantised bytes, row_dim of them, e.g. DeepSeek-V4.1's FP8 / FP4 rows)
    """

    name: str
    num_caches: int
    ratio: int = 1
    ring_blocks: int = 0
    num_mtp_caches: int = 0
    ring_lookback: int = 0
    row_dim: int | None = None
    dtype: torch.dtype | None = None

    def cache_spec(self, spec: KVCacheSpec) -> KVCacheSpec:
        """The spec of this group's caches, from the model's `spec`: rows row_dim wide (all
        latent) and of `dtype` where set."""
        if self.row_dim is not None:
            spec = dataclasses.replace(spec, latent_dim=self.row_dim, rope_dim=0)
        return spec if self.dtype is None else dataclasses.replace(spec, dtype=self.dtype)

    def ring_step_tokens(self, block_size: int) -> int:
        """A ring's: the most tokens a request computes in one step in place, R - lookback (R =
        ring_blocks * BS rows): its rows then replace only positions older than its first
        token's lookback."""
        return self.ring_blocks * block_size - self.ring_lookback

    def blocks_for(self, num_tokens: int, block_size: int) -> int:
        """Blocks a request holds once num_tokens tokens are in the cache."""
        if self.ring_blocks:
            return self.ring_blocks
        return -(-(num_tokens // self.ratio) // block_size)

    def positions_covered(self, num_blocks: int, block_size: int) -> int | None:
        """With num_blocks blocks, the positions p < this whose rows (entry (p + 1) // ratio - 1,
        the entry closing at p) have a block; None for a ring (it wraps: its writes must stay
        within the positions it was sized for)."""
        if self.ring_blocks:
            return None
        return (num_blocks * block_size + 1) * self.ratio - 1


@dataclass(frozen=True)
class ForwardBatch:
    """One step's inputs, on the backend's device. Requests are laid out back to back (ragged).

    input_ids       (T,) int64   token ids of this step (prefill chunks and decode tokens)
    positions       (T,) int64   absolute position of each token in its request
    slot_mapping    (T,) int64   KV-cache slot each token's K row is written to (-1 = none)
    attn            paged-attention metadata (block tables, lengths, query offsets)
    logits_indices  (S,) int64   rows of the final hidden states that need logits
    group_block_tables  per cache group after the first (a model with several KVCacheGroups),
                    (B, MBg) int32 block tables of that group; slot_mapping and attn.block_tables
                    are the first group's (a ring's: column i is ring block i % n, or a
                    step-scratch block for the columns of a long step's positions). Empty: every
                    cache is paged by attn.block_tables.
    token_history   (T, K) int64 or None: for a model that reads K = CausalLM.token_history
                    previous tokens (DeepSeek-V4.1's Engram n-grams), column r - 1 of a token at
                    position p holds the id of the token at position p - r (any valid id where
                    p - r < 0; placeholders of pending tokens as in input_ids, resolved with them)
    fixed_exchange  the step is padded to a graph bucket, and with expert parallelism every rank
                    runs a step of that bucket: MoE layers exchange fixed-size buffers
                    (deepinfer.parallel.expert_parallel.fixed_exchange), capturable in a graph.
                    False: the host-sized all_to_all exchange.
    image_embeds    (Ti, Dm) or None: a vision-language model's image rows (their spans' vision
                    tower output, start / newline / end vectors included), in token order, for the
                    positions image_mask marks
    image_mask      (T,) bool or None: the step's tokens inside an image span (their input
                    embeddings are image_embeds' rows; DeepSeek-V4.1 routes them with the image
                    bias and masks them out of Engram). None: a step of text only
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    attn: AttentionMetadata
    logits_indices: torch.Tensor
    group_block_tables: tuple[torch.Tensor, ...] = ()
    fixed_exchange: bool = False
    token_history: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None
    image_mask: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
