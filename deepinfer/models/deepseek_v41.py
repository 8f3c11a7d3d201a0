"""DeepSeek-V4.1 (V4.1-Flash), text model, in the paper's order: caches -> attention (sliding
window, C1 / C2 main entries, sparse indexer, grouped output) -> shared state across layers and
YOCO -> MoE -> block with (shifted) hyper-connections -> model. Written only against the backend
contract; the parts V4 has too (the MoE, the grouped output, the hyper-connection weights, the
entry bookkeeping, the paged wide caches) are V4's (deepinfer.models.deepseek_v4).

Symbols: T tokens in the step, H heads, D head_dim (one K = V head), R rotated tail of D,
N hc_mult streams, Dm hidden, m compression ratio (1 or 2), Hi / Di indexer heads / head width,
G o_groups.

Every layer attends to a sliding window of its own K = V rows (sinks in the denominator).
A compressed layer (ratio m) adds main entries: C1 (m = 1) one per token,
c_p = rope(norm(W_A x_p)); C2 (m = 2) one per token pair, c_j = rope(norm(sum_t softmax_t(z_t) v_t))
over t in {2j, 2j+1}, [z | v] = [W_gate x | W_A x] per channel; entry j is visible from position
(j+1)m - 1 on. A sparse indexer keeps index_topk entries per query: score
sum_h w_h relu(q_h . k_s), index keys k_s = rope(k_norm(W_k c_s^pre)) from the entry before its
rope. Attention is one softmax over the window's rows and the kept entries.

Candidate blocks (text_config.candidate_source_layer_id, two-stage selection): the source layer
keeps its own top-k over every visible entry and also ranks blocks of candidate_block_size
entries by their best score (the newest visible entry's block always first), keeping
candidate_topk_blocks of them per query (attention.indexer_candidate_blocks); every later layer
that runs an indexer scores only the entries of those blocks and picks its top-k among them
(attention.indexer_topk_in_blocks). The blocks are per step (StepState.candidates): no cache.

Sharing (config_v41.SharingTopology): a layer whose KV source is another layer attends that
layer's entries and computes none; an index-key consumer scores its source's keys with its own
queries; a top-k consumer uses its source's picks. YOCO: from the first C1 layer on (the decoder
half), KV-source layers compute their entries from one shared hidden state h*, the first decoder
layer's attention input, so the decoder's long-range memory depends on h* alone.

Hyper-connections: shifted (hc_shifted, default): sublayer k's input applies the pre mix that
sublayer k-1 computed from its own input streams (the first reads stream 0), and after the last
sublayer its pre mix collapses the streams (no HC head). Unshifted: V4's mHC with a head.

Caches (paged by the engine, D-wide rows but the index keys' Di):
  window      one row per token, every layer (the ring);
  state       C2 KV sources: [W_A x | W_gate x] per token (2D), what the pair closing in a
              later step pools (the ring);
  entries/m   KV sources of ratio m: row j holds entry j;
  index/m     index-key sources of ratio m: row j holds entry j's key (Di wide).
Candidate blocks need none: each step's are recomputed from the source layer's scores.
The ring holds window - 1 + 1 + max_backtrack positions (a C2 pair reads one position back).
Row formats (EngineConfig.kv_cache_dtype, use_kv_cache_dtype; kv_formats_v41): "auto" stores the
window rows in FP8 (528 B at D = 512), the entries in FP4 (288 B) and the index keys in MXFP4
(68 B), each a uint8 row quantised as it is written (write_kv_rows) and dequantised where the
sparse attention and the indexer read it (quantized_attention, quantized_indexer_topk; the
candidate stages take the index keys' format too; beside MXFP4 keys the ops round the index
queries to MXFP4 as well, DeepSeek's FP4 indexer), prefill included, so every step attends and
scores the rounded values; the C2 state keeps the model dtype bit for
bit in the ring's bytes (ByteRows). "bf16": every cache in the model dtype.

Engram (deepinfer.models.engram): in its layers, hashed n-gram embeddings gated into the
streams before the attention's pre mix; the n-gram ids come from each token's input id and the
engine's token history (ForwardBatch.token_history: the previous G - 1 tokens), built once per
forward on the device. Its tables are weights on the device, or in pinned host memory
(envs.ENGRAM_HOST_TABLES, deepinfer.models.engram), as stored: float rows, or DeepSeek's FP8
rows (e4m3 with a UE8M0 scale per 32 values of a row) that each lookup dequantises. With
envs.ENGRAM_PREFETCH every Engram layer's lookup starts once the ids are built (StepState
engram_rows) and each layer waits for its own rows.

Tensor names are DeepSeek's published ones (layers.{i}.attn.wq_a.weight, ..., with or without
a `model.` prefix). Loaded here: float checkpoints (bfloat16 / float32 weights) and the published
format as stored (stored_in_fp8): FP8 e4m3 linears with UE8M0 scales per 32 x 32 block
(`.scale`, float8_e8m0fnu), run through the contract's FP8 GEMMs with block 32 (activations
quantised per token per 32 channels), wo_a dequantised at load where o_lora_rank is not a
multiple of 32 (keep_grouped_fp8); MXFP4 routed experts (packed e2m1 + UE8M0 per 32 along K);
Engram tables as FP8 rows (`engram.embed.weight` e4m3 with `engram.embed.scale` (R, Dh / 32)
UE8M0, kept so in memory); the rest (embedding, head, router, compressors, the indexer's wk /
weights_proj) bf16, norms, sinks and mixing weights float32. The DSpark draft layers (mtp.*)
load as the DFlash drafter (V41DFlashDrafter) when speculative decoding asks for it.

Images (config.json's vision_config): the vision tower (models.vision) turns each image into
its prompt span's rows, which replace those positions' input embeddings (ForwardBatch
image_embeds / image_mask); image tokens select their experts with the image routing bias
(ffn.gate.bias_vl) and are masked out of Engram (their streams pass unchanged; as n-gram
members they read as pad).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from deepinfer import envs
from deepinfer.backend.kv_formats_v41 import (
    KV_CACHE_DTYPES_V41,
    CacheKind,
    RowFormat,
    row_bytes,
    row_formats_v41,
)
from deepinfer.backend.ops import Backend
from deepinfer.backend.types import AttentionModifiers, KVCacheSpec, PagedKVCache, PendingRows
from deepinfer.models.config import ModelConfig
from deepinfer.models.config_v41 import V41Config
from deepinfer.models.deepseek_v4 import (
    HyperConnection,
    LayerCaches,
    NewEntries,
    SharedKVAttention,
    V4MoE,
    WideCache,
    join_exchanges,
    load_f32,
    rope_tail,
)
from deepinfer.models.dflash import DFlashConfig, DFlashHeads
from deepinfer.models.engram import Engram, ngram_ids, table_sizes, vocabulary_table
from deepinfer.models.forward_batch import ForwardBatch, KVCacheGroup
from deepinfer.models.interface import check_kv_cache_dtype
from deepinfer.models.layers import Linear, RMSNorm
from deepinfer.models.rope import cos_sin_cache
from deepinfer.models.vision import VisionModel
from deepinfer.models.weights import WeightSource
from deepinfer.parallel.expert_parallel import ExpertParallel

if TYPE_CHECKING:
    from deepinfer.models.drafter import BlockDrafter

# --------------------------------------------------------------------------- weights


def stored_in_fp8(prefix: str) -> bool:
    """Whether DeepSeek's published V4.1 checkpoint stores linear `prefix` (a name without
    `.weight`) in FP8 32 x 32: the attention's wq_a / wq_b / wkv / wo_a / wo_b, the indexer's
    wq_b and the shared experts; the compressors, the indexer's wk and weights_proj and the router
    are bf16 (routed experts: MXFP4). The loader reads whatever is stored; the quantiser of the
    test checkpoints (testing.v41_checkpoint) and random weights follow this."""
    if ".compressor." in prefix or prefix.endswith((".indexer.wk", ".weights_proj", ".gate")):
        return False
    return prefix.endswith((".wq_a", ".wq_b", ".wkv", ".wo_a", ".wo_b")) or ".shared_experts." in prefix


# --------------------------------------------------------------------------- caches


class QuantizedRows(WideCache):
    """One cache of rows quantised to `fmt` (V4.1's KV row formats; the contract's write_kv_rows
    and read_kv_rows): `width` values a row, row_bytes(fmt, width) bytes."""

    def __init__(self, cache: PagedKVCache, width: int, fmt: RowFormat) -> None:
        super().__init__([cache], width)
        self.fmt = fmt

    def write(self, backend: Backend, rows: torch.Tensor, slots: torch.Tensor) -> None:
        backend.kv_cache.write_kv_rows(self.caches[0], rows, slots, self.fmt)

    def read(self, backend: Backend, slots: torch.Tensor) -> torch.Tensor:
        return backend.kv_cache.read_kv_rows(self.caches[0], slots, self.fmt)


class ByteRows(WideCache):
    """Rows of `width` values in `dtype` kept bit for bit in uint8 caches of another width (the
    C2 state beside the FP8 window rows of its group): each row's bytes split over the caches."""

    def __init__(self, caches: Sequence[PagedKVCache], width: int, dtype: torch.dtype) -> None:
        super().__init__(caches, width)
        self.dtype = dtype

    def write(self, backend: Backend, rows: torch.Tensor, slots: torch.Tensor) -> None:
        raw = rows.to(self.dtype).contiguous().view(torch.uint8)  # (n, width * itemsize)
        WideCache.write(self, backend, raw, slots)

    def read(self, backend: Backend, slots: torch.Tensor) -> torch.Tensor:
        parts = [backend.kv_cache.read_kv(cache, slots) for cache in self.caches]
        nbytes = self.width * self.dtype.itemsize
        return torch.cat(parts, dim=-1)[:, :nbytes].contiguous().view(self.dtype)


