"""Reference KV-cache layout (the contract's default, see PagedKVCache).

Layout: one tensor per layer, (NB, BS, D); slot s lives at [s // BS, s % BS].
"""

from __future__ import annotations

import torch

from deepinfer.backend.types import KVCacheSpec, PagedKVCache


def allocate_kv_cache(spec: KVCacheSpec, num_layers: int, device: torch.device) -> list[PagedKVCache]:
    shape = (spec.num_blocks, spec.block_size, spec.head_dim)
    return [
        PagedKVCache(spec, (torch.zeros(shape, dtype=spec.dtype, device=device),)) for _ in range(num_layers)
    ]


def _flat(cache: PagedKVCache) -> torch.Tensor:
    """(NB * BS, D) view of the reference layout."""
    return cache.tensors[0].view(-1, cache.spec.head_dim)


def write_kv(cache: PagedKVCache, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    flat = _flat(cache)
    valid = slot_mapping >= 0
    flat[slot_mapping[valid]] = kv[valid].to(flat.dtype)


def read_kv(cache: PagedKVCache, slots: torch.Tensor) -> torch.Tensor:
    return _flat(cache)[slots]


def copy_blocks(cache: PagedKVCache, src: torch.Tensor, dst: torch.Tensor) -> None:
    for t in cache.tensors:
        t[dst] = t[src]


def gather_request_kv(cache: PagedKVCache, block_table: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The first kv_len cached K rows of one request, (kv_len, D), in the cache dtype."""
    bs = cache.spec.block_size
    num_blocks = (kv_len + bs - 1) // bs
    blocks = block_table[:num_blocks].long()
    return cache.tensors[0][blocks].reshape(-1, cache.spec.head_dim)[:kv_len]
