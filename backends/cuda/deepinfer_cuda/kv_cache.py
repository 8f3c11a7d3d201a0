"""The KV-cache part: the contract's (NB, BS, D) layout per layer, written by Triton kernels;
cache_tensor checks that layout for the other parts. FP8 latent caches (spec.kv_format "fp8"):
the reference layout of its rows, (NB, BS, bytes_per_token) uint8, quantised by
kernels/kv_fp8.py at write time. DeepSeek-V4.1's row formats (write_kv_rows): quantised and stored
in one launch by kernels/kv_v41.py."""

from __future__ import annotations

import torch

from deepinfer import envs
from deepinfer.backend.kv_formats_v41 import RowFormat
from deepinfer.backend.ops import KVCacheOps
from deepinfer.backend.types import AttentionMetadata, BackendOptions, PagedKVCache
from deepinfer.reference import v4 as ref_v4
from deepinfer_cuda.kernels import kv_fp8, kv_v41
from deepinfer_cuda.kernels import small as small_k
from deepinfer_cuda.kernels import v4 as v4_k


class CudaKVCache(KVCacheOps):
    """The contract's default layout, (NB, BS, D) per layer, written by Triton kernels."""

    def __init__(self, options: BackendOptions, env: envs.Env = envs.DEFAULTS) -> None:
        super().__init__(options)
        self.fused = not env.cuda_unfused
        self.pdl = env.cuda_pdl
        self.v4_step = self.fused and env.cuda_v4_step  # compressed_entries' kernel

    def write_kv(self, cache: PagedKVCache, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Triton row store (no host sync, graph-safe); slot -1 skips the row. FP8 latent caches:
        the quantising store (kernels/kv_fp8.py)."""
        spec = cache.spec
        if spec.is_fp8:
            kv_fp8.write_fp8_rows(
                cache_tensor(cache, fp8=True), kv, slot_mapping, spec.latent_dim, spec.rope_dim
            )
        else:
            small_k.write_kv(cache_tensor(cache), kv, slot_mapping)

    def write_kv_rows(
        self, cache: PagedKVCache, rows: torch.Tensor, slot_mapping: torch.Tensor, fmt: RowFormat | None
    ) -> None:
        """V4.1's rows: the fused quantise + store of `fmt` (kernels/kv_v41.py, one launch, bit for
        bit the reference quantiser); None, or unfused: the contract's default (the torch
        quantiser, then write_kv's row store)."""
        if fmt is None or not self.fused:
            super().write_kv_rows(cache, rows, slot_mapping, fmt)
        else:
            kv_v41.write_kv_rows(cache_tensor(cache), rows, slot_mapping, fmt)

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
        round like torch, or an FP8 latent cache: the contract's composition (this backend's
        rms_norm, rope, write_kv)."""
        if cache.spec.is_fp8:
            super().write_mla_kv(
                cache, kv, norm_weight, eps, positions, cos_sin_cache, interleaved, slot_mapping
            )
            return
        t = cache_tensor(cache)
        args = (norm_weight, eps, positions, cos_sin_cache, interleaved, slot_mapping)
        if self.fused and kv.dtype in small_k.CAST_DTYPES and t.dtype in small_k.CAST_DTYPES:
            small_k.write_mla_kv(t, kv, cache.spec.latent_dim, *args, pdl=self.pdl)
        else:
            super().write_mla_kv(cache, kv, *args)

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
        """One launch (kernels/v4.py) where every request computes the same number of tokens
        (decode, verification and graph steps); ragged steps, unfused or DEEPINFER_CUDA_V4_STEP=0:
        the contract's."""
        lens = set(meta.query_lens_host)
        if not self.v4_step or len(lens) != 1:
            return super().compressed_entries(
                meta, slot_mapping, entry_tables, key_tables, ratio=ratio, overlap=overlap,
                block_size=block_size,
            )  # fmt: skip
        return v4_k.compressed_entries(
            meta.seq_lens, slot_mapping, meta.block_tables, entry_tables, key_tables, lens.pop(), ratio,
            overlap, block_size,
        )  # fmt: skip


def cache_tensor(cache: PagedKVCache, fp8: bool = False) -> torch.Tensor:
    """The (NB, BS, D) tensor of the reference layout, which this backend keeps; with fp8, the
    (NB, BS, bytes_per_token) uint8 tensor of an FP8 latent cache (an op that does not read FP8
    rows passes fp8=False and refuses one)."""
    t = cache.tensors[0]
    spec = cache.spec
    if spec.is_fp8 and not fp8:
        raise ValueError("this CUDA op does not read FP8 latent caches (kv_format 'fp8'): MLA attention only")
    width = spec.bytes_per_token if spec.is_fp8 else spec.head_dim
    if len(cache.tensors) != 1 or tuple(t.shape) != (spec.num_blocks, spec.block_size, width):
        raise ValueError("the CUDA backend expects the (num_blocks, block_size, head_dim) cache layout")
    if not t.is_contiguous():
        raise ValueError("the KV cache tensor must be contiguous")
    return t