def layer_cache_kinds(v41: V41Config, layer: int) -> list[tuple[str, int]]:
    """(kind, row width) of layer `layer`'s own caches, in LayerCaches order."""
    ratio, topo, d = v41.compress_ratios[layer], v41.sharing, v41.head_dim
    kinds = [("window", d)]
    if ratio and topo.kv[layer] == layer:
        kinds.append(("compressed", d))
        if ratio == 2:
            kinds.append(("state", 2 * d))
    if ratio and topo.index_k[layer] == layer:
        kinds.append(("index_keys", v41.index_head_dim))
    return kinds


def _group_key(kind: str, ratio: int) -> tuple[int, int]:
    """(0, 0) the ring; (1, m) the entries of ratio m; (2, m) the index keys of ratio m."""
    if kind in ("window", "state"):
        return (0, 0)
    return (2, ratio) if kind == "index_keys" else (1, ratio)


def ring_lookback(v41: V41Config) -> int:
    """Positions before a step's first token that it reads: window - 1 (the first query's keys),
    1 for a C2 pair whose first token came in the step before."""
    return max(v41.sliding_window - 1, 1 if 2 in v41.compress_ratios else 0)


# a layer's cache kinds (layer_cache_kinds) -> the kind whose row format they take
FORMAT_OF: dict[str, CacheKind] = {
    "window": "window",
    "state": "window",
    "compressed": "main",
    "index_keys": "index",
}
GROUP_KIND: dict[int, CacheKind] = {0: "window", 1: "main", 2: "index"}  # _group_key's first -> kind


def group_row(
    v41: V41Config, key: tuple[int, int], formats: dict[CacheKind, RowFormat | None]
) -> tuple[int, RowFormat | None]:
    """(row width, format) of the caches of group `key`: values (the ring's and the entries' D,
    the index keys' Di) where unquantised, else the bytes of one row of the group's format."""
    fmt = formats[GROUP_KIND[key[0]]]
    width = v41.index_head_dim if key[0] == 2 else v41.head_dim
    return (width, None) if fmt is None else (row_bytes(fmt, width), fmt)


def cache_count(kind: str, width: int, row: int, fmt: RowFormat | None, dtype: torch.dtype) -> int:
    """Caches one layer's `kind` of `width` values takes in a group of rows `row` wide: one
    quantised row (window, entries, index keys in a format), or the state's values bit for bit
    in the ring's bytes (ByteRows), or ceil(width / row) rows of values."""
    if fmt is None:
        return WideCache.count(width, row)
    return WideCache.count(width * dtype.itemsize, row) if kind == "state" else 1


def cache_layout(
    v41: V41Config,
    formats: dict[CacheKind, RowFormat | None] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    draft_layers: int = 0,
) -> tuple[list[dict[str, tuple[int, int, int]]], dict[tuple[int, int], int]]:
    """Per layer, kind -> (first, end, width) in the flat cache list laid out group by group
    (ring, entries by ratio, index keys by ratio), layer by layer within a group; and the number
    of caches of each group. formats: the row formats (row_formats_v41; default none quantised),
    dtype: the model's (the state's values). draft_layers: the DFlash drafter's layers, after
    the model's: a window ring each (the last caches of the ring group)."""
    formats = formats or row_formats_v41("bf16")
    kinds = [layer_cache_kinds(v41, i) for i in range(len(v41.compress_ratios))]
    kinds += [[("window", v41.head_dim)] for _ in range(draft_layers)]
    ratios = v41.compress_ratios + (0,) * draft_layers
    out: list[dict[str, tuple[int, int, int]]] = [{} for _ in kinds]
    counts: dict[tuple[int, int], int] = {}
    at = 0
    keys = sorted({_group_key(k, ratios[i]) for i, ks in enumerate(kinds) for k, _ in ks})
    for key in keys:
        for i, layer_kinds in enumerate(kinds):
            for kind, width in layer_kinds:
                if _group_key(kind, ratios[i]) == key:
                    row, fmt = group_row(v41, key, formats)
                    n = cache_count(kind, width, row, fmt, dtype)
                    out[i][kind] = (at, at + n, width)
                    counts[key] = counts.get(key, 0) + n
                    at += n
    return out, counts


