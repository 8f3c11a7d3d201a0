"""Reference definitions of DeepSeek-V4's ops: manifold-constrained hyper-connections (mHC), the
clamped SwiGLU, the compressor's gated pooling, the entries closing in a step and their slots, the
lightning indexer's top-k and attention over a sliding window plus compressed entries. Semantics
on deepinfer.backend.ops (SmallOps.hc_pre, hc_post, hc_head, clamped_silu_and_mul, gated_pool;
KVCacheOps.compressed_entries; AttentionOps.indexer_topk, indexer_candidate_blocks,
indexer_topk_in_blocks (DeepSeek-V4.1's two-stage selection), compressed_attention). Plain
float32 PyTorch, one request at a time where lengths differ.

Symbols: T tokens, N hc_mult streams, Dm hidden, H heads, D head width, S slots of a window,
Hi / Di indexer heads / head width, C compressed entries of a request, Kt top-k.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from deepinfer.backend.types import NO_MODIFIERS, AttentionMetadata, AttentionModifiers, PagedKVCache
from deepinfer.reference import gemm
from deepinfer.reference.attention import attend, visible_mask
from deepinfer.reference.memory import read_kv

RowReader = Callable[[PagedKVCache, torch.Tensor], torch.Tensor]  # (cache, slots (n,)) -> (n, D)


def _unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def hc_mixes(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    batch_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams (T, N, Dm) -> (pre (T, N), post (T, N), comb (T, N, N)), float32."""
    t, n, _ = streams.shape
    flat = _unweighted_rms(streams.flatten(1).float(), norm_eps)
    mix = gemm.mm(flat, fn.float().T, batch_invariant)  # (T, (2+N)N)
    pre_w, post_w, comb_w = mix[:, :n], mix[:, n : 2 * n], mix[:, 2 * n :]
    b = base.float()
    s = scale.float()
    pre = torch.sigmoid(pre_w * s[0] + b[:n]) + hc_eps
    post = 2 * torch.sigmoid(post_w * s[1] + b[n : 2 * n])
    comb = torch.softmax(comb_w.view(t, n, n) * s[2] + b[2 * n :].view(n, n), dim=-1) + hc_eps
    # Sinkhorn-Knopp towards a doubly-stochastic matrix: columns first, then rows and columns.
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_n pre[:, n] * streams[:, n]: (T, N, Dm), (T, N) -> (T, Dm) in streams' dtype, float32
    sums in stream order."""
    return (pre.float()[..., None] * streams.float()).sum(dim=1).to(streams.dtype)


def hc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    batch_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams (T, N, Dm) -> (collapsed (T, Dm) in streams' dtype, post (T, N), comb (T, N, N))."""
    pre, post, comb = hc_mixes(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, batch_invariant)
    return hc_collapse(streams, pre), post, comb


