"""The Ascend paged KV-cache layout: the latent and the rope part in separate caches.

As vllm-ascend lays out MLA caches: latent cache (NB, BS, 1, latent_dim) and, when rope_dim > 0,
rope cache (NB, BS, 1, rope_dim). Viewed as (NB, 1, BS, d) they are the (blocknum, KV_N,
blocksize, D) paged layout npu_fused_infer_attention_score(_v2) reads (key = value = latent,
key_rope = rope). The block index comes first, so the contract's default copy_blocks applies.
"""

from __future__ import annotations

from typing import Any

import torch

from deepinfer.backend.types import KVCacheSpec, PagedKVCache


def allocate(spec: KVCacheSpec, num_layers: int, device: torch.device) -> list[PagedKVCache]:
    """One zero-filled (latent[, rope]) pair per layer."""
    if spec.latent_dim <= 0 or spec.rope_dim < 0 or spec.block_size <= 0 or spec.num_blocks <= 0:
        raise ValueError(f"invalid KV-cache spec {spec}")
    caches = []
    for _ in range(num_layers):
        shape = (spec.num_blocks, spec.block_size, 1)
        parts = [torch.zeros((*shape, spec.latent_dim), dtype=spec.dtype, device=device)]
        if spec.rope_dim:
            parts.append(torch.zeros((*shape, spec.rope_dim), dtype=spec.dtype, device=device))
        caches.append(PagedKVCache(spec, tuple(parts)))
    return caches


def parts(cache: PagedKVCache) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(latent (NB, BS, 1, Dl), rope (NB, BS, 1, Dr) or None)."""
    if len(cache.tensors) not in (1, 2) or cache.tensors[0].dim() != 4:
        raise TypeError(
            "this KV cache was not allocated by the ascend backend (expected its latent/rope layout)"
        )
    return cache.tensors[0], (cache.tensors[1] if len(cache.tensors) == 2 else None)


def write(tnpu: Any, cache: PagedKVCache, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter K rows (T, D) to their slots with npu_scatter_nd_update_ (rows with slot -1 skipped).
    No host sync, so a captured graph may contain it."""
    spec = cache.spec
    if kv.dim() != 2 or kv.shape[1] != spec.head_dim or slot_mapping.shape != (kv.shape[0],):
        raise ValueError(
            f"write_kv: kv must be (T, {spec.head_dim}) and slot_mapping (T,); "
            f"got {tuple(kv.shape)} and {tuple(slot_mapping.shape)}"
        )
    if kv.shape[0] == 0:
        return
    # npu_scatter_nd_update_ has no "skip" index, and dropping the -1 rows (nonzero) would sync
    # the host and break graph capture. Instead each padding row repeats the first valid row
    # (same slot, same data: the duplicate write is harmless); if no row is valid, slot 0 is
    # rewritten with its own content.
    t = kv.shape[0]
    valid = slot_mapping >= 0
    first = torch.argmax(valid.to(torch.int32))  # first valid row, 0 when there is none
    src = torch.where(valid, torch.arange(t, device=kv.device), first)
    slots = slot_mapping.index_select(0, src)
    none_valid = (slots < 0).unsqueeze(1)  # all True or all False
    idx = slots.clamp(min=0).view(-1, 1)  # (T, 1): slot = block * BS + offset
    rows = kv.index_select(0, src).to(spec.dtype)
    latent, rope = parts(cache)
    for part, cols in ((latent, rows[:, : spec.latent_dim]), (rope, rows[:, spec.latent_dim :])):
        if part is None:
            continue
        flat = part.view(-1, part.shape[-1])
        tnpu.npu_scatter_nd_update_(flat, idx, torch.where(none_valid, flat[:1], cols).contiguous())


def gather_rows(cache: PagedKVCache, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(latent (*slots.shape, Dl), rope (*slots.shape, Dr) or None) rows at `slots`."""
    spec = cache.spec
    latent, rope = parts(cache)
    flat = slots.reshape(-1)
    lat = latent.view(-1, spec.latent_dim).index_select(0, flat).view(*slots.shape, spec.latent_dim)
    if rope is None:
        return lat, None
    rp = rope.view(-1, spec.rope_dim).index_select(0, flat).view(*slots.shape, spec.rope_dim)
    return lat, rp


def read(cache: PagedKVCache, slots: torch.Tensor) -> torch.Tensor:
    """(n, D) rows at `slots` (n,), latent then rope."""
    lat, rp = gather_rows(cache, slots.long())
    return lat if rp is None else torch.cat([lat, rp], dim=-1)
