"""Reference paged latent attention: one request at a time, float32 softmax.

Semantics are documented on deepinfer.backend.ops.AttentionOps and, for the modifiers and their
edge rules, on deepinfer.backend.types.AttentionModifiers.
"""

from __future__ import annotations

import itertools

import torch

from deepinfer.backend.types import NO_MODIFIERS, AttentionMetadata, AttentionModifiers, PagedKVCache
from deepinfer.reference.memory import gather_request_kv


def visible_mask(
    positions: torch.Tensor,
    kv_len: int,
    window: int | None,
    topk_indices: torch.Tensor | None,
) -> torch.Tensor:
    """(n, kv_len) bool: query at positions[i] may see key j (causal, window, top-k). Top-k ids
    are a set: repeats count once, ids < 0 or >= kv_len are ignored."""
    j = torch.arange(kv_len, device=positions.device)
    mask = j[None, :] <= positions[:, None]
    if window is not None:
        mask &= (positions[:, None] - j[None, :]) < window
    if topk_indices is not None:
        allowed = torch.zeros_like(mask)
        idx = topk_indices.long()
        valid = (idx >= 0) & (idx < kv_len)
        rows = torch.arange(idx.shape[0], device=idx.device)[:, None].expand_as(idx)
        allowed[rows[valid], idx[valid]] = True
        mask &= allowed
    return mask


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    v_dim: int,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """q (n, H, D), k (L, D), mask (n, L) -> (n, H, v_dim) float32 (V = k[:, :v_dim])."""
    qf, kf = q.float(), k.float()
    scores = torch.einsum("nhd,ld->nhl", qf, kf) * scale
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    if sinks is not None:
        sink = sinks.float()[None, :, None].expand(scores.shape[0], -1, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs)  # a row that sees no key outputs zeros (the edge rule)
    return torch.einsum("nhl,lv->nhv", probs, kf[:, :v_dim])


def paged_attention(
    q: torch.Tensor,
    cache: PagedKVCache,
    meta: AttentionMetadata,
    scale: float,
    v_dim: int,
    modifiers: AttentionModifiers = NO_MODIFIERS,
) -> torch.Tensor:
    """Ragged causal attention over the paged cache. q (T, H, D) -> (T, H, v_dim) in q's dtype."""
    window, sinks, topk_indices = modifiers.window, modifiers.sinks, modifiers.topk_indices
    out = torch.empty((q.shape[0], q.shape[1], v_dim), dtype=q.dtype, device=q.device)
    start = 0
    # Lengths from the device tensors: the host copies may be upper bounds (graph replays).
    seq_lens = meta.seq_lens.tolist()
    query_lens = meta.query_start_loc.diff().tolist()
    for b, (kv_len, n) in enumerate(zip(seq_lens, query_lens)):
        if n == 0:
            continue
        if n > kv_len:
            raise ValueError(f"request {b}: query length {n} exceeds its KV length {kv_len}")
        k = gather_request_kv(cache, meta.block_tables[b], kv_len)
        positions = torch.arange(kv_len - n, kv_len, device=q.device)
        rows = slice(start, start + n)
        topk = topk_indices[rows] if topk_indices is not None else None
        mask = visible_mask(positions, kv_len, window, topk)
        out[rows] = attend(q[rows], k, mask, scale, v_dim, sinks).to(q.dtype)
        start += n
    return out


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Bidirectional attention inside each segment [cu_seqlens[s], cu_seqlens[s+1]) (a vision
    tower's images): q, k (T, H, D), v (T, H, Dv) -> (T, H, Dv) in q's dtype, float32 softmax,
    one segment at a time; a row never sees another segment's keys."""
    out = torch.zeros((*q.shape[:2], v.shape[-1]), dtype=q.dtype, device=q.device)
    bounds = cu_seqlens.tolist()
    for a, b in itertools.pairwise(bounds):
        if b <= a:
            continue
        scores = torch.einsum("qhd,khd->hqk", q[a:b].float(), k[a:b].float()) * scale
        probs = torch.softmax(scores, dim=-1)
        out[a:b] = torch.einsum("hqk,khd->qhd", probs, v[a:b].float()).to(q.dtype)
    return out