def _c1_entries(entries: NewEntries, batch: ForwardBatch) -> NewEntries:
    """C1's entries are the step's tokens, one each, in the batch's order; a token that writes no
    cache row (slot -1: a graph step's padding, whose block tables point at block 0, which a real
    request may own) stores no entry and no index key either."""
    if entries.out_slots.shape[0] != batch.slot_mapping.shape[0]:
        raise ValueError(
            f"C1 entries: {entries.out_slots.shape[0]} close in a step of {batch.slot_mapping.shape[0]} "
            "tokens; every token closes one"
        )
    writes = batch.slot_mapping >= 0
    return dataclasses.replace(
        entries,
        out_slots=torch.where(writes, entries.out_slots, -1),
        key_slots=torch.where(writes, entries.key_slots, -1),
    )


# --------------------------------------------------------------------------- attention


@dataclass
class V41LayerCaches(LayerCaches):
    """V4's LayerCaches with the row format of each kind (row_formats_v41)."""

    formats: dict[CacheKind, RowFormat | None] = field(default_factory=lambda: row_formats_v41("bf16"))


@dataclass
class StepState:
    """What one forward carries from layer to layer (DeepSeek's cross-layer runtime): h* (YOCO's
    shared hidden), each KV source's entries closing in this step before their rope (the index
    keys' input), each index source's top-k picks, Engram's n-gram ids."""

    shared_hidden: torch.Tensor | None = None
    pre_rope: dict[int, torch.Tensor | None] = field(default_factory=dict)
    topk: dict[int, torch.Tensor] = field(default_factory=dict)
    candidates: torch.Tensor | None = None  # (T, candidate_topk_blocks) int32, from the candidate source
    ngram_ids: torch.Tensor | None = None  # (T, G) compressed ids, models with Engram layers
    engram_rows: dict[int, PendingRows] = field(default_factory=dict)  # layer -> rows (ENGRAM_PREFETCH)


class MainEntries(nn.Module):
    """A KV source's main compressor: C1 c = norm(W_A x) per token; C2 c = norm(gated pool of a
    token pair's W_A x under W_gate x); stored after the tail's rope at the entry's first token's
    position."""

    def __init__(self, backend: Backend, config: ModelConfig, ratio: int, width: int) -> None:
        super().__init__()
        self.backend, self.ratio, self.width = backend, ratio, width
        self.wkv = Linear(backend, config.hidden_size, width)
        self.wgate = Linear(backend, config.hidden_size, width) if ratio == 2 else None
        self.norm = RMSNorm(backend, width, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        entries: NewEntries | None,
        state: WideCache | None,
        out: WideCache,
        table: torch.Tensor,
    ) -> torch.Tensor | None:
        """Stores the entries closing in this step (for C2, after this step's projections went
        to `state`); returns them before the rope (W, width), None when none close."""
        small = self.backend.small
        if self.wgate is None:  # C1: one entry per token, the step's tokens in order
            if entries is None:
                return None
            pre = self.norm(self.wkv(x))  # (T, D): entry w is token w's (_c1_entries)
        else:
            assert state is not None
            state.write(self.backend, torch.cat([self.wkv(x), self.wgate(x)], dim=-1), batch.slot_mapping)
            if entries is None:
                return None
            w, span = entries.state_slots.shape
            rows = state.read(self.backend, entries.state_slots.reshape(-1)).view(w, span, -1)
            kv, gate = rows[..., : self.width], rows[..., self.width :].float()
            gate = gate.masked_fill(~entries.present[..., None], float("-inf"))
            pre = self.norm(small.gated_pool(kv, gate))  # (W, D)
        roped = rope_tail(self.backend, pre[:, None], entries.positions, table)[:, 0]
        out.write(self.backend, roped, entries.out_slots)
        result: torch.Tensor = pre
        return result

    def load(self, reader: WeightSource, prefix: str, dtype: torch.dtype) -> None:
        self.wkv.load(reader, f"{prefix}.wkv", dtype)
        if self.wgate is not None:
            self.wgate.load(reader, f"{prefix}.wgate", dtype)
        self.norm.weight = load_f32(reader, f"{prefix}.norm.weight", (self.width,))


