"""Paged latent attention on npu_fused_infer_attention_score_v2 (FIA).

Two documented paths, chosen per call by shape (no silent fallback to the reference):

fused MLA, paged (the production path; DeepSeek V2/V3 shapes):
    latent_dim 512 + rope_dim 64, bf16/fp16, block size a multiple of 16 <= 1024, H <= 128, no
    window / sinks / top-k. One FIA call per step for decode and prefill rows alike: TND layout,
    query (T, Hp, 512) + query_rope (T, Hp, 64) with heads padded to a power of two Hp, key = value
    = the latent cache viewed (NB, 1, BS, 512), key_rope = the rope cache (NB, 1, BS, 64),
    block_table, sparse_mode 3 (right-down causal, compressed 2048x2048 mask),
    actual_seq_qlen CUMULATIVE, actual_seq_kvlen PER REQUEST (the TND + paged + D=512 rule).

gathered (every other shape, window, sinks, top-k):
    each request's visible K rows (trimmed to the window) are gathered from the paged cache into
    a padded (B, S_kv, KV_N, D) tensor and FIA runs non-paged in BSND layout with per-request
    lengths. D is zero-padded to a multiple of 16 (zeros add nothing to q.k; the extra V columns
    are dropped). Latent 512 + rope 64 keeps the rope split (query_rope / key_rope). Causality is
    sparse_mode 3, a sliding window sparse_mode 4 (band: pre_tokens = window - 1, next_tokens = 0),
    top-k indices an explicit (B, 1, S_q, S_kv) mask with sparse_mode 0 (row-invalid correction,
    inner_precise 2, where S_q > 1; rows that see no key are zeroed afterwards). Sinks scale each
    row by sigmoid(lse - sink) from the returned softmax LSE, which is exact: the sink only adds
    exp(sink) to the softmax denominator.
    FIA's learnable_sink is not used: it needs TND layout and V_D <= 128.
    Decode-only steps (S_q = 1) ignore sparse_mode and pre/next tokens on the NPU, which is why
    the window is applied by trimming the gathered rows rather than by the band.

Sinks on the 512 + 64 rope-split path rely on FIA returning the LSE there: the v2 doc lists no
restriction, the v1 doc's MLA example says that mode has no softmax_lse (a known risk, see
docs/ascend.md; no DeepSeek model combines that layout with sinks). Any call with a dtype other
than bf16/fp16 raises NotImplementedError.

DeepSeek-V4:
indexer_topk          npu_lightning_indexer, TND query (T, Hi, 128) with one batch entry per
                      query row, key = the entry cache as it is ((NB, BS, 1, 128) is PA_BSND),
                      actual_seq_lengths_key = the entries visible to each row, block_table =
                      its request's row, weights * scale, sparse_mode 3, sparse_count = top-k.
                      Shapes outside the op's limits (float32, D != 128, block size not a
                      multiple of 16, > 64 heads) run the contract's reference definition.
varlen_attention      npu_fusion_attention (the vision tower: bidirectional within each image),
                      TND layout, actual_seq_qlen = actual_seq_kvlen = the CUMULATIVE lengths of
                      the non-empty segments (host list), no mask (sparse_mode 0), contiguous
                      q / k / v; shapes outside its documented limits (Dv != D, D not a multiple
                      of 16 or above 512, float64) run the contract's reference definition.
compressed_attention  the contract's reference definition: torch_npu has no op taking two key
                      sets (window rows and compressed entries) in one softmax with sinks;
                      vllm-ascend's custom op npu_sparse_attn_sharedkv does (docs/ascend.md).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from deepinfer.backend.ops import AttentionOps
from deepinfer.backend.types import (
    NO_MODIFIERS,
    AttentionMetadata,
    AttentionModifiers,
    BackendOptions,
    PagedKVCache,
)
from deepinfer_ascend import kv_cache

MASK_SIZE = 2048  # sparse_mode 2/3/4 take this compressed causal mask
MLA_LATENT, MLA_ROPE = 512, 64
MAX_MLA_HEADS = 128
MAX_GQA_RATIO = 64  # num_query_heads / num_key_value_heads outside the 512-wide MLA case
DTYPES = (torch.bfloat16, torch.float16)
LI_DIM, LI_MAX_HEADS = 128, 64  # npu_lightning_indexer: D of query and key 128, query N <= 64

# (graph recorder hook) fn(op, kwargs, refresh) -> out; None outside graph capture.
Issuer = Callable[[Any, dict[str, Any], Callable[[], dict[str, Any]] | None], Any]


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def cumulative(lengths: list[int]) -> list[int]:
    out, total = [], 0
    for n in lengths:
        total += n
        out.append(total)
    return out


class AscendAttention(AttentionOps):
    def __init__(self, options: BackendOptions, tnpu: Any, device: torch.device) -> None:
        super().__init__(options)
        self._tnpu = tnpu
        self._device = device
        self._mask: torch.Tensor | None = None
        self.issuer: Issuer | None = None  # set by the graph runner while capturing

    # ------------------------------------------------------------------ contract

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
        d = q.shape[-1]
        if v.shape[-1] != d or d % 16 or d > 512 or q.dtype not in (*DTYPES, torch.float32):
            return super().varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale=scale)
        if self.backend.device.is_capturing():
            raise NotImplementedError("ascend: varlen_attention reads cu_seqlens on the host; not in a graph")
        bounds = cu_seqlens.tolist()  # the op takes host lists
        cum = [b for a, b in itertools.pairwise(bounds) if b > a]  # empty segments dropped
        if not cum:
            return q.new_zeros((*q.shape[:2], d))
        out = self._tnpu.npu_fusion_attention(
            q.contiguous(), k.contiguous(), v.contiguous(), q.shape[1], "TND",
            scale=scale, actual_seq_qlen=cum, actual_seq_kvlen=cum, sparse_mode=0,
        )[0]  # fmt: skip
        result: torch.Tensor = out
        return result

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
        return self._attend(q, cache, meta, scale, v_dim, modifiers)

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
        if not self._indexer_fits(q, weights, keys, topk):
            return super().indexer_topk(q, weights, keys, meta, ratio=ratio, topk=topk, scale=scale)
        if self.issuer is not None:
            raise NotImplementedError("ascend: indexer_topk is not captured in NPU graphs yet")
        t = q.shape[0]
        if t == 0:
            return torch.full((0, topk), -1, dtype=torch.int32, device=q.device)
        # Each query row is a batch entry of its own (S1 = 1, so sparse_mode 3 lets all of its
        # S2 keys through), with S2 = the entries visible to it, (p + 1) // ratio: the op's
        # right-down causal mask counts keys one per query position, entries come one per ratio.
        rows = torch.arange(t, device=q.device)
        qsl = meta.query_start_loc.long()
        req = torch.searchsorted(qsl[1:], rows, right=True)  # (T,) request of each row
        pos = meta.seq_lens.long()[req] - (qsl[req + 1] - rows)  # (T,) absolute position
        latent, _ = kv_cache.parts(keys)  # (NB, BS, 1, 128): the PA_BSND key layout as it is
        ids, _ = self._tnpu.npu_lightning_indexer(
            q.contiguous(),
            latent,
            (weights.float() * scale).contiguous(),  # relu(.) * scale * w = relu(.) * (w * scale)
            actual_seq_lengths_query=(rows + 1).to(torch.int32),  # cumulative: one row each
            actual_seq_lengths_key=((pos + 1) // ratio).to(torch.int32),  # per row
            block_table=meta.block_tables.index_select(0, req).to(torch.int32).contiguous(),
            layout_query="TND",
            layout_key="PA_BSND",
            sparse_count=topk,
            sparse_mode=3,
        )  # (T, 1, topk) int32, -1 past the visible entries
        out: torch.Tensor = ids.view(t, topk)
        return out

    @staticmethod
    def _indexer_fits(q: torch.Tensor, weights: torch.Tensor, keys: PagedKVCache, topk: int) -> bool:
        """npu_lightning_indexer's documented limits: bf16/fp16 query and key of one dtype, D 128
        for both, query heads <= 64, paged block size a multiple of 16 <= 1024, top-k <= 2048
        (or 3072..8192 by 1024); weights float32."""
        spec = keys.spec
        return (
            q.dtype in DTYPES
            and spec.dtype == q.dtype
            and weights.dtype == torch.float32
            and q.dim() == 3
            and q.shape[1] <= LI_MAX_HEADS
            and q.shape[2] == LI_DIM == spec.latent_dim
            and spec.rope_dim == 0
            and spec.block_size % 16 == 0
            and spec.block_size <= 1024
            and (1 <= topk <= 2048 or topk in (3072, 4096, 5120, 6144, 7168, 8192))
        )

    # ------------------------------------------------------------------ dispatch

    def _attend(
        self,
        q: torch.Tensor,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        scale: float,
        v_dim: int,
        modifiers: AttentionModifiers,
    ) -> torch.Tensor:
        spec = cache.spec
        t, h, d = q.shape
        if d != spec.head_dim:
            raise ValueError(f"q has head dim {d}, the cache holds {spec.head_dim}-wide K rows")
        if not 0 < v_dim <= d:
            raise ValueError(f"v_dim must be in 1..{d}, got {v_dim}")
        if q.dtype not in DTYPES or spec.dtype != q.dtype:
            raise NotImplementedError(
                f"ascend attention runs bf16/fp16 with q and cache of one dtype (FIA); got q {q.dtype}, "
                f"cache {spec.dtype}"
            )
        if t != meta.num_tokens:
            raise ValueError(f"q has {t} rows, the metadata {meta.num_tokens} query tokens")
        for b, (kv_len, n) in enumerate(zip(meta.seq_lens_host, meta.query_lens_host)):
            if n > kv_len:
                raise ValueError(f"request {b}: query length {n} exceeds its KV length {kv_len}")
        if t == 0:
            return q.new_empty((0, h, v_dim))
        if self._fused_mla_fits(cache, h, v_dim, modifiers):
            return self._paged_mla(q, cache, meta, scale, v_dim)
        return self._gathered(q, cache, meta, scale, v_dim, modifiers)

    @staticmethod
    def _is_mla(cache: PagedKVCache) -> bool:
        return cache.spec.latent_dim == MLA_LATENT and cache.spec.rope_dim == MLA_ROPE

    def _fused_mla_fits(
        self,
        cache: PagedKVCache,
        heads: int,
        v_dim: int,
        modifiers: AttentionModifiers,
    ) -> bool:
        bs = cache.spec.block_size
        return (
            self._is_mla(cache)
            and bs % 16 == 0
            and bs <= 1024
            and heads <= MAX_MLA_HEADS
            and v_dim <= MLA_LATENT
            and modifiers.is_plain
        )

    def causal_mask(self) -> torch.Tensor:
        """The compressed (2048, 2048) int8 mask of sparse_mode 2/3/4: 1 = masked (j > i)."""
        if self._mask is None:
            ones = torch.ones((MASK_SIZE, MASK_SIZE), dtype=torch.int8, device=self._device)
            self._mask = torch.triu(ones, diagonal=1)
        return self._mask

    def _run(self, kwargs: dict[str, Any], refresh: Callable[[], dict[str, Any]] | None = None) -> Any:
        op = self._tnpu.npu_fused_infer_attention_score_v2
        if self.issuer is not None:
            return self.issuer(op, kwargs, refresh)
        return op(**kwargs)

    # ------------------------------------------------------------------ fused paged MLA

    def _paged_mla(
        self, q: torch.Tensor, cache: PagedKVCache, meta: AttentionMetadata, scale: float, v_dim: int
    ) -> torch.Tensor:
        spec = cache.spec
        h = q.shape[1]
        hp = next_pow2(h)  # FIA: query N in {1, 2, 4, ..., 128} when D = 512
        qp = q if hp == h else torch.nn.functional.pad(q, (0, 0, 0, hp - h))
        latent, rope = kv_cache.parts(cache)
        assert rope is not None
        nb, bs = spec.num_blocks, spec.block_size
        kwargs: dict[str, Any] = dict(
            query=qp[..., :MLA_LATENT].contiguous(),  # (T, Hp, 512)
            key=latent.view(nb, 1, bs, MLA_LATENT),
            value=latent.view(nb, 1, bs, MLA_LATENT),
            query_rope=qp[..., MLA_LATENT:].contiguous(),  # (T, Hp, 64)
            key_rope=rope.view(nb, 1, bs, MLA_ROPE),
            atten_mask=self.causal_mask(),
            actual_seq_qlen=cumulative(list(meta.query_lens_host)),
            actual_seq_kvlen=list(meta.seq_lens_host),
            block_table=meta.block_tables,
            num_query_heads=hp,
            num_key_value_heads=1,
            softmax_scale=scale,
            input_layout="TND",
            sparse_mode=3,
            block_size=bs,
        )

        def refresh() -> dict[str, Any]:
            # Graph replay: the runner refreshed the metadata's device tensors in place.
            qsl = meta.query_start_loc.tolist()
            return dict(actual_seq_qlen=qsl[1:], actual_seq_kvlen=meta.seq_lens.tolist())

        out: torch.Tensor = self._run(kwargs, refresh)[0]  # (T, Hp, 512)
        return out[:, :h, :v_dim]

    # ------------------------------------------------------------------ gathered

    def _gathered(
        self,
        q: torch.Tensor,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        scale: float,
        v_dim: int,
        modifiers: AttentionModifiers,
    ) -> torch.Tensor:
        window, sinks, topk = modifiers.window, modifiers.sinks, modifiers.topk_indices
        if self.issuer is not None:
            raise NotImplementedError(
                "graph capture covers the fused paged MLA path only; the gathered attention path "
                "has per-step shapes (run it eagerly)"
            )
        spec = cache.spec
        t, h, d = q.shape
        mla = self._is_mla(cache)
        if mla and h > MAX_MLA_HEADS:
            raise NotImplementedError(f"FIA's MLA path takes at most {MAX_MLA_HEADS} query heads, got {h}")
        dev = q.device
        bs = spec.block_size

        # Requests with query rows, and the KV range each may see (trimmed to the window).
        reqs = [b for b, n in enumerate(meta.query_lens_host) if n > 0]
        q_start = [0, *cumulative(list(meta.query_lens_host))]
        qlens = [meta.query_lens_host[b] for b in reqs]
        kv_lens = [meta.seq_lens_host[b] for b in reqs]
        first = [kv - n for kv, n in zip(kv_lens, qlens)]  # absolute position of each first query row
        kv_start = [max(0, p - window + 1) if window is not None else 0 for p in first]
        kv_vis = [kv - s for kv, s in zip(kv_lens, kv_start)]
        nb, sq, skv = len(reqs), max(qlens), max(kv_vis)

        # Gather K rows: slot of (request i, row j) = table[pos // BS] * BS + pos % BS.
        pos = torch.tensor(
            [[s + min(j, n - 1) for j in range(skv)] for s, n in zip(kv_start, kv_vis)], dtype=torch.long
        ).to(dev)  # (nb, skv); padding repeats the last row, hidden by actual_seq_kvlen
        tables = meta.block_tables.index_select(0, torch.tensor(reqs, device=dev)).long()
        slots = tables.gather(1, pos // bs) * bs + pos % bs
        lat, rp = kv_cache.gather_rows(cache, slots)  # (nb, skv, Dl), (nb, skv, Dr)

        # Query rows -> (nb, sq, H, D) padded; `rows` maps each valid padded row back to q.
        rows = torch.tensor([i * sq + j for i, n in enumerate(qlens) for j in range(n)], device=dev)
        src = torch.tensor([q_start[b] + j for b, n in zip(reqs, qlens) for j in range(n)], device=dev)
        if mla:
            hx, dq = next_pow2(h), MLA_LATENT
        else:
            hx, dq = h, -(-d // 16) * 16
        qpad = q.new_zeros((nb * sq, hx, dq + (MLA_ROPE if mla else 0)))
        qpad[rows, :h, :d] = q.index_select(0, src)
        qpad = qpad.view(nb, sq, hx, -1)

        kwargs: dict[str, Any] = dict(
            softmax_scale=scale,
            input_layout="BSND",
            num_query_heads=hx,
            actual_seq_qlen=qlens,  # per request: BSND lengths are not cumulative
            actual_seq_kvlen=kv_vis,
            return_softmax_lse=sinks is not None,
        )
        if mla:
            assert rp is not None
            key = lat.unsqueeze(2).contiguous()  # (nb, skv, 1, 512)
            kwargs.update(
                query=qpad[..., :MLA_LATENT].contiguous(),
                key=key,
                value=key,
                query_rope=qpad[..., MLA_LATENT:].contiguous(),
                key_rope=rp.unsqueeze(2).contiguous(),
                num_key_value_heads=1,
            )
        else:
            k = lat if rp is None else torch.cat([lat, rp], dim=-1)
            kvh = next(g for g in range(1, h + 1) if h % g == 0 and h // g <= MAX_GQA_RATIO)
            key = torch.nn.functional.pad(k, (0, dq - d)).unsqueeze(2).expand(nb, skv, kvh, dq).contiguous()
            kwargs.update(query=qpad.contiguous(), key=key, value=key, num_key_value_heads=kvh)

        decode_only = sq == 1 and not mla  # FIA ignores sparse_mode and pre/next tokens here
        dead: torch.Tensor | None = None  # (nb * sq,) rows that see no key (top-k excluded all)
        if topk is not None:
            mask = self._topk_mask(topk, src, rows, nb, sq, skv, first, kv_start, qlens, window)
            dead = mask.all(dim=-1).view(-1)
            # Row-invalid correction (inner_precise 2) exists for Q_S > 1 only; dead rows are
            # zeroed below either way (the contract's result for a row that sees nothing).
            kwargs.update(atten_mask=mask, sparse_mode=0, inner_precise=2 if sq > 1 else 0)
        elif decode_only:
            kwargs.update(sparse_mode=0)
        elif window is not None:
            kwargs.update(atten_mask=self.causal_mask(), sparse_mode=4, pre_tokens=window - 1, next_tokens=0)
        else:
            kwargs.update(atten_mask=self.causal_mask(), sparse_mode=3)

        out, lse = self._run(kwargs)  # (nb, sq, hx, Dv), lse (nb, hx, sq, 1)
        if sinks is not None:
            # softmax with a sink = softmax without it * Z / (Z + e^sink) = * sigmoid(lse - sink)
            corr = torch.sigmoid(lse.squeeze(-1)[:, :h] - sinks.float().view(1, h, 1))  # (nb, h, sq)
            out = (out[:, :, :h].float() * corr.transpose(1, 2).unsqueeze(-1)).to(q.dtype)
        flat = out.reshape(nb * sq, out.shape[2], -1)
        if dead is not None:
            flat = torch.where(dead[:, None, None], torch.zeros((), dtype=flat.dtype, device=dev), flat)
        res = flat.index_select(0, rows)[:, :h, :v_dim]
        final = q.new_empty((t, h, v_dim))
        final[src] = res
        return final

    def _topk_mask(
        self,
        topk: torch.Tensor,
        src: torch.Tensor,
        rows: torch.Tensor,
        nb: int,
        sq: int,
        skv: int,
        first: list[int],
        kv_start: list[int],
        qlens: list[int],
        window: int | None,
    ) -> torch.Tensor:
        """(nb, 1, sq, skv) bool, True = masked: a key is visible iff it is among the row's top-k
        indices, causal, and inside the window. Positions are relative to the gathered rows."""
        dev = topk.device
        # absolute position and KV offset of every valid query row
        p = torch.tensor([f + j for f, n in zip(first, qlens) for j in range(n)], device=dev)
        s = torch.tensor([ks for ks, n in zip(kv_start, qlens) for _ in range(n)], device=dev)
        idx = topk.index_select(0, src).long() - s[:, None]  # (n, Kt) relative key ids
        valid = (topk.index_select(0, src) >= 0) & (idx >= 0) & (idx < skv)
        allowed = torch.zeros((src.numel(), skv + 1), dtype=torch.bool, device=dev)
        allowed.scatter_(1, torch.where(valid, idx, skv), True)  # invalid -> spare column
        allowed = allowed[:, :skv]
        j = torch.arange(skv, device=dev)
        rel = (p - s)[:, None]  # the row's own relative position
        allowed &= j[None, :] <= rel
        if window is not None:
            allowed &= j[None, :] > rel - window
        mask = torch.ones((nb * sq, skv), dtype=torch.bool, device=dev)
        mask[rows] = ~allowed
        return mask.view(nb, 1, sq, skv)
