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
DEEPINFER_CUDA_UNFUSED=1 switches those back to the composed
paths they replace (routing in torch as the reference computes it, the torch sort and a torch
tile table per GEMM, write_mla_kv, mla_query and exponential_noise as the contract's defaults,
which run through this backend's own rms_norm / rope / write_kv / batched_linear and the
reference hash; the V4 ops as the contract's reference defaults) so that a benchmark can measure
what the fusion buys. Results agree within each op's contract either way.

Switches (deepinfer.envs, docs/environment.md): create_cuda_backend reads them once, from the
environment or the snapshot it is given, and each part keeps the values it uses; a launch reads
none, so a backend and the graphs it captured keep the switches it was created with.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from deepinfer import envs
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

# --------------------------------------------------------------------------- device / memory


class CudaGraphRunner(GraphRunner):
    """A captured CUDA graph; replay() re-runs it on the same buffers."""

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self.graph = graph

    def replay(self) -> None:
        self.graph.replay()


class CudaDevice(DeviceOps):
    graph_lengths_on_device = True  # the kernels read lengths on the device (host ones: bounds)

    def __init__(self, options: BackendOptions, device: torch.device, env: envs.Env = envs.DEFAULTS) -> None:
        super().__init__(options)
        self._device = device
        self._is_cuda = device.type == "cuda"
        # to_host / to_device by small.copy_words
        self.kernel_copies = not env.cuda_unfused and env.cuda_kernel_copies

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

    def __init__(self, options: BackendOptions, env: envs.Env = envs.DEFAULTS) -> None:
        super().__init__(options)
        self.fused = not env.cuda_unfused
        self.pdl = env.cuda_pdl

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
            small_k.write_mla_kv(t, kv, cache.spec.latent_dim, *args, pdl=self.pdl)
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

    def __init__(self, options: BackendOptions, env: envs.Env = envs.DEFAULTS) -> None:
        super().__init__(options)
        self.fused = not env.cuda_unfused
        # mla_query_and_cache's one launch up to this many rows (64: the limit before 128-row tiles)
        self.query_rows = mla_k.DECODE_MAX_T if env.cuda_wide_query else 64
        self.early_inputs = env.cuda_early_inputs  # the decode step's MLA kernels (kernels/mla.py)
        self.pdl = env.cuda_pdl
        self.vendor = env.cuda_vendor  # FlashMLA where installed (deepinfer_cuda.vendor)

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
        if self.vendor and not self.batch_invariant and modifiers.is_plain:
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
            and not (self.vendor and vendor.flash_mla_available())
        )
        if not fits:
            return super().mla_decode_and_uv(
                q, cache, meta, w_uv, scale=scale, v_dim=v_dim, modifiers=modifiers
            )
        o = attn_k.mla_attention_partials(  # the model's decode step: its metadata and older rows
            q, _cache_tensor(cache), meta, scale=scale, v_dim=v_dim, latent_dim=cache.spec.latent_dim,
            early_cache=self.early_inputs, pdl=self.pdl,
        )  # fmt: skip
        if isinstance(o, torch.Tensor):
            return gemm.batched_linear(o.transpose(0, 1), w_uv).transpose(0, 1)
        return gemm_k.skinny_merge_matmul(o.part, o.lse, o.splits, q.shape[0], w_uv, pdl=self.pdl)

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
            pdl=self.pdl,
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
            q_nope, q_pe, w_uk, positions, cos_sin_cache, interleaved, batch_invariant=self.batch_invariant,
            pdl=self.pdl,
        )  # fmt: skip

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
            write=write, early_inputs=self.early_inputs, decode_max_t=self.query_rows, pdl=self.pdl,
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
            batch_invariant=self.batch_invariant, pdl=self.pdl,
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
    def __init__(self, options: BackendOptions, env: envs.Env = envs.DEFAULTS) -> None:
        super().__init__(options)
        self.fused = not env.cuda_unfused
        # decode-sized float linears on kernels/gemm.skinny_matmul (outside batch-invariant mode)
        self.skinny = self.fused and env.cuda_skinny and not self.batch_invariant
        self.pdl = env.cuda_pdl
        self.vendor = env.cuda_vendor  # DeepGEMM where installed (deepinfer_cuda.vendor)
        # the batch-invariant matmul's tiles, where a benchmark pins them (else by M)
        self.invariant_tile = gemm_k.invariant_setting(env.cuda_invariant_tile)

    def _tiles(self, group_sizes: torch.Tensor, rows: int, fp8: bool) -> gemm_k.TileTable | None:
        """The tile table in one launch (None, unfused: grouped_gemm computes it in torch)."""
        if not self.fused:
            return None
        cfg = gemm_k.grouped_config(rows, fp8, self.batch_invariant, group_sizes.device)
        return moe_k.tile_table(group_sizes, rows, cfg.block_m)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Up to SKINNY_MAX_M rows and SKINNY_MAX_WEIGHT_BYTES of weight: the skinny Triton GEMM
        (its weight loads overlap the previous kernel); else cuBLAS through torch. Batch-invariant
        mode uses the fixed-tile Triton matmul instead (cuBLAS may change kernel, and reduction
        order, with M)."""
        if self.batch_invariant:
            return gemm_k.matmul(x, weight, bias, self.invariant_tile)
        if self.skinny and bias is None and x.dim() == 2 and gemm_k.skinny_pays(x, weight):
            return gemm_k.skinny_matmul(x, weight, pdl=self.pdl)
        return torch.nn.functional.linear(x, weight, bias)

    def batched_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """cuBLAS bmm, or the skinny GEMM at decode sizes, its (G, M, N) result a view of an (M, G, N)
        tensor (MLA transposes it back to (T, H, Vh) and flattens the heads without a copy);
        batch-invariant mode: the fixed-tile Triton matmul over every group in one launch (each
        row's result independent of M)."""
        if self.batch_invariant:
            return gemm_k.batched_matmul(x, weight, self.invariant_tile)
        if self.skinny and gemm_k.skinny_pays(x, weight):
            out = torch.empty((x.shape[1], x.shape[0], weight.shape[1]), dtype=x.dtype, device=x.device)
            return gemm_k.skinny_matmul(x, weight, out.transpose(0, 1), pdl=self.pdl)
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
        if self.vendor and not self.batch_invariant:
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
        return gemm_k.grouped_gemm_fp4(
            x, weight, weight_scale, group_sizes, batch_invariant=self.batch_invariant,
            tiles=self._tiles(group_sizes, x.shape[0], False),
        )  # fmt: skip


# --------------------------------------------------------------------------- moe


class CudaMoe(MoeOps):
    """Fused: the router's scores at decode sizes and the router in one Triton kernel each, both
    in one launch at decode sizes (select_experts); the stable expert sort, src_to_dst, counts
    and the grouped GEMM's tile table in another (kernels/moe.py); expert MLPs by the Triton
    grouped GEMM; the weighted combine in Triton. Unfused (DEEPINFER_CUDA_UNFUSED=1): the reference's
    torch routing, the torch sort and a torch tile table per GEMM, as before the fusion."""

    def __init__(self, options: BackendOptions, env: envs.Env = envs.DEFAULTS) -> None:
        super().__init__(options)
        self.fused = not env.cuda_unfused
        self.decode = self.fused and env.cuda_moe_decode  # kernels/moe.decode_moe for a few tokens
        # its tiles where a benchmark pins them (else decode_config's by size), and its copy limit
        self.decode_tiles, self.max_copies = moe_k.decode_setting(env.cuda_moe_decode_tiles)
        self.early = env.cuda_moe_early
        self.pdl = env.cuda_pdl
        # The last one-launch routing: (x, ids) by weak reference, its shared experts S and E + S.
        # fused_moe on that very x and ids may start the shared copies early.
        self._routed: tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor], int, int] | None = None

    def router_logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Decode sizes (outside batch-invariant mode): one Triton launch on x as it is; else the
        contract's x.float() and a float32 linear."""
        if self._router_gemv(x, weight):
            return moe_k.router_logits(x, weight, pdl=self.pdl)
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
            weights, ids = moe_k.select_experts(
                x, gate_weight, config, correction_bias, hash_ids, pdl=self.pdl
            )
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
    ) -> torch.Tensor:
        cfg = self._config(x_sorted.shape[0], w13_scale, x_sorted.device)
        tiles = moe_k.tile_table(counts, x_sorted.shape[0], cfg.block_m) if self.fused else None
        return self._mlp(x_sorted, counts, tiles, cfg, w13, w2, w13_scale, w2_scale, gather=None)

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
        """Like the default composition, but the first GEMM reads token rows straight from x
        through the sorted ids (no permuted copy of x). Fused: route -> align (one launch: sort,
        counts and the tile table for both GEMMs) -> GEMM -> silu_and_mul -> GEMM -> combine.
        Up to max_copies token copies (moe_k.DECODE_MAX_COPIES unless pinned), outside
        batch-invariant mode (the two paths round alike but reduce in different tiles, so a row's
        bits would change with T at the limit), for unquantised experts: kernels/moe.decode_moe,
        two launches (up with silu_and_mul, down with the combine), no sort;
        DEEPINFER_CUDA_MOE_DECODE=0 turns it off."""
        if ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
            raise ValueError(
                f"fused_moe: ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must be (T, K)"
            )
        small = ids.numel() <= self.max_copies
        shared = self._shared_early(x, ids, w13)
        if self.decode and not self.batch_invariant and small and w13_scale is None and w2_scale is None:
            # bf16 / float32 experts (FP8: slower)
            return moe_k.decode_moe(
                x, weights, ids, w13, w2, config=self.decode_tiles, shared_experts=shared, pdl=self.pdl
            )
        cfg = self._config(ids.numel(), w13_scale, ids.device)
        a = self._align(ids, w13.shape[0], cfg.block_m)
        y = self._mlp(x, a.counts, a.tiles, cfg, w13, w2, w13_scale, w2_scale, gather=a.token)
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
    ) -> torch.Tensor:
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
            return gemm(small_k.silu_and_mul(gemm(x, w13, None, None, gather)), w2, None, None)
        xq, xs = gemm_k.quantize_fp8(x)  # per-token quantisation commutes with the row gather
        aq, a_s = gemm_k.quantize_fp8(small_k.silu_and_mul(gemm(xq, w13, xs, w13_scale.float(), gather)))
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

    def __init__(self, options: BackendOptions, env: envs.Env = envs.DEFAULTS) -> None:
        super().__init__(options)
        self.fused = not env.cuda_unfused
        self.argmax_kernel = self.fused and env.cuda_argmax
        self.pdl = env.cuda_pdl

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return small_k.rms_norm(x, weight, eps, pdl=self.pdl)[0]

    def argmax(self, logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """One launch (kernels/small.argmax) where fused; else the contract's two reductions."""
        if self.argmax_kernel and logits.dim() == 2 and logits.dtype == torch.float32 and logits.shape[1]:
            return small_k.argmax(logits, out)
        return super().argmax(logits, out)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One kernel: the sum in float32, normalised before its rounding to x's dtype."""
        y, h = small_k.rms_norm(x, weight, eps, residual, pdl=self.pdl)
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


def create_cuda_backend(options: BackendOptions | None = None, env: envs.Env | None = None) -> Backend:
    """The cuda Backend on options.device_index; `env`: the switches (default: read from the
    environment now, deepinfer.envs), which its parts keep."""
    options = options or BackendOptions()
    env = envs.read() if env is None else env
    device = cuda_device(options)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return Backend(
        name="cuda",
        options=options,
        capabilities=capabilities_for(device),
        device=CudaDevice(options, device, env),
        kv_cache=CudaKVCache(options, env),
        attention=CudaAttention(options, env),
        gemm=CudaGemm(options, env),
        moe=CudaMoe(options, env),
        collectives=CudaCollectives(options, device),
        small=CudaSmall(options, env),
    )
