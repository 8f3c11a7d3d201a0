"""The backend contract: the op interfaces every accelerator implements.

A backend is a `Backend` made of seven narrow parts. In each part, methods marked
`@abstractmethod` are required; every other method is optional and has a default, so a new port
works on day one and is accelerated op by op. Two kinds of defaults:
  - leaf ops (rms_norm, rope, route, quantize_fp8, ...) default to the reference implementation
    (deepinfer.reference: plain PyTorch, any torch device), which also defines what they mean;
  - composite ops (experts, fused_moe, grouped_gemm, linear_fp8, write_mla_kv, mla_query,
    mla_query_and_cache, mla_decode_and_uv, add_rms_norm, decode, ...) default to a composition
    of THIS BACKEND's own ops, reached through the part's `backend`: speed up grouped_gemm and
    the default experts get faster too.
docs/porting.md has the table of every default: what it calls and when to override it.

Shape symbols are listed in deepinfer/backend/types.py. All ops take and return tensors on
the backend's device. Unless an op says otherwise, outputs are new tensors and inputs are
not modified.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist

from deepinfer.backend import fp4
from deepinfer.backend import kv_formats_v41 as kvf
from deepinfer.backend.fp8 import FP8_BLOCK
from deepinfer.backend.host import HostEvent, HostStream
from deepinfer.backend.types import (
    NO_MODIFIERS,
    AttentionMetadata,
    AttentionModifiers,
    BackendOptions,
    Capabilities,
    Event,
    KVCacheSpec,
    PagedKVCache,
    PendingRows,
    RouterConfig,
    Stream,
)
from deepinfer.reference import attention as ref_attention
from deepinfer.reference import engram as ref_engram
from deepinfer.reference import gemm as ref_gemm
from deepinfer.reference import memory as ref_memory
from deepinfer.reference import moe as ref_moe
from deepinfer.reference import small as ref_small
from deepinfer.reference import v4 as ref_v4


class _Part:
    """Common base of the parts: the options the backend was created with, and the Backend the
    part belongs to (set when the Backend is assembled), through which composite defaults call
    the backend's other ops."""

    def __init__(self, options: BackendOptions) -> None:
        self.options = options
        self._backend: Backend | None = None

    @property
    def backend(self) -> Backend:
        """The Backend this part belongs to (the last one assembled with it)."""
        backend: Backend | None = getattr(self, "_backend", None)
        if backend is None:
            raise RuntimeError(
                f"{type(self).__name__} is not part of a Backend yet: build the Backend(...) that holds "
                "it before calling its ops (defaults reach the other parts through it)"
            )
        return backend

    @property
    def batch_invariant(self) -> bool:
        return self.options.batch_invariant


class GraphRunner(ABC):
    """A captured sequence of device work, replayed with the same input/output buffers."""

    @abstractmethod
    def replay(self) -> None: ...