def hc_post(y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out[t, k] = post[t, k] * y[t] + sum_j comb[t, j, k] * streams[t, j] -> (T, N, Dm).
    Elementwise, one stream j at a time: each row's bits are independent of the batch."""
    out = post.float()[..., None] * y.float()[:, None, :]
    for j in range(streams.shape[1]):
        out = out + comb[:, j, :, None].float() * streams[:, j, None, :].float()
    return out.to(streams.dtype)


def hc_head(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """The final collapse of the N streams: (T, N, Dm) -> (T, Dm)."""
    flat = _unweighted_rms(streams.flatten(1).float(), norm_eps)
    mix = gemm.mm(flat, fn.float().T, batch_invariant)  # (T, N)
    pre = torch.sigmoid(mix * scale.float()[0] + base.float()) + hc_eps
    return (pre[..., None] * streams.float()).sum(dim=1).to(streams.dtype)


def clamped_silu_and_mul(x: torch.Tensor, limit: float) -> torch.Tensor:
    """[gate | up] (M, 2I) -> silu(min(gate, limit)) * clamp(up, -limit, limit), (M, I)."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)).to(x.dtype)


def gated_pool(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """kv (W, S, D), gate (W, S, D) float logits (-inf: slot absent) -> (W, D) in kv's dtype:
    sum over S of softmax_S(gate) * kv, per channel. A window whose slots are all absent is 0."""
    probs = torch.nan_to_num(torch.softmax(gate.float(), dim=1))
    return (probs * kv.float()).sum(dim=1).to(kv.dtype)


EntrySlots = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def compressed_entries(
    meta: AttentionMetadata,
    slot_mapping: torch.Tensor,
    entry_tables: torch.Tensor,
    key_tables: torch.Tensor | None,
    ratio: int,
    overlap: bool,
    block_size: int,
) -> EntrySlots | None:
    """KVCacheOps.compressed_entries: every request computing the same number q of tokens (as a
    replayed graph does) found from the device lengths and slots, ceil(q / m) candidates per
    request; ragged steps listed from the host lengths."""
    device = slot_mapping.device
    query_lens = set(meta.query_lens_host)
    if not query_lens:
        return None
    last: torch.Tensor | None = None
    if len(query_lens) == 1:
        q = query_lens.pop()
        k = -(-q // ratio)  # the most entries q consecutive positions close
        ends = meta.seq_lens.long()[:, None]  # (B, 1)
        w = (ends - q) // ratio + torch.arange(k, device=device)  # (B, k) candidates
        # the row of each candidate's closing position (w+1)m - 1 among the request's q
        row = torch.arange(ends.shape[0], device=device)[:, None] * q + (w + 1) * ratio - 1 - (ends - q)
        written = slot_mapping[row.clamp(0, slot_mapping.shape[0] - 1)] >= 0
        closes = ((w < ends // ratio) & written).flatten()
        # a candidate that does not close reads rows it owns (closed entry w, positions up to
        # its last): every index stays inside its tables, whatever it reads is discarded
        w = torch.minimum(w, (ends // ratio - 1).clamp(min=0)).flatten()
        last = (ends - 1).expand(-1, k).flatten()
        req = torch.arange(ends.shape[0] * k, device=device) // k  # (B * k,) b, b, ...
    else:
        reqs: list[int] = []
        ids: list[int] = []
        rows: list[int] = []  # the step row of each entry's closing position
        start = 0
        for b, (end, n) in enumerate(zip(meta.seq_lens_host, meta.query_lens_host)):
            for entry in range((end - n) // ratio, end // ratio):
                reqs.append(b)
                ids.append(entry)
                rows.append(start + (entry + 1) * ratio - 1 - (end - n))
            start += n
        if not ids:
            return None
        req = torch.tensor(reqs, dtype=torch.int64, device=device)
        w = torch.tensor(ids, dtype=torch.int64, device=device)
        closes = slot_mapping[torch.tensor(rows, dtype=torch.int64, device=device)] >= 0
    first = (w - 1) * ratio if overlap else w * ratio  # CSA: the previous window, then this one
    span = 2 * ratio if overlap else ratio
    pos = first[:, None] + torch.arange(span, device=device)  # (W, S)
    present = pos >= 0
    pos = pos.clamp(min=0)
    if last is not None:
        pos = torch.minimum(pos, last[:, None])
    tables = meta.block_tables.long()
    # columns clamped: a graph step's padding rows may end a column past the table (their
    # reads are discarded); real rows are always inside it
    col = (pos // block_size).clamp(max=tables.shape[1] - 1)
    state_slots = tables[req[:, None], col] * block_size + pos % block_size

    def row_slots(tables: torch.Tensor) -> torch.Tensor:  # (W,) row w of each request's table
        col = (w // block_size).clamp(max=tables.shape[1] - 1)
        slots = tables.long()[req, col] * block_size + w % block_size
        return torch.where(closes, slots, -1)

    out_slots = row_slots(entry_tables)
    key_slots = out_slots if key_tables is None else row_slots(key_tables)
    return state_slots, present, out_slots, w * ratio, key_slots


def _request_rows(
    cache: PagedKVCache, block_table: torch.Tensor, n: int, read_rows: RowReader, first: int = 0
) -> torch.Tensor:
    """The rows of positions first..n-1 of one request, (n - first, D), read through `read_rows`
    (so any backend's cache layout works)."""
    bs = cache.spec.block_size
    pos = torch.arange(first, n, device=block_table.device)
    return read_rows(cache, block_table.long()[pos // bs] * bs + pos % bs)


def _compressed_visible(positions: torch.Tensor, num_entries: int, ratio: int) -> torch.Tensor:
    """(n, C) bool: entry w pools tokens [w*ratio, (w+1)*ratio), all at or before the query."""
    w = torch.arange(num_entries, device=positions.device)
    return w[None, :] < ((positions + 1) // ratio)[:, None]


def _indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: PagedKVCache,
    meta: AttentionMetadata,
    ratio: int,
    scale: float,
    read_rows: RowReader,
) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
    """Per request with query rows and entries: (its rows of q, scores (n, C) float32 with -inf
    where an entry is not visible, visible entries per row (n,))."""
    start = 0
    for b, (kv_len, n) in enumerate(zip(meta.seq_lens.tolist(), meta.query_start_loc.diff().tolist())):
        rows = slice(start, start + n)
        start += n
        num_entries = kv_len // ratio
        if n == 0 or num_entries == 0:
            continue
        k = _request_rows(keys, meta.block_tables[b], num_entries, read_rows)[
            :, : q.shape[-1]
        ].float()  # (C, Di)
        logits = torch.einsum("nhd,cd->nhc", q[rows].float(), k)
        scores = (torch.relu(logits) * scale * weights[rows].float()[..., None]).sum(dim=1)  # (n, C)
        positions = torch.arange(kv_len - n, kv_len, device=q.device)
        visible = _compressed_visible(positions, num_entries, ratio)
        yield rows, scores.masked_fill(~visible, float("-inf")), (positions + 1) // ratio


def _best(scores: torch.Tensor, k: int) -> torch.Tensor:
    """(n, C) scores, -inf for none -> (n, k) int32 ids of the k best (-1 past the finite ones);
    ties (entries no head scores above zero, often) go to the lower id: a row's picks then
    depend on its own scores alone, not on how many entries the step holds."""
    top = scores.sort(dim=-1, descending=True, stable=True)
    k_eff = min(k, scores.shape[1])
    values, indices = top.values[:, :k_eff], top.indices[:, :k_eff]
    ids = torch.where(values > float("-inf"), indices, -1).to(torch.int32)
    return torch.nn.functional.pad(ids, (0, k - k_eff), value=-1)


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: PagedKVCache,
    meta: AttentionMetadata,
    ratio: int,
    topk: int,
    scale: float,
    read_rows: RowReader = read_kv,
) -> torch.Tensor:
    """q (T, Hi, Di), weights (T, Hi) -> (T, topk) int32 compressed-entry ids, -1 where unused."""
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int32, device=q.device)
    for rows, scores, _ in _indexer_scores(q, weights, keys, meta, ratio, scale, read_rows):
        out[rows] = _best(scores, topk)
    return out


def indexer_candidate_blocks(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: PagedKVCache,
    meta: AttentionMetadata,
    ratio: int,
    topk: int,
    scale: float,
    block_size: int,
    topk_blocks: int,
    read_rows: RowReader = read_kv,
) -> tuple[torch.Tensor, torch.Tensor]:
    """indexer_topk's ids (T, topk) and the candidate blocks (T, topk_blocks) int32: blocks of
    block_size entries ranked by their best visible entry's score, the block of the newest
    visible entry first (scored +inf), ties to the lower block id, -1 unused."""
    t = q.shape[0]
    ids = torch.full((t, topk), -1, dtype=torch.int32, device=q.device)
    blocks = torch.full((t, topk_blocks), -1, dtype=torch.int32, device=q.device)
    for rows, scores, visible in _indexer_scores(q, weights, keys, meta, ratio, scale, read_rows):
        ids[rows] = _best(scores, topk)
        n, c = scores.shape
        nb = -(-c // block_size)
        padded = torch.nn.functional.pad(scores, (0, nb * block_size - c), value=float("-inf"))
        best = padded.view(n, nb, block_size).amax(dim=-1)  # (n, NB)
        last = (visible - 1).div(block_size, rounding_mode="floor")  # the newest entry's block
        at = torch.nonzero(visible > 0).squeeze(-1)
        best[at, last[at]] = float("inf")
        blocks[rows] = _best(best, topk_blocks)
    return ids, blocks


def indexer_topk_in_blocks(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: PagedKVCache,
    meta: AttentionMetadata,
    blocks: torch.Tensor,
    ratio: int,
    topk: int,
    scale: float,
    block_size: int,
    read_rows: RowReader = read_kv,
) -> torch.Tensor:
    """indexer_topk over the visible entries of each row's listed blocks (T, Kb) only."""
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int32, device=q.device)
    for rows, scores, _ in _indexer_scores(q, weights, keys, meta, ratio, scale, read_rows):
        n, c = scores.shape
        nb = -(-c // block_size)
        listed = blocks[rows].long()
        listed = torch.where((listed >= 0) & (listed < nb), listed, nb)  # the rest to a spare column
        inside = torch.zeros((n, nb + 1), dtype=torch.bool, device=q.device).scatter_(1, listed, True)
        inside = inside[:, :nb].repeat_interleave(block_size, dim=1)[:, :c]
        out[rows] = _best(scores.masked_fill(~inside, float("-inf")), topk)
    return out


def compressed_attention(
    q: torch.Tensor,
    cache: PagedKVCache,
    compressed: PagedKVCache,
    meta: AttentionMetadata,
    scale: float,
    ratio: int,
    modifiers: AttentionModifiers = NO_MODIFIERS,
    read_rows: RowReader = read_kv,
    compressed_block_tables: torch.Tensor | None = None,
    read_compressed: RowReader | None = None,
) -> torch.Tensor:
    """q (T, H, D) -> (T, H, D): one softmax over the token rows of `cache` the window lets through
    and the compressed entries of `compressed` (all visible ones, or the top-k ids among them),
    with the sinks in the denominator. K = V (the whole row). `compressed` is paged by
    compressed_block_tables (default meta.block_tables) and read through read_compressed
    (default read_rows)."""
    d = q.shape[-1]
    read_entries = read_rows if read_compressed is None else read_compressed
    entry_tables = meta.block_tables if compressed_block_tables is None else compressed_block_tables
    out = torch.empty_like(q)
    start = 0
    for b, (kv_len, n) in enumerate(zip(meta.seq_lens.tolist(), meta.query_start_loc.diff().tolist())):
        if n == 0:
            continue
        if n > kv_len:
            raise ValueError(f"request {b}: query length {n} exceeds its KV length {kv_len}")
        rows = slice(start, start + n)
        start += n
        positions = torch.arange(kv_len - n, kv_len, device=q.device)
        # token rows: only those some query's window reaches (all of them without a window)
        first = 0 if modifiers.window is None else max(0, kv_len - n - modifiers.window + 1)
        k = _request_rows(cache, meta.block_tables[b], kv_len, read_rows, first)[:, :d]
        mask = visible_mask(positions, kv_len, modifiers.window, None)[:, first:]
        num_entries = kv_len // ratio
        kc = _request_rows(compressed, entry_tables[b], num_entries, read_entries)[:, :d]
        cmask = _compressed_visible(positions, num_entries, ratio)
        if modifiers.topk_indices is not None:
            cmask &= visible_mask(positions, num_entries, None, modifiers.topk_indices[rows])
        keys = torch.cat([k.float(), kc.float()])
        out[rows] = attend(q[rows], keys, torch.cat([mask, cmask], dim=1), scale, d, modifiers.sinks).to(
            q.dtype
        )
    return out
