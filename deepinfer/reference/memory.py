"""Reference KV-cache layout (the contract's default, see PagedKVCache).

Layout: one tensor per layer, (NB, BS, D); slot s lives at [s // BS, s % BS]. FP8 latent caches
(spec.kv_format "fp8"): (NB, BS, bytes_per_token) uint8, each row deepinfer.backend.kv_formats_mla's;
written quantised, read dequantised to float32.
"""

from __future__ import annotations

import torch

from deepinfer.backend.kv_formats_mla import dequantize_mla_rows, quantize_mla_rows
from deepinfer.backend.types import KVCacheSpec, PagedKVCache


def allocate_kv_cache(spec: KVCacheSpec, num_layers: int, device: torch.device) -> list[PagedKVCache]:
    if spec.is_fp8:
        shape, dtype = (spec.num_blocks, spec.block_size, spec.bytes_per_token), torch.uint8
    else:
        shape, dtype = (spec.num_blocks, spec.block_size, spec.head_dim), spec.dtype
    return [PagedKVCache(spec, (torch.zeros(shape, dtype=dtype, device=device),)) for _ in range(num_layers)]


def _flat(cache: PagedKVCache) -> torch.Tensor:
    """(NB * BS, D) view of the reference layout ((NB * BS, bytes_per_token) for FP8 rows)."""
    return cache.tensors[0].view(-1, cache.tensors[0].shape[-1])


def _dequantize(cache: PagedKVCache, rows: torch.Tensor) -> torch.Tensor:
    """Stored rows -> K rows: FP8 rows dequantised to float32, others as stored."""
    spec = cache.spec
    return dequantize_mla_rows(rows, spec.latent_dim, spec.rope_dim) if spec.is_fp8 else rows


def write_kv(cache: PagedKVCache, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    flat = _flat(cache)
    valid = slot_mapping >= 0
    rows = kv[valid]
    flat[slot_mapping[valid]] = (
        quantize_mla_rows(rows, cache.spec.latent_dim) if cache.spec.is_fp8 else rows.to(flat.dtype)
    )


def read_kv(cache: PagedKVCache, slots: torch.Tensor) -> torch.Tensor:
    return _dequantize(cache, _flat(cache)[slots])


def copy_blocks(cache: PagedKVCache, src: torch.Tensor, dst: torch.Tensor) -> None:
    for t in cache.tensors:
        t[dst] = t[src]


def gather_request_kv(cache: PagedKVCache, block_table: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The first kv_len cached K rows of one request, (kv_len, D), in the cache dtype (FP8 rows:
    dequantised to float32)."""
    bs = cache.spec.block_size
    num_blocks = (kv_len + bs - 1) // bs
    blocks = block_table[:num_blocks].long()
    t = cache.tensors[0]
    return _dequantize(cache, t[blocks].reshape(-1, t.shape[-1])[:kv_len])
