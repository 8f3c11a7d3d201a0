"""The CUDA backend's parts and its factory. Kernels live in deepinfer_cuda.kernels.

Device: torch.cuda (streams, events, pinned buffers, CUDA graphs). Under TRITON_INTERPRET=1 on
a machine without a GPU the same parts run the same Triton kernels in the interpreter on CPU
tensors (no streams or graphs there); that is how CI checks the kernels.

Fused decode paths (fewer launches per step): the MoE router in one kernel, the expert sort and
the grouped GEMM's tile table in one (computed once per layer, shared by both expert GEMMs),
MLA's cache write (norm + rope + store) in one, MLA's query (rope + per-head product + concat)
in one, the sampling noise in one; DeepSeek-V4's mHC weights (Sinkhorn included), mixes and head
collapse in one each, its lightning indexer (scores, then top-k) and compressed attention (window
rows + compressed entries + sinks) in Triton.
DEEPINFER_CUDA_UNFUSED=1, read when the backend is created, switches those back to the composed
paths they replace (routing in torch as the reference computes it, the torch sort and a torch
tile table per GEMM, write_mla_kv, mla_query and exponential_noise as the contract's defaults,
which run through this backend's own rms_norm / rope / write_kv / batched_linear and the
reference hash; the V4 ops as the contract's reference defaults) so that a benchmark can measure
what the fusion buys. Results agree within each op's contract either way.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from deepinfer.backend.fp8 import FP8_DTYPE
from deepinfer.backend.host import HostEvent, HostStream, host_memory_info
from deepinfer.backend.ops import (
    AttentionOps,
    Backend,
    CollectiveOps,
    DeviceOps,
    GemmOps,
    GraphRunner,
    KVCacheOps,
    MoeOps,
    RerunGraph,
    SmallOps,
)
from deepinfer.backend.types import (
    NO_MODIFIERS,
    AttentionMetadata,
    AttentionModifiers,
    BackendOptions,
    Capabilities,
    Event,
    PagedKVCache,
    RouterConfig,
    Stream,
)
from deepinfer_cuda import vendor
from deepinfer_cuda.kernels import attention as attn_k
from deepinfer_cuda.kernels import gemm as gemm_k
from deepinfer_cuda.kernels import mla as mla_k
from deepinfer_cuda.kernels import moe as moe_k
from deepinfer_cuda.kernels import small as small_k
from deepinfer_cuda.kernels import v4 as v4_k
from deepinfer_cuda.kernels.moe import sort_by_expert
from deepinfer_cuda.plugin import interpreting

UNFUSED_ENV = "DEEPINFER_CUDA_UNFUSED"


def fused_from_env() -> bool:
    """False when DEEPINFER_CUDA_UNFUSED is set (to anything but 0): the composed paths."""
    return os.environ.get(UNFUSED_ENV, "0") in ("", "0")


MOE_DECODE_ENV = "DEEPINFER_CUDA_MOE_DECODE"


def moe_decode_from_env() -> bool:
    """False when DEEPINFER_CUDA_MOE_DECODE=0: decode-sized MoE layers take the grouped path too."""
    return os.environ.get(MOE_DECODE_ENV, "1") != "0"


MOE_EARLY_ENV = "DEEPINFER_CUDA_MOE_EARLY"


def moe_early_from_env() -> bool:
    """False when DEEPINFER_CUDA_MOE_EARLY=0: the decode MoE kernels' shared-expert copies wait
    for the router like the routed ones (CudaMoe._shared_early)."""
    return os.environ.get(MOE_EARLY_ENV, "1") != "0"


EARLY_INPUTS_ENV = "DEEPINFER_CUDA_EARLY_INPUTS"


def early_inputs_from_env() -> bool:
    """False when DEEPINFER_CUDA_EARLY_INPUTS=0: the decode step's MLA kernels read the step's
    inputs (positions, slots, lengths, block tables) and the cache rows of earlier steps only
    after waiting for the previous kernel (kernels/mla.py early_inputs, kernels/attention.py
    early_cache)."""
    return os.environ.get(EARLY_INPUTS_ENV, "1") != "0"


ARGMAX_ENV = "DEEPINFER_CUDA_ARGMAX"


def argmax_from_env() -> bool:
    """False when DEEPINFER_CUDA_ARGMAX=0: the greedy draw takes the contract's two reductions
    instead of the one-launch kernel (kernels/small.argmax)."""
    return os.environ.get(ARGMAX_ENV, "1") != "0"


WIDE_QUERY_ENV = "DEEPINFER_CUDA_WIDE_QUERY"


def query_rows_from_env() -> int:
    """The most rows for which MLA's query takes its 16-row decode tiles and writes the cache in
    the same launch: mla.DECODE_MAX_T, or 64 (the limit before it) when DEEPINFER_CUDA_WIDE_QUERY=0."""
    return mla_k.DECODE_MAX_T if os.environ.get(WIDE_QUERY_ENV, "1") != "0" else 64


KERNEL_COPIES_ENV = "DEEPINFER_CUDA_KERNEL_COPIES"


def kernel_copies_from_env() -> bool:
    """False when DEEPINFER_CUDA_KERNEL_COPIES=0: the step's small host copies (the sampled
    tokens, the step inputs) by the copy engine (CudaDevice.to_host / to_device)."""
    return os.environ.get(KERNEL_COPIES_ENV, "1") != "0"


SKINNY_ENV = "DEEPINFER_CUDA_SKINNY"


def skinny_from_env() -> bool:
    """False when DEEPINFER_CUDA_SKINNY=0: decode-sized float linears stay on cuBLAS."""
    return os.environ.get(SKINNY_ENV, "1") != "0"


V4_DECODE_ENV = "DEEPINFER_CUDA_V4_DECODE"


def v4_decode_from_env() -> bool:
    """False when DEEPINFER_CUDA_V4_DECODE=0: the published DeepSeek-V4 format's decode kernels
    off (FP8 linears and the grouped FP8 wo_a at decode sizes on the skinny kernel, MXFP4 experts
    on the decode MoE kernels, the MXFP4 grouped GEMM's nibble-pair decode), so that a benchmark
    can run the paths they replace in the same process tree."""
    return os.environ.get(V4_DECODE_ENV, "1") != "0"


# --------------------------------------------------------------------------- device / memory


class CudaGraphRunner(GraphRunner):
    """A captured CUDA graph; replay() re-runs it on the same buffers."""

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self.graph = graph

    def replay(self) -> None:
        self.graph.replay()


class CudaDevice(DeviceOps):
    graph_lengths_on_device = True  # the kernels read lengths on the device (host ones: bounds)

    def __init__(self, options: BackendOptions, device: torch.device, kernel_copies: bool = True) -> None:
        super().__init__(options)
        self._device = device
        self._is_cuda = device.type == "cuda"
        self.kernel_copies = kernel_copies  # to_host / to_device by small.copy_words

    def device(self) -> torch.device:
        return self._device

    def synchronize(self) -> None:
        if self._is_cuda:
            torch.cuda.synchronize(self._device)

    def memory_info(self) -> tuple[int, int]:
        if not self._is_cuda:
            return host_memory_info()
        free, total = torch.cuda.mem_get_info(self._device)
        return int(free), int(total)

    def new_stream(self) -> Stream:
        if not self._is_cuda:
            return HostStream()
        stream: Stream = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]
        return stream

    def stream_context(self, stream: Stream) -> AbstractContextManager[object]:
        if not self._is_cuda:
            return nullcontext(stream)
        return torch.cuda.stream(stream)  # type: ignore[arg-type]

    def new_event(self) -> Event:
        if not self._is_cuda:
            return HostEvent()
        event: Event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        return event

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=self._is_cuda)

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Up to small.COPY_MAX_BYTES: a Triton kernel writes the pinned buffer through its
        mapped address (kernels/small.copy_words), where a copy-engine transfer after the draw's
        graph waited about 6 us to start on an H200; larger or odd-sized: the contract's copy."""
        if not (self.kernel_copies and small_k.copy_words(src, dst)):
            super().to_host(src, dst)

    def to_device(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """As to_host: a kernel reads the pinned buffer (the step's inputs) through its mapped
        address."""
        if not (self.kernel_copies and small_k.copy_words(src, dst)):
            super().to_device(src, dst)

    def capture_graph(
        self, fn: Callable[[], object], share_with: GraphRunner | None = None
    ) -> GraphRunner | None:
        """Runs `fn` once eagerly on a side stream (compiles kernels, warms the allocator),
        then captures it into a CUDA graph, in share_with's memory pool or a new one. On the
        interpreter (no graphs on the CPU) the contract's stand-in, RerunGraph."""
        if not self._is_cuda:
            return RerunGraph(fn)
        if isinstance(share_with, CudaGraphRunner):
            pool = share_with.graph.pool()
        else:  # a new pool: one whose graphs were all freed must not be captured into again
            pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(self._device).wait_stream(side)
        torch.cuda.synchronize(self._device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            fn()
        return CudaGraphRunner(graph)

    def is_capturing(self) -> bool:
        return self._is_cuda and torch.cuda.is_current_stream_capturing()

    def peak_memory_bytes(self) -> int | None:
        return int(torch.cuda.max_memory_allocated(self._device)) if self._is_cuda else None

    def reset_peak_memory(self) -> None:
        if self._is_cuda:
            torch.cuda.reset_peak_memory_stats(self._device)


class CudaKVCache(KVCacheOps):
    """The contract's default layout, (NB, BS, D) per layer, written by Triton kernels."""

    def __init__(self, options: BackendOptions, fused: bool = True) -> None:
        super().__init__(options)
        self.fused = fused

    def write_kv(self, cache: PagedKVCache, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Triton row store (no host sync, graph-safe); slot -1 skips the row."""
        small_k.write_kv(_cache_tensor(cache), kv, slot_mapping)

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
        """One Triton kernel (norm + rope + cast + store; replaces two contiguous copies, the
        norm, the rope, a cat and the store). Unfused, or a cache dtype the kernel does not
        round like torch: the contract's composition (this backend's rms_norm, rope, write_kv)."""
        t = _cache_tensor(cache)
        args = (norm_weight, eps, positions, cos_sin_cache, interleaved, slot_mapping)
        if self.fused and kv.dtype in small_k.CAST_DTYPES and t.dtype in small_k.CAST_DTYPES:
            small_k.write_mla_kv(t, kv, cache.spec.latent_dim, *args)
        else:
            super().write_mla_kv(cache, kv, *args)


def _cache_tensor(cache: PagedKVCache) -> torch.Tensor:
    """The (NB, BS, D) tensor of the reference layout, which this backend keeps."""
    t = cache.tensors[0]
    spec = cache.spec
    if len(cache.tensors) != 1 or tuple(t.shape) != (spec.num_blocks, spec.block_size, spec.head_dim):
        raise ValueError("the CUDA backend expects the (num_blocks, block_size, head_dim) cache layout")
    if not t.is_contiguous():
        raise ValueError("the KV cache tensor must be contiguous")
    return t


# --------------------------------------------------------------------------- attention


class CudaAttention(AttentionOps):
    """The Triton attention kernel (kernels/attention.py); MLA's query preparation in one launch
    (kernels/mla.py); DeepSeek-V4's compressed attention and lightning indexer in kernels/v4.py
    (unfused: the contract's defaults)."""

    def __init__(
        self, options: BackendOptions, fused: bool = True, query_rows: int = mla_k.DECODE_MAX_T
    ) -> None:
        super().__init__(options)
        self.fused = fused
        self.query_rows = query_rows  # mla_query_and_cache's one launch up to this many rows

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
        if not meta.is_decode_only:
            raise ValueError("decode attention needs exactly one query token per request")
        kv = _cache_tensor(cache)
        if not self.batch_invariant and modifiers.is_plain:
            out = vendor.flash_mla_decode(q, kv, meta, scale=scale, v_dim=v_dim)
            if out is not None:
                return out
        return self._run(q, cache, meta, scale, v_dim, modifiers)

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
        return self._run(q, cache, meta, scale, v_dim, modifiers)

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
        """Where the W_UV product takes the skinny GEMM (decode sizes, outside batch-invariant
        mode) and FlashMLA does not serve: the attention's split-KV partials are merged inside the
        product's launch (gemm.skinny_merge_matmul), so the combine's launch is gone. Else (or
        where one split serves every row, written whole by the attention) the default."""
        gemm = self.backend.gemm
        fits = (
            self.fused
            and getattr(gemm, "skinny", False)
            and modifiers.is_plain
            and meta.is_decode_only
            and w_uv.dtype == q.dtype
            and v_dim <= cache.spec.head_dim
            and gemm_k.skinny_merge_ok(q.shape[0], w_uv)
            and not vendor.flash_mla_available()
        )
        if not fits:
            return super().mla_decode_and_uv(
                q, cache, meta, w_uv, scale=scale, v_dim=v_dim, modifiers=modifiers
            )
        o = attn_k.mla_attention_partials(  # the model's decode step: its metadata and older rows
            q, _cache_tensor(cache), meta, scale=scale, v_dim=v_dim, latent_dim=cache.spec.latent_dim,
            early_cache=early_inputs_from_env(),
        )  # fmt: skip
        if isinstance(o, torch.Tensor):
            return gemm.batched_linear(o.transpose(0, 1), w_uv).transpose(0, 1)
        return gemm_k.skinny_merge_matmul(o.part, o.lse, o.splits, q.shape[0], w_uv)

    def _run(
        self,
        q: torch.Tensor,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        scale: float,
        v_dim: int,
        modifiers: AttentionModifiers,
    ) -> torch.Tensor:
        if v_dim > cache.spec.head_dim:
            raise ValueError(f"v_dim {v_dim} exceeds the cached row width {cache.spec.head_dim}")
        sinks = modifiers.sinks
        return attn_k.mla_attention(
            q, _cache_tensor(cache), meta, scale=scale, v_dim=v_dim, latent_dim=cache.spec.latent_dim,
            window=modifiers.window, sinks=None if sinks is None else sinks.float().contiguous(),
            topk_indices=modifiers.topk_indices, batch_invariant=self.batch_invariant,
            split_size=attn_k.invariant_split(self.options.max_model_len) if self.batch_invariant else None,
        )  # fmt: skip

    def mla_query(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        w_uk: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        interleaved: bool,
    ) -> torch.Tensor:
        """One Triton launch for every T (kernels/mla.py; batch-invariant mode: one tile for every
        T). Unfused, or dtypes the kernel does not take: the contract's composition."""
        if not self.fused or not mla_k.supported(q_nope, q_pe, w_uk):
            return super().mla_query(q_nope, q_pe, w_uk, positions, cos_sin_cache, interleaved)
        return mla_k.mla_query(
            q_nope, q_pe, w_uk, positions, cos_sin_cache, interleaved, batch_invariant=self.batch_invariant
        )

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
        """The cache write inside mla_query's launch (kernels/mla.py, CacheWrite) up to
        query_rows tokens (mla.DECODE_MAX_T), where the query takes 16-row tiles (a tail program
        writes at most 16 rows one after another); larger steps, dtypes the kernels do not take,
        or unfused: the two ops."""
        t = _cache_tensor(cache)
        fits = q_nope.shape[0] <= self.query_rows and mla_k.supported(q_nope, q_pe, w_uk)
        if not (self.fused and fits and kv.dtype in small_k.CAST_DTYPES and t.dtype in small_k.CAST_DTYPES):
            return super().mla_query_and_cache(
                q_nope, q_pe, w_uk, kv, cache, kv_norm_weight, eps, positions, cos_sin_cache, interleaved,
                slot_mapping,
            )  # fmt: skip
        write = mla_k.CacheWrite(t, kv, kv_norm_weight, eps, slot_mapping)
        return mla_k.mla_query(  # the model's step: positions and slots are its step inputs
            q_nope, q_pe, w_uk, positions, cos_sin_cache, interleaved, batch_invariant=self.batch_invariant,
            write=write, early_inputs=early_inputs_from_env(), decode_max_t=self.query_rows,
        )  # fmt: skip

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
        if not self.fused:
            return super().compressed_attention(
                q, cache, compressed, meta, scale=scale, ratio=ratio, modifiers=modifiers,
                compressed_block_tables=compressed_block_tables,
            )  # fmt: skip
        sinks = modifiers.sinks
        return v4_k.compressed_attention(
            q, _cache_tensor(cache), _cache_tensor(compressed), meta, scale=scale, ratio=ratio,
            window=modifiers.window, sinks=None if sinks is None else sinks.float().contiguous(),
            topk_indices=modifiers.topk_indices, compressed_block_tables=compressed_block_tables,
            batch_invariant=self.batch_invariant,
        )  # fmt: skip

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
        if not self.fused:
            return super().indexer_topk(q, weights, keys, meta, ratio=ratio, topk=topk, scale=scale)
        return v4_k.indexer_topk(
            q, weights.float(), _cache_tensor(keys), meta, ratio=ratio, topk=topk, scale=scale
        )


# --------------------------------------------------------------------------- gemm


class CudaGemm(GemmOps):
    def __init__(
        self, options: BackendOptions, fused: bool = True, skinny: bool = True, v4_decode: bool = True
    ) -> None:
        super().__init__(options)
        self.fused = fused
        # decode-sized float linears on kernels/gemm.skinny_matmul (outside batch-invariant mode)
        self.skinny = fused and skinny and not self.batch_invariant
        # ... and FP8 ones on its FP8 flag (skinny_fp8_matmul); the MXFP4 grouped GEMM's pair decode
        self.v4_decode = v4_decode
        self.skinny_fp8 = self.skinny and v4_decode

    def _tiles(self, group_sizes: torch.Tensor, rows: int, fp8: bool) -> gemm_k.TileTable | None:
        """The tile table in one launch (None, unfused: grouped_gemm computes it in torch)."""
        if not self.fused:
            return None
        cfg = gemm_k.grouped_config(rows, fp8, self.batch_invariant, group_sizes.device)
        return moe_k.tile_table(group_sizes, rows, cfg.block_m)

    # ----- DeepSeek-V4's published format at decode sizes (DEEPINFER_CUDA_V4_DECODE)

    def linear_fp8(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Up to gemm.SKINNY_FP8_MAX_M rows (outside batch-invariant mode): ONE launch, the skinny
        kernel's FP8 flag (x quantised in the kernel, the e4m3 slab loaded before the wait); else
        the contract's quantize_fp8 + fp8_gemm."""
        fits = bias is None and x.dim() == 2 and gemm_k.skinny_fp8_ok(x, weight, weight_scale)
        if self.skinny_fp8 and fits:
            return gemm_k.skinny_fp8_matmul(x, weight, weight_scale)
        return super().linear_fp8(x, weight, weight_scale, bias)

    def batched_linear_fp8(
        self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor
    ) -> torch.Tensor:
        """Decode sizes: one skinny FP8 launch over the G groups, read from x's strided view and
        written as a (G, M, N) view of an (M, G, N) tensor (V4 flattens (M, G * N) without a copy);
        else the contract's grouped_gemm_fp8."""
        if self.skinny_fp8 and gemm_k.skinny_fp8_ok(x, weight, weight_scale):
            out = torch.empty((x.shape[1], x.shape[0], weight.shape[1]), dtype=x.dtype, device=x.device)
            return gemm_k.skinny_fp8_matmul(x, weight, weight_scale, out.transpose(0, 1))
        return super().batched_linear_fp8(x, weight, weight_scale)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Up to SKINNY_MAX_M rows and SKINNY_MAX_WEIGHT_BYTES of weight: the skinny Triton GEMM
        (its weight loads overlap the previous kernel); else cuBLAS through torch. Batch-invariant
        mode uses the fixed-tile Triton matmul instead (cuBLAS may change kernel, and reduction
        order, with M)."""
        if self.batch_invariant:
            return gemm_k.matmul(x, weight, bias)
        if self.skinny and bias is None and x.dim() == 2 and gemm_k.skinny_pays(x, weight):
            return gemm_k.skinny_matmul(x, weight)
        return torch.nn.functional.linear(x, weight, bias)

    def batched_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """cuBLAS bmm, or the skinny GEMM at decode sizes, its (G, M, N) result a view of an (M, G, N)
        tensor (MLA transposes it back to (T, H, Vh) and flattens the heads without a copy);
        batch-invariant mode: the fixed-tile Triton matmul over every group in one launch (each
        row's result independent of M)."""
        if self.batch_invariant:
            return gemm_k.batched_matmul(x, weight)
        if self.skinny and gemm_k.skinny_pays(x, weight):
            out = torch.empty((x.shape[1], x.shape[0], weight.shape[1]), dtype=x.dtype, device=x.device)
            return gemm_k.skinny_matmul(x, weight, out.transpose(0, 1))
        return torch.bmm(x, weight.transpose(1, 2))

    def quantize_fp8(self, x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
        return gemm_k.quantize_fp8(x, block)

    def fp8_gemm(
        self,
        xq: torch.Tensor,
        x_scale: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        if not self.batch_invariant:
            out = vendor.deep_gemm_fp8(xq, x_scale, weight, weight_scale, out_dtype)
            if out is not None:
                return out
        return gemm_k.fp8_gemm(
            xq, x_scale, weight, weight_scale, out_dtype, batch_invariant=self.batch_invariant
        )

    def grouped_gemm(self, x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        return gemm_k.grouped_gemm(
            x, weight, group_sizes, out_dtype=x.dtype, batch_invariant=self.batch_invariant,
            tiles=self._tiles(group_sizes, x.shape[0], False),
        )  # fmt: skip

    def grouped_gemm_fp8(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        group_sizes: torch.Tensor,
    ) -> torch.Tensor:
        if weight.dtype != FP8_DTYPE:
            raise ValueError(f"grouped_gemm_fp8 takes float8_e4m3fn weights, got {weight.dtype}")
        xq, xs = gemm_k.quantize_fp8(x)
        return gemm_k.grouped_gemm(
            xq, weight, group_sizes, out_dtype=x.dtype, x_scale=xs, weight_scale=weight_scale.float(),
            batch_invariant=self.batch_invariant, tiles=self._tiles(group_sizes, x.shape[0], True),
        )  # fmt: skip

    def grouped_gemm_fp4(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        group_sizes: torch.Tensor,
    ) -> torch.Tensor:
        """MXFP4 experts in one Triton launch: e2m1 codes and UE8M0 scales decoded in the kernel,
        the product in x's dtype (SM90 has no FP4 tensor cores)."""
        pairs = self.v4_decode
        cfg = gemm_k.grouped_fp4_config(x.shape[0], self.batch_invariant, x.device, pairs)
        tiles = moe_k.tile_table(group_sizes, x.shape[0], cfg.block_m) if self.fused else None
        return gemm_k.grouped_gemm_fp4(
            x, weight, weight_scale, group_sizes, batch_invariant=self.batch_invariant, tiles=tiles,
            pairs=pairs, config=cfg,
        )  # fmt: skip


# --------------------------------------------------------------------------- moe


class CudaMoe(MoeOps):
    """Fused: the router's scores at decode sizes and the router in one Triton kernel each, both
    in one launch at decode sizes (select_experts); the stable expert sort, src_to_dst, counts
    and the grouped GEMM's tile table in another (kernels/moe.py); expert MLPs by the Triton
    grouped GEMM; the weighted combine in Triton. Unfused (DEEPINFER_CUDA_UNFUSED=1): the reference's
    torch routing, the torch sort and a torch tile table per GEMM, as before the fusion."""

    def __init__(
        self, options: BackendOptions, fused: bool = True, decode: bool = True, v4_decode: bool = True
    ) -> None:
        super().__init__(options)
        self.fused = fused
        self.decode = fused and decode  # kernels/moe.decode_moe for a few tokens
        # MXFP4 experts on decode_moe too; off (DEEPINFER_CUDA_V4_DECODE=0), DeepSeek-V4's MoE
        # (the calls with swiglu_limit) takes the contract's composition, as before V4 used fused_moe
        self.v4_decode = v4_decode
        self.early = moe_early_from_env()
        # The last one-launch routing: (x, ids) by weak reference, its shared experts S and E + S.
        # fused_moe on that very x and ids may start the shared copies early.
        self._routed: tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor], int, int] | None = None

    def router_logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Decode sizes (outside batch-invariant mode): one Triton launch on x as it is; else the
        contract's x.float() and a float32 linear."""
        if self._router_gemv(x, weight):
            return moe_k.router_logits(x, weight)
        return super().router_logits(x, weight)

    def route(
        self,
        logits: torch.Tensor,
        config: RouterConfig,
        correction_bias: torch.Tensor | None = None,
        hash_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.fused:  # the contract's default: the reference router in torch ops
            return super().route(logits, config, correction_bias, hash_ids)
        tile = moe_k.router_tile(logits.shape[0], self.batch_invariant)  # its warps order a softmax sum
        return moe_k.route(logits, config, correction_bias, hash_ids, tile)

    def select_experts(
        self,
        x: torch.Tensor,
        gate_weight: torch.Tensor,
        config: RouterConfig,
        correction_bias: torch.Tensor | None = None,
        hash_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Where router_logits takes its one-launch path, scores and routing in ONE launch (the
        same bits as router_logits + route); else those two."""
        self._routed = None
        if self._router_gemv(x, gate_weight):
            weights, ids = moe_k.select_experts(x, gate_weight, config, correction_bias, hash_ids)
            s = config.shared_experts
            self._routed = (weakref.ref(x), weakref.ref(ids), s, gate_weight.shape[0] + s)
            return weights, ids
        return super().select_experts(x, gate_weight, config, correction_bias, hash_ids)

    def _shared_early(self, x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor) -> int:
        """S where fused_moe's x and ids are the last one-launch routing's and w13 holds its E + S
        experts: the decode kernels then start the S shared experts' copies while the router runs
        (kernels/moe.decode_moe); else 0. The models call fused_moe right after select_experts, on
        the x they routed (inference tensors keep no version counter to check that x is unchanged)."""
        routed, self._routed = self._routed, None
        if routed is None or not self.early:
            return 0
        x_ref, ids_ref, shared, experts = routed
        same = x_ref() is x and ids_ref() is ids and w13.shape[0] == experts
        return shared if same else 0

    def _router_gemv(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Decode sizes, fused mode, outside batch-invariant mode: the router's one-launch kernels."""
        small = x.dim() == 2 and x.shape[0] <= moe_k.ROUTER_GEMV_MAX_TOKENS and weight.dtype == torch.float32
        return self.fused and small and not self.batch_invariant

    def _align(self, ids: torch.Tensor, num_experts: int, block_m: int | None) -> moe_k.Alignment:
        if self.fused:
            return moe_k.align(ids, num_experts, block_m)
        order, src_to_dst, counts = sort_by_expert(ids, num_experts)
        return moe_k.Alignment(order, order // ids.shape[1], src_to_dst, counts, None)

    def permute(
        self, x: torch.Tensor, ids: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = self._align(ids, num_experts, None)
        return x[a.token], a.src_to_dst, a.counts

    def unpermute(
        self, y_sorted: torch.Tensor, src_to_dst: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        return small_k.weighted_combine(y_sorted, src_to_dst, weights)

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
        if w13.dtype == torch.uint8:  # MXFP4: the contract's composition over grouped_gemm_fp4
            return super().experts(x_sorted, counts, w13, w2, w13_scale, w2_scale, swiglu_limit)
        cfg = self._config(x_sorted.shape[0], w13_scale, x_sorted.device)
        tiles = moe_k.tile_table(counts, x_sorted.shape[0], cfg.block_m) if self.fused else None
        return self._mlp(x_sorted, counts, tiles, cfg, w13, w2, w13_scale, w2_scale, None, swiglu_limit)

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
        """Like the default composition, but the first GEMM reads token rows straight from x
        through the sorted ids (no permuted copy of x). Fused: route -> align (one launch: sort,
        counts and the tile table for both GEMMs) -> GEMM -> silu_and_mul -> GEMM -> combine.
        Up to moe_k.DECODE_MAX_COPIES token copies, outside batch-invariant mode (the two paths
        round alike but reduce in different tiles, so a row's bits would change with T at the
        limit), for unquantised experts: kernels/moe.decode_moe, two launches (up with
        silu_and_mul, down with the combine), no sort; DEEPINFER_CUDA_MOE_DECODE=0 turns it off.
        MXFP4 experts (DeepSeek-V4): decode_moe's GEMV kernels up to moe_k.FP4_DECODE_MAX_COPIES
        copies; above, the contract's composition over grouped_gemm_fp4. DEEPINFER_CUDA_V4_DECODE=0:
        every call with swiglu_limit (DeepSeek-V4) takes that composition, the path before."""
        if ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
            raise ValueError(
                f"fused_moe: ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must be (T, K)"
            )
        small = ids.numel() <= moe_k.DECODE_MAX_COPIES
        shared = self._shared_early(x, ids, w13)
        limit = swiglu_limit
        if w13.dtype == torch.uint8 or (limit is not None and not self.v4_decode):  # MXFP4, or V4 off
            fits = self.fused and not self.batch_invariant and ids.numel() <= moe_k.FP4_DECODE_MAX_COPIES
            if self.v4_decode and fits:
                return moe_k.decode_moe(x, weights, ids, w13, w2, w13_scale, w2_scale, swiglu_limit=limit)
            return super().fused_moe(x, weights, ids, w13, w2, w13_scale, w2_scale, limit)
        if self.decode and not self.batch_invariant and small and w13_scale is None and w2_scale is None:
            # bf16 / float32 experts (FP8: slower)
            return moe_k.decode_moe(x, weights, ids, w13, w2, shared_experts=shared, swiglu_limit=limit)
        cfg = self._config(ids.numel(), w13_scale, ids.device)
        a = self._align(ids, w13.shape[0], cfg.block_m)
        y = self._mlp(x, a.counts, a.tiles, cfg, w13, w2, w13_scale, w2_scale, a.token, limit)
        return small_k.weighted_combine(y, a.src_to_dst, weights)

    def _config(self, rows: int, w13_scale: torch.Tensor | None, device: torch.device) -> gemm_k.GemmConfig:
        """One tiling for both expert GEMMs (same rows, same FP8-ness), so one tile table serves."""
        return gemm_k.grouped_config(rows, w13_scale is not None, self.batch_invariant, device)

    def _mlp(
        self,
        x: torch.Tensor,
        counts: torch.Tensor,
        tiles: gemm_k.TileTable | None,
        cfg: gemm_k.GemmConfig,
        w13: torch.Tensor,
        w2: torch.Tensor,
        w13_scale: torch.Tensor | None,
        w2_scale: torch.Tensor | None,
        gather: torch.Tensor | None,
        limit: float | None = None,
    ) -> torch.Tensor:
        def act(h: torch.Tensor) -> torch.Tensor:
            return small_k.silu_and_mul(h) if limit is None else small_k.clamped_silu_and_mul(h, limit)

        if (w13_scale is None) != (w2_scale is None):
            raise ValueError("FP8 experts need both w13_scale and w2_scale")
        rows = gather.shape[0] if gather is not None else x.shape[0]

        def gemm(
            a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor | None, w_scale: torch.Tensor | None,
            gather: torch.Tensor | None = None,
        ) -> torch.Tensor:  # fmt: skip
            return gemm_k.grouped_gemm(
                a, w, counts, out_dtype=x.dtype, x_scale=a_scale, weight_scale=w_scale, gather=gather,
                num_rows=rows, config=cfg, tiles=tiles,
            )  # fmt: skip

        if w13_scale is None or w2_scale is None:
            return gemm(act(gemm(x, w13, None, None, gather)), w2, None, None)
        xq, xs = gemm_k.quantize_fp8(x)  # per-token quantisation commutes with the row gather
        aq, a_s = gemm_k.quantize_fp8(act(gemm(xq, w13, xs, w13_scale.float(), gather)))
        return gemm(aq, w2, a_s, w2_scale.float())


# --------------------------------------------------------------------------- collectives / small ops


class CudaCollectives(CollectiveOps):
    def __init__(self, options: BackendOptions, device: torch.device) -> None:
        super().__init__(options)
        self._dist_backend = "nccl" if device.type == "cuda" else "gloo"

    @property
    def dist_backend(self) -> str:
        return self._dist_backend

    def expert_exchange(
        self, num_experts: int, x: torch.Tensor, top_k: int
    ) -> Callable[..., torch.Tensor] | None:
        """DeepEP's normal kernels when they apply (deepinfer_cuda.deepep), else None."""
        from deepinfer_cuda.deepep import deepep_exchange

        return deepep_exchange(num_experts, x)


class CudaSmall(SmallOps):
    """Triton rms_norm, rope, silu_and_mul (and DeepSeek-V4's clamped one, compressor pooling and
    mHC ops), bitmask and the sampling noise; sampling stays in torch (sort-based top-k / top-p over the
    vocabulary, already a handful of device kernels)."""

    def __init__(self, options: BackendOptions, fused: bool = True, argmax: bool = True) -> None:
        super().__init__(options)
        self.fused = fused
        self.argmax_kernel = fused and argmax

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return small_k.rms_norm(x, weight, eps)[0]

    def argmax(self, logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """One launch (kernels/small.argmax) where fused; else the contract's two reductions."""
        if self.argmax_kernel and logits.dim() == 2 and logits.dtype == torch.float32 and logits.shape[1]:
            return small_k.argmax(logits, out)
        return super().argmax(logits, out)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One kernel: the sum in float32, normalised before its rounding to x's dtype."""
        y, h = small_k.rms_norm(x, weight, eps, residual)
        assert h is not None
        return y, h

    def rope(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        interleaved: bool,
    ) -> torch.Tensor:
        return small_k.rope(x, positions, cos_sin_cache, interleaved)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return small_k.silu_and_mul(x)

    def clamped_silu_and_mul(self, x: torch.Tensor, limit: float) -> torch.Tensor:
        return small_k.clamped_silu_and_mul(x, limit)

    def gated_pool(self, kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return small_k.gated_pool(kv, gate)

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
        """One launch (kernels/v4.py: split mix product, then Sinkhorn in registers)."""
        if not self.fused:
            return super().hc_pre(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)
        return v4_k.hc_pre(
            streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, batch_invariant=self.batch_invariant
        )

    def hc_post(
        self, y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        if not self.fused:
            return super().hc_post(y, streams, post, comb)
        return v4_k.hc_post(y, streams, post, comb)

    def hc_head(
        self,
        streams: torch.Tensor,
        fn: torch.Tensor,
        base: torch.Tensor,
        scale: torch.Tensor,
        norm_eps: float,
        hc_eps: float,
    ) -> torch.Tensor:
        if not self.fused:
            return super().hc_head(streams, fn, base, scale, norm_eps, hc_eps)
        return v4_k.hc_head(streams, fn, base, scale, norm_eps, hc_eps, batch_invariant=self.batch_invariant)

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        small_k.apply_token_bitmask(logits, bitmask)

    def exponential_noise(self, seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """One Triton kernel (the reference's hash, bit for bit; -log within float32 rounding)."""
        if not self.fused:  # the contract's default (the reference hash in torch ops)
            return super().exponential_noise(seeds, offsets, vocab_size)
        return small_k.exponential_noise(seeds, offsets, vocab_size)


# --------------------------------------------------------------------------- factory


def cuda_device(options: BackendOptions) -> torch.device:
    """cuda:<device_index>, or the CPU when the kernels run in the Triton interpreter."""
    if interpreting():
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(
            "the cuda backend needs a CUDA GPU (or TRITON_INTERPRET=1 for the CPU interpreter)"
        )
    if not 0 <= options.device_index < torch.cuda.device_count():
        raise ValueError(
            f"device_index {options.device_index} out of range: {torch.cuda.device_count()} GPU(s) visible"
        )
    return torch.device("cuda", options.device_index)


def capabilities_for(device: torch.device) -> Capabilities:
    if device.type == "cuda":
        fp8 = torch.cuda.get_device_capability(device) >= (8, 9)
    else:
        fp8 = True  # the interpreter runs the FP8 kernels (see kernels/common.py)
    return Capabilities(
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        supports_fp8=fp8,
        supports_batch_invariant=True,
        supports_graphs=True,  # CUDA graphs; RerunGraph under the interpreter
    )


def create_cuda_backend(options: BackendOptions | None = None) -> Backend:
    options = options or BackendOptions()
    device = cuda_device(options)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    fused = fused_from_env()
    return Backend(
        name="cuda",
        options=options,
        capabilities=capabilities_for(device),
        device=CudaDevice(options, device, fused and kernel_copies_from_env()),
        kv_cache=CudaKVCache(options, fused),
        attention=CudaAttention(options, fused, query_rows_from_env()),
        gemm=CudaGemm(options, fused, skinny_from_env(), v4_decode_from_env()),
        moe=CudaMoe(options, fused, moe_decode_from_env(), v4_decode_from_env()),
        collectives=CudaCollectives(options, device),
        small=CudaSmall(options, fused, argmax_from_env()),
    )