class RerunGraph(GraphRunner):
    """Graph stand-in for devices without graphs of their own (the CPU): replay() runs the
    captured function again. The function closes over its capture-time objects, so its host
    values stay frozen exactly as in a real graph while the device tensors it reads are refilled
    in place: this checks the graph path's data flow (persistent buffers, bucket padding,
    upper-bound lengths), not its speed."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


@contextmanager
def _torch_stream(stream: Any) -> Iterator[Any]:
    with stream:  # torch.Stream makes itself current inside `with`
        yield stream


# --------------------------------------------------------------------------- device


class DeviceOps(_Part):
    """Device handle, synchronisation, memory, streams, events, pinned buffers and graphs.

    Streams, events and pinned buffers: on the CPU the defaults are host stand-ins (HostStream,
    HostEvent, unpinned tensors), right only because CPU work is synchronous. On any other device
    they are torch's device-generic torch.Stream / torch.Event and pin_memory=True, which work
    when the device's torch integration implements them (CUDA does; a PrivateUse1 device must
    register stream, event and host-allocator hooks). An event that reports completion before the
    device has finished lets the engine read a host buffer that is still being written: override
    these four methods unless the conformance suite's stream test passes on the real device.
    """

    # Whether a graph replay's attention takes its lengths from AttentionMetadata's device tensors
    # as they are when the op runs, so that a captured function may compute them itself (the MTP
    # head's chained drafts inside a verification graph). False (the default): a replay may read
    # them before it starts (the Ascend backend re-issues its attention tasks with them), so only
    # tensors the caller refilled in place are safe, and the engine steps such work eagerly.
    graph_lengths_on_device: bool = False

    @abstractmethod
    def device(self) -> torch.device:
        """The torch device every tensor of this backend lives on."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until all queued work on the device has finished."""

    @abstractmethod
    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory, as the driver reports them. The engine sizes the
        KV pool from `free`: report what a new allocation can really get."""

    def _synchronous(self) -> bool:
        return self.device().type == "cpu"

    def new_stream(self) -> Stream:
        """A new stream for overlapping work. Default: HostStream on the CPU, torch.Stream(device)
        elsewhere."""
        if self._synchronous():
            return HostStream()
        stream: Stream = torch.Stream(self.device())
        return stream

    def stream_context(self, stream: Stream) -> AbstractContextManager[object]:
        """Context manager that makes `stream` current for the ops issued inside it. Default:
        nothing on the CPU; a torch.Stream's own `with` elsewhere."""
        if isinstance(stream, torch.Stream):
            return _torch_stream(stream)
        return nullcontext(stream)

    def new_event(self) -> Event:
        """A new event with record() / synchronize() / query(). Default: HostEvent (always
        complete) on the CPU, torch.Event(device) elsewhere."""
        if self._synchronous():
            return HostEvent()
        event: Event = torch.Event(self.device())
        return event

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor the device can copy from and to asynchronously
        (non_blocking=True). Default: plain host memory on the CPU, pin_memory=True elsewhere."""
        return torch.empty(shape, dtype=dtype, pin_memory=not self._synchronous())

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Queue a copy of the device tensor `src` into `dst`, a pinned_empty tensor of its shape
        and dtype, on the current stream: the host reads it once an event recorded after this
        call has completed. The engine sends each step's sampled tokens this way. Default:
        dst.copy_(src, non_blocking=True)."""
        dst.copy_(src, non_blocking=True)

    def to_device(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Queue a copy of `src`, a pinned_empty tensor, into the device tensor `dst` of its
        shape and dtype, on the current stream: the host must not rewrite `src` before an event
        recorded after this call has completed. The engine sends each step's inputs this way.
        Default: dst.copy_(src, non_blocking=True)."""
        dst.copy_(src, non_blocking=True)

    def capture_graph(
        self, fn: Callable[[], object], share_with: GraphRunner | None = None
    ) -> GraphRunner | None:
        """Capture `fn` for replay, or None where the backend has no graphs
        (Capabilities.supports_graphs is False): callers then run `fn` eagerly. With
        `share_with` (a graph this backend captured), the new graph allocates from that graph's
        memory pool: capture the largest of a set first and share its pool with the rest.

        What a replay may rely on: the device tensors `fn` read at capture keep their addresses
        and are refilled in place by the caller; every host value `fn` computed at capture
        (shapes, Python ints, the host lengths in AttentionMetadata) is frozen. So `fn` must not
        read the device from the host (no .item(), .tolist(), nonzero, data-dependent shapes):
        the ops of a decode step (attention, the KV writes, the MoE path) must all be free of
        host syncs before a backend claims graphs. Several defaults are not (they loop over
        group sizes or request lengths on the host)."""
        return None

    def is_capturing(self) -> bool:
        """True while capture_graph records device work into a real graph (RerunGraph records
        nothing: False). Defaults that read request lengths on the host (DeepSeek-V4's
        compressed_attention and indexer_topk) raise NotImplementedError then, and the engine
        runs decode steps eagerly. Default: False."""
        return False

    def peak_memory_bytes(self) -> int | None:
        """Most device memory held by tensors since the last reset_peak_memory (None: the
        device does not say). The engine sizes its graph memory with it."""
        return None

    def reset_peak_memory(self) -> None:
        """Start a new peak_memory_bytes measurement."""


# --------------------------------------------------------------------------- KV cache


class KVCacheOps(_Part):
    """The paged KV cache: its layout (allocate), the writes each step issues, reads for tests
    and tools, block copies. All optional: the defaults keep the layout PagedKVCache describes,
    one (NB, BS, D) tensor per layer. A backend that changes the layout overrides allocate,
    write_kv and read_kv together (write_mla_kv's default ends in write_kv, and copy_blocks works
    on any layout whose tensors keep the block index first, which every layout must)."""

    def allocate(self, spec: KVCacheSpec, num_layers: int) -> list[PagedKVCache]:
        """One zero-filled cache per layer, on the backend's device. Every tensor of a cache has
        spec.num_blocks as its FIRST dimension."""
        return ref_memory.allocate_kv_cache(spec, num_layers, self.backend.device.device())

    def write_kv(self, cache: PagedKVCache, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store K rows in the cache, in place.

        kv: (T, D) in any float dtype (cast to the cache dtype; FP8 latent caches: quantised from
        these values as deepinfer.backend.kv_formats_mla.quantize_mla_rows does), possibly a strided view;
        slot_mapping: (T,) int64 with slot = block_id * BS + offset; a slot of -1 skips that row
        (padding). Default: boolean-mask indexing (a host sync: override it before claiming graphs).
        """
        ref_memory.write_kv(cache, kv, slot_mapping)

    def read_kv(self, cache: PagedKVCache, slots: torch.Tensor) -> torch.Tensor:
        """(n, D) K rows stored at `slots` (n,) int64, in the cache dtype: write_kv of them stores
        the same rows (FP8 latent caches, spec.kv_format "fp8": the rows dequantised to float32,
        exact; writing them back may pick another scale for a tile, never other values). The
        conformance suite checks a layout through it; DeepSeek-V4 reads its state rows with it,
        and the engine copies ring rows to and from step scratch with it (deepinfer.engine.ring)."""
        return ref_memory.read_kv(cache, slots)

    def write_mla_kv(
        self,
        cache: PagedKVCache,
        kv: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        interleaved: bool,
        slot_mapping: torch.Tensor,
    ) -> None:
        """MLA's cache write in one op: kv (T, C + R) is the raw output of the KV down-projection;
        the row stored at slot_mapping[t] is [rms_norm(kv[t, :C]) * norm_weight | rope(kv[t, C:])],
        with rms_norm and rope as the small ops define them (rope at positions (T,) int64).
        C = cache.spec.latent_dim, R = cache.spec.rope_dim; a slot of -1 skips the row.
        Default: this backend's small.rms_norm and small.rope, then this part's write_kv."""
        small = self.backend.small
        c = cache.spec.latent_dim
        latent = small.rms_norm(kv[:, :c], norm_weight, eps)
        k_pe = kv[:, c:]
        if k_pe.shape[1]:
            k_pe = small.rope(k_pe[:, None], positions, cos_sin_cache, interleaved)[:, 0]
        self.write_kv(cache, torch.cat([latent, k_pe.to(latent.dtype)], dim=-1), slot_mapping)

    def write_kv_rows(
        self, cache: PagedKVCache, rows: torch.Tensor, slot_mapping: torch.Tensor, fmt: kvf.RowFormat | None
    ) -> None:
        """Store rows (T, W) float, quantised to `fmt` (DeepSeek-V4.1's KV row formats: the bytes
        kv_formats_v41.quantize_rows defines, in a uint8 cache of rows row_bytes(fmt, W) wide;
        None: write_kv as it is). Slot -1 skips a row. Default: that quantiser (no host sync),
        then this part's write_kv of the bytes."""
        if fmt is None:
            self.write_kv(cache, rows, slot_mapping)
        else:
            self.write_kv(cache, kvf.quantize_rows(rows, fmt), slot_mapping)

    def read_kv_rows(
        self, cache: PagedKVCache, slots: torch.Tensor, fmt: kvf.RowFormat | None
    ) -> torch.Tensor:
        """(n, W) float32 rows at `slots` (n,) int64 of a cache write_kv_rows filled in `fmt`,
        dequantised (kv_formats_v41.dequantize_rows; None: read_kv's rows as float32)."""
        raw = self.read_kv(cache, slots)
        return raw.float() if fmt is None else kvf.dequantize_rows(raw, fmt)

    def compressed_entries(
        self,
        meta: AttentionMetadata,
        slot_mapping: torch.Tensor,
        entry_tables: torch.Tensor,
        key_tables: torch.Tensor | None,
        *,
        ratio: int,
        overlap: bool,
        block_size: int,
    ) -> ref_v4.EntrySlots | None:
        """DeepSeek-V4's compressed entries of ratio m that close in a step, and where their
        pooled tokens and the entries themselves are stored: the step's index work, done once
        per ratio (every layer of that ratio reads it). Entry w pools positions [w*m, (w+1)m)
        (overlap, CSA: [(w-1)m, (w+1)m), 2m slots) and closes at position (w+1)m - 1; request b
        (positions [seq_lens[b] - q_b, seq_lens[b])) closes the entries w with (w+1)m - 1 among
        them whose closing row it writes (slot_mapping >= 0).

        Returns None where no entry closes, else (W entries, S = m or 2m slots):
          state_slots (W, S) int64: the slot of each pooled position p through meta.block_tables
            (block_tables[b, min(p // BS, MB - 1)] * BS + p % BS, p clamped to 0), BS = block_size
            (entry_tables' too);
          present (W, S) bool: p >= 0;
          out_slots (W,) int64: row w of request b's entry table (entry_tables, (B, MBe) int32), -1
            where the entry does not close (it stores nothing);
          positions (W,) int64: w * m (the entry's rope position);
          key_slots (W,) int64: as out_slots through key_tables (None: out_slots itself).
        Every query length equal (meta.query_lens_host all q: decode, verification and graph
        steps): computed from the DEVICE seq_lens and slot_mapping (the host lengths may be
        upper bounds), W = B * ceil(q / m) candidates in request order, ceil(q / m) each, those
        that do not close with out_slots -1, their w clamped to the request's last closed entry
        (0 if none) and their positions to the request's last. Ragged steps: the closing entries
        alone, listed from the host lengths. Default: the reference (torch ops)."""
        return ref_v4.compressed_entries(
            meta, slot_mapping, entry_tables, key_tables, ratio, overlap, block_size
        )

    def copy_blocks(self, cache: PagedKVCache, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks src[i] -> dst[i] ((n,) int64 each), in place, every tensor.
        Every source is read before any destination is written; destinations are distinct.
        Default: one indexed copy per tensor along the first (block) dimension, right for every
        layout; override only to do it in one launch."""
        ref_memory.copy_blocks(cache, src, dst)


# --------------------------------------------------------------------------- attention


class AttentionOps(_Part):
    """Paged latent attention (MLA absorbed form: one shared KV head, V a prefix of K).

    scores[h, j] = scale * <q[h, :D], K[j, :D]> over the request's visible positions j;
    out[h] = sum_j softmax(scores[h])_j * K[j, :v_dim]. Softmax in float32. `scale` is the
    caller's (models do not pass D^-0.5); v_dim <= cache.spec.latent_dim.

    Visible positions: query row i of request b sits at absolute position
    p = seq_lens[b] - query_len[b] + i and sees cached positions j <= p (causal), further limited
    by `modifiers` (AttentionModifiers: sliding window, per-head sinks, sparse top-k indices).
    The edge rules are the modifiers' (see AttentionModifiers): a row that sees no key outputs
    zeros, with or without sinks; top-k ids are a set, -1 unused, ids past the KV length ignored.
    Cache rows past a request's KV length (never written, or stale) may hold anything, NaN
    included: they must not reach the output, even through a zero softmax weight (0 * NaN).

    Lengths: the device tensors of `meta` are the truth. Its host copies may be UPPER BOUNDS of
    them (every seq_lens_host entry >= the device one, the query lengths equal): that is how a
    step captured once in a graph replays with other lengths (decode steps; verification and
    prefill graph steps, whose requests are each padded to the same query length). A row whose
    device KV length is shorter reads only its own rows.
    """

    def decode(
        self,
        q: torch.Tensor,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        *,
        scale: float,
        v_dim: int,
        modifiers: AttentionModifiers = NO_MODIFIERS,
    ) -> torch.Tensor:
        """One query token per request. q: (B, H, D) -> (B, H, v_dim) in q's dtype.
        Requires meta.is_decode_only (ValueError otherwise). Batch-invariant backends use a FIXED
        split size over KV. Default: the check, then `prefill`; override for a dedicated kernel."""
        if not meta.is_decode_only:
            raise ValueError("decode attention needs exactly one query token per request")
        return self.prefill(q, cache, meta, scale=scale, v_dim=v_dim, modifiers=modifiers)

    @abstractmethod
    def prefill(
        self,
        q: torch.Tensor,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        *,
        scale: float,
        v_dim: int,
        modifiers: AttentionModifiers = NO_MODIFIERS,
    ) -> torch.Tensor:
        """Ragged causal attention over a cached prefix (chunked prefill; any query lengths,
        decode rows and empty requests included). q: (T, H, D), possibly a strided view with
        stride(-1) == 1 -> (T, H, v_dim) in q's dtype."""

    def mla_decode_and_uv(
        self,
        q: torch.Tensor,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        w_uv: torch.Tensor,
        *,
        scale: float,
        v_dim: int,
        modifiers: AttentionModifiers = NO_MODIFIERS,
    ) -> torch.Tensor:
        """MLA's decode output mapped to each head's value space in one op: decode(q, cache, meta,
        scale=scale, v_dim=v_dim, modifiers=modifiers) (B, H, v_dim), then each head's product
        with w_uv (H, Vh, v_dim) as gemm.batched_linear defines it -> (B, H, Vh) in q's dtype.
        One op so that a backend can merge the attention's split-KV partials where the product
        reads them (one launch a layer fewer at decode sizes). Callers pass the step's own
        metadata and a cache whose rows before each request's query tokens were written before
        the forward started (a model's decode step): a backend may read those while the forward's
        previous kernel still runs. Default: the two ops."""
        o = self.decode(q, cache, meta, scale=scale, v_dim=v_dim, modifiers=modifiers)
        return self.backend.gemm.batched_linear(o.transpose(0, 1), w_uv).transpose(0, 1)

    def mla_query(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        w_uk: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        interleaved: bool,
    ) -> torch.Tensor:
        """MLA's absorbed query, the q that decode / prefill take: q_nope (T, H, N) and q_pe
        (T, H, R), possibly strided views with stride(-1) == 1 (slices of one projection output),
        w_uk (H, C, N) = W_UK^T per head (as gemm.batched_linear takes weights), positions (T,)
        int64, cos_sin_cache (P, R) as small.rope takes it -> (T, H, C + R) in q_nope's dtype,
        q_full[t, h] = [q_nope[t, h] @ w_uk[h]^T | rope(q_pe)[t, h]], each part as
        gemm.batched_linear and small.rope define it. One op so that a backend can prepare the
        query in one launch per layer (rope, the per-head product and the concat are three or four
        at decode sizes). Default: this backend's gemm.batched_linear and small.rope, then
        torch.cat (batch-invariant where those are)."""
        q_latent = self.backend.gemm.batched_linear(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        if q_pe.shape[-1]:
            q_pe = self.backend.small.rope(q_pe, positions, cos_sin_cache, interleaved)
        return torch.cat([q_latent, q_pe.to(q_latent.dtype)], dim=-1)

    def mla_query_and_cache(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        w_uk: torch.Tensor,
        kv: torch.Tensor,
        cache: PagedKVCache,
        kv_norm_weight: torch.Tensor,
        eps: float,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        interleaved: bool,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """MLA's step preparation in one op: kv_cache.write_mla_kv(cache, kv, kv_norm_weight, eps,
        positions, cos_sin_cache, interleaved, slot_mapping), then mla_query(q_nope, q_pe, w_uk,
        positions, cos_sin_cache, interleaved), returned; both read the same projection output
        and positions, so a backend may do both in one launch (one launch a layer fewer at decode
        sizes). The stored rows and the query are those of the two ops. Callers pass the step's
        own positions and slot_mapping, written before the forward started (a backend may read
        them while the forward's previous kernel still runs). Default: the two ops."""
        self.backend.kv_cache.write_mla_kv(
            cache, kv, kv_norm_weight, eps, positions, cos_sin_cache, interleaved, slot_mapping
        )
        return self.mla_query(q_nope, q_pe, w_uk, positions, cos_sin_cache, interleaved)

    def compressed_attention(
        self,
        q: torch.Tensor,
        cache: PagedKVCache,
        compressed: PagedKVCache,
        meta: AttentionMetadata,
        *,
        scale: float,
        ratio: int,
        modifiers: AttentionModifiers = NO_MODIFIERS,
        compressed_block_tables: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """DeepSeek-V4 attention: one softmax over two key sets, K = V (whole rows, D wide).
        q (T, H, D) -> (T, H, D) in q's dtype.

        `cache` holds one row per token position (paged by meta.block_tables as `prefill` reads
        it); the query at position p sees the token rows the causal limit and modifiers.window let
        through. `compressed` holds one row per compressed entry w (entry w at position w of
        compressed_block_tables (B, MBc) int32, default meta.block_tables; a request of KV length
        L has L // ratio of them); entry w pools tokens
        [w*ratio, (w+1)*ratio) and is visible to the query at p when (w+1)*ratio <= p+1, further
        limited to the ids of modifiers.topk_indices (T, Kt) when given (the edge rules of
        AttentionModifiers: a set, -1 unused, ids past the visible entries ignored).
        modifiers.sinks (H,) joins the softmax denominator. Default: the reference, reading the
        rows through this backend's kv_cache.read_kv (any layout), one request at a time from
        the device lengths read on the host (NotImplementedError while a real graph captures)."""
        _refuse_capture(self.backend, "compressed_attention")
        read = self.backend.kv_cache.read_kv
        return ref_v4.compressed_attention(
            q, cache, compressed, meta, scale, ratio, modifiers, read, compressed_block_tables
        )

    def indexer_topk(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: PagedKVCache,
        meta: AttentionMetadata,
        *,
        ratio: int,
        topk: int,
        scale: float,
    ) -> torch.Tensor:
        """DeepSeek-V4's lightning indexer: which compressed entries each query row attends to.
        q (T, Hi, Di), weights (T, Hi) float32; `keys` holds one row (Di wide, or wider: the
        first Di values count) per compressed entry, paged like `compressed_attention`'s.
        score[t, w] = sum_h weights[t, h] * relu(q[t, h] . keys[w]) * scale over the entries
        visible to row t ((w+1)*ratio <= p+1). -> (T, topk) int32: the ids of the
        min(topk, visible) best-scoring visible entries in any order, -1 in the other columns;
        among equal scores the lower ids (a row's picks depend on its own scores only, not on
        the entries past it or the other rows: a verification step picks what plain decoding
        picks). Scores computed in float32. Default: the reference, reading the keys through this
        backend's kv_cache.read_kv (any layout), one request at a time from the device lengths
        read on the host (NotImplementedError while a real graph captures)."""
        _refuse_capture(self.backend, "indexer_topk")
        return ref_v4.indexer_topk(q, weights, keys, meta, ratio, topk, scale, self.backend.kv_cache.read_kv)

    def quantized_attention(
        self,
        q: torch.Tensor,
        window: PagedKVCache,
        entries: PagedKVCache | None,
        meta: AttentionMetadata,
        *,
        scale: float,
        ratio: int,
        window_format: kvf.RowFormat | None,
        entry_format: kvf.RowFormat | None,
        modifiers: AttentionModifiers = NO_MODIFIERS,
        compressed_block_tables: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """DeepSeek-V4.1's sparse attention over quantised rows: compressed_attention(q, window,
        entries, ...) where each cache's rows are those read_kv_rows dequantises (window in
        window_format, entries in entry_format; the rows are D = q's width values). entries None:
        the window only (a sliding-window layer; ratio unused). q (T, H, D) -> (T, H, D) in q's
        dtype. Default: the reference over read_kv_rows (any layout), one request at a time from
        the device lengths read on the host (NotImplementedError while a real graph captures)."""
        _refuse_capture(self.backend, "quantized_attention")
        read_window, read_entries = self._row_reader(window_format), self._row_reader(entry_format)
        if entries is None:  # the window alone: a ratio past every length closes no entry
            entries, ratio, read_entries = window, 1 << 62, read_window
        return ref_v4.compressed_attention(
            q, window, entries, meta, scale, ratio, modifiers, read_window, compressed_block_tables,
            read_compressed=read_entries,
        )  # fmt: skip

    def quantized_indexer_topk(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: PagedKVCache,
        meta: AttentionMetadata,
        *,
        ratio: int,
        topk: int,
        scale: float,
        key_format: kvf.RowFormat | None,
    ) -> torch.Tensor:
        """DeepSeek-V4.1's indexer scoring over quantised keys: indexer_topk(q, weights, keys, ...)
        where the keys are the rows read_kv_rows dequantises in key_format (Di = q's width
        values) and the queries those kv_formats_v41.round_index_queries gives: key_format
        "mxfp4" (the published FP4 indexer) scores each query head rounded to MXFP4 as a key is
        (one power-of-two scale per 32 values), other formats q as it is. Ties as indexer_topk's,
        among the scores of the rounded queries (FP4 codes tie more often than floats). Default:
        the reference over read_kv_rows, one request at a time from the device lengths read on
        the host (NotImplementedError while a real graph captures)."""
        _refuse_capture(self.backend, "quantized_indexer_topk")
        read, q = self._row_reader(key_format), kvf.round_index_queries(q, key_format)
        return ref_v4.indexer_topk(q, weights, keys, meta, ratio, topk, scale, read)

    def varlen_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        *,
        scale: float,
    ) -> torch.Tensor:
        """Unpaged bidirectional attention within segments (a vision tower's images, each one
        segment): q, k (T, H, D), v (T, H, Dv), each possibly a strided view with stride(-1) == 1
        (slices of one qkv projection); cu_seqlens (S + 1,) int32 on the device, cu_seqlens[0] = 0,
        cu_seqlens[S] = T, non-decreasing (empty segments allowed); max_seqlen >= the longest
        segment, on the host. Row t of segment s: out[t, h] = sum_j softmax_j(scale * q[t, h] .
        k[j, h]) v[j, h] over the rows j of segment s only (no causal limit), softmax in float32
        -> (T, H, Dv) in q's dtype. Default: the reference, one segment at a time from cu_seqlens
        read on the host (NotImplementedError while a real graph captures)."""
        _refuse_capture(self.backend, "varlen_attention")
        return ref_attention.varlen_attention(q, k, v, cu_seqlens, scale)

    def indexer_candidate_blocks(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: PagedKVCache,
        meta: AttentionMetadata,
        *,
        ratio: int,
        topk: int,
        scale: float,
        block_size: int,
        topk_blocks: int,
        key_format: kvf.RowFormat | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V4.1's candidate-block selection, first stage (the candidate source layer):
        indexer_topk's picks, and the blocks every later layer scores inside. Arguments and
        scores as indexer_topk; block j holds entries [j*block_size, (j+1)*block_size). A row's
        block score is the best score of its visible entries in the block, except the block of
        the row's newest visible entry, which scores +inf (always kept). -> (ids (T, topk),
        blocks (T, topk_blocks)) int32: blocks = the min(topk_blocks, visible blocks) best
        blocks in any order, ties to the lower block id, -1 in the other columns. key_format:
        the keys' row format as quantized_indexer_topk's, which also says how the queries are
        rounded ("mxfp4": to MXFP4; None: keys in a float dtype, q as it is). Default: the
        reference over read_kv (read_kv_rows where key_format is set; NotImplementedError while
        a real graph captures)."""
        _refuse_capture(self.backend, "indexer_candidate_blocks")
        q = kvf.round_index_queries(q, key_format)
        return ref_v4.indexer_candidate_blocks(
            q, weights, keys, meta, ratio, topk, scale, block_size, topk_blocks, self._key_reader(key_format)
        )

    def indexer_topk_in_blocks(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: PagedKVCache,
        meta: AttentionMetadata,
        blocks: torch.Tensor,
        *,
        ratio: int,
        topk: int,
        scale: float,
        block_size: int,
        key_format: kvf.RowFormat | None = None,
    ) -> torch.Tensor:
        """DeepSeek-V4.1's candidate-block selection, second stage: indexer_topk restricted to
        the visible entries of each row's candidate blocks. blocks (T, Kb) int32: distinct block
        ids per row (blocks of block_size entries, as indexer_candidate_blocks lists them), -1
        unused, ids past the row's visible blocks ignored. -> (T, topk) int32: the
        min(topk, candidate entries) best candidate entries in any order, ties to the lower
        entry id, -1 in the other columns. key_format: as indexer_candidate_blocks' (keys and
        queries). Default: the reference over read_kv (read_kv_rows where key_format is set;
        NotImplementedError while a real graph captures)."""
        _refuse_capture(self.backend, "indexer_topk_in_blocks")
        q = kvf.round_index_queries(q, key_format)
        return ref_v4.indexer_topk_in_blocks(
            q, weights, keys, meta, blocks, ratio, topk, scale, block_size, self._key_reader(key_format)
        )

    def _key_reader(self, key_format: kvf.RowFormat | None) -> ref_v4.RowReader:
        """The index keys' rows: read_kv's values, or read_kv_rows' dequantised ones."""
        return self.backend.kv_cache.read_kv if key_format is None else self._row_reader(key_format)

    def _row_reader(self, fmt: kvf.RowFormat | None) -> ref_v4.RowReader:
        """read_kv_rows in `fmt`: (cache, slots) -> float32 rows, dequantised."""
        kv = self.backend.kv_cache

        def read(cache: PagedKVCache, slots: torch.Tensor) -> torch.Tensor:
            return kv.read_kv_rows(cache, slots, fmt)

        return read


def _refuse_capture(backend: Backend, op: str) -> None:
    if backend.device.is_capturing():
        raise NotImplementedError(
            f"{backend.name}: the default {op} reads request lengths on the host and cannot be "
            "captured in a graph; override it with a kernel that reads them on the device"
        )


# --------------------------------------------------------------------------- gemm


class GemmOps(_Part):
    """Dense and grouped matrix products, in floating point, FP8 e4m3 with block scales, and
    (grouped, for experts) MXFP4.

    FP8 format: deepinfer.backend.fp8 (DeepSeek's). Scales MULTIPLY. A weight (N, K) e4m3 has a
    float32 scale per b x b block, (ceil(N/b), ceil(K/b)); activations have one per token per b
    channels, (M, ceil(K/b)); value = fp8 * scale. The FP8 ops take the block b as `block`: 128
    (DeepSeek-V3 / V4, fp8.FP8_BLOCK, the default) is required of every backend; 32 (DeepSeek-V4.1,
    fp8.MXFP8_BLOCK: e4m3 with UE8M0 scales per 32 x 32 weight block and per 1 x 32 activation
    group) is optional: the defaults here compute it, and a backend that overrides an op without
    it raises NotImplementedError naming the block. Scale tensors may be strided (e.g.
    column-major, as TMA-based kernels keep them): their shapes, not their strides, are the contract.
    MXFP4 format: deepinfer.backend.fp4 (DeepSeek-V4's routed experts): e2m1 values packed two
    per byte, one UE8M0 (power-of-two) scale byte per 32 values along K; activations are not
    quantised.
    """

    @abstractmethod
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (M, K) @ weight (N, K)^T + bias (N,) -> (M, N) in x's dtype."""

    def batched_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """One product per group: x (G, M, K), weight (G, N, K) -> (G, M, N) in x's dtype, with
        out[g] = x[g] @ weight[g]^T. x and weight may be strided views. MLA uses it per head to
        absorb the key up-projection into the query and to expand the latent output into each
        head's values. Default: torch.bmm; batch-invariant: this part's linear per group."""
        if not self.batch_invariant:
            return torch.bmm(x, weight.transpose(1, 2))
        out = torch.empty((x.shape[0], x.shape[1], weight.shape[1]), dtype=x.dtype, device=x.device)
        for g in range(x.shape[0]):
            out[g] = self.linear(x[g], weight[g])
        return out

    def quantize_fp8(self, x: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token, per-`block`-channel symmetric quantisation.
        x (M, K) -> (xq (M, K) float8_e4m3fn, scale (M, ceil(K/block)) float32 = amax / 448).
        block 128 (DeepSeek's format) is required of every backend, 32 (V4.1's) optional; other
        sizes are optional and a backend that lacks one raises ValueError or NotImplementedError.
        Default: the reference."""
        return ref_gemm.quantize_fp8(x, block)

    def fp8_gemm(
        self,
        xq: torch.Tensor,
        x_scale: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        out_dtype: torch.dtype,
        block: int = FP8_BLOCK,
    ) -> torch.Tensor:
        """Block-scaled FP8 product: (xq * x_scale) @ (weight * weight_scale)^T -> (M, N) out_dtype.
        xq (M, K) e4m3, x_scale (M, ceil(K/b)), weight (N, K) e4m3, weight_scale (ceil(N/b),
        ceil(K/b)), b = block; accumulation in float32. Default: the reference (dequantise both
        operands to float32, then a float32 matmul: correct, slow, and memory-hungry)."""
        return ref_gemm.fp8_gemm(xq, x_scale, weight, weight_scale, out_dtype, self.batch_invariant, block)

    def linear_fp8(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        block: int = FP8_BLOCK,
    ) -> torch.Tensor:
        """x (M, K) float -> (M, N) in x's dtype, x quantised per token per `block` channels and
        weight_scale (ceil(N/b), ceil(K/b)). Default: this part's quantize_fp8, then fp8_gemm."""
        xq, xs = self.quantize_fp8(x, block)
        y = self.fp8_gemm(xq, xs, weight, weight_scale, x.dtype, block=block)
        return y if bias is None else y + bias

    def batched_linear_fp8(
        self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: int = FP8_BLOCK
    ) -> torch.Tensor:
        """One FP8 product per group: x (G, M, K) float (may be a strided view), weight (G, N, K)
        e4m3 with block scales (G, ceil(N/b), ceil(K/b)) -> (G, M, N) in x's dtype, out[g] =
        linear_fp8(x[g], weight[g], weight_scale[g], block=block). DeepSeek-V4's grouped output
        projection (wo_a). Default: grouped_gemm_fp8 over the G * M rows, M a group."""
        g, m, k = x.shape
        sizes = torch.full((g,), m, dtype=torch.int64, device=x.device)
        y = self.grouped_gemm_fp8(x.reshape(g * m, k), weight, weight_scale, sizes, block=block)
        return y.view(g, m, weight.shape[1])

    def grouped_gemm(self, x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        """Rows sorted by group: x (M, K), weight (E, N, K), group_sizes (E,) int64 summing to M.
        Rows of group e are multiplied by weight[e]^T -> (M, N) in x's dtype.
        Default: this part's linear once per non-empty group (group_sizes read on the host)."""
        out = torch.empty((x.shape[0], weight.shape[1]), dtype=x.dtype, device=x.device)
        for g, start, end in ref_gemm.group_bounds(group_sizes):
            out[start:end] = self.linear(x[start:end], weight[g])
        return out

    def grouped_gemm_fp8(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        group_sizes: torch.Tensor,
        block: int = FP8_BLOCK,
    ) -> torch.Tensor:
        """As grouped_gemm with weight (E, N, K) e4m3 and weight_scale (E, ceil(N/b),
        ceil(K/b)); x (M, K) float is quantised per token per b channels first (b = block).
        Default: this part's quantize_fp8 once, then fp8_gemm once per non-empty group."""
        xq, xs = self.quantize_fp8(x, block)
        out = torch.empty((x.shape[0], weight.shape[1]), dtype=x.dtype, device=x.device)
        for g, start, end in ref_gemm.group_bounds(group_sizes):
            out[start:end] = self.fp8_gemm(
                xq[start:end], xs[start:end], weight[g], weight_scale[g], x.dtype, block=block
            )
        return out

    def grouped_gemm_fp4(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        group_sizes: torch.Tensor,
    ) -> torch.Tensor:
        """As grouped_gemm with MXFP4 weights (deepinfer.backend.fp4): weight (E, N, K/2) uint8,
        two e2m1 values per byte (element 2j in the low nibble of byte j), weight_scale
        (E, N, ceil(K/32)) uint8 UE8M0 bytes (scale 2^(byte - 127) for each 32 values along K).
        out = x @ dequant(weight[e])^T for the rows of group e, accumulated in float32; x (M, K)
        float is NOT quantised; -> (M, N) in x's dtype. Meaning: the reference
        (deepinfer.reference.gemm.grouped_gemm_fp4). Default: each non-empty group's weights
        dequantised to x's dtype (exact: e2m1 times a power of two), then this part's linear."""
        out = torch.empty((x.shape[0], weight.shape[1]), dtype=x.dtype, device=x.device)
        for g, start, end in ref_gemm.group_bounds(group_sizes):
            w = fp4.dequantize_weight(weight[g], weight_scale[g], x.dtype)
            out[start:end] = self.linear(x[start:end], w)
        return out


# --------------------------------------------------------------------------- moe


class MoeOps(_Part):
    """Routing, token permutation and expert compute for fine-grained MoE. All optional.

    Expert weights are stored fused: w13 (E, 2I, Dm) = [gate; up], w2 (E, Dm, I) = down, in one
    of three formats: floating point (no scales); FP8 e4m3 with block scales w13_scale
    (E, ceil(2I/128), ceil(Dm/128)), w2_scale (E, ceil(Dm/128), ceil(I/128)); MXFP4 (uint8
    weights, deepinfer.backend.fp4: w13 (E, 2I, Dm/2), w2 (E, Dm, I/2), UE8M0 scale bytes
    (E, 2I, ceil(Dm/32)), (E, Dm, ceil(I/32)); DeepSeek-V4's routed experts).
    swiglu_limit (DeepSeek-V4): the activation between the products is
    small.clamped_silu_and_mul(h, swiglu_limit) instead of small.silu_and_mul(h).
    Token ids into the permuted buffer are TOKEN-MAJOR: source row s = t * K + k.
    """

    def router_logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The router's scores before routing: x (T, Dm) float (any float dtype), weight (E, Dm)
        float32 -> (T, E) float32 = x @ weight^T with x taken exactly to float32 (routing is
        computed in float32). Default: the backend's linear on x.float()."""
        return self.backend.gemm.linear(x.float(), weight.float())

    def route(
        self,
        logits: torch.Tensor,
        config: RouterConfig,
        correction_bias: torch.Tensor | None = None,
        hash_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits (T, E) -> (weights (T, K + S) float32, ids (T, K + S) int32), see RouterConfig
        (S = config.shared_experts, usually 0: the pairs (E + s, 1.0) follow the K routed ones).
        correction_bias (E,) float32 changes selection only. hash_ids (T, K) fixes the selection
        (hash routing by token id); weights still come from the scores at those experts. The
        order of the K + S pairs within a row is free; the SET is fixed, ties included: equal
        group scores keep the lower group id, equal selection scores pick the lower expert id
        (RouterConfig). Default: the reference (torch ops)."""
        return ref_moe.route(logits, config, correction_bias, hash_ids)

    def select_experts(
        self,
        x: torch.Tensor,
        gate_weight: torch.Tensor,
        config: RouterConfig,
        correction_bias: torch.Tensor | None = None,
        hash_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole router: x (T, Dm) float, gate_weight (E, Dm) float32 -> (weights (T, K + S)
        float32, ids (T, K + S) int32) = route(router_logits(x, gate_weight), config,
        correction_bias, hash_ids): the same outputs and tie rules as that composition. Default:
        this part's router_logits, then its route."""
        return self.route(self.router_logits(x, gate_weight), config, correction_bias, hash_ids)

    def permute(
        self, x: torch.Tensor, ids: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Group token copies by expert (stable in source order).
        x (T, Dm), ids (T, K) -> (x_sorted (T*K, Dm), src_to_dst (T*K,) int64, counts (E,) int64)
        with x_sorted[src_to_dst[t*K + k]] = x[t]. Default: the reference (a stable sort)."""
        return ref_moe.permute(x, ids, num_experts)

    def unpermute(
        self, y_sorted: torch.Tensor, src_to_dst: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Weighted combine: out[t] = sum_k weights[t, k] * y_sorted[src_to_dst[t*K + k]].
        y_sorted (T*K, Dm), weights (T, K) float32 -> (T, Dm) in y's dtype (summed in float32).
        Default: the reference."""
        return ref_moe.unpermute(y_sorted, src_to_dst, weights)

    def experts(
        self,
        x_sorted: torch.Tensor,
        counts: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        w13_scale: torch.Tensor | None = None,
        w2_scale: torch.Tensor | None = None,
        swiglu_limit: float | None = None,
    ) -> torch.Tensor:
        """Expert MLP over expert-sorted rows: grouped_gemm(w13) -> silu_and_mul (clamped at
        swiglu_limit where given) -> grouped_gemm(w2). x_sorted (M, Dm), counts (E,) -> (M, Dm),
        the weights in any of the formats above. Default: this backend's gemm.grouped_gemm (or
        grouped_gemm_fp8, grouped_gemm_fp4) and small.silu_and_mul (or clamped_silu_and_mul)."""
        if (w13_scale is None) != (w2_scale is None) or (w13.dtype == torch.uint8 and w13_scale is None):
            raise ValueError("FP8 and MXFP4 experts need both w13_scale and w2_scale")
        gemm, small = self.backend.gemm, self.backend.small

        def act(h: torch.Tensor) -> torch.Tensor:
            if swiglu_limit is None:
                return small.silu_and_mul(h)
            return small.clamped_silu_and_mul(h, swiglu_limit)

        if w13_scale is not None and w2_scale is not None:
            grouped = gemm.grouped_gemm_fp4 if w13.dtype == torch.uint8 else gemm.grouped_gemm_fp8
            return grouped(act(grouped(x_sorted, w13, w13_scale, counts)), w2, w2_scale, counts)
        h = gemm.grouped_gemm(x_sorted, w13, counts)
        return gemm.grouped_gemm(act(h), w2, counts)

    def fused_moe(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        w13_scale: torch.Tensor | None = None,
        w2_scale: torch.Tensor | None = None,
        swiglu_limit: float | None = None,
    ) -> torch.Tensor:
        """The routed-expert output of a MoE layer: x (T, Dm), weights/ids (T, K) -> (T, Dm).
        Default: this part's permute, experts and unpermute."""
        x_sorted, src_to_dst, counts = self.permute(x, ids, w13.shape[0])
        if swiglu_limit is None:  # (backends may override experts without the argument)
            y = self.experts(x_sorted, counts, w13, w2, w13_scale, w2_scale)
        else:
            y = self.experts(x_sorted, counts, w13, w2, w13_scale, w2_scale, swiglu_limit=swiglu_limit)
        return self.unpermute(y, src_to_dst, weights)


# --------------------------------------------------------------------------- collectives


# torch renamed all_gather_into_tensor / reduce_scatter_tensor (the old names warn)
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class CollectiveOps(_Part):
    """Collectives over torch.distributed with the backend's process-group backend.

    `group` is a torch.distributed ProcessGroup (None = the default group). All ops act in
    place where torch.distributed does and return the result tensor. The defaults call
    torch.distributed directly; they are right for any dist backend that implements the ops.
    """

    @property
    @abstractmethod
    def dist_backend(self) -> str:
        """The torch.distributed backend name for this device ("gloo", "nccl", "hccl", ...)."""

    def all_reduce(self, t: torch.Tensor, group: Any = None) -> torch.Tensor:
        """Sum over ranks, in place."""
        dist.all_reduce(t, group=group)
        return t

    def all_gather(self, t: torch.Tensor, group: Any = None) -> torch.Tensor:
        """(n, ...) per rank -> (world * n, ...), rank-ordered."""
        world = dist.get_world_size(group)
        out = torch.empty((world * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        _all_gather_single(out, t.contiguous(), group=group)
        return out

    def reduce_scatter(self, t: torch.Tensor, group: Any = None) -> torch.Tensor:
        """(world * n, ...) per rank -> this rank's (n, ...) slice of the sum over ranks."""
        world = dist.get_world_size(group)
        out = torch.empty((t.shape[0] // world, *t.shape[1:]), dtype=t.dtype, device=t.device)
        _reduce_scatter_single(out, t.contiguous(), group=group)
        return out

    def all_to_all_single(
        self,
        t: torch.Tensor,
        output_splits: list[int] | None = None,
        input_splits: list[int] | None = None,
        group: Any = None,
    ) -> torch.Tensor:
        """Send rows input_splits[r] to rank r; receive output_splits[r] rows from rank r
        (even splits when None)."""
        rows = sum(output_splits) if output_splits is not None else t.shape[0]
        out = torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.all_to_all_single(out, t.contiguous(), output_splits, input_splits, group=group)
        return out

    def all_to_all_single_async(
        self,
        t: torch.Tensor,
        output_splits: list[int] | None = None,
        input_splits: list[int] | None = None,
        group: Any = None,
    ) -> tuple[torch.Tensor, Callable[[], None]]:
        """all_to_all_single started without waiting -> (out, wait): `out` holds the result once
        wait() returned; compute queued in between overlaps the exchange. Collectives started on a
        group run in the order they were started, on every rank."""
        rows = sum(output_splits) if output_splits is not None else t.shape[0]
        out = torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
        work = dist.all_to_all_single(
            out, t.contiguous(), output_splits, input_splits, group=group, async_op=True
        )
        return out, work.wait

    def expert_exchange(
        self, num_experts: int, x: torch.Tensor, top_k: int
    ) -> Callable[..., torch.Tensor] | None:
        """A fused expert-parallel dispatch + combine (e.g. DeepEP, Ascend MC2) for MoE layers of
        num_experts routed experts spread over the default group's ranks as
        ExpertParallel.expert_bounds spreads them (when W does not divide E the first E % W ranks
        hold one more: an exchange that needs them even returns None, or raises where it was asked
        for explicitly), top_k experts per token, with activations like x; None (the default): the
        layer exchanges with
        all_to_all_single(_async) (deepinfer.parallel.expert_parallel.dispatch_combine defines the
        meaning). It is called as
        exchange(x (T, Dm), weights (T, K) float32, ids (T, K) global expert ids, local: range of
        this rank's experts, experts(rows (R, Dm), local ids (R,)) -> unweighted outputs (R, Dm))
        -> (T, Dm) = sum_k weights * expert_k(x). A collective: every rank must get the same
        answer for the same arguments."""
        return None

    def broadcast(self, t: torch.Tensor, src: int, group: Any = None) -> torch.Tensor:
        """Copy rank `src`'s tensor to every rank, in place."""
        dist.broadcast(t, src, group=group)
        return t

    def barrier(self, group: Any = None) -> None:
        dist.barrier(group=group)


# --------------------------------------------------------------------------- small ops


class SmallOps(_Part):
    """Norms, rotary embedding, activations, logits masking and sampling. All optional."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """y = x / sqrt(mean(x^2) + eps) * weight over the last dim, computed in float32.
        x (..., Dm), possibly a strided view; weight (Dm,) in any float dtype; y in x's dtype.
        Default: the reference."""
        return ref_small.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add fused with the next norm: h = x + residual (summed in float32, stored
        in x's dtype: the residual stream), y = rms_norm(h) -> (y, h), both in x's dtype.
        residual: same shape as x (it may be x itself, or a view of the same buffer). A fused
        kernel may normalise the sum before its rounding to x's dtype (a rounding apart).
        Default: the add, then this part's rms_norm."""
        h = (x.float() + residual.float()).to(x.dtype)
        return self.rms_norm(h, weight, eps), h

    def rope(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        interleaved: bool,
    ) -> torch.Tensor:
        """Rotary embedding. x (T, H, R), positions (T,) int64, cos_sin_cache (P, R) float32 whose
        row p is [cos(p*f_0..f_{R/2-1}) | sin(...)]. interleaved: pairs (2i, 2i+1) rotate by f_i
        (DeepSeek checkpoints); else pairs (i, i + R/2). Output in x's dtype. Default: the reference."""
        return ref_small.rope(x, positions, cos_sin_cache, interleaved)

    def rope_tail(
        self, x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, inverse: bool = False
    ) -> torch.Tensor:
        """DeepSeek-V4's partial rope: x (T, H, D) -> a new (T, H, D) tensor in x's dtype, its
        first D - R channels as they are and its last R (R = cos_sin_cache.shape[1]) rotated as
        rope(..., interleaved=True) rotates them; inverse: by -angle (each pair (a, b) -> (b, a),
        rotated by +angle, swapped back). Default: this part's rope on the tail, then a cat."""
        r = cos_sin_cache.shape[1]
        tail = x[..., -r:]
        if inverse:
            tail = _swap_pairs(tail)
        tail = self.rope(tail, positions, cos_sin_cache, True)
        if inverse:
            tail = _swap_pairs(tail)
        return torch.cat([x[..., :-r], tail], dim=-1)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, 2I) = [gate | up] -> silu(gate) * up, (M, I), computed in float32.
        Default: the reference."""
        return ref_small.silu_and_mul(x)

    def clamped_silu_and_mul(self, x: torch.Tensor, limit: float) -> torch.Tensor:
        """DeepSeek-V4's clamped SwiGLU: x (M, 2I) = [gate | up] -> silu(min(gate, limit)) *
        clamp(up, -limit, limit), (M, I), computed in float32. Default: the reference."""
        return ref_v4.clamped_silu_and_mul(x, limit)

    def gated_pool(self, kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V4's compressor pooling: kv (W, S, D), gate (W, S, D) float logits (-inf marks
        an absent slot) -> (W, D) in kv's dtype, out[w] = sum_s softmax_s(gate[w])[s] * kv[w, s]
        per channel, softmax in float32; a window with every slot absent gives zeros.
        Default: the reference."""
        return ref_v4.gated_pool(kv, gate)

    def compressor_pool(
        self, kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, present: torch.Tensor
    ) -> torch.Tensor:
        """DeepSeek-V4's compressor pooling of its state rows: kv (W, S, D), gate (W, S, D) in any
        float dtype, bias (S, D) float32 (the per-slot position bias), present (W, S) bool ->
        gated_pool(kv, logits) with logits = gate + bias in float32, -inf where not present.
        Default: those two torch ops, then this part's gated_pool."""
        logits = torch.where(present[..., None], gate + bias, float("-inf"))
        return self.gated_pool(kv, logits)

    def hc_pre(
        self,
        streams: torch.Tensor,
        fn: torch.Tensor,
        base: torch.Tensor,
        scale: torch.Tensor,
        norm_eps: float,
        hc_eps: float,
        sinkhorn_iters: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Manifold-constrained hyper-connection weights before a block. streams (T, N, Dm);
        fn ((2+N)N, N*Dm), base ((2+N)N,), scale (3,) float32. In float32: m = rms(flatten(streams))
        @ fn^T (unweighted rms, norm_eps), split [pre N | post N | comb N*N];
        pre = sigmoid(m_pre*scale[0] + base_pre) + hc_eps; post = 2 sigmoid(m_post*scale[1] + base_post);
        comb = softmax_rows(m_comb*scale[2] + base_comb) + hc_eps, then divided by its column sums
        (+hc_eps), then sinkhorn_iters-1 times by row sums and column sums (+hc_eps each).
        -> (sum_n pre[n] * streams[n] (T, Dm) in streams' dtype, post (T, N), comb (T, N, N)).
        Default: the reference."""
        return ref_v4.hc_pre(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, self.batch_invariant)

    def hc_mixes(
        self,
        streams: torch.Tensor,
        fn: torch.Tensor,
        base: torch.Tensor,
        scale: torch.Tensor,
        norm_eps: float,
        hc_eps: float,
        sinkhorn_iters: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hc_pre's three mixes without applying pre: (pre (T, N), post (T, N), comb (T, N, N))
        float32, exactly as hc_pre defines them. DeepSeek-V4.1's shifted hyper-connections apply
        a sublayer's pre mix to the streams after it (hc_collapse). Default: the reference."""
        return ref_v4.hc_mixes(
            streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, self.batch_invariant
        )

    def hc_collapse(self, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """sum_n pre[t, n] * streams[t, n]: streams (T, N, Dm), pre (T, N) float32 -> (T, Dm) in
        streams' dtype, computed in float32 (hc_pre's collapse). Default: the reference."""
        return ref_v4.hc_collapse(streams, pre)

    def hc_post(
        self, y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """The residual mix after a block: out[t, k] = post[t, k] * y[t] + sum_j comb[t, j, k] *
        streams[t, j]. y (T, Dm), streams (T, N, Dm) -> (T, N, Dm) in streams' dtype, computed in
        float32. Default: the reference."""
        return ref_v4.hc_post(y, streams, post, comb)

    def hc_head(
        self,
        streams: torch.Tensor,
        fn: torch.Tensor,
        base: torch.Tensor,
        scale: torch.Tensor,
        norm_eps: float,
        hc_eps: float,
    ) -> torch.Tensor:
        """The last collapse of the streams: pre = sigmoid((rms(flatten(streams)) @ fn^T) * scale[0]
        + base) + hc_eps with fn (N, N*Dm), base (N,), scale (1,); -> sum_n pre[n] * streams[n],
        (T, Dm) in streams' dtype, computed in float32. Default: the reference."""
        return ref_v4.hc_head(streams, fn, base, scale, norm_eps, hc_eps, self.batch_invariant)

    def engram_lookup(
        self,
        ngram_ids: torch.Tensor,
        multipliers: torch.Tensor,
        sizes: torch.Tensor,
        table: torch.Tensor,
        *,
        scales: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """DeepSeek-V4.1's Engram embedding: hashed n-gram rows of a stacked table, side by side.
        ngram_ids (T, G) int64 (row t: the compressed ids of tokens p, p-1, ..., p-G+1, all >= 0),
        multipliers (G,) int64, sizes (C,) int64 (C = (G - 1) * Hg heads, head c of n-gram size
        c // Hg + 2), table (R, Dh) with R >= sum(sizes) -> (T, C * Dh) in table's dtype, where
        head c reads row (XOR_{r < n} ids[t, r] * multipliers[r]) mod sizes[c] + (sizes[0] + ...
        + sizes[c - 1]); products wrap in int64, the remainder is non-negative. A gather: exact.
        FP8 rows (DeepSeek's published tables): table float8_e4m3fn (R, Dh), Dh a multiple of
        32, with scales (R, Dh / 32) uint8 UE8M0 (value j of a row times 2^(scales[row, j // 32]
        - 127)) -> the rows dequantised, in `dtype` (float32 / bfloat16 / float16; default
        float32): still exact, an e4m3 value times a power of two fits each. The table (and its
        scales) are on the device, or, where Capabilities.reads_host_tables, in pinned host
        memory (device.pinned_empty): the output is on the ids' device either way. Device only,
        graph-safe. Default: the reference (deepinfer.reference.engram; host tables only where
        host memory is the device's, the CPU)."""
        return ref_engram.engram_lookup(ngram_ids, multipliers, sizes, table, scales, dtype)

    def engram_prefetch(
        self,
        ngram_ids: torch.Tensor,
        multipliers: torch.Tensor,
        sizes: torch.Tensor,
        table: torch.Tensor,
        *,
        scales: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> PendingRows:
        """engram_lookup (same arguments, the same rows bit for bit) started so that it may run
        beside the work issued after it on the current stream, until engram_wait(pending): a
        model fetches every Engram layer's rows at the start of its forward (the n-gram ids
        depend on the input tokens only) and each layer waits for its own (DeepSeek's engine
        does the same). The inputs must stay unchanged until that wait. Graph-safe: a prefetch
        and its wait inside one capture_graph are both captured. Default: this backend's
        engram_lookup, now, on the current stream."""
        return PendingRows(
            self.engram_lookup(ngram_ids, multipliers, sizes, table, scales=scales, dtype=dtype)
        )

    def engram_wait(self, pending: PendingRows) -> torch.Tensor:
        """The rows of an engram_prefetch (T, C * Dh), ready for the work issued after this call
        on the current stream (the stream, and the capture if any, of the prefetch). Call it once
        for each prefetch. Default: pending.rows (the default prefetch wrote them in order)."""
        return pending.rows

    def engram_gate(
        self, streams: torch.Tensor, kv: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """DeepSeek-V4.1's Engram gate into the residual streams: streams (T, N, Dm), kv
        (T, N + 1, Dm) (a key per stream, then one value), weight (N, Dm) float32 (the fused
        q_weight * k_weight) -> streams + g * v, (T, N, Dm) in streams' dtype, computed in
        float32 with a = <rms(x_n) * weight_n, rms(k_n)> / sqrt(Dm) (unweighted rms, eps) and
        g = sigmoid(sign(a) * sqrt(max(|a|, 1e-6))). Default: the reference."""
        return ref_engram.engram_gate(streams, kv, weight, eps)

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """In place: logits (B, V) float, possibly rows of a wider buffer; bitmask (B, ceil(V/32))
        int32, bit (v % 32) of word v // 32 set = token v allowed. Disallowed logits become -inf.
        Default: the reference."""
        ref_small.apply_token_bitmask(logits, bitmask)

    def exponential_noise(self, seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Exp(1) noise for sampling, a pure function of (seed, offset, token id): row b is
        -log(u) with u in (0, 1) from a counter-based hash of (seeds[b], offsets[b], v) (see
        deepinfer.reference.small.exponential_noise for the exact hash). seeds, offsets (B,)
        int64 (seeds: any value; offsets >= 0: the position of the token being sampled)
        -> (B, vocab_size) float32. No generator state: a request's draws do not depend on the
        batch, the step or a graph replay, only on its seed and the position it samples.
        Default: the reference."""
        return ref_small.exponential_noise(seeds, offsets, vocab_size)

    def argmax(self, logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Greedy sampling's reduction: logits (S, V) float32 -> (S,) int64, the index of each
        row's first maximum (torch.argmax's answer: ties go to the lowest index, a row of -inf
        to 0), written into `out` (S,) int64 when given (the engine's persistent buffer) and
        returned. Device only, graph-safe. Rows holding NaN give an unspecified index.
        Default: ref_small.argmax_rows (two torch reductions)."""
        if out is None:
            out = torch.empty(logits.shape[:1], dtype=torch.int64, device=logits.device)
        ref_small.argmax_rows(logits, out)
        return out

    def sampling_probs(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
    ) -> torch.Tensor:
        """The distribution `sample` draws each row from: logits (B, V) float32 and the per-row
        parameters as in `sample` -> (B, V) float32 probabilities, softmax of logits / T
        filtered by top_k, then top_p, then min_p (zero outside); rows with temperature <= 0
        filtered at T = 1 (`sample` takes their argmax). Speculative rejection sampling reads
        p(d) from it (deepinfer.engine.rejection). Device only, graph-safe. Default: the
        reference."""
        return ref_small.sampling_probs(logits, temperature, top_k, top_p, min_p)

    def sample(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        exp_noise: torch.Tensor,
    ) -> torch.Tensor:
        """Sample one token per row. logits (B, V) float32; temperature, top_p, min_p (B,) float32;
        top_k (B,) int64 (<= 0 or >= V: off); exp_noise (B, V) float32 drawn Exp(1) by the caller
        from per-request generators, which makes sampling batch-invariant.
        Rows with temperature 0 take the argmax. Others: logits / temperature, keep the top_k
        largest, then the smallest set whose probability reaches top_p, then tokens with
        p >= min_p * max p; sample by the exponential race argmax(p / noise). -> (B,) int64.
        Default: the reference."""
        return ref_small.sample(logits, temperature, top_k, top_p, min_p, exp_noise)


# --------------------------------------------------------------------------- the backend

# KV-layout ops that lived on DeviceOps before KVCacheOps existed: a device part that still
# defines one would be silently ignored, so assembling such a backend is an error.
_MOVED_TO_KV_CACHE = ("allocate_kv_cache", "write_kv", "read_kv", "write_mla_kv", "copy_blocks")


def _swap_pairs(x: torch.Tensor) -> torch.Tensor:
    """(..., R): channels (2i, 2i+1) -> (2i+1, 2i)."""
    return x.view(*x.shape[:-1], x.shape[-1] // 2, 2).flip(-1).flatten(-2)


@dataclass
class Backend:
    """An accelerator as deepinfer sees it: its name, what it claims, and its seven parts.

    Assembling a Backend binds every part to it (part.backend), through which the composite
    defaults reach the other parts."""

    name: str
    options: BackendOptions
    capabilities: Capabilities
    device: DeviceOps
    kv_cache: KVCacheOps
    attention: AttentionOps
    gemm: GemmOps
    moe: MoeOps
    collectives: CollectiveOps
    small: SmallOps

    def __post_init__(self) -> None:
        if self.options.batch_invariant and not self.capabilities.supports_batch_invariant:
            raise ValueError(f"backend {self.name!r} does not support batch-invariant mode")
        for f in fields(self):
            part = getattr(self, f.name)
            kind = _PART_TYPES.get(f.name)
            if kind is not None and not isinstance(part, kind):
                raise TypeError(
                    f"backend {self.name!r}: `{f.name}` must be a {kind.__name__} instance, "
                    f"got {type(part).__name__}"
                )
        moved = [m for m in _MOVED_TO_KV_CACHE if hasattr(self.device, m)]
        if moved:
            raise TypeError(
                f"backend {self.name!r}: {type(self.device).__name__} defines {', '.join(moved)}; the "
                "KV-cache ops moved from DeviceOps to KVCacheOps (allocate_kv_cache is now "
                "KVCacheOps.allocate): move them to a KVCacheOps subclass passed as kv_cache="
            )
        for part in self.parts():
            part._backend = self

    def parts(self) -> Iterator[_Part]:
        yield from (
            self.device, self.kv_cache, self.attention, self.gemm, self.moe, self.collectives, self.small
        )  # fmt: skip


_PART_TYPES: dict[str, type[_Part]] = {
    "device": DeviceOps,
    "kv_cache": KVCacheOps,
    "attention": AttentionOps,
    "gemm": GemmOps,
    "moe": MoeOps,
    "collectives": CollectiveOps,
    "small": SmallOps,
}
