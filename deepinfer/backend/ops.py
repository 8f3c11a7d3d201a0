"""The backend contract: the op interfaces every accelerator implements.

A backend is a `Backend` made of six narrow parts. In each part, methods marked
`@abstractmethod` are required; every other method is optional and defaults to the reference
implementation (plain PyTorch, runs on any torch device), so a new port works on day one and
is accelerated op by op. The reference implementation defines what each op means; the
conformance suite (deepinfer.testing) holds every backend to it.

Shape symbols are listed in deepinfer/backend/types.py. All ops take and return tensors on
the backend's device. Unless an op says otherwise, outputs are new tensors and inputs are
not modified.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from deepinfer.backend.types import (
    AttentionMetadata,
    BackendOptions,
    Capabilities,
    KVCacheSpec,
    PagedKVCache,
    RouterConfig,
)
from deepinfer.reference import gemm as ref_gemm
from deepinfer.reference import memory as ref_memory
from deepinfer.reference import moe as ref_moe
from deepinfer.reference import small as ref_small


class _Part:
    """Common base of the parts: keeps the options the backend was created with."""

    def __init__(self, options: BackendOptions) -> None:
        self.options = options

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


# --------------------------------------------------------------------------- device / memory


class DeviceOps(_Part):
    """Device handle, synchronisation, memory, streams, the paged KV pool and graphs."""

    @abstractmethod
    def device(self) -> torch.device:
        """The torch device every tensor of this backend lives on."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until all queued work on the device has finished."""

    @abstractmethod
    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory, as the driver reports them."""

    def new_stream(self) -> Any:
        """A new stream for overlapping work; devices without streams return a host stand-in."""
        return ref_memory.HostStream()

    def stream_context(self, stream: Any) -> AbstractContextManager[Any]:
        """Context manager that makes `stream` current for the ops issued inside it."""
        return nullcontext(stream)

    def new_event(self) -> Any:
        """A new event with record() / synchronize() / query()."""
        return ref_memory.HostEvent()

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor the device can copy from asynchronously."""
        return torch.empty(shape, dtype=dtype)

    def allocate_kv_cache(self, spec: KVCacheSpec, num_layers: int) -> list[PagedKVCache]:
        """One zero-filled cache per layer. Backends that change the layout override the
        four KV methods together (allocate, write, read, and, if needed, copy)."""
        return ref_memory.allocate_kv_cache(spec, num_layers, self.device())

    def write_kv(self, cache: PagedKVCache, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store K rows in the cache, in place.

        kv: (T, D) in any float dtype (cast to the cache dtype); slot_mapping: (T,) int64 with
        slot = block_id * BS + offset; a slot of -1 skips that row (padding).
        """
        ref_memory.write_kv(cache, kv, slot_mapping)

    def read_kv(self, cache: PagedKVCache, slots: torch.Tensor) -> torch.Tensor:
        """(n, D) K rows stored at `slots` (n,) int64, in the cache dtype. For tests and tools."""
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
        Default: the two small ops (reference), then this part's write_kv (any layout)."""
        c = cache.spec.latent_dim
        latent, _ = ref_small.rms_norm(kv[:, :c], norm_weight, eps)
        k_pe = kv[:, c:]
        if k_pe.shape[1]:
            k_pe = ref_small.rope(k_pe[:, None], positions, cos_sin_cache, interleaved)[:, 0]
        self.write_kv(cache, torch.cat([latent, k_pe], dim=-1), slot_mapping)

    def copy_blocks(self, cache: PagedKVCache, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks src[i] -> dst[i] ((n,) int64 each), in place, every tensor.
        Every source is read before any destination is written; destinations are distinct."""
        ref_memory.copy_blocks(cache, src, dst)

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
        read the device from the host (no .item(), .tolist(), nonzero, data-dependent shapes)."""
        return None

    def peak_memory_bytes(self) -> int | None:
        """Most device memory held by tensors since the last reset_peak_memory (None: the
        device does not say). The engine sizes its graph memory with it."""
        return None

    def reset_peak_memory(self) -> None:
        """Start a new peak_memory_bytes measurement."""


# --------------------------------------------------------------------------- attention


class AttentionOps(_Part):
    """Paged latent attention (MLA absorbed form: one shared KV head, V a prefix of K).

    scores[h, j] = scale * <q[h, :D], K[j, :D]> over the request's visible positions j;
    out[h] = sum_j softmax(scores[h])_j * K[j, :v_dim]. Softmax in float32.
    Optional modifiers, the same in both ops:
      window:       position p sees only j with p - j < window (sliding window of `window` keys).
      sinks:        (H,) float32 per-head sink logit; adds exp(sinks[h]) to the softmax
                    denominator (it takes probability mass and contributes no value).
      topk_indices: (rows, Kt) int32 absolute positions each query row may see (-1 = unused),
                    intersected with the causal and window limits (sparse attention).
    Cache rows past a request's KV length (never written, or stale) may hold anything, NaN
    included: they must not reach the output, even through a zero softmax weight (0 * NaN).

    Lengths: the device tensors of `meta` are the truth. Its host copies may be UPPER BOUNDS of
    them (every seq_lens_host entry >= the device one, the query lengths equal): that is how a
    decode step captured once in a graph replays with other lengths. A decode row whose device
    KV length is shorter reads only its own rows.
    """

    def decode(
        self,
        q: torch.Tensor,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        *,
        scale: float,
        v_dim: int,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        topk_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One query token per request. q: (B, H, D) -> (B, H, v_dim) in q's dtype.
        Requires meta.is_decode_only (ValueError otherwise). Batch-invariant backends use a FIXED
        split size over KV. Default: the check, then `prefill`; override for a dedicated kernel."""
        if not meta.is_decode_only:
            raise ValueError("decode attention needs exactly one query token per request")
        return self.prefill(
            q, cache, meta, scale=scale, v_dim=v_dim, window=window, sinks=sinks, topk_indices=topk_indices
        )

    @abstractmethod
    def prefill(
        self,
        q: torch.Tensor,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        *,
        scale: float,
        v_dim: int,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        topk_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Ragged causal attention over a cached prefix (chunked prefill; any query lengths,
        decode rows included). q: (T, H, D) -> (T, H, v_dim) in q's dtype."""


# --------------------------------------------------------------------------- gemm


class GemmOps(_Part):
    """Dense and grouped matrix products, in floating point and FP8 e4m3 with block scales.

    FP8 convention (DeepSeek's): scales MULTIPLY. A weight (N, K) e4m3 has a float32 scale per
    128x128 block, (ceil(N/128), ceil(K/128)); activations have one per token per 128 channels,
    (M, ceil(K/128)); value = fp8 * scale.
    """

    @abstractmethod
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (M, K) @ weight (N, K)^T + bias (N,) -> (M, N) in x's dtype."""

    def batched_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """One product per group: x (G, M, K), weight (G, N, K) -> (G, M, N) in x's dtype, with
        out[g] = x[g] @ weight[g]^T. x may be a strided view. MLA uses it per head to absorb the
        key up-projection into the query and to expand the latent output into each head's values."""
        return ref_gemm.batched_linear(x, weight, self.batch_invariant)

    def quantize_fp8(self, x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token, per-`block`-channel symmetric quantisation.
        x (M, K) -> (xq (M, K) float8_e4m3fn, scale (M, ceil(K/block)) float32 = amax / 448).
        block 128 (DeepSeek's format) is required of every backend; other sizes are optional and a
        backend that lacks one raises ValueError or NotImplementedError."""
        return ref_gemm.quantize_fp8(x, block)

    def fp8_gemm(
        self,
        xq: torch.Tensor,
        x_scale: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        """Block-scaled FP8 product: (xq * x_scale) @ (weight * weight_scale)^T -> (M, N) out_dtype.
        xq (M, K) e4m3, x_scale (M, ceil(K/128)), weight (N, K) e4m3, weight_scale (ceil(N/128),
        ceil(K/128)); accumulation in float32."""
        return ref_gemm.fp8_gemm(xq, x_scale, weight, weight_scale, out_dtype, self.batch_invariant)

    def linear_fp8(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (M, K) float -> quantize_fp8 -> fp8_gemm -> (M, N) in x's dtype."""
        xq, xs = self.quantize_fp8(x)
        y = self.fp8_gemm(xq, xs, weight, weight_scale, x.dtype)
        return y if bias is None else y + bias

    def grouped_gemm(self, x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        """Rows sorted by group: x (M, K), weight (E, N, K), group_sizes (E,) int64 summing to M.
        Rows of group e are multiplied by weight[e]^T -> (M, N) in x's dtype."""
        return ref_gemm.grouped_gemm(x, weight, group_sizes, self.batch_invariant)

    def grouped_gemm_fp8(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        group_sizes: torch.Tensor,
    ) -> torch.Tensor:
        """As grouped_gemm with weight (E, N, K) e4m3 and weight_scale (E, ceil(N/128),
        ceil(K/128)); x (M, K) float is quantised per token per 128 channels first."""
        return ref_gemm.grouped_gemm_fp8(x, weight, weight_scale, group_sizes, self.batch_invariant)


# --------------------------------------------------------------------------- moe


class MoeOps(_Part):
    """Routing, token permutation and expert compute for fine-grained MoE. All optional.

    Expert weights are stored fused: w13 (E, 2I, Dm) = [gate; up], w2 (E, Dm, I) = down.
    Token ids into the permuted buffer are TOKEN-MAJOR: source row s = t * K + k.
    """

    def route(
        self,
        logits: torch.Tensor,
        config: RouterConfig,
        correction_bias: torch.Tensor | None = None,
        hash_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits (T, E) -> (weights (T, K) float32, ids (T, K) int32), see RouterConfig.
        correction_bias (E,) float32 changes selection only. hash_ids (T, K) fixes the selection
        (hash routing by token id); weights still come from the scores at those experts."""
        return ref_moe.route(logits, config, correction_bias, hash_ids)

    def permute(
        self, x: torch.Tensor, ids: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Group token copies by expert (stable in source order).
        x (T, Dm), ids (T, K) -> (x_sorted (T*K, Dm), src_to_dst (T*K,) int64, counts (E,) int64)
        with x_sorted[src_to_dst[t*K + k]] = x[t]."""
        return ref_moe.permute(x, ids, num_experts)

    def unpermute(
        self, y_sorted: torch.Tensor, src_to_dst: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Weighted combine: out[t] = sum_k weights[t, k] * y_sorted[src_to_dst[t*K + k]].
        y_sorted (T*K, Dm), weights (T, K) float32 -> (T, Dm) in y's dtype (summed in float32)."""
        return ref_moe.unpermute(y_sorted, src_to_dst, weights)

    def experts(
        self,
        x_sorted: torch.Tensor,
        counts: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        w13_scale: torch.Tensor | None = None,
        w2_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Expert MLP over expert-sorted rows: grouped_gemm(w13) -> silu_and_mul -> grouped_gemm(w2).
        x_sorted (M, Dm), counts (E,) -> (M, Dm). FP8 (e4m3 weights, block scales) when scales given."""
        return ref_moe.experts(x_sorted, counts, w13, w2, w13_scale, w2_scale, self.batch_invariant)

    def fused_moe(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        w13_scale: torch.Tensor | None = None,
        w2_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The routed-expert output of a MoE layer: x (T, Dm), weights/ids (T, K) -> (T, Dm)."""
        x_sorted, src_to_dst, counts = self.permute(x, ids, w13.shape[0])
        y = self.experts(x_sorted, counts, w13, w2, w13_scale, w2_scale)
        return self.unpermute(y, src_to_dst, weights)


# --------------------------------------------------------------------------- collectives


class CollectiveOps(_Part):
    """Collectives over torch.distributed with the backend's process-group backend.

    `group` is a torch.distributed ProcessGroup (None = the default group). All ops act in
    place where torch.distributed does and return the result tensor.
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
        dist.all_gather_into_tensor(out, t.contiguous(), group=group)
        return out

    def reduce_scatter(self, t: torch.Tensor, group: Any = None) -> torch.Tensor:
        """(world * n, ...) per rank -> this rank's (n, ...) slice of the sum over ranks."""
        world = dist.get_world_size(group)
        out = torch.empty((t.shape[0] // world, *t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.reduce_scatter_tensor(out, t.contiguous(), group=group)
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

    def broadcast(self, t: torch.Tensor, src: int, group: Any = None) -> torch.Tensor:
        """Copy rank `src`'s tensor to every rank, in place."""
        dist.broadcast(t, src, group=group)
        return t

    def barrier(self, group: Any = None) -> None:
        dist.barrier(group=group)


# --------------------------------------------------------------------------- small ops


class SmallOps(_Part):
    """Norms, rotary embedding, activations, logits masking and sampling. All optional."""

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """y = x / sqrt(mean(x^2) + eps) * weight over the last dim, computed in float32.
        With residual (same shape as x): h = x + residual is normalised and returned too:
        (y, h); without: (y, None). x (..., Dm), weight (Dm,); y and h in x's dtype."""
        return ref_small.rms_norm(x, weight, eps, residual)

    def rope(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        interleaved: bool,
    ) -> torch.Tensor:
        """Rotary embedding. x (T, H, R), positions (T,) int64, cos_sin_cache (P, R) float32 whose
        row p is [cos(p*f_0..f_{R/2-1}) | sin(...)]. interleaved: pairs (2i, 2i+1) rotate by f_i
        (DeepSeek checkpoints); else pairs (i, i + R/2). Output in x's dtype and layout."""
        return ref_small.rope(x, positions, cos_sin_cache, interleaved)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, 2I) = [gate | up] -> silu(gate) * up, (M, I), computed in float32."""
        return ref_small.silu_and_mul(x)

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """In place: logits (B, V) float; bitmask (B, ceil(V/32)) int32, bit (v % 32) of word
        v // 32 set = token v allowed. Disallowed logits become -inf."""
        ref_small.apply_token_bitmask(logits, bitmask)

    def exponential_noise(self, seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Exp(1) noise for sampling, a pure function of (seed, offset, token id): row b is
        -log(u) with u in (0, 1) from a counter-based hash of (seeds[b], offsets[b], v) (see
        deepinfer.reference.small.exponential_noise for the exact hash). seeds, offsets (B,)
        int64 (seeds: any value; offsets >= 0: the position of the token being sampled)
        -> (B, vocab_size) float32. No generator state: a request's draws do not depend on the
        batch, the step or a graph replay, only on its seed and the position it samples."""
        return ref_small.exponential_noise(seeds, offsets, vocab_size)

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
        p >= min_p * max p; sample by the exponential race argmax(p / noise). -> (B,) int64."""
        return ref_small.sample(logits, temperature, top_k, top_p, min_p, exp_noise)


# --------------------------------------------------------------------------- the backend


@dataclass
class Backend:
    """An accelerator as deepinfer sees it: its name, what it claims, and its six parts."""

    name: str
    options: BackendOptions
    capabilities: Capabilities
    device: DeviceOps
    attention: AttentionOps
    gemm: GemmOps
    moe: MoeOps
    collectives: CollectiveOps
    small: SmallOps

    def __post_init__(self) -> None:
        if self.options.batch_invariant and not self.capabilities.supports_batch_invariant:
            raise ValueError(f"backend {self.name!r} does not support batch-invariant mode")

    def parts(self) -> Iterator[_Part]:
        yield from (self.device, self.attention, self.gemm, self.moe, self.collectives, self.small)
