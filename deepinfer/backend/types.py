"""Plain data that crosses the backend contract: options, capabilities, KV-cache handles, metadata.

Symbols used in shape comments across deepinfer:
  T  tokens in a step (all requests, ragged)      B  requests in a step
  H  query heads                                  D  K width of the latent cache (latent + rope, 576)
  Dv V width (a prefix of K: the latent, 512)     NB blocks in a pool, BS tokens per block
  MB blocks per request in a block table          E  experts, K top-k, I expert intermediate width
  M  rows of a GEMM, N output features            Dm model (hidden) width
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch


@dataclass(frozen=True)
class BackendOptions:
    """What the caller asks of a backend when it is created.

    device_index: which device of the backend's kind (rank-local index under torch.distributed).
    batch_invariant: every op returns, for one row, the same bits whatever else shares the batch
        (fixed reduction order and split sizes). Only honoured by backends whose capabilities say so.
    """

    device_index: int = 0
    batch_invariant: bool = False


@dataclass(frozen=True)
class Capabilities:
    """What a backend claims; the conformance suite tests exactly these claims."""

    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
    supports_fp8: bool = False
    supports_batch_invariant: bool = False
    supports_graphs: bool = False


@dataclass(frozen=True)
class Availability:
    """Result of a backend's probe. `reason` says why it is unavailable (or what was found)."""

    available: bool
    reason: str = ""


@dataclass(frozen=True)
class KVCacheSpec:
    """One layer's paged latent cache.

    Each cached token holds a K row of `latent_dim + rope_dim` values; V is a prefix of it whose
    width the attention ops take as `v_dim` <= latent_dim (MLA absorbed: 512 + 64 with v_dim 512;
    K = V latents: rope_dim = 0).
    """

    num_blocks: int
    block_size: int
    latent_dim: int
    rope_dim: int
    dtype: torch.dtype

    @property
    def head_dim(self) -> int:
        return self.latent_dim + self.rope_dim

    @property
    def bytes_per_token(self) -> int:
        return self.head_dim * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class PagedKVCache:
    """A layer's paged KV cache. The tensors' layout belongs to the backend that allocated it.

    Model code never indexes `tensors`; it passes the handle to the backend's ops. The default
    (reference) layout is one tensor (NB, BS, D). Every layout keeps the block index first so
    that block copies are layout-agnostic.
    """

    spec: KVCacheSpec
    tensors: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step paged-attention metadata, built once per step by the model runner.

    Device tensors (on the backend's device):
      block_tables     (B, MB) int32: block ids of each request, in order; unused entries are 0.
      seq_lens         (B,) int32: KV length of each request INCLUDING this step's tokens.
      query_start_loc  (B+1,) int32: cumulative query lengths; request b owns rows
                       query_start_loc[b]:query_start_loc[b+1] of q.
    Host copies (some vendor kernels take host length lists; building them here avoids syncs):
      seq_lens_host, query_lens_host: per request; max_query_len, max_seq_len: their maxima.

    Query row i of request b sits at absolute position seq_lens[b] - query_len[b] + i and sees
    cached positions j <= that position (causal), further limited by a sliding window or top-k
    indices when the op is given them. This step's K rows must be written before attention runs.
    """

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens_host: tuple[int, ...]
    query_lens_host: tuple[int, ...]
    max_query_len: int = field(default=0)
    max_seq_len: int = field(default=0)

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_host)

    @property
    def is_decode_only(self) -> bool:
        """Every request has exactly one query token (the decode kernel applies)."""
        return all(q == 1 for q in self.query_lens_host)

    @staticmethod
    def build(
        block_tables: torch.Tensor,
        seq_lens: list[int],
        query_lens: list[int],
    ) -> AttentionMetadata:
        """Build from host lists; device tensors go to `block_tables.device`."""
        if len(seq_lens) != len(query_lens):
            raise ValueError("seq_lens and query_lens must have one entry per request")
        device = block_tables.device
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        return AttentionMetadata(
            block_tables=block_tables.to(torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens_host=tuple(seq_lens),
            query_lens_host=tuple(query_lens),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
        )


Scoring = Literal["softmax", "sigmoid", "sqrtsoftplus"]
GroupScore = Literal["max", "top2_sum"]


@dataclass(frozen=True)
class RouterConfig:
    """How a MoE router turns logits into (weights, expert ids).

    scores = scoring(logits) in float32. Selection uses scores + correction_bias (when given);
    with num_groups > 1 only the `topk_groups` best groups (by `group_score` over each group's
    biased scores) are eligible. Weights are the UNBIASED scores at the chosen experts,
    divided by their sum when `renormalize`, then times `routed_scaling_factor`.
    """

    scoring: Scoring
    top_k: int
    num_groups: int = 1
    topk_groups: int = 1
    group_score: GroupScore = "max"
    renormalize: bool = False
    routed_scaling_factor: float = 1.0