class SparseIndexer(nn.Module):
    """An index source's indexer: queries from the attention's q_lora residual, weights from its
    input; keys (index-key sources) from the main entries before their rope."""

    def __init__(
        self, backend: Backend, config: ModelConfig, v41: V41Config, layer: int, has_keys: bool
    ) -> None:
        super().__init__()
        assert config.q_lora_rank is not None
        self.backend, self.ratio = backend, v41.compress_ratios[layer]
        topo, c = v41.sharing, v41.sharing.candidate
        # candidate blocks: the "source" layer finds them, the later ones are "restricted" to them
        self.stage = None if c is None or layer < c else "source" if layer == c else "restricted"
        self.block_size, self.topk_blocks = topo.candidate_block_size, topo.candidate_topk_blocks
        self.heads, self.dim, self.topk = v41.index_n_heads, v41.index_head_dim, v41.index_topk
        self.wq_b = Linear(backend, config.q_lora_rank, self.heads * self.dim)
        self.weights_proj = Linear(backend, config.hidden_size, self.heads)
        self.has_keys = has_keys
        self.wk = Linear(backend, v41.head_dim, self.dim)
        self.k_norm = RMSNorm(backend, self.dim, config.rms_norm_eps)

    def write_keys(
        self, pre_rope: torch.Tensor | None, entries: NewEntries | None, keys: WideCache, table: torch.Tensor
    ) -> None:
        """Index keys of the entries closing in this step -> `keys` at entries.key_slots."""
        if pre_rope is None or entries is None:
            return
        k = self.k_norm(self.wk(pre_rope))[:, None]  # (W, 1, Di)
        keys.write(
            self.backend, rope_tail(self.backend, k, entries.positions, table)[:, 0], entries.key_slots
        )

    def select(
        self,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        batch: ForwardBatch,
        keys: WideCache,
        key_tables: torch.Tensor | None,
        table: torch.Tensor,
        step: StepState,
        key_format: RowFormat | None = None,
    ) -> torch.Tensor:
        """-> (T, index_topk) int32 entry ids per query, -1 unused (lower id first among ties).
        The scores' positive scale factors do not change the picks; the contract's scale is
        Di^-0.5 on q . k. Candidate blocks: the source layer also leaves its blocks in `step`;
        a later layer picks only inside them. key_format: the keys' row format (None: values), in
        every stage."""
        attn = self.backend.attention
        q = rope_tail(
            self.backend, self.wq_b(q_residual).view(-1, self.heads, self.dim), batch.positions, table
        )
        weights = self.weights_proj(x).float()  # (T, Hi)
        meta = batch.attn if key_tables is None else dataclasses.replace(batch.attn, block_tables=key_tables)
        cache, ratio, topk, scale = keys.caches[0], self.ratio, self.topk, self.dim**-0.5
        if self.stage == "source":
            ids, step.candidates = attn.indexer_candidate_blocks(
                q, weights, cache, meta, ratio=ratio, topk=topk, scale=scale, block_size=self.block_size,
                topk_blocks=self.topk_blocks, key_format=key_format,
            )  # fmt: skip
            return ids
        if self.stage == "restricted":
            assert step.candidates is not None  # the source layer ran before this one
            return attn.indexer_topk_in_blocks(
                q, weights, cache, meta, step.candidates, ratio=ratio, topk=topk, scale=scale,
                block_size=self.block_size, key_format=key_format,
            )  # fmt: skip
        if key_format is None:
            return attn.indexer_topk(q, weights, cache, meta, ratio=ratio, topk=topk, scale=scale)
        return attn.quantized_indexer_topk(
            q, weights, cache, meta, ratio=ratio, topk=topk, scale=scale, key_format=key_format
        )

    def load(self, reader: WeightSource, prefix: str, dtype: torch.dtype) -> None:
        self.wq_b.load(reader, f"{prefix}.wq_b", dtype)
        self.weights_proj.load(reader, f"{prefix}.weights_proj", dtype)
        if self.has_keys:
            self.wk.load(reader, f"{prefix}.wk", dtype)
            self.k_norm.weight = load_f32(reader, f"{prefix}.k_norm.weight", (self.dim,))
        else:  # an index source scoring another layer's keys: its own key projection is unused
            for name in (f"{prefix}.wk.weight", f"{prefix}.wk.scale", f"{prefix}.k_norm.weight"):
                if reader.has(name):
                    reader.skip(name)


class V41Attention(SharedKVAttention):
    """V4.1's: the shared K = V attention (no per-head query norm) with, for compressed layers,
    the main entries (own or a source's) picked by a sparse indexer (own or a source's)."""

    QUERY_NORM = False
    KV_NORM_NAME = "kv_norm"

    def __init__(self, backend: Backend, config: ModelConfig, v41: V41Config, layer: int) -> None:
        d, topo = v41.head_dim, v41.sharing
        super().__init__(backend, config, d, v41.sliding_window, v41.o_groups, v41.o_lora_rank)
        self.layer, self.ratio = layer, v41.compress_ratios[layer]
        self.kv_source, self.index_source = topo.kv[layer], topo.index[layer]
        self.decoder = layer >= v41.n_prefill_layer
        own_kv = self.ratio and self.kv_source == layer
        self.compressor = MainEntries(backend, config, self.ratio, d) if own_kv else None
        own_index = self.ratio and self.index_source == layer
        has_keys = bool(self.ratio) and topo.index_k[layer] == layer
        self.indexer = SparseIndexer(backend, config, v41, layer, has_keys) if own_index else None
        self.has_keys = has_keys

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        caches: V41LayerCaches,
        entries: NewEntries | None,
        table: torch.Tensor,
        step: StepState,
    ) -> torch.Tensor:
        """x (T, Dm) the normed attention input -> (T, Dm). caches: this layer's window, its KV
        source's entries and its index-key source's keys (LayerCaches)."""
        formats = caches.formats
        q_residual, q = self.project(x, batch, caches.window, table, formats["window"])
        if not self.ratio:
            if formats["window"] is None:
                return self.output(self.window_attention(q, batch, caches.window), batch, table)
            return self.output(self.quantized_attention(q, batch, caches, formats, None), batch, table)
        assert caches.compressed is not None
        if self.compressor is not None:
            if self.decoder and step.shared_hidden is None:
                step.shared_hidden = x  # h*: the decoder half's first layer's attention input
            source = step.shared_hidden if self.decoder else x
            assert source is not None
            step.pre_rope[self.layer] = self.compressor(
                source, batch, entries, caches.state, caches.compressed, table
            )
        if self.has_keys:
            assert self.indexer is not None and caches.index_keys is not None
            pre = step.pre_rope.get(self.kv_source)
            self.indexer.write_keys(pre, entries, caches.index_keys, table)
        if self.indexer is not None:
            assert caches.index_keys is not None
            step.topk[self.layer] = self.indexer.select(
                x, q_residual, batch, caches.index_keys, caches.key_tables, table, step, formats["index"]
            )
        topk = step.topk[self.index_source]
        if formats["window"] is None and formats["main"] is None:
            return self.output(self.compressed_attention(q, batch, caches, self.ratio, topk), batch, table)
        return self.output(self.quantized_attention(q, batch, caches, formats, topk), batch, table)

    def quantized_attention(
        self,
        q: torch.Tensor,
        batch: ForwardBatch,
        caches: V41LayerCaches,
        formats: dict[CacheKind, RowFormat | None],
        topk: torch.Tensor | None,
    ) -> torch.Tensor:
        """The window's rows (and, in a compressed layer, the top-k entries) read from their
        quantised rows (the contract's quantized_attention). (T, H, D)."""
        mods = AttentionModifiers(window=self.window, sinks=self.attn_sink, topk_indices=topk)
        entries = None if caches.compressed is None or not self.ratio else caches.compressed.caches[0]
        return self.backend.attention.quantized_attention(
            q, caches.window, entries, batch.attn, scale=self.dim**-0.5, ratio=self.ratio or 1,
            window_format=formats["window"], entry_format=formats["main"], modifiers=mods,
            compressed_block_tables=caches.entry_tables,
        )  # fmt: skip

    def load(self, reader: WeightSource, prefix: str, dtype: torch.dtype) -> None:
        self.load_projections(reader, prefix, dtype)
        if self.compressor is not None:
            self.compressor.load(reader, f"{prefix}.compressor", dtype)
        if self.indexer is not None:
            self.indexer.load(reader, f"{prefix}.indexer", dtype)


# --------------------------------------------------------------------------- block and model


