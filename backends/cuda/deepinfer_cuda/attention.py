"""The attention part: paged MLA attention, MLA's query (with the cache write), DeepSeek-V4's
compressed attention and lightning indexer, the vision tower's varlen attention, on the Triton kernels
of deepinfer_cuda.kernels."""

from __future__ import annotations

import torch

from deepinfer import envs
from deepinfer.backend.kv_formats_mla import fp8_tile
from deepinfer.backend.kv_formats_v41 import RowFormat
from deepinfer.backend.ops import AttentionOps
from deepinfer.backend.types import (
    NO_MODIFIERS,
    AttentionMetadata,
    AttentionModifiers,
    BackendOptions,
    KVCacheSpec,
    PagedKVCache,
)
from deepinfer_cuda import vendor
from deepinfer_cuda.kernels import attention as attn_k
from deepinfer_cuda.kernels import gemm as gemm_k
from deepinfer_cuda.kernels import mla as mla_k
from deepinfer_cuda.kernels import small as small_k
from deepinfer_cuda.kernels import v4 as v4_k
from deepinfer_cuda.kernels import vision as vision_k
from deepinfer_cuda.kv_cache import cache_tensor


def fp8_tile_of(spec: KVCacheSpec) -> int:
    """The FP8 latent rows' tile of a cache spec (0: rows in spec.dtype)."""
    return fp8_tile(spec.latent_dim) if spec.is_fp8 else 0


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
        self.fp8_half_read = env.cuda_fp8_half_read  # FP8 latent rows read in float16 (kernels/kv_fp8.py)
        self.small_grid = env.cuda_v4_small_grid  # V4's compressed attention (kernels/v4.py)

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
        kv = cache_tensor(cache, fp8=True)
        if self.vendor and not self.batch_invariant and modifiers.is_plain and not cache.spec.is_fp8:
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
            and not (self.vendor and vendor.flash_mla_available() and not cache.spec.is_fp8)
        )
        if not fits:
            return super().mla_decode_and_uv(
                q, cache, meta, w_uv, scale=scale, v_dim=v_dim, modifiers=modifiers
            )
        o = attn_k.mla_attention_partials(  # the model's decode step: its metadata and older rows
            q, cache_tensor(cache, fp8=True), meta, scale=scale, v_dim=v_dim,
            latent_dim=cache.spec.latent_dim, early_cache=self.early_inputs, pdl=self.pdl,
            fp8_tile=fp8_tile_of(cache.spec), fp8_half_read=self.fp8_half_read,
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
            q, cache_tensor(cache, fp8=True), meta, scale=scale, v_dim=v_dim,
            latent_dim=cache.spec.latent_dim, window=modifiers.window,
            sinks=None if sinks is None else sinks.float().contiguous(),
            topk_indices=modifiers.topk_indices, batch_invariant=self.batch_invariant,
            split_size=attn_k.invariant_split(self.options.max_model_len) if self.batch_invariant else None,
            pdl=self.pdl, fp8_tile=fp8_tile_of(cache.spec), fp8_half_read=self.fp8_half_read,
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
        if cache.spec.is_fp8:  # the quantising store, then the query (two launches)
            return super().mla_query_and_cache(
                q_nope, q_pe, w_uk, kv, cache, kv_norm_weight, eps, positions, cos_sin_cache, interleaved,
                slot_mapping,
            )  # fmt: skip
        t = cache_tensor(cache)
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
            q, cache_tensor(cache), cache_tensor(compressed), meta, scale=scale, ratio=ratio,
            window=modifiers.window, sinks=None if sinks is None else sinks.float().contiguous(),
            topk_indices=modifiers.topk_indices, compressed_block_tables=compressed_block_tables,
            batch_invariant=self.batch_invariant, pdl=self.pdl, small_grid=self.small_grid,
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
            q, weights.float(), cache_tensor(keys), meta, ratio=ratio, topk=topk, scale=scale
        )

    def quantized_attention(
        self,
        q: torch.Tensor,
        window: PagedKVCache,
        entries: PagedKVCache | None,
        meta: AttentionMetadata,
        *,
        scale: float,
        ratio: int,
        window_format: RowFormat | None,
        entry_format: RowFormat | None,
        modifiers: AttentionModifiers = NO_MODIFIERS,
        compressed_block_tables: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """V4's compressed-attention kernel reading the quantised rows (dequantised per tile in
        registers); the window alone: an empty top-k list."""
        if not self.fused:
            return super().quantized_attention(
                q, window, entries, meta, scale=scale, ratio=ratio, window_format=window_format,
                entry_format=entry_format, modifiers=modifiers,
                compressed_block_tables=compressed_block_tables,
            )  # fmt: skip
        topk, sinks = modifiers.topk_indices, modifiers.sinks
        if entries is None:  # no entry listed: the window's rows alone
            entries, entry_format, compressed_block_tables = window, window_format, None
            topk = torch.empty((q.shape[0], 0), dtype=torch.int32, device=q.device)
        return v4_k.compressed_attention(
            q, cache_tensor(window), cache_tensor(entries), meta, scale=scale, ratio=ratio,
            window=modifiers.window, sinks=None if sinks is None else sinks.float().contiguous(),
            topk_indices=topk, compressed_block_tables=compressed_block_tables,
            batch_invariant=self.batch_invariant, pdl=self.pdl, kv_format=window_format,
            ckv_format=entry_format, small_grid=self.small_grid,
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
        key_format: RowFormat | None,
    ) -> torch.Tensor:
        """V4's indexer kernels, the scores over the keys dequantised per tile in registers (MXFP4
        keys: the queries rounded to MXFP4 in registers too)."""
        if not self.fused:
            return super().quantized_indexer_topk(
                q, weights, keys, meta, ratio=ratio, topk=topk, scale=scale, key_format=key_format
            )
        return v4_k.indexer_topk(
            q, weights.float(), cache_tensor(keys), meta, ratio=ratio, topk=topk, scale=scale,
            key_format=key_format,
        )  # fmt: skip

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
        """kernels/vision.py (no split over keys: a row's bits depend on its own segment only,
        batch-invariant as it is); unfused: the contract's default."""
        if not self.fused:
            return super().varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale=scale)
        return vision_k.varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale)

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
        key_format: RowFormat | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """V4's indexer scores (quantised keys dequantised per tile in registers; MXFP4 keys: the
        queries rounded to MXFP4 there too), then their block maxima and the blocks' top."""
        if not self.fused:
            return super().indexer_candidate_blocks(
                q, weights, keys, meta, ratio=ratio, topk=topk, scale=scale, block_size=block_size,
                topk_blocks=topk_blocks, key_format=key_format,
            )  # fmt: skip
        return v4_k.indexer_candidate_blocks(
            q, weights.float(), cache_tensor(keys), meta, ratio=ratio, topk=topk, scale=scale,
            block_size=block_size, topk_blocks=topk_blocks, key_format=key_format,
        )  # fmt: skip

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
        key_format: RowFormat | None = None,
    ) -> torch.Tensor:
        """The scores of the listed blocks' entries alone (quantised keys dequantised per tile in
        registers; MXFP4 keys: the queries rounded to MXFP4 there too), then their top."""
        if not self.fused:
            return super().indexer_topk_in_blocks(
                q, weights, keys, meta, blocks, ratio=ratio, topk=topk, scale=scale, block_size=block_size,
                key_format=key_format,
            )  # fmt: skip
        return v4_k.indexer_topk_in_blocks(
            q, weights.float(), cache_tensor(keys), meta, blocks, ratio=ratio, topk=topk, scale=scale,
            block_size=block_size, key_format=key_format,
        )  # fmt: skip
