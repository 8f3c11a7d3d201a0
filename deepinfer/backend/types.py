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
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from deepinfer.backend import kv_formats_mla


@dataclass(frozen=True)
class BackendOptions:
    """What the caller asks of a backend when it is created.

    device_index: which device of the backend's kind (rank-local index under torch.distributed).
    batch_invariant: every op returns, for one row, the same bits whatever else shares the batch
        (fixed reduction order and split sizes). Only honoured by backends whose capabilities say so.
    max_model_len: the longest sequence (prompt + output) the caller will run, when it knows it;
        a batch-invariant backend may size its fixed reductions by it (the cuda attention splits
        the keys at fixed positions max_model_len / 16 apart: short sequences still spread over
        several programs). None: the backend's default for any length.
    """

    device_index: int = 0
    batch_invariant: bool = False
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        n = self.max_model_len
        if n is not None and (isinstance(n, bool) or n < 1):
            raise ValueError(f"BackendOptions.max_model_len must be a positive int or None, got {n!r}")


@dataclass(frozen=True)
class Capabilities:
    """What a backend claims; the conformance suite tests exactly these claims."""

    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
    supports_fp8: bool = False
    supports_batch_invariant: bool = False
    supports_graphs: bool = False
    # small.engram_lookup reads a table in pinned host memory (device.pinned_empty) from the
    # device, with no host sync (DeepSeek-V4.1's Engram tables kept off the device)
    reads_host_tables: bool = False
    # attention and KV-cache ops take caches of FP8 latent rows (KVCacheSpec.kv_format "fp8",
    # deepinfer.backend.kv_formats_mla): what kv_cache_dtype="fp8" needs of a backend
    supports_fp8_kv_cache: bool = False


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

    kv_format "auto" stores the rows in `dtype`; "fp8" stores each as FlashMLA's FP8 latent row
    (deepinfer.backend.kv_formats_mla: e4m3 latent with a float32 scale per 128 values, bf16
    rope; 656 bytes for 512 + 64), `dtype` then being the model's.
    """

    num_blocks: int
    block_size: int
    latent_dim: int
    rope_dim: int
    dtype: torch.dtype
    kv_format: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_format not in kv_formats_mla.KV_FORMATS:
            formats = kv_formats_mla.KV_FORMATS
            raise ValueError(f"KVCacheSpec.kv_format must be one of {formats}, got {self.kv_format!r}")
        if self.is_fp8:
            kv_formats_mla.fp8_row_bytes(
                self.latent_dim, self.rope_dim
            )  # ValueError for widths it cannot hold

    @property
    def is_fp8(self) -> bool:
        return self.kv_format == kv_formats_mla.FP8_KV_FORMAT

    @property
    def head_dim(self) -> int:
        return self.latent_dim + self.rope_dim

    @property
    def bytes_per_token(self) -> int:
        if self.is_fp8:
            return kv_formats_mla.fp8_row_bytes(self.latent_dim, self.rope_dim)
        return self.head_dim * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class PagedKVCache:
    """A layer's paged KV cache. The tensors' layout belongs to the backend that allocated it
    (its KVCacheOps); model code and the engine never index `tensors`, they pass the handle back.

    The default layout (KVCacheOps' defaults, the reference backend's) is ONE tensor per layer,
    (NB, BS, D) in spec.dtype with D = latent_dim + rope_dim: slot s = block * BS + offset lives at
    [s // BS, s % BS], the latent first, then the rope part. A backend may split a row over several
    tensors (e.g. latent and rope apart) or reorder what follows the block index, but the BLOCK
    INDEX IS THE FIRST DIMENSION OF EVERY TENSOR: that is what lets the default copy_blocks (and
    the engine's block bookkeeping) work on any layout.
    """

    spec: KVCacheSpec
    tensors: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class AttentionModifiers:
    """What narrows or reweights the keys a query row sees beyond causality, passed to both
    attention ops as one object (`modifiers=`; NO_MODIFIERS when there are none).

    window:       int >= 1. The query at absolute position p sees the keys j with
                  p - window < j <= p: the last `window` positions, itself included. A window
                  longer than the sequence changes nothing.
    sinks:        (H,) float32, one logit per query head: exp(sinks[h]) joins head h's softmax
                  denominator and contributes no value (it only takes probability mass).
    topk_indices: (T, Kt) integer, one row per query row (the rows of q): the absolute key
                  positions that row may see, intersected with the causal limit and the window
                  (sparse attention).

    Edge rules every backend follows (the conformance suite checks each):
      - a query row that sees no key outputs ZEROS, with or without sinks (the sink has no value,
        so its probability mass contributes nothing). It happens when a top-k row lists nothing
        visible; it must not produce NaN (0/0) or read a key it may not see;
      - top-k ids are a SET: an id listed twice counts once (it is not weighted twice);
      - top-k ids < 0 are unused (-1 by convention); an id >= the request's KV length, or past the
        row's own position, is ignored: never an error and never read from the cache;
      - the order of ids within a row does not matter.
    """

    window: int | None = None
    sinks: torch.Tensor | None = None
    topk_indices: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"attention window must be >= 1, got {self.window}")
        if self.sinks is not None and self.sinks.dim() != 1:
            raise ValueError(f"attention sinks must be (H,), got shape {tuple(self.sinks.shape)}")
        if self.topk_indices is not None and (
            self.topk_indices.dim() != 2 or self.topk_indices.is_floating_point()
        ):
            raise ValueError(
                "attention topk_indices must be an integer (T, Kt) tensor, got "
                f"{self.topk_indices.dtype} {tuple(self.topk_indices.shape)}"
            )

    @property
    def is_plain(self) -> bool:
        """No window, no sinks, no top-k: causal attention over the whole prefix."""
        return self.window is None and self.sinks is None and self.topk_indices is None

    def describe(self) -> str:
        """A short description for messages: 'window=8, sinks, top-k 6' or 'none'."""
        parts = []
        if self.window is not None:
            parts.append(f"window={self.window}")
        if self.sinks is not None:
            parts.append("sinks")
        if self.topk_indices is not None:
            parts.append(f"top-k {self.topk_indices.shape[1]}")
        return ", ".join(parts) or "none"


NO_MODIFIERS = AttentionModifiers()


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step paged-attention metadata, built once per step by the worker.

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


@runtime_checkable
class Stream(Protocol):
    """A queue of device work (torch.cuda.Stream, torch.Stream, or the CPU's HostStream)."""

    def synchronize(self) -> None:
        """Block the host until the work queued on this stream so far has finished."""

    def wait_stream(self, stream: Any, /) -> None:
        """Work queued on this stream later waits for the work queued on `stream` so far."""

    def wait_event(self, event: Any, /) -> None:
        """Work queued on this stream later waits for `event`."""


@runtime_checkable
class Event(Protocol):
    """A marker in a stream (torch.cuda.Event, torch.Event, or the CPU's HostEvent)."""

    def record(self, stream: Any = None, /) -> None:
        """Mark the current point of `stream` (None: the current stream)."""

    def synchronize(self) -> None:
        """Block the host until the work before the recorded point has finished."""

    def query(self) -> bool:
        """Whether that work has finished, without blocking."""


@dataclass
class PendingRows:
    """Engram rows a SmallOps.engram_prefetch started to fetch: `rows` (T, C * Dh), for the work
    issued after SmallOps.engram_wait(this) on the stream that issued the prefetch; `ready`: what
    the backend's wait joins (its event), None where the rows were written in order already."""

    rows: torch.Tensor
    ready: Any = None


Scoring = Literal["softmax", "sigmoid", "sqrtsoftplus"]
GroupScore = Literal["max", "top2_sum"]


@dataclass(frozen=True)
class RouterConfig:
    """How a MoE router turns logits into (weights, expert ids).

    scores = scoring(logits) in float32. Selection uses scores + correction_bias (when given);
    with num_groups > 1 only the `topk_groups` best groups (by `group_score` over each group's
    biased scores) are eligible. Weights are the UNBIASED scores at the chosen experts,
    divided by their sum when `renormalize`, then times `routed_scaling_factor`.

    Ties: among equal group scores the lower group id is kept, among equal selection scores the
    lower expert id is chosen (a top2_sum group whose best score is tied sums that score twice).
    Exact ties are common (equal logits, a token whose hidden state is zero).

    shared_experts = S > 0 appends S always-chosen experts to every row: ids E .. E + S - 1
    (E = the logits' width) with weight exactly 1.0, neither renormalised nor scaled. A model
    that holds its shared MLP as S more experts after the routed ones (w13 / w2 with E + S
    experts) then computes routed and shared experts in one grouped GEMM.
    """

    scoring: Scoring
    top_k: int
    num_groups: int = 1
    topk_groups: int = 1
    group_score: GroupScore = "max"
    renormalize: bool = False
    routed_scaling_factor: float = 1.0
    shared_experts: int = 0