class V41Block(nn.Module):
    """Attention then MoE, each between hyper-connection mixes: streams (T, N, Dm) in and out.
    Shifted: the pre mix each sublayer applies is the previous sublayer's (passed in, passed on)."""

    def __init__(
        self,
        backend: Backend,
        config: ModelConfig,
        v41: V41Config,
        layer: int,
        engram: Engram | None = None,
        ep: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        self.backend, self.shifted, self.ratio = backend, v41.hc_shifted, v41.compress_ratios[layer]
        self.engram = engram
        self.attn_norm = RMSNorm(backend, config.hidden_size, config.rms_norm_eps)
        self.attn = V41Attention(backend, config, v41, layer)
        self.ffn_norm = RMSNorm(backend, config.hidden_size, config.rms_norm_eps)
        self.ffn = V4MoE(backend, config, v41.swiglu_limit, hashed=False, ep=ep)
        hc = (v41.hc_mult, v41.hc_eps, v41.hc_sinkhorn_iters)
        self.hc_attn = HyperConnection(backend, config, *hc)
        self.hc_ffn = HyperConnection(backend, config, *hc)

    def _pre(
        self, hc: HyperConnection, streams: torch.Tensor, pre: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(sublayer input, post, comb, the pre mix the next sublayer applies (shifted only))."""
        small = self.backend.small
        if not self.shifted:
            x, post, comb = hc.pre(streams)
            return x, post, comb, None
        assert pre is not None
        nxt, post, comb = small.hc_mixes(streams, hc.fn, hc.base, hc.scale, hc.norm_eps, hc.hc_eps, hc.iters)
        return small.hc_collapse(streams, pre), post, comb, nxt

    def forward(
        self,
        streams: torch.Tensor,
        pre: torch.Tensor | None,
        batch: ForwardBatch,
        caches: V41LayerCaches,
        entries: NewEntries | None,
        table: torch.Tensor,
        step: StepState,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        small = self.backend.small
        if self.engram is not None:  # on the streams after the previous post mix
            assert step.ngram_ids is not None
            rows = step.engram_rows.get(self.engram.layer)
            streams = self.engram(streams, step.ngram_ids, batch.image_mask, rows)
        x, post, comb, pre = self._pre(self.hc_attn, streams, pre)
        a = self.attn(self.attn_norm(x), batch, caches, entries, table, step)
        streams = small.hc_post(a, streams, post, comb)
        x, post, comb, pre = self._pre(self.hc_ffn, streams, pre)
        f = self.ffn(self.ffn_norm(x), batch.input_ids, batch.fixed_exchange, batch.image_mask)
        return small.hc_post(f, streams, post, comb), pre

    def load(
        self, reader: WeightSource, prefix: str, dtype: torch.dtype, vocab_size: int, vision: bool = False
    ) -> None:
        """vision: the model takes images (their routing bias is loaded)."""
        dm = (self.attn_norm.dim,)
        self.attn_norm.weight = load_f32(reader, f"{prefix}.attn_norm.weight", dm)
        self.ffn_norm.weight = load_f32(reader, f"{prefix}.ffn_norm.weight", dm)
        self.attn.load(reader, f"{prefix}.attn", dtype)
        self.ffn.load(reader, f"{prefix}.ffn", dtype, vocab_size)
        name = f"{prefix}.ffn.gate.bias_vl"  # image tokens' routing bias (DeepSeek: the text bias if absent)
        if vision:
            self.ffn.bias_vl = (
                load_f32(reader, name, self.ffn.bias.shape) if reader.has(name) else self.ffn.bias
            )
        elif reader.has(name):  # a text-only model takes no image tokens
            reader.skip(name)
        self.hc_attn.load(reader, f"{prefix}.hc_attn")
        self.hc_ffn.load(reader, f"{prefix}.hc_ffn")
        if self.engram is not None:
            self.engram.load(reader, f"{prefix}.engram", dtype)


class V41DFlashDrafter(DFlashHeads):
    """DeepSeek-V4.1's DSpark drafter (reference/deepseek-v4.1.md 1.10-1.11): the shared heads
    (models.dflash.DFlashHeads) over num_nextn_predict_layers V4.1 blocks, sliding-window only
    with the base rope, the drafter's own MoE (dspark_n_routed_experts / dspark_num_experts_per_tok
    of the target's expert shape) and hyper-connections (shifted only).

    Injection: trunk_j = the mean over the N streams entering target layer j (the attention's
    input streams), u = project_norm(projection([trunk_0 | ...])), and each draft layer's window
    row k = rope(kv_norm(wkv u)) at the token's position, in the target's forward. Block step
    (DFlashHeads.block_batch): slot s at t+1+s is a one-row query of KV length t+1+B over a
    window of W + B rows: keys t-W+1 .. t+B, the W injected rows and all B slots. The ring holds
    them (kv_cache_groups keeps B rows of backtrack at least). Tensors: {root}mtp.{i}.* (the
    layers' names under mtp.{i}, then the heads' of DFlashHeads.load_heads)."""

    def __init__(self, config: ModelConfig, v41: V41Config, backend: Backend, rope: torch.Tensor) -> None:
        """rope: the base rope table (P, R) float32 (the model's main_rope)."""
        d = v41.dspark
        if d is None or not v41.mtp_compress_ratios:
            raise ValueError(
                "speculative_config asks for the DFlash drafter but this DeepSeek-V4.1 checkpoint has "
                "none (text_config.num_nextn_predict_layers is 0)"
            )
        if not v41.hc_shifted:
            raise ValueError(
                "DeepSeek-V4.1's DFlash draft layers need shifted hyper-connections (hc_shifted)"
            )
        dconfig = DFlashConfig(
            num_layers=len(v41.mtp_compress_ratios), block_size=d.block_size,
            target_layer_ids=d.target_layer_ids, markov_rank=d.markov_rank, noise_token_id=d.noise_token_id,
            n_routed_experts=d.n_routed_experts, num_experts_per_tok=d.num_experts_per_tok,
            moe_intermediate_size=config.moe_intermediate_size, n_shared_experts=config.n_shared_experts,
        )  # fmt: skip
        super().__init__(config, dconfig, backend)
        self.rope = rope
        self.window_format: RowFormat | None = None  # the window rows' format (the model's)
        self.hc_mult = v41.hc_mult
        block = dataclasses.replace(
            config, n_routed_experts=d.n_routed_experts, num_experts_per_tok=d.num_experts_per_tok
        )
        # every draft layer is sliding-window only, without Engram: built as layer 0 of ratio 0
        plain = dataclasses.replace(v41, compress_ratios=(0,) * len(v41.compress_ratios), engram=None)
        self.layers = nn.ModuleList(V41Block(backend, block, plain, 0) for _ in range(dconfig.num_layers))
        for layer in self.blocks:
            layer.attn.window = v41.sliding_window + d.block_size  # the injected W and the block's B

    @property
    def blocks(self) -> list[V41Block]:
        return [cast(V41Block, layer) for layer in self.layers]

    def inject(self, trunks: torch.Tensor, batch: ForwardBatch, caches: list[PagedKVCache]) -> None:
        """trunks (T, n, Dm) the mean streams -> each draft layer's window row at
        batch.slot_mapping (slot -1: padding, no row)."""
        if trunks.shape[0] == 0:  # an idle forward (expert parallelism: a rank without requests)
            return
        u = self.project(trunks)  # (T, Dm)
        for layer, cache in zip(self.blocks, caches):
            attn = layer.attn
            k = rope_tail(self.backend, attn.kv_norm(attn.wkv(u))[:, None], batch.positions, self.rope)[:, 0]
            self.backend.kv_cache.write_kv_rows(cache, k, batch.slot_mapping, self.window_format)

    def block_states(
        self, fb: ForwardBatch, embed: torch.Tensor, caches: list[PagedKVCache]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The L blocks over the block step -> (h (R B, Dm) the collapsed streams, norm(h))."""
        x = nn.functional.embedding(fb.input_ids, embed)  # (R B, Dm)
        streams = x[:, None, :].expand(-1, self.hc_mult, -1).contiguous()  # (R B, N, Dm)
        first = torch.zeros(x.shape[0], self.hc_mult, dtype=torch.float32, device=x.device)
        first[:, 0] = 1.0  # the first sublayer reads stream 0
        pre: torch.Tensor | None = first
        formats = row_formats_v41("bf16") | {"window": self.window_format}
        for layer, cache in zip(self.blocks, caches):
            streams, pre = layer(streams, pre, fb, V41LayerCaches(cache, formats=formats), None, self.rope,
                                 StepState())  # fmt: skip
        assert pre is not None
        h = self.backend.small.hc_collapse(streams, pre)
        return h, self.norm(h)

    def load_norm(self, norm: RMSNorm, reader: WeightSource, name: str, dtype: torch.dtype) -> None:
        norm.weight = load_f32(reader, name, (norm.dim,))

    def load(self, reader: WeightSource, root: str, dtype: torch.dtype, vocab_size: int) -> None:
        """{root}mtp.{i}.*: each block's tensors (V41Block's names), then the heads'."""
        for i, layer in enumerate(self.blocks):
            layer.load(reader, f"{root}mtp.{i}", dtype, vocab_size)
        self.load_heads(reader, root, dtype)
        emb = f"{root}mtp.0.emb.weight"  # DeepSeek's tied copy of the embedding, where stored
        if reader.has(emb):
            reader.skip(emb)


class DeepseekV41ForCausalLM(nn.Module):
    """The DeepSeek-V4.1 text decoder over its paged caches (cache_layout: the ring, the entry
    groups, the index-key groups). forward(batch, kv_caches) -> the final hidden states (T, Dm),
    the streams already collapsed (shifted: by the last sublayer's pre mix; else the HC head);
    compute_logits(rows) -> (S, V) float32. The engine interface is models.interface.CausalLM."""

    supports_graphs = True  # decode steps find their closing entries on the device
    supports_prefill_graphs = False
    supports_drafts_with_graphs = False
    supports_prefix_caching = False  # a block's entries depend on the tokens after it (C2)
    engram_vocab: torch.Tensor  # (V,) int64 raw -> compressed ids, models with Engram layers
    token_history = 0  # Engram models: max_ngram_size - 1 (set in __init__)
    engram_prefetch = False  # Engram models: envs.ENGRAM_PREFETCH (set in __init__)

    def __init__(
        self,
        config: ModelConfig,
        backend: Backend,
        dtype: torch.dtype,
        root: Path | None = None,
        expert_parallel: ExpertParallel | None = None,
        dflash: bool = False,
    ) -> None:
        """root: the checkpoint directory (Engram's compressed vocabulary reads its tokenizer.json).
        dflash: build the DSpark draft layers (V41DFlashDrafter; loaded from mtp.*, else skipped).
        expert_parallel: this rank's share of the routed experts (V4MoE)."""
        super().__init__()
        v41 = config.v41
        if v41 is None:
            raise ValueError(f"DeepseekV41ForCausalLM needs a deepseek_v41 config, got {config.model_type!r}")
        self.config, self.v41, self.backend, self.dtype = config, v41, backend, dtype
        self.drafter: BlockDrafter | None = None
        self.dflash: V41DFlashDrafter | None = None  # built below when asked for
        n = config.num_hidden_layers
        self.register_buffer("embed_tokens", torch.empty(0, device="meta"))  # (V, Dm)
        self.register_buffer("lm_head", torch.empty(0, device="meta"))  # (V, Dm)
        engrams: dict[int, Engram] = {}
        self.token_history = 0  # previous tokens each token's forward reads (Engram: G - 1)
        device = backend.device.device()
        if v41.engram is not None:
            e = v41.engram
            if v41.hc_mult < 2:
                raise ValueError(f"Engram gates hc_mult >= 2 streams; text_config.hc_mult is {v41.hc_mult}")
            vocab, hash_vocab = vocabulary_table(e, config.vocab_size, root)
            self.register_buffer("engram_vocab", vocab.to(device), persistent=False)  # (V,) raw -> compressed
            self.engram_pad = int(vocab[e.pad_token_id]) if e.pad_token_id < len(vocab) else e.pad_token_id
            env = envs.read()
            host, self.engram_prefetch = env.engram_host_tables, env.engram_prefetch
            if host and not backend.capabilities.reads_host_tables:
                raise ValueError(
                    f"{envs.ENGRAM_HOST_TABLES.name}=1: backend {backend.name!r} cannot read Engram tables "
                    "in host memory (Capabilities.reads_host_tables is False); unset it to keep them on "
                    "the device"
                )
            sizes = table_sizes(e)
            for i in e.layer_ids:
                engrams[i] = Engram(backend, config, e, i, sizes[i], hash_vocab, v41.hc_mult, host)
            self.token_history = e.max_ngram_size - 1
        self.layers = nn.ModuleList(
            V41Block(backend, config, v41, i, engrams.get(i), expert_parallel) for i in range(n)
        )
        self.norm = RMSNorm(backend, config.hidden_size, config.rms_norm_eps)
        self.vision = (
            None if v41.vision is None else VisionModel(backend, v41.vision, config.hidden_size, dtype)
        )
        for name in ("hc_head_fn", "hc_head_base", "hc_head_scale"):  # unshifted only
            self.register_buffer(name, torch.empty(0, device="meta"))
        for name, rope in (("main_rope", config.rope), ("compress_rope", v41.compress_rope)):
            table = cos_sin_cache(rope, v41.rope_dim, config.max_position_embeddings, device)
            self.register_buffer(name, table, persistent=False)
        if dflash:
            self.dflash = V41DFlashDrafter(config, v41, backend, cast(torch.Tensor, self.main_rope))
            # its block steps and the injection run in the verification and decode graphs
            self.supports_drafts_with_graphs = True
        self.use_kv_cache_dtype("bf16")  # until the engine sets EngineConfig.kv_cache_dtype (Worker)

    @property
    def rope_positions(self) -> int:
        return self.config.max_position_embeddings

    @property
    def hidden_shape(self) -> tuple[int]:
        """One token's hidden state as forward returns it (the streams collapsed): (Dm,)."""
        return (self.config.hidden_size,)

    @property
    def num_mtp_layers(self) -> int:
        """0: the DSpark draft layers run as the DFlash drafter (speculative method "dflash")."""
        return 0

    @property
    def num_kv_layers(self) -> int:
        return sum(self._counts.values())

    def use_kv_cache_dtype(self, kv_cache_dtype: str) -> None:
        """The caches' row formats (kv_formats_v41.row_formats_v41): "auto" / "fp4" the published
        ones (FP8 window rings, FP4 main entries and index keys), "fp8" FP8 main entries, "bf16"
        none quantised. The C2 state stays in the model dtype whatever the choice: it holds the
        projections a pair pools before its norm, read once when the pair closes, a ring-bounded
        cache per request (DeepSeek keeps it in float32 too); rounding it would round the entry
        twice."""
        check_kv_cache_dtype(kv_cache_dtype, KV_CACHE_DTYPES_V41, self.config.model_type)
        self.kv_cache_dtype = kv_cache_dtype
        self.formats = row_formats_v41(kv_cache_dtype)
        try:
            drafts = self.dflash.num_layers if self.dflash is not None else 0
            self._slices, self._counts = cache_layout(self.v41, self.formats, self.dtype, drafts)
        except ValueError as exc:  # widths the formats' scale blocks do not divide
            raise ValueError(
                f"kv_cache_dtype={kv_cache_dtype!r} cannot hold this model's rows (head_dim "
                f"{self.v41.head_dim}, index_head_dim {self.v41.index_head_dim}): {exc}; use "
                "kv_cache_dtype='bf16'"
            ) from exc
        self._group_keys = sorted(set(self._counts) - {(0, 0)})
        if self.dflash is not None:
            self.dflash.window_format = self.formats["window"]

    def dflash_caches(self, kv_caches: Sequence[PagedKVCache]) -> list[PagedKVCache]:
        """The DFlash draft layers' window rings among kv_caches (the ring group's last ones)."""
        n = self.config.num_hidden_layers
        return [kv_caches[layer["window"][0]] for layer in self._slices[n:]]

    def kv_cache_spec(self, num_blocks: int, block_size: int) -> KVCacheSpec:
        return KVCacheSpec(num_blocks, block_size, self.v41.head_dim, 0, self.dtype)

    def _group(
        self, name: str, key: tuple[int, int], ratio: int = 1, ring_blocks: int = 0, ring_lookback: int = 0
    ) -> KVCacheGroup:
        """Group `key`'s KVCacheGroup: quantised rows are uint8 bytes, row_bytes of them."""
        row, fmt = group_row(self.v41, key, self.formats)
        width = row if fmt is not None or key[0] == 2 else None
        return KVCacheGroup(
            name, self._counts[key], ratio=ratio, ring_blocks=ring_blocks, ring_lookback=ring_lookback,
            row_dim=width, dtype=None if fmt is None else torch.uint8,
        )  # fmt: skip

    def kv_cache_groups(
        self, block_size: int, max_backtrack: int = 0, mtp_layers: int = 0
    ) -> list[KVCacheGroup]:
        """The ring (ring_lookback + 1 + max_backtrack positions, whole blocks), then the entry
        groups by ratio, then the index-key groups by ratio (rows Di wide)."""
        if mtp_layers:
            raise ValueError("DeepSeek-V4.1's draft layers run as the DFlash drafter, not as MTP layers")
        if self.dflash is not None:  # the block reads W injected rows and writes B past them
            max_backtrack = max(max_backtrack, self.dflash.block_size)
        lookback = ring_lookback(self.v41)
        ring = -(-(lookback + 1 + max_backtrack) // block_size)
        groups = [self._group("ring", (0, 0), ring_blocks=ring, ring_lookback=lookback)]
        for kind, m in self._group_keys:
            groups.append(self._group(f"{'entries' if kind == 1 else 'index'}/{m}", (kind, m), ratio=m))
        return groups

    def _layer_caches(
        self, kv_caches: Sequence[PagedKVCache], tables: dict[tuple[int, int], torch.Tensor]
    ) -> list[V41LayerCaches]:
        """Each layer's window, and its KV source's entries (and state) and index-key source's
        keys, wherever they sit."""
        own = [{kind: self._rows(kind, kv_caches[a:b], width) for kind, (a, b, width) in layer.items()}
               for layer in self._slices[: self.config.num_hidden_layers]]  # fmt: skip
        topo, out = self.v41.sharing, []
        for i, ratio in enumerate(self.v41.compress_ratios):
            window = own[i]["window"].caches[0]
            if not ratio:
                out.append(V41LayerCaches(window, formats=self.formats))
                continue
            src, keys = own[topo.kv[i]], own[topo.index_k[i]]
            entry_tables, key_tables = tables.get((1, ratio)), tables.get((2, ratio))
            out.append(
                V41LayerCaches(
                    window, compressed=src["compressed"], state=src.get("state"),
                    index_keys=keys["index_keys"], entry_tables=entry_tables, key_tables=key_tables,
                    formats=self.formats,
                )
            )  # fmt: skip
        return out

    def _rows(self, kind: str, caches: Sequence[PagedKVCache], width: int) -> WideCache:
        """One layer's `kind` over its caches: quantised rows, the state's bytes beside FP8 window
        rows, or rows of values."""
        fmt = self.formats[FORMAT_OF[kind]]
        if fmt is None:
            return WideCache(caches, width)
        return (
            ByteRows(caches, width, self.dtype) if kind == "state" else QuantizedRows(caches[0], width, fmt)
        )

    def forward(self, batch: ForwardBatch, kv_caches: Sequence[PagedKVCache]) -> torch.Tensor:
        """(T, Dm) final hidden states of every token in the batch."""
        v41, small = self.v41, self.backend.small
        if batch.attn.max_seq_len > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {batch.attn.max_seq_len} exceeds max_position_embeddings "
                f"({self.config.max_position_embeddings})"
            )
        if len(kv_caches) != self.num_kv_layers:
            raise ValueError(f"expected {self.num_kv_layers} KV caches, got {len(kv_caches)}")
        if batch.num_tokens == 0:  # an expert-parallel rank with no requests: the exchanges only
            return join_exchanges(self.layers, self.embed_tokens, self.hidden_shape)
        keys = self._group_keys
        tables = dict(zip(keys, batch.group_block_tables or [batch.attn.block_tables] * len(keys)))
        block_size = kv_caches[0].spec.block_size
        entries = {
            m: NewEntries.build(self.backend, batch, m, False, block_size, tables[(1, m)], tables.get((2, m)))
            for m in sorted(set(v41.compress_ratios) - {0})
        }
        if entries.get(1) is not None:
            entries[1] = _c1_entries(cast(NewEntries, entries[1]), batch)
        caches = self._layer_caches(kv_caches, tables)
        x = self._embed(batch)  # (T, Dm)
        streams = x[:, None, :].expand(-1, v41.hc_mult, -1).contiguous()  # (T, N, Dm)
        pre: torch.Tensor | None = None
        if v41.hc_shifted:  # the first sublayer reads stream 0
            pre = torch.zeros(x.shape[0], v41.hc_mult, dtype=torch.float32, device=x.device)
            pre[:, 0] = 1.0
        step = StepState(ngram_ids=self._ngram_ids(batch))
        if self.engram_prefetch and step.ngram_ids is not None:  # every layer's rows, as the ids are known
            for block in self.layers:
                e = cast(V41Block, block).engram
                if e is not None:
                    step.engram_rows[e.layer] = e.prefetch(step.ngram_ids, x.dtype)
        targets = self.dflash.config.target_layer_ids if self.dflash is not None else ()
        trunks: dict[int, torch.Tensor] = {}
        for i, (block, layer_caches) in enumerate(zip(self.layers, caches)):
            if i in targets:  # the drafter's trunk: the mean of the attention's input streams
                trunks[i] = streams.float().mean(dim=1).to(streams.dtype)
            ratio = cast(V41Block, block).ratio
            table = self.compress_rope if ratio else self.main_rope
            streams, pre = block(streams, pre, batch, layer_caches, entries.get(ratio), table, step)
        if self.dflash is not None:
            stacked = torch.stack([trunks[i] for i in targets], dim=1)  # (T, n, Dm)
            self.dflash.inject(stacked, batch, self.dflash_caches(kv_caches))
        if pre is not None:
            return small.hc_collapse(streams, pre)
        c = self.config
        return small.hc_head(
            streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, c.rms_norm_eps, v41.hc_eps
        )

    def _embed(self, batch: ForwardBatch) -> torch.Tensor:
        """(T, Dm) input embeddings: the token embeddings, the image rows (ForwardBatch
        image_embeds) at the image positions."""
        if batch.image_mask is None:
            return nn.functional.embedding(batch.input_ids, self.embed_tokens)
        if batch.image_embeds is None or self.vision is None:
            raise ValueError("a step with image positions needs image_embeds and a model with a vision tower")
        ids = torch.where(batch.image_mask, 0, batch.input_ids)  # image ids are past the vocabulary
        x = nn.functional.embedding(ids, self.embed_tokens)
        return x.masked_scatter(batch.image_mask[:, None], batch.image_embeds.to(x.dtype))

    def encode_images(self, images: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Resized uint8 images (h, w, 3) (engine.images) -> each one's span rows (L, Dm)
        (models.vision.VisionModel.encode)."""
        if self.vision is None:
            raise ValueError("this DeepSeek-V4.1 checkpoint has no vision tower (no vision_config)")
        return self.vision.encode(images)

    def _ngram_ids(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Engram's (T, G) compressed n-gram ids of the step's tokens (None without Engram)."""
        e = self.v41.engram
        if e is None:
            return None
        history = batch.token_history
        t = batch.num_tokens
        if history is None:
            if t:
                raise ValueError(
                    f"DeepSeek-V4.1's Engram layers read each token's {self.token_history} previous "
                    "tokens: the ForwardBatch has no token_history"
                )
            history = batch.input_ids.new_zeros((0, self.token_history))
        if tuple(history.shape) != (t, self.token_history):
            raise ValueError(
                f"token_history must be ({t}, {self.token_history}) for the step's tokens, got "
                f"{tuple(history.shape)}"
            )
        return ngram_ids(batch.input_ids, history, batch.positions, self.engram_vocab, self.engram_pad)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden (S, Dm) rows of forward's output -> logits (S, V) float32."""
        logits = self.backend.gemm.linear(self.norm(hidden), self.lm_head)
        return logits.float() if out is None else out.copy_(logits)

    def forward_mtp(
        self, batch: ForwardBatch, hidden: torch.Tensor, kv_caches: Sequence[PagedKVCache], depth: int = 0
    ) -> torch.Tensor:
        raise ValueError("DeepSeek-V4.1's DSpark draft layers run as the DFlash drafter (method 'dflash')")

    def compute_mtp_logits(self, hidden: torch.Tensor, depth: int = 0) -> torch.Tensor:
        raise ValueError("DeepSeek-V4.1's DSpark draft layers run as the DFlash drafter (method 'dflash')")

    def load_weights(self, reader: WeightSource) -> None:
        """DeepSeek's names, with or without a `model.` prefix; the draft layers' (mtp.*) load
        into the DFlash drafter when it is built, else are left unread (marked skipped), and so
        are a vision tower's (vision.*, aligner.*, image_*) where config.json has no
        vision_config."""
        c, v41, dtype = self.config, self.v41, self.dtype
        root = "model." if reader.has("model.embed.weight") else ""
        shape = (c.vocab_size, c.hidden_size)
        self.embed_tokens = reader.get(f"{root}embed.weight", shape, dtype)
        vision = self.vision is not None
        for i, layer in enumerate(self.layers):
            cast(V41Block, layer).load(reader, f"{root}layers.{i}", dtype, c.vocab_size, vision)
        if self.vision is not None:
            self.vision.load(reader, root)
        self.norm.weight = load_f32(reader, f"{root}norm.weight", (c.hidden_size,))
        if not v41.hc_shifted:
            n = v41.hc_mult
            self.hc_head_fn = load_f32(reader, f"{root}hc_head_fn", (n, n * c.hidden_size))
            self.hc_head_base = load_f32(reader, f"{root}hc_head_base", (n,))
            self.hc_head_scale = load_f32(reader, f"{root}hc_head_scale", (1,))
        self.lm_head = (
            self.embed_tokens if c.tie_word_embeddings else reader.get(f"{root}head.weight", shape, dtype)
        )
        if self.dflash is not None:
            self.dflash.load(reader, root, dtype, c.vocab_size)
        for name in list(reader.location):
            plain = name.removeprefix("model.")
            if (self.dflash is None and plain.startswith("mtp.")) or (
                self.vision is None and plain.startswith(("vision.", "aligner.", "image_"))
            ):
                reader.skip(name)
