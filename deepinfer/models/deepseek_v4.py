"""DeepSeek-V4 (V4-Flash), in the paper's order: config -> caches -> attention (sliding window,
compressor, lightning indexer, grouped output) -> MoE (hash or sqrtsoftplus routing, clamped
SwiGLU) -> block with hyper-connections -> model. Written only against the backend contract.

Symbols: T tokens in the step, H heads, D head_dim (one K = V head), R rotated tail of D,
N hc_mult residual streams, Dm hidden, m compression ratio, W compressed entries closed in this
step, S slots pooled per entry (m, or 2m for CSA's overlapping windows), Hi / Di indexer heads /
head width, G o_groups, E experts, K experts per token.

Every layer attends to a sliding window of its own K = V rows. A CSA layer (m = 4) adds
compressed entries, each a gated pool of 2m overlapping tokens' projections, of which a lightning
indexer picks the top index_topk per query; an HCA layer (m = 128) adds entries pooled from m
tokens each, all visible. Entry w pools tokens up to (w+1)m - 1 and is visible to queries from
that position on.

Caches (paged by the engine, rows of D values but the index keys' Di; a wider row spans several
caches, see WideCache):
  window     one row per token: its K = V row (rms-normed, tail rotated).
  compressed one row per compressed entry w (row w of its block table).
  state      the compressor's projections of each token ([kv | gate], 2 or 4 rows of D): what
             the entries that close in a later step pool (chunked prefill, decode, recompute after
             preemption all read them back), so no state lives outside the paged caches.
  index keys / index state: the indexer's compressed keys and its compressor's projections.
They form KVCacheGroups (cache_groups): the per-token caches (window, state, index state) are
read at most L = `ring_lookback` positions before a step's first token, so each request keeps
them in a RING of R = L + 1 + k rows rounded up to whole blocks (k: the most drafts a
verification step carries, 0 without speculative decoding; position p at row p mod R): its
window and state memory stay constant however long it grows. A step in which a request computes
at most R - L tokens (decode, verification and draft steps: those graphs replay) writes them in
the ring in place, replacing only positions older than its first token's lookback. A longer step
of a request (a prefill chunk, a recompute after preemption) writes its rows to step-scratch
blocks, a pool shared by the step's requests, whose first column is copied from the ring before
the forward and whose last R positions are copied back after it (deepinfer.engine.ring): the
ring then holds what writing every row in place would have left, and a request's tokens per
step are bounded by the step's budget only. A ring of L + C rows (C the longest step) would
cost V4-Flash 640 rows per request (C = 512) where 128 + k suffice; the scratch costs the step's
tokens once for all requests. The entry caches grow by one row per m tokens, one group per ratio
(1/4 and 1/128: HCA entries do not take CSA-sized blocks), and the indexer keys in a group of
their own (index/4: rows Di wide, where the entries' are D: V4-Flash's keys take 256 B an entry,
not 1,024), each group paged by its own block table. The attention ops see the ring
through a block table whose column i is ring block i % (R / BS) (a scratch block for the columns
of a long step's positions): key position j is read at block j // BS, row j % BS as in any paged
cache, and nothing older than R positions is ever read. Given one block table only (an empty
ForwardBatch.group_block_tables, as tests and tools drive it), every cache is paged by it, one
row per token position (entry w at row w).

Prefix caching (engine.kv_cache.GroupedBlockManager; docs/prefix_caching.md) is exact, at
multiples P of the block size: what a step that starts at P reads is (a) the entries w < P // m
of each ratio, each pooled from tokens up to (w+1)m - 1 only, so a function of the prefix: the
full entry blocks (and indexer-key blocks) are shared, the last, partly filled one is copied
into a block of the request's own; and (b) the ring's rows of positions [P - L, P): each full
token block's ring rows (window, compressor and indexer state of every layer) are copied after
the step that computes them into a pool of retained blocks, and a hit copies the ceil(L / BS)
blocks before P into its ring. Recomputing the last window instead would not be exact: a
layer's window rows come from the hidden states of the layer below over its own window, so what
a recompute must cover grows by window - 1 positions a layer (V4-Flash: 43 x 127). A ring row
takes far more bytes than the entries a token adds (V4-Flash: 189 caches a token against 6.5),
so the retained pool is sized apart (EngineConfig.prefix_ring_blocks; default the entry pools'
bytes) and evicts least recently used blocks first. Not with speculative decoding (the MTP
head's ring rows are not retained).
Decode and verification steps, and the MTP head's chained drafts, replay
graphs: the entries that close in a step where every request computes q tokens (1, or 1 + k
with padding drafts) are found on the device from its lengths and slots (NewEntries.build), so
the forward reads no length on the host; an entry whose closing row is padding (slot -1: a
padding draft, a row past the positions the request's blocks cover) stores nothing.

Speculative decoding (V4MTPLayer, DeepSeek's MTPBlock): the MTP layer reads the last block's
streams and the next token's embedding, and runs a block of its own layer type over caches of
its own: more rows of the same groups (cache_groups(..., mtp_layers)), which the engine pages,
frees and preempts with the model's. Rejected drafts need no undo: every per-token row (window,
compressor and indexer state) sits at its position, and the entries closing at a position are
pooled again from those rows whenever a step computes that position, so the step that computes
a rejected draft's position again overwrites all it wrote (a verified step's entries equal plain
decoding's); a row past the request's length is never read. The ring holds L + 1 + k rows
or more, so a verification step's 1 + k rows never replace a row that the step after its
rollback reads (the last draft's replaces the one just outside the first query's window).

Tensor names are those transformers' save_pretrained writes for DeepseekV4ForCausalLM (DeepSeek's
published names under a `model.` prefix: model.layers.{i}.attn.wq_a.weight, ...); DeepSeek's own
layout without the prefix (embed.weight, layers.{i}...) loads too. The MTP layers (transformers
saves none) load from DeepSeek's mtp.{k}.* (with or without the prefix) or from layers past
num_hidden_layers.

Weights load as the checkpoint stores them (see loader.CheckpointReader.linear). DeepSeek's
published V4 checkpoints: the linears FP8 e4m3 with a UE8M0 scale per 128x128 block (`.scale`),
except the compressors' projections, the indexer's weights_proj and the router (stored_in_fp8);
the routed experts MXFP4 (deepinfer.backend.fp4; V4-Flash-Base: FP8); embedding, head, norms
and mixing parameters in bf16 / float32. FP8 linears run through gemm.linear_fp8, FP8 wo_a
through gemm.batched_linear_fp8 (one product per output group), the routed experts through
moe.fused_moe with the clamped SwiGLU (MXFP4 or FP8 experts: grouped_gemm_fp4 / _fp8 by default).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from deepinfer.backend.fp8 import FP8_BLOCK, dequantize_weight
from deepinfer.backend.kv_formats_v41 import RowFormat
from deepinfer.backend.ops import Backend
from deepinfer.backend.types import AttentionModifiers, KVCacheSpec, PagedKVCache, RouterConfig
from deepinfer.models.config import ModelConfig, V4Config
from deepinfer.models.deepseek import SPECULATIVE_PADDING_POSITIONS
from deepinfer.models.forward_batch import ForwardBatch, KVCacheGroup
from deepinfer.models.interface import check_kv_cache_dtype
from deepinfer.models.layers import Linear, RMSNorm, concat_linears, fuse_gate_up, fusion_enabled
from deepinfer.models.rope import cos_sin_cache
from deepinfer.parallel.expert_parallel import ExpertParallel, routed_experts

if TYPE_CHECKING:
    from deepinfer.models.dflash import DFlashHeads
    from deepinfer.models.drafter import BlockDrafter
    from deepinfer.models.weights import WeightSource


def load_f32(reader: WeightSource, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Norm weights, sinks, biases and mixing parameters stay float32 (as transformers keeps them)."""
    return reader.get(name, shape, torch.float32)


def rope_tail(
    backend: Backend, x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """Interleaved rope on the last R channels of x (T, H, D); table (P, R) [cos | sin].
    inverse: rotate by -angle instead (small.rope_tail: one op, a new tensor)."""
    return backend.small.rope_tail(x, positions, table, inverse)


def grouped_output(backend: Backend, wo_a: Linear, o_rank: int, per_group: torch.Tensor) -> torch.Tensor:
    """The grouped low-rank output: (G, T, H*D/G) -> (G, T, o_rank), group g through rows
    [g*r, (g+1)*r) of wo_a. FP8: gemm.batched_linear_fp8 with each group's (r/b, Kb) scale
    blocks, b = wo_a.block (keep_grouped_fp8: wo_a stays FP8 only when r is a multiple of b)."""
    gemm, g, k = backend.gemm, per_group.shape[0], per_group.shape[2]
    w, scale = wo_a.weight.view(g, o_rank, k), wo_a.weight_scale_inv
    if scale is None:
        return gemm.batched_linear(per_group, w)
    return gemm.batched_linear_fp8(per_group, w, scale.view(g, -1, scale.shape[-1]), block=wo_a.block)


def keep_grouped_fp8(wo_a: Linear, o_rank: int, dtype: torch.dtype) -> None:
    """After wo_a loads: where a scale block (wo_a.block rows) would span two output groups (o_rank
    not a multiple of it), no per-group FP8 weight exists, so wo_a is dequantised to `dtype` (as
    DeepSeek's own V4 inference code keeps it, in bf16)."""
    scale = wo_a.weight_scale_inv
    if scale is not None and o_rank % wo_a.block:
        wo_a.weight = dequantize_weight(wo_a.weight, scale, wo_a.block).to(dtype)
        wo_a.weight_scale_inv = None


def stored_in_fp8(prefix: str) -> bool:
    """Whether DeepSeek's FP8 checkpoints store linear `prefix` in FP8 (a tensor name without
    `.weight`): every linear but the compressors' projections (`...compressor.wkv` / `wgate`,
    the indexer's too), the indexer's weights_proj and the router (`...ffn.gate`), which they keep
    in bf16 / float32. Random FP8 weights and the test checkpoints follow it."""
    return ".compressor." not in prefix and not prefix.endswith((".weights_proj", ".gate"))


# --------------------------------------------------------------------------- caches

# The per-token caches: a step reads them at most ring_lookback positions before its first token.
RING_KINDS = ("window", "state", "index_state")


def cache_kinds(config: ModelConfig, ratio: int) -> list[tuple[str, int]]:
    """(kind, row width) of the caches of a layer of compression `ratio` (0: sliding window only),
    in LayerCaches order. A compressor's state row is [kv | gate], each 2 series wide for CSA."""
    v4 = config.v4
    assert v4 is not None
    d, di = v4.head_dim, v4.index_head_dim
    kinds = [("window", d)]
    if ratio:
        series = 2 if ratio == v4.csa_ratio else 1
        kinds += [("compressed", d), ("state", 2 * series * d)]
    if ratio == v4.csa_ratio:
        kinds += [("index_keys", di), ("index_state", 2 * 2 * di)]
    return kinds


def ring_lookback(v4: V4Config) -> int:
    """Positions before a step's first token that the step reads: window - 1 (the first query's
    keys); 2m - 1 for CSA (the first entry closing in the step pools the window before its own);
    m - 1 for HCA."""
    ratios = set(v4.compress_ratios)
    back = v4.sliding_window - 1
    if v4.csa_ratio in ratios:
        back = max(back, 2 * v4.csa_ratio - 1)
    if v4.hca_ratio in ratios:
        back = max(back, v4.hca_ratio - 1)
    return back


def _group_key(kind: str, ratio: int) -> tuple[int, int]:
    """The group of a cache, in cache_groups' order: (0, 0) the ring; (1, m) the entries of ratio
    m; (2, m) the indexer keys of ratio m (rows Di wide)."""
    if kind in RING_KINDS:
        return (0, 0)
    return (2, ratio) if kind == "index_keys" else (1, ratio)


def _row_dim(v4: V4Config, key: tuple[int, int]) -> int:
    """The row width of group `key`'s caches: Di for the indexer keys, D for the others."""
    return v4.index_head_dim if key[0] == 2 else v4.head_dim


def cache_groups(
    config: ModelConfig, block_size: int, max_backtrack: int = 0, mtp_layers: int = 0
) -> list[KVCacheGroup]:
    """The ring, then one entry group per compression ratio (ascending), then the indexer keys'
    group ("index/4": CSA's ratio, rows Di wide, not D: 1/4 of the bytes). The ring holds
    R = ceil((L + 1 + max_backtrack) / BS) blocks (L = ring_lookback): a step of up to
    R - L tokens per request (a verification step's 1 + max_backtrack) writes it in place and
    reads only rows it holds; longer steps go through step scratch (deepinfer.engine.ring).
    max_backtrack: the most drafts a verification step carries (rolled back when rejected).
    mtp_layers: the first MTP layers whose caches the groups also hold (the last
    num_mtp_caches of each group)."""
    v4 = config.v4
    assert v4 is not None
    counts: dict[tuple[int, int], int] = {}
    mtp_counts: dict[tuple[int, int], int] = {}
    ratios = v4.compress_ratios + v4.mtp_compress_ratios[:mtp_layers]
    for i, ratio in enumerate(ratios):
        for kind, width in cache_kinds(config, ratio):
            key = _group_key(kind, ratio)
            n = WideCache.count(width, _row_dim(v4, key))
            counts[key] = counts.get(key, 0) + n
            if i >= len(v4.compress_ratios):
                mtp_counts[key] = mtp_counts.get(key, 0) + n
    lookback = ring_lookback(v4)
    ring = -(-(lookback + 1 + max_backtrack) // block_size)
    groups = [
        KVCacheGroup(
            "ring", counts[(0, 0)], ring_blocks=ring, num_mtp_caches=mtp_counts.get((0, 0), 0),
            ring_lookback=lookback,
        )
    ]  # fmt: skip
    for key in sorted(counts)[1:]:
        keys, m = key[0] == 2, key[1]
        name, row_dim = (f"index/{m}", v4.index_head_dim) if keys else (f"entries/{m}", None)
        groups.append(
            KVCacheGroup(name, counts[key], ratio=m, num_mtp_caches=mtp_counts.get(key, 0), row_dim=row_dim)
        )
    return groups


def _cache_slices(config: ModelConfig, ratios: Sequence[int]) -> list[dict[str, tuple[int, int, int]]]:
    """Per layer of compression ratios[i], kind -> (first, end, width): where its caches sit in a
    flat cache list laid out group by group (cache_groups' order), layer by layer within a group."""
    v4 = config.v4
    assert v4 is not None
    kinds = [cache_kinds(config, r) for r in ratios]
    out: list[dict[str, tuple[int, int, int]]] = [{} for _ in kinds]
    at = 0
    for key in sorted({_group_key(k, r) for r, ks in zip(ratios, kinds) for k, _ in ks}):
        for i, (ratio, layer_kinds) in enumerate(zip(ratios, kinds)):
            for kind, width in layer_kinds:
                if _group_key(kind, ratio) == key:
                    n = WideCache.count(width, _row_dim(v4, key))
                    out[i][kind] = (at, at + n, width)
                    at += n
    return out


class WideCache:
    """Rows wider than one cache row (D; Di in the indexer keys' group), split over
    ceil(width / D) caches of the same blocks."""

    def __init__(self, caches: Sequence[PagedKVCache], width: int) -> None:
        self.caches, self.width = list(caches), width

    @staticmethod
    def count(width: int, d: int) -> int:
        return -(-width // d)

    def write(self, backend: Backend, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """rows (n, width) -> the caches at slots (n,) (-1 skips a row)."""
        d = self.caches[0].spec.head_dim
        assert rows.shape[1] <= d * len(self.caches), "rows wider than their caches"
        if rows.shape[1] < d * len(self.caches):  # the last cache's row only partly filled
            rows = nn.functional.pad(rows, (0, d * len(self.caches) - rows.shape[1]))
        for i, cache in enumerate(self.caches):
            backend.kv_cache.write_kv(cache, rows[:, i * d : (i + 1) * d], slots)

    def read(self, backend: Backend, slots: torch.Tensor) -> torch.Tensor:
        """(n, width) rows at slots (n,) int64."""
        parts = [backend.kv_cache.read_kv(cache, slots) for cache in self.caches]
        return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1))[:, : self.width]

    def read_segments(self, backend: Backend, slots: torch.Tensor, seg: int) -> list[torch.Tensor]:
        """The rows at slots (n,) int64 as width // seg column segments of (n, seg) each (a
        compressor's [kv | gate] series), every cache read once; a segment inside one cache is a
        view of its rows (no concatenation)."""
        d = self.caches[0].spec.head_dim
        parts = [backend.kv_cache.read_kv(cache, slots) for cache in self.caches]
        out = []
        for lo in range(0, self.width, seg):
            first, last = lo // d, (lo + seg - 1) // d
            if first == last:
                out.append(parts[first][:, lo - first * d : lo - first * d + seg])
            else:
                out.append(
                    torch.cat(parts[first : last + 1], dim=-1)[:, lo - first * d : lo - first * d + seg]
                )
        return out


@dataclass(frozen=True)
class NewEntries:
    """The compressed entries of one ratio that close in this step (W of them, any request).

    state_slots (W, S) int64: state-cache slot of each pooled token (0 where absent);
    present (W, S) bool: the token exists (CSA's first window has no previous one);
    out_slots (W,) int64: where entry w is stored (row w of its request's entry table);
    positions (W,) int64: the entry's rope position, w * m;
    key_slots (W,) int64: where the indexer's key of entry w is stored (row w of its request's
    index-key table; out_slots without one).
    State rows are found through batch.attn.block_tables (the ring's), entries through
    `entry_tables` (their group's block tables), indexer keys through `key_tables`.
    """

    state_slots: torch.Tensor
    present: torch.Tensor
    out_slots: torch.Tensor
    positions: torch.Tensor
    key_slots: torch.Tensor

    @staticmethod
    def build(
        backend: Backend,
        batch: ForwardBatch,
        ratio: int,
        overlap: bool,
        block_size: int,
        entry_tables: torch.Tensor,
        key_tables: torch.Tensor | None = None,
    ) -> NewEntries | None:
        """Entries w with (w+1)m - 1 among this step's positions: w in [start // m, end // m)
        for a request computing positions [start, end), and whose closing position the step
        writes (a padding row, slot -1, computes nothing: its entry stores nothing). None when
        there are none. Once per step and ratio, for every layer of that ratio
        (kv_cache.compressed_entries: in a step where every request computes q tokens, as a
        replayed graph does, found on the device from its lengths and slots, ceil(q / m)
        candidates per request, those that do not close storing nothing)."""
        found = backend.kv_cache.compressed_entries(
            batch.attn, batch.slot_mapping, entry_tables, key_tables, ratio=ratio, overlap=overlap,
            block_size=block_size,
        )  # fmt: skip
        return None if found is None else NewEntries(*found)


# --------------------------------------------------------------------------- compressor


class Compressor(nn.Module):
    """Gated pooling of m (HCA) or 2m overlapping (CSA) tokens into one compressed entry:
    entry_w = rope(rms_norm(sum_s softmax_s(gate_s + ape_s) * kv_s)) at position w*m.

    CSA projects each token to two series [a | b] (2 * width): entry w pools window w-1's `a`
    halves and window w's `b` halves (2m slots); HCA pools window w's single series (m slots).
    """

    def __init__(self, backend: Backend, config: ModelConfig, ratio: int, width: int, overlap: bool) -> None:
        super().__init__()
        self.backend, self.ratio, self.width, self.overlap = backend, ratio, width, overlap
        series = 2 if overlap else 1
        self.wkv = Linear(backend, config.hidden_size, series * width)
        self.wgate = Linear(backend, config.hidden_size, series * width)
        # wkv and wgate in one GEMM, [kv | gate] as the state rows store them (concat_linears at
        # load; None: two GEMMs and a cat, DEEPINFER_MODEL_UNFUSED=compressor)
        self.kv_gate: Linear | None = None
        self.norm = RMSNorm(backend, width, config.rms_norm_eps)
        self.register_buffer("ape", torch.empty(0, device="meta"))  # (m, series * width) float32
        # (S, width) float32: the position bias of each pooled slot (CSA: window w-1's `a` half
        # for slots 0..m-1, window w's `b` half for m..2m-1), set with ape at load
        self.register_buffer("slot_ape", torch.empty(0, device="meta"))

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        entries: NewEntries | None,
        state: WideCache,
        out: WideCache,
        table: torch.Tensor,
    ) -> None:
        """Stores this step's projections of x (T, Dm) in `state`, then pools the entries that
        close in this step into `out`."""
        small = self.backend.small
        if self.kv_gate is not None:
            proj = self.kv_gate(x)
        else:
            proj = torch.cat([self.wkv(x), self.wgate(x)], dim=-1)
        state.write(self.backend, proj, batch.slot_mapping)
        if entries is None:
            return
        w_count, span = entries.state_slots.shape
        # the row's series, each (W, S, width): [kv] [gate] (HCA) or [kv_a] [kv_b] [gate_a] [gate_b]
        segs = state.read_segments(self.backend, entries.state_slots.reshape(-1), self.width)
        segs = [t.view(w_count, span, -1) for t in segs]
        if self.overlap:  # slots 0..m-1: previous window's `a` half; m..2m-1: this window's `b` half
            m = self.ratio
            kv = torch.cat([segs[0][:, :m], segs[1][:, m:]], dim=1)
            gate = torch.cat([segs[2][:, :m], segs[3][:, m:]], dim=1)
        else:
            kv, gate = segs
        # logits gate + ape in float32, -inf where the slot's position does not exist
        pooled = small.compressor_pool(kv, gate, self.slot_ape, entries.present)  # (W, width)
        pooled = small.rms_norm(pooled, self.norm.weight, self.norm.eps)
        pooled = rope_tail(self.backend, pooled[:, None], entries.positions, table)[:, 0]
        out.write(self.backend, pooled, entries.out_slots)

    def load(self, reader: WeightSource, prefix: str, dtype: torch.dtype) -> None:
        self.wkv.load(reader, f"{prefix}.wkv", dtype)
        self.wgate.load(reader, f"{prefix}.wgate", dtype)
        if fusion_enabled("compressor", reader.unfused):
            self.kv_gate = concat_linears(self.backend, [self.wkv, self.wgate])
        self.norm.weight = load_f32(reader, f"{prefix}.norm.weight", (self.width,))
        self.ape = load_f32(reader, f"{prefix}.ape", (self.ratio, self.wkv.out_features))
        d = self.width
        self.slot_ape = torch.cat([self.ape[:, :d], self.ape[:, d:]]) if self.overlap else self.ape


class Indexer(nn.Module):
    """Lightning indexer: its own CSA compressor at Di, and queries from the attention's q_lora
    residual; each query keeps the index_topk compressed entries with the highest
    sum_h w_h relu(q_h . k) (backend.attention.indexer_topk)."""

    def __init__(self, backend: Backend, config: ModelConfig, v4: V4Config, ratio: int) -> None:
        super().__init__()
        self.backend, self.ratio = backend, ratio
        self.heads, self.dim, self.topk = v4.index_n_heads, v4.index_head_dim, v4.index_topk
        assert config.q_lora_rank is not None
        self.compressor = Compressor(backend, config, ratio, self.dim, overlap=True)
        self.wq_b = Linear(backend, config.q_lora_rank, self.heads * self.dim)
        self.weights_proj = Linear(backend, config.hidden_size, self.heads)

    def forward(
        self,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        batch: ForwardBatch,
        entries: NewEntries | None,
        state: WideCache,
        keys: WideCache,
        table: torch.Tensor,
        key_tables: torch.Tensor | None,
    ) -> torch.Tensor:
        """-> (T, index_topk) int32 compressed-entry ids per query, -1 unused. key_tables: the
        block tables of `keys` (None: batch.attn's); the keys closing in this step go to
        entries.key_slots."""
        key_entries = None if entries is None else dataclasses.replace(entries, out_slots=entries.key_slots)
        self.compressor(x, batch, key_entries, state, keys, table)
        q = self.wq_b(q_residual).view(-1, self.heads, self.dim)  # (T, Hi, Di)
        q = rope_tail(self.backend, q, batch.positions, table)
        weights = self.weights_proj(x).float() * self.heads**-0.5  # (T, Hi)
        meta = batch.attn if key_tables is None else dataclasses.replace(batch.attn, block_tables=key_tables)
        return self.backend.attention.indexer_topk(
            q, weights, keys.caches[0], meta, ratio=self.ratio, topk=self.topk, scale=self.dim**-0.5
        )

    def load(self, reader: WeightSource, prefix: str, dtype: torch.dtype) -> None:
        self.compressor.load(reader, f"{prefix}.compressor", dtype)
        self.wq_b.load(reader, f"{prefix}.wq_b", dtype)
        self.weights_proj.load(reader, f"{prefix}.weights_proj", dtype)


# --------------------------------------------------------------------------- attention


@dataclass
class LayerCaches:
    """One layer's caches (see the module docstring); None where its kind has none.
    entry_tables (B, MBc) int32: the block tables of compressed, key_tables (B, MBi) those of
    index_keys (None: the step's attn.block_tables)."""

    window: PagedKVCache
    compressed: WideCache | None = None
    state: WideCache | None = None
    index_keys: WideCache | None = None
    index_state: WideCache | None = None
    entry_tables: torch.Tensor | None = None
    key_tables: torch.Tensor | None = None


class SharedKVAttention(nn.Module):
    """The attention both V4 and V4.1 build on: MQA over one shared K = V head of head_dim D
    with a partial rope tail, per-head sinks and a sliding window; the query through a low rank
    (wq_a, q_norm, wq_b), the grouped low-rank output (G groups of H/G heads -> o_lora_rank each,
    then one mix to Dm). Subclasses add the compressed branch; their forward is project ->
    window or compressed attention -> output."""

    ones: torch.Tensor  # (D,) the unweighted per-head query norm's weight
    QUERY_NORM = True  # V4 normalises each head's query (unweighted RMSNorm); V4.1 does not
    KV_NORM_NAME = "norm"  # the checkpoint name of the K = V projection's norm under {prefix}.

    def __init__(self, backend: Backend, config: ModelConfig, head_dim: int, window: int, o_groups: int,
                 o_lora_rank: int) -> None:  # fmt: skip
        super().__init__()
        c, d = config, head_dim
        assert c.q_lora_rank is not None
        self.backend = backend
        self.heads, self.dim, self.eps = c.num_attention_heads, d, c.rms_norm_eps
        self.window, self.groups, self.o_rank = window, o_groups, o_lora_rank
        self.wq_a = Linear(backend, c.hidden_size, c.q_lora_rank)
        self.q_norm = RMSNorm(backend, c.q_lora_rank, c.rms_norm_eps)
        self.wq_b = Linear(backend, c.q_lora_rank, self.heads * d)
        self.wkv = Linear(backend, c.hidden_size, d)
        self.kv_norm = RMSNorm(backend, d, c.rms_norm_eps)
        self.wo_a = Linear(backend, self.heads * d // self.groups, self.groups * self.o_rank)
        self.wo_b = Linear(backend, self.groups * self.o_rank, c.hidden_size)
        self.register_buffer("attn_sink", torch.empty(0, device="meta"))  # (H,) float32
        if self.QUERY_NORM:
            self.register_buffer("ones", torch.ones(d, device=backend.device.device()), persistent=False)

    def project(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        window: PagedKVCache,
        table: torch.Tensor,
        window_format: RowFormat | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, Dm) -> (q_residual (T, q_lora_rank), q (T, H, D) roped); this step's K = V rows
        (T, D), roped, written into the window cache (quantised to window_format: V4.1's rows)."""
        backend, t, pos = self.backend, x.shape[0], batch.positions
        q_residual = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_residual).view(t, self.heads, self.dim)
        if self.QUERY_NORM:
            q = backend.small.rms_norm(q, self.ones, self.eps)
        q = rope_tail(backend, q, pos, table)
        kv = rope_tail(backend, self.kv_norm(self.wkv(x))[:, None], pos, table)[:, 0]
        backend.kv_cache.write_kv_rows(window, kv, batch.slot_mapping, window_format)
        return q_residual, q

    def window_attention(self, q: torch.Tensor, batch: ForwardBatch, window: PagedKVCache) -> torch.Tensor:
        """Sliding-window-only layers: (T, H, D) over the window ring, with the sinks."""
        mods = AttentionModifiers(window=self.window, sinks=self.attn_sink)
        attend = (
            self.backend.attention.decode if batch.attn.is_decode_only else self.backend.attention.prefill
        )
        return attend(q, window, batch.attn, scale=self.dim**-0.5, v_dim=self.dim, modifiers=mods)

    def compressed_attention(
        self, q: torch.Tensor, batch: ForwardBatch, caches: LayerCaches, ratio: int, topk: torch.Tensor | None
    ) -> torch.Tensor:
        """The window plus the compressed entries (all of them, or the indexer's top-k)."""
        assert caches.compressed is not None
        mods = AttentionModifiers(window=self.window, sinks=self.attn_sink, topk_indices=topk)
        return self.backend.attention.compressed_attention(
            q, caches.window, caches.compressed.caches[0], batch.attn, scale=self.dim**-0.5, ratio=ratio,
            modifiers=mods, compressed_block_tables=caches.entry_tables,
        )  # fmt: skip

    def output(self, o: torch.Tensor, batch: ForwardBatch, table: torch.Tensor) -> torch.Tensor:
        """(T, H, D) attention output -> (T, Dm). V = K carries the keys' rotation: rotating the
        output back by its own position leaves each entry's contribution a function of the
        relative distance. Then the grouped output: (G, T, H*D/G) -> (T, G, o_lora_rank) -> wo_b."""
        t = o.shape[0]
        o = rope_tail(self.backend, o, batch.positions, table, inverse=True)
        per_group = o.reshape(t, self.groups, -1).transpose(0, 1)
        grouped = grouped_output(self.backend, self.wo_a, self.o_rank, per_group).transpose(0, 1)
        out: torch.Tensor = self.wo_b(grouped.reshape(t, -1))
        return out

    def load_projections(self, reader: WeightSource, prefix: str, dtype: torch.dtype) -> None:
        for name in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b"):
            getattr(self, name).load(reader, f"{prefix}.{name}", dtype)
        keep_grouped_fp8(self.wo_a, self.o_rank, dtype)
        self.q_norm.weight = load_f32(reader, f"{prefix}.q_norm.weight", (self.q_norm.dim,))
        self.kv_norm.weight = load_f32(reader, f"{prefix}.{self.KV_NORM_NAME}.weight", (self.dim,))
        self.attn_sink = load_f32(reader, f"{prefix}.attn_sink", (self.heads,))


class V4Attention(SharedKVAttention):
    """V4's: the shared K = V attention with, by the layer's ratio, nothing more (sliding window
    only), a compressed branch over all entries (HCA) or over the indexer's top-k of overlapping
    windows' entries (CSA)."""

    def __init__(self, backend: Backend, config: ModelConfig, v4: V4Config, ratio: int) -> None:
        super().__init__(backend, config, v4.head_dim, v4.sliding_window, v4.o_groups, v4.o_lora_rank)
        self.ratio = ratio
        csa = ratio == v4.csa_ratio
        self.compressor = Compressor(backend, config, ratio, v4.head_dim, overlap=csa) if ratio else None
        self.indexer = Indexer(backend, config, v4, ratio) if csa else None

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        caches: LayerCaches,
        entries: NewEntries | None,
        table: torch.Tensor,
    ) -> torch.Tensor:
        """x (T, Dm) -> (T, Dm). table: this layer's rope (main for sliding-only layers, compress
        otherwise)."""
        q_residual, q = self.project(x, batch, caches.window, table)
        if self.compressor is None:
            return self.output(self.window_attention(q, batch, caches.window), batch, table)
        assert caches.compressed is not None and caches.state is not None
        self.compressor(x, batch, entries, caches.state, caches.compressed, table)
        topk = None
        if self.indexer is not None:
            assert caches.index_state is not None and caches.index_keys is not None
            topk = self.indexer(
                x, q_residual, batch, entries, caches.index_state, caches.index_keys, table, caches.key_tables
            )
        return self.output(self.compressed_attention(q, batch, caches, self.ratio, topk), batch, table)

    def load(self, reader: WeightSource, prefix: str, dtype: torch.dtype) -> None:
        self.load_projections(reader, prefix, dtype)
        if self.compressor is not None:
            self.compressor.load(reader, f"{prefix}.compressor", dtype)
        if self.indexer is not None:
            self.indexer.load(reader, f"{prefix}.indexer", dtype)


# --------------------------------------------------------------------------- MoE


class V4MoE(nn.Module):
    """Routed experts (K of E, sqrtsoftplus scores renormalised and scaled; selection by the
    router's top-k with its correction bias, or by the fixed tid2eid table in hash layers) plus
    one shared expert, every SwiGLU clamped at swiglu_limit. The router's scores are float32
    products of x and the float32 gate (moe.select_experts), as V2 / V3's; transformers' V4 takes
    them in the model dtype, which in bfloat16 rounds the logits before routing.

    With expert parallelism (deepinfer.parallel.expert_parallel) the layer holds only its rank's
    routed experts (self.held: the logical expert of each of its slots; with EPLB redundant
    replicas too); the router, the hash table and the shared expert stay on every
    rank, and every rank runs forward (possibly with no tokens) the same number of times."""

    def __init__(
        self,
        backend: Backend,
        config: ModelConfig,
        swiglu_limit: float,
        hashed: bool,
        ep: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        c = config
        self.backend, self.hashed, self.limit = backend, hashed, swiglu_limit
        self.num_experts, self.hidden, self.inter = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
        self.ep = ep
        # rank r holds the expert slots [bounds[r], bounds[r + 1]) (all of them without EP): with
        # EPLB E + R physical ones whose logical experts self.eplb maps (deepinfer.parallel.eplb)
        e = self.num_experts
        self.bounds = ep.expert_bounds(ep.num_physical(e)) if ep is not None else [0, e]
        rank = ep.rank if ep is not None else 0
        self.local = range(self.bounds[rank], self.bounds[rank + 1])
        self.held = ep.held_experts(e) if ep is not None else list(range(e))  # slot -> logical expert
        self.eplb = ep.expert_map(e, backend.device.device()) if ep is not None else None
        self.router = RouterConfig(
            scoring=c.scoring_func,  # type: ignore[arg-type]
            top_k=c.num_experts_per_tok,
            renormalize=True,
            routed_scaling_factor=c.routed_scaling_factor,
        )
        self.shared_gate_up = Linear(backend, c.hidden_size, 2 * c.moe_intermediate_size)
        self.shared_down = Linear(backend, c.moe_intermediate_size, c.hidden_size)
        self.bias_vl: torch.Tensor | None = None  # (E,) float32: image tokens' bias (V4.1's bias_vl)
        for name in ("gate_weight", "w13", "w2", "bias", "tid2eid"):
            self.register_buffer(name, torch.empty(0, device="meta"))
        self.register_buffer("w13_scale", None)
        self.register_buffer("w2_scale", None)
        # E' = this rank's routed experts (E without expert parallelism)
        # w13 (E', 2I, Dm) = [gate; up], w2 (E', Dm, I) in the model dtype, no scales; or
        #   FP8: e4m3, each half of w13 padded to whole 128-row blocks (layers.fuse_gate_up), block
        #   scales (E, 2I'/128, Dm/128), (E, Dm/128, I'/128) float32;
        #   MXFP4: packed uint8 (E, 2I, Dm/2), (E, Dm, I/2), UE8M0 bytes (E, 2I, Dm/32), (E, Dm, I/32).
        # gate_weight (E, Dm) float32 (routing is computed in float32), bias (E,) float32,
        # tid2eid (V, K) int64

    def forward(
        self,
        x: torch.Tensor,
        input_ids: torch.Tensor,
        fixed_exchange: bool = False,
        image_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (T, Dm), input_ids (T,) -> (T, Dm). fixed_exchange (expert parallelism): every rank
        runs this layer with the same T (a graph step: ForwardBatch.fixed_exchange). image_mask
        (T,) bool (DeepSeek-V4.1's image tokens): those rows select with bias_vl instead of bias."""
        moe, small = self.backend.moe, self.backend.small
        if self.hashed:
            hash_ids = self.tid2eid[input_ids]
            weights, ids = moe.select_experts(x, self.gate_weight, self.router, hash_ids=hash_ids)
        else:
            weights, ids = moe.select_experts(x, self.gate_weight, self.router, correction_bias=self.bias)
            if image_mask is not None and self.bias_vl is not None:  # both, then each row's own
                w_vl, ids_vl = moe.select_experts(
                    x, self.gate_weight, self.router, correction_bias=self.bias_vl
                )
                weights = torch.where(image_mask[:, None], w_vl, weights)
                ids = torch.where(image_mask[:, None], ids_vl, ids)
        if self.ep is None:
            routed = self._local_moe(x, weights, ids)
            shared = self.shared_down(small.clamped_silu_and_mul(self.shared_gate_up(x), self.limit))
            out: torch.Tensor = routed + shared
            return out
        if self.eplb is not None:  # logical -> physical experts, counted in eager steps
            ids = self.eplb.physical(weights, ids, record=not fixed_exchange)
        parts: list[torch.Tensor] = []

        def shared_expert() -> None:  # overlaps the last combine with two micro-batches
            parts.append(self.shared_down(small.clamped_silu_and_mul(self.shared_gate_up(x), self.limit)))

        routed = routed_experts(
            self.backend.collectives, self.ep, self.bounds, x, weights, ids, fixed_exchange,
            self._local_moe, shared_expert,
        )  # fmt: skip
        return routed + parts[0]

    def expert_tensors(self) -> list[torch.Tensor]:
        """The routed experts' tensors, (slots, ...) each (EPLB moves their rows)."""
        return [t for t in (self.w13, self.w2, self.w13_scale, self.w2_scale) if t is not None]

    def _local_moe(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's routed experts: x (R, Dm), weights / ids (R, K') of its own experts -> (R, Dm)."""
        return self.backend.moe.fused_moe(
            x, weights, ids, self.w13, self.w2, self.w13_scale, self.w2_scale, swiglu_limit=self.limit
        )

    def load(self, reader: WeightSource, prefix: str, dtype: torch.dtype, vocab_size: int) -> None:
        dm, i, e = self.hidden, self.inter, self.num_experts
        self.gate_weight = load_f32(reader, f"{prefix}.gate.weight", (e, dm))
        if self.hashed:
            self.tid2eid = reader.get_ids(f"{prefix}.gate.tid2eid", (vocab_size, self.router.top_k), e)
        else:
            self.bias = load_f32(reader, f"{prefix}.gate.bias", (e,))

        self._load_experts(reader, f"{prefix}.experts", dtype)
        sp = f"{prefix}.shared_experts"
        w13, s13, w2, s2 = fuse_gate_up(
            reader.linear(f"{sp}.w1", (i, dm), dtype),
            reader.linear(f"{sp}.w3", (i, dm), dtype),
            reader.linear(f"{sp}.w2", (dm, i), dtype),
            reader.fp8_block,
        )
        self.shared_gate_up.weight, self.shared_gate_up.weight_scale_inv = w13, s13
        self.shared_down.weight, self.shared_down.weight_scale_inv = w2, s2
        self.shared_gate_up.block = self.shared_down.block = reader.fp8_block

    def _load_experts(self, reader: WeightSource, ex: str, dtype: torch.dtype) -> None:
        """Every routed expert's w1 (gate), w3 (up), w2 (down), in one format for all of them
        (with expert parallelism: this rank's; the others' tensors are marked as known)."""
        dm, i = self.hidden, self.inter
        shapes = {"w1": (i, dm), "w3": (i, dm), "w2": (dm, i)}
        for k in sorted(set(range(self.num_experts)) - set(self.held)):
            for n in shapes:
                for suffix in ("weight", "scale", "weight_scale_inv"):
                    if reader.has(f"{ex}.{k}.{n}.{suffix}"):
                        reader.skip(f"{ex}.{k}.{n}.{suffix}")
        experts = [
            {n: reader.linear(f"{ex}.{k}.{n}", shape, dtype, fp4=True) for n, shape in shapes.items()}
            for k in self.held
        ]

        def fmt(w: torch.Tensor, s: torch.Tensor | None) -> str:
            return "float" if s is None else "MXFP4" if w.dtype == torch.uint8 else "FP8"

        formats = {fmt(*p) for parts in experts for p in parts.values()}
        if len(formats) > 1:
            raise ValueError(f"{ex}: the routed experts mix weight formats ({', '.join(sorted(formats))})")

        def stack(ts: list[torch.Tensor]) -> torch.Tensor:
            """One byte a value through uint8 (e4m3 has no stack kernel on every device)."""
            raw = [t.view(torch.uint8) if t.dtype.itemsize == 1 else t for t in ts]
            return torch.stack(raw).view(ts[0].dtype)

        if formats == {"FP8"}:
            if reader.fp8_block != FP8_BLOCK:  # moe.fused_moe's FP8 experts take 128-blocks
                raise ValueError(
                    f"{ex}: FP8 routed experts with {reader.fp8_block}x{reader.fp8_block} block scales are "
                    "not supported (DeepSeek-V4.1 publishes them in MXFP4; FP8 experts take 128x128 blocks)"
                )
            fused = [fuse_gate_up(p["w1"], p["w3"], p["w2"]) for p in experts]
            self.w13, self.w2 = stack([f[0] for f in fused]), stack([f[2] for f in fused])
            self.w13_scale = torch.stack([cast(torch.Tensor, f[1]) for f in fused])
            self.w2_scale = torch.stack([cast(torch.Tensor, f[3]) for f in fused])
            return
        # float, or MXFP4 (per-row scales: gate and up rows concatenate as they are)
        for name, parts in (("w13", ("w1", "w3")), ("w2", ("w2",))):
            setattr(self, name, stack([torch.cat([p[n][0] for n in parts]) for p in experts]))
            if formats == {"MXFP4"}:
                scales = [torch.cat([cast(torch.Tensor, p[n][1]) for n in parts]) for p in experts]
                setattr(self, f"{name}_scale", torch.stack(scales))


# --------------------------------------------------------------------------- block and model


class HyperConnection(nn.Module):
    """mHC around one block: its (pre, post, comb) weights come from the N streams themselves."""

    def __init__(
        self, backend: Backend, config: ModelConfig, hc_mult: int, hc_eps: float, iters: int
    ) -> None:
        super().__init__()
        self.backend, self.n, self.dm = backend, hc_mult, config.hidden_size
        self.norm_eps, self.hc_eps, self.iters = config.rms_norm_eps, hc_eps, iters
        for name in ("fn", "base", "scale"):
            self.register_buffer(name, torch.empty(0, device="meta"))

    def pre(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams (T, N, Dm) -> (block input (T, Dm), post (T, N), comb (T, N, N))."""
        return self.backend.small.hc_pre(
            streams, self.fn, self.base, self.scale, self.norm_eps, self.hc_eps, self.iters
        )

    def load(self, reader: WeightSource, prefix: str) -> None:
        k = (2 + self.n) * self.n
        self.fn = load_f32(reader, f"{prefix}_fn", (k, self.n * self.dm))
        self.base = load_f32(reader, f"{prefix}_base", (k,))
        self.scale = load_f32(reader, f"{prefix}_scale", (3,))


class V4Block(nn.Module):
    """streams += mHC(attention(norm(collapse(streams)))); then the same around the MoE.
    ratio: its compression ratio (0: sliding window only); hashed: its MoE routes by tid2eid."""

    def __init__(
        self,
        backend: Backend,
        config: ModelConfig,
        ratio: int,
        hashed: bool,
        ep: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        v4 = config.v4
        assert v4 is not None
        self.backend = backend
        self.ratio = ratio
        self.attn_norm = RMSNorm(backend, config.hidden_size, config.rms_norm_eps)
        self.attn = V4Attention(backend, config, v4, self.ratio)
        self.ffn_norm = RMSNorm(backend, config.hidden_size, config.rms_norm_eps)
        self.ffn = V4MoE(backend, config, v4.swiglu_limit, hashed, ep)
        hc = (v4.hc_mult, v4.hc_eps, v4.hc_sinkhorn_iters)
        self.hc_attn = HyperConnection(backend, config, *hc)
        self.hc_ffn = HyperConnection(backend, config, *hc)

    def forward(
        self,
        streams: torch.Tensor,
        batch: ForwardBatch,
        caches: LayerCaches,
        entries: NewEntries | None,
        table: torch.Tensor,
    ) -> torch.Tensor:
        """streams (T, N, Dm) -> (T, N, Dm)."""
        small = self.backend.small
        x, post, comb = self.hc_attn.pre(streams)
        a = self.attn(self.attn_norm(x), batch, caches, entries, table)
        streams = small.hc_post(a, streams, post, comb)
        x, post, comb = self.hc_ffn.pre(streams)
        f = self.ffn(self.ffn_norm(x), batch.input_ids, batch.fixed_exchange)
        return small.hc_post(f, streams, post, comb)

    def load(self, reader: WeightSource, prefix: str, dtype: torch.dtype, vocab_size: int) -> None:
        dm = (self.attn_norm.dim,)
        self.attn_norm.weight = load_f32(reader, f"{prefix}.attn_norm.weight", dm)
        self.ffn_norm.weight = load_f32(reader, f"{prefix}.ffn_norm.weight", dm)
        self.attn.load(reader, f"{prefix}.attn", dtype)
        self.ffn.load(reader, f"{prefix}.ffn", dtype, vocab_size)
        self.hc_attn.load(reader, f"{prefix}.hc_attn")
        self.hc_ffn.load(reader, f"{prefix}.hc_ffn")


class StreamHead(nn.Module):
    """The streams' way out to the vocabulary: the mHC collapse of the N streams (its own fn,
    base, scale), a norm, and the output matrix (the model's, shared by every head)."""

    fn: torch.Tensor  # (N, N Dm) float32
    base: torch.Tensor  # (N,) float32
    scale: torch.Tensor  # (1,) float32

    def __init__(self, backend: Backend, config: ModelConfig, v4: V4Config) -> None:
        super().__init__()
        self.backend, self.n, self.dm = backend, v4.hc_mult, config.hidden_size
        self.norm_eps, self.hc_eps = config.rms_norm_eps, v4.hc_eps
        self.norm = RMSNorm(backend, config.hidden_size, config.rms_norm_eps)
        for name in ("fn", "base", "scale"):
            self.register_buffer(name, torch.empty(0, device="meta"))

    def forward(
        self, streams: torch.Tensor, lm_head: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """streams (S, N, Dm), lm_head (V, Dm) -> logits (S, V) float32 (into `out` when given)."""
        x = self.backend.small.hc_head(streams, self.fn, self.base, self.scale, self.norm_eps, self.hc_eps)
        logits = self.backend.gemm.linear(self.norm(x), lm_head)
        return logits.float() if out is None else out.copy_(logits)

    def load(self, reader: WeightSource, norm: str, names: tuple[str, str, str]) -> None:
        """norm: its norm weight's name; names: those of fn, base and scale."""
        self.norm.weight = load_f32(reader, norm, (self.dm,))
        for attr, name, shape in zip(
            ("fn", "base", "scale"), names, ((self.n, self.n * self.dm), (self.n,), (1,))
        ):
            setattr(self, attr, load_f32(reader, name, shape))


class V4MTPLayer(nn.Module):
    """DeepSeek-V4's multi-token-prediction layer (mtp.{k}.* in DeepSeek's checkpoints; MTPBlock
    in DeepSeek's inference/model.py; transformers' DeepseekV4 has none). From the main model's
    last streams h_i (N, Dm) at position i (before its head) and token i+1:
      streams = e_proj(enorm(embed(t_{i+1}))) (the same for each stream) + h_proj(hnorm(h_i))
      -> a V4 block of its own layer type (compress_ratios[num_hidden_layers + k]) and caches
      -> its own StreamHead (collapse, norm) over the shared output matrix: logits of token i+2.
    The embedding and the output matrix are the main model's."""

    def __init__(
        self,
        backend: Backend,
        config: ModelConfig,
        v4: V4Config,
        ratio: int,
        hashed: bool,
        ep: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        dm, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(backend, dm, eps)
        self.hnorm = RMSNorm(backend, dm, eps)
        self.e_proj = Linear(backend, dm, dm)
        self.h_proj = Linear(backend, dm, dm)
        self.block = V4Block(backend, config, ratio, hashed, ep)
        self.head = StreamHead(backend, config, v4)

    def forward(
        self,
        embedded: torch.Tensor,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        caches: LayerCaches,
        entries: NewEntries | None,
        table: torch.Tensor,
    ) -> torch.Tensor:
        """embedded (T, Dm) of token i+1, hidden (T, N, Dm) at position i -> streams (T, N, Dm)."""
        t, n, dm = hidden.shape
        e = self.e_proj(self.enorm(embedded))  # (T, Dm)
        h = self.h_proj(self.hnorm(hidden).reshape(t * n, dm)).view(t, n, dm)
        out: torch.Tensor = self.block(e[:, None, :] + h, batch, caches, entries, table)
        return out

    def load(self, reader: WeightSource, prefix: str, dtype: torch.dtype, vocab_size: int) -> None:
        dm = (self.enorm.dim,)
        self.enorm.weight = load_f32(reader, f"{prefix}.enorm.weight", dm)
        self.hnorm.weight = load_f32(reader, f"{prefix}.hnorm.weight", dm)
        self.e_proj.load(reader, f"{prefix}.e_proj", dtype)
        self.h_proj.load(reader, f"{prefix}.h_proj", dtype)
        self.block.load(reader, prefix, dtype, vocab_size)
        names = (f"{prefix}.hc_head_fn", f"{prefix}.hc_head_base", f"{prefix}.hc_head_scale")
        self.head.load(reader, f"{prefix}.norm.weight", names)
        for copy in ("embed.weight", "head.weight"):  # copies of the shared ones, where stored
            if reader.has(f"{prefix}.{copy}"):
                reader.skip(f"{prefix}.{copy}")


def join_exchanges(layers: nn.ModuleList, embed: torch.Tensor, hidden_shape: tuple[int, ...]) -> torch.Tensor:
    """A forward over no tokens (an expert-parallel rank without requests): every layer's MoE
    exchange with no rows of this rank, which the other ranks' forwards wait for; attention has
    nothing to compute. -> the empty hidden states (0, *hidden_shape)."""
    x = embed.new_empty((0, embed.shape[1]))
    ids = torch.empty((0,), dtype=torch.int64, device=embed.device)
    for block in layers:
        cast(V4MoE, block.ffn)(x, ids)
    return embed.new_empty((0, *hidden_shape))


class DeepseekV4ForCausalLM(nn.Module):
    """The DeepSeek-V4 decoder over its paged caches (LayerCaches per layer, flattened into the
    engine's cache list: num_kv_layers caches, kv_cache_groups' caches in order, D-wide rows but
    the indexer keys' Di-wide ones).

    forward(batch, kv_caches) -> the last block's streams (T, N, Dm), the hidden state the MTP
    layer reads; compute_logits(rows) -> (S, V) float32 through the model's StreamHead. The MTP
    layers, when the checkpoint has them, run through forward_mtp (-> streams) and
    compute_mtp_logits, over their own caches: the last num_mtp_caches of each cache group
    (kv_cache_groups(..., mtp_layers)), paged by the same block tables. The engine interface is
    deepinfer.models.interface.CausalLM.
    """

    supports_graphs = True  # decode steps find their closing entries on the device
    supports_prefill_graphs = False  # its prefill steps page several cache groups (none yet)
    supports_drafts_with_graphs = True  # verification steps and the MTP head's drafts replay graphs
    supports_prefix_caching = True  # entries shared or copied, the ring's lookback restored (docstring)
    token_history = 0  # reads no earlier tokens than its KV cache holds

    def __init__(
        self,
        config: ModelConfig,
        backend: Backend,
        dtype: torch.dtype,
        expert_parallel: ExpertParallel | None = None,
    ) -> None:
        """expert_parallel: this rank's share of the routed experts (every layer's and the MTP
        layers'); attention, its window ring and compressed caches are the rank's own requests'."""
        super().__init__()
        v4 = config.v4
        if v4 is None:
            raise ValueError(f"DeepseekV4ForCausalLM needs a deepseek_v4 config, got {config.model_type!r}")
        self.config, self.v4, self.backend, self.dtype = config, v4, backend, dtype
        self.expert_parallel = expert_parallel
        self.register_buffer("embed_tokens", torch.empty(0, device="meta"))  # (V, Dm)
        self.layers = nn.ModuleList(
            V4Block(backend, config, ratio, hashed, expert_parallel)
            for ratio, hashed in zip(v4.compress_ratios, v4.hash_layers)
        )
        self.head = StreamHead(backend, config, v4)
        self.register_buffer("lm_head", torch.empty(0, device="meta"))  # (V, Dm)
        self.mtp = nn.ModuleList()  # filled by load_weights when the checkpoint has MTP weights
        self.drafter: BlockDrafter | None = None  # set by the loader when one is saved beside
        self.dflash: DFlashHeads | None = None  # not for V4 (deepinfer.models.dflash)
        # rows past max_position_embeddings serve only verification steps' padding drafts (up to
        # k positions past max_model_len, outputs discarded), as DeepSeek-V2's
        self.rope_positions = config.max_position_embeddings + SPECULATIVE_PADDING_POSITIONS
        device = backend.device.device()
        # (P, R) [cos | sin] tables: plain rope for sliding-only layers, the compressed branches'
        # own (compress_rope_theta, YaRN when configured) for CSA / HCA layers
        for name, rope in (("main_rope", config.rope), ("compress_rope", v4.compress_rope)):
            table = cos_sin_cache(rope, v4.rope_dim, self.rope_positions, device)
            self.register_buffer(name, table, persistent=False)
        self._slices = _cache_slices(config, v4.compress_ratios)
        # the groups after the ring (entries, indexer keys), in cache_groups' order
        kinds = {_group_key(k, r) for r in v4.compress_ratios for k, _ in cache_kinds(config, r)}
        self._group_keys = sorted(kinds - {(0, 0)})
        # the MTP caches of the first L MTP layers (cache_groups(..., L)): their count -> slices
        self._mtp_slices: dict[int, list[dict[str, tuple[int, int, int]]]] = {}
        for n in range(1, len(v4.mtp_compress_ratios) + 1):
            slices = _cache_slices(config, v4.mtp_compress_ratios[:n])
            self._mtp_slices[sum(b - a for s in slices for a, b, _ in s.values())] = slices

    # ------------------------------------------------------------------ engine interface

    def dflash_caches(self, kv_caches: Sequence[PagedKVCache]) -> list[PagedKVCache]:
        """None: V4 has no DFlash drafter (dflash stays None)."""
        return []

    @property
    def num_kv_layers(self) -> int:
        return sum(end - first for slices in self._slices for first, end, _ in slices.values())

    def use_kv_cache_dtype(self, kv_cache_dtype: str) -> None:
        """Only "auto": the caches in the model dtype."""
        check_kv_cache_dtype(kv_cache_dtype, ("auto",), self.config.model_type)

    def kv_cache_groups(
        self, block_size: int, max_backtrack: int = 0, mtp_layers: int = 0
    ) -> list[KVCacheGroup]:
        """The ring and the entry groups (cache_groups) for verification steps of at most
        max_backtrack drafts, with the caches of the first mtp_layers MTP layers."""
        return cache_groups(self.config, block_size, max_backtrack, mtp_layers)

    @property
    def num_mtp_layers(self) -> int:
        """MTP layers loaded (0 when the checkpoint has none, e.g. transformers' saves)."""
        return len(self.mtp)

    def kv_cache_spec(self, num_blocks: int, block_size: int) -> KVCacheSpec:
        """D-wide rows (wider rows span several caches, see WideCache); the indexer keys' group
        narrows it to Di (KVCacheGroup.cache_spec). Caches all of this spec (one block table
        only) serve too where Di <= D (V4's): a key row then fills the first Di values of a
        D-wide row."""
        return KVCacheSpec(num_blocks, block_size, self.v4.head_dim, 0, self.dtype)

    @staticmethod
    def _layer_caches(
        kv_caches: Sequence[PagedKVCache],
        slices: list[dict[str, tuple[int, int, int]]],
        ratios: Sequence[int],
        tables: dict[tuple[int, int], torch.Tensor],
    ) -> list[LayerCaches]:
        out = []
        for ratio, layer in zip(ratios, slices):
            wide = {kind: WideCache(kv_caches[a:b], width) for kind, (a, b, width) in layer.items()}
            window = wide.pop("window").caches[0]
            entry_tables, key_tables = tables.get((1, ratio)), tables.get((2, ratio))
            out.append(LayerCaches(window, **wide, entry_tables=entry_tables, key_tables=key_tables))
        return out

    @property
    def hidden_shape(self) -> tuple[int, int]:
        """One token's hidden state as forward returns it: its (N, Dm) streams."""
        return (self.v4.hc_mult, self.config.hidden_size)

    def _check_length(self, batch: ForwardBatch) -> None:
        if batch.attn.max_seq_len > self.rope_positions:
            raise ValueError(
                f"sequence length {batch.attn.max_seq_len} exceeds max_position_embeddings "
                f"({self.config.max_position_embeddings}) + {SPECULATIVE_PADDING_POSITIONS} padding positions"
            )

    def _entries(
        self, batch: ForwardBatch, ratios: Sequence[int], block_size: int
    ) -> tuple[dict[tuple[int, int], torch.Tensor], dict[int, NewEntries | None]]:
        """The block tables of the groups after the ring, by _group_key (given one table only,
        that one for each), and per compression ratio among `ratios` the entries that close in
        this step."""
        keys = self._group_keys
        tables = dict(zip(keys, batch.group_block_tables or [batch.attn.block_tables] * len(keys)))
        entries = {
            r: NewEntries.build(
                self.backend, batch, r, r == self.v4.csa_ratio, block_size, tables[(1, r)], tables.get((2, r))
            )
            for r in sorted(set(ratios) - {0})
        }
        return tables, entries

    def forward(self, batch: ForwardBatch, kv_caches: Sequence[PagedKVCache]) -> torch.Tensor:
        """(T, N, Dm) the last block's streams of every token in the batch."""
        v4 = self.v4
        self._check_length(batch)
        if len(kv_caches) != self.num_kv_layers:
            raise ValueError(f"expected {self.num_kv_layers} KV caches, got {len(kv_caches)}")
        if batch.num_tokens == 0:  # an expert-parallel rank with no requests: the exchanges only
            return join_exchanges(self.layers, self.embed_tokens, self.hidden_shape)
        tables, entries = self._entries(batch, v4.compress_ratios, kv_caches[0].spec.block_size)
        caches = self._layer_caches(kv_caches, self._slices, v4.compress_ratios, tables)
        x = nn.functional.embedding(batch.input_ids, self.embed_tokens)  # (T, Dm)
        streams = x[:, None, :].expand(-1, v4.hc_mult, -1).contiguous()  # (T, N, Dm)
        for block, layer_caches in zip(self.layers, caches):
            ratio = cast(V4Block, block).ratio
            table = self.compress_rope if ratio else self.main_rope
            streams = block(streams, batch, layer_caches, entries.get(ratio), table)
        return streams

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden (S, N, Dm) rows of forward's output -> logits (S, V) float32 (into `out` (S, V)
        float32 when given)."""
        logits: torch.Tensor = self.head(hidden, self.lm_head, out)
        return logits

    def forward_mtp(
        self,
        batch: ForwardBatch,
        hidden: torch.Tensor,
        kv_caches: Sequence[PagedKVCache],
        depth: int = 0,
    ) -> torch.Tensor:
        """MTP layer `depth`: batch.input_ids hold token i+1 for each row, batch.positions
        position i, and hidden (T, N, Dm) the streams at position i (forward's output, or this
        method's for a chained draft). Returns its streams (T, N, Dm); compute_mtp_logits of them
        predicts token i+2. kv_caches: the MTP caches of cache_groups(..., mtp_layers > depth),
        or, given one block table only (no group_block_tables), any such list."""
        if depth >= self.num_mtp_layers:
            raise ValueError(
                f"MTP depth {depth} requested but the checkpoint has {self.num_mtp_layers} MTP layers"
            )
        slices = self._mtp_slices.get(len(kv_caches))
        if slices is None or depth >= len(slices):
            raise ValueError(f"{len(kv_caches)} MTP caches do not hold MTP layer {depth}'s")
        mtp = cast(V4MTPLayer, self.mtp[depth])
        if batch.num_tokens == 0:  # an expert-parallel rank drafting nothing: the exchange only
            return join_exchanges(nn.ModuleList([mtp.block]), self.embed_tokens, self.hidden_shape)
        self._check_length(batch)
        ratio = mtp.block.ratio
        tables, entries = self._entries(batch, (ratio,), kv_caches[0].spec.block_size)
        ratios = self.v4.mtp_compress_ratios[: len(slices)]
        caches = self._layer_caches(kv_caches, slices, ratios, tables)[depth]
        table = self.compress_rope if ratio else self.main_rope
        embedded = nn.functional.embedding(batch.input_ids, self.embed_tokens)  # (T, Dm)
        out: torch.Tensor = mtp(embedded, hidden, batch, caches, entries.get(ratio), table)
        return out

    def compute_mtp_logits(self, hidden: torch.Tensor, depth: int = 0) -> torch.Tensor:
        """hidden (S, N, Dm) rows of forward_mtp(depth)'s output -> logits (S, V) float32."""
        out: torch.Tensor = cast(V4MTPLayer, self.mtp[depth]).head(hidden, self.lm_head)
        return out

    # ------------------------------------------------------------------ loading

    def load_weights(self, reader: WeightSource) -> None:
        """Read every tensor from `reader` (see deepinfer.models.loader), the MTP layers' where
        the checkpoint has them: mtp.{k}.* (DeepSeek's names, with or without the `model.`
        prefix) or layers.{num_hidden_layers + k}.*."""
        c, v4, dtype = self.config, self.v4, self.dtype
        root = "model." if reader.has("model.embed_tokens.weight") else ""
        shape = (c.vocab_size, c.hidden_size)
        self.embed_tokens = reader.get("model.embed_tokens.weight" if root else "embed.weight", shape, dtype)
        for i, layer in enumerate(self.layers):
            cast(V4Block, layer).load(reader, f"{root}layers.{i}", dtype, c.vocab_size)
        head = f"{root}hc_head." if root else "hc_head_"
        names = ("hc_fn", "hc_base", "hc_scale") if root else ("fn", "base", "scale")
        self.head.load(reader, f"{root}norm.weight", (head + names[0], head + names[1], head + names[2]))
        if c.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = reader.get("head.weight", shape, dtype)
        for k in range(c.num_nextn_predict_layers):
            found = [
                p
                for p in (f"{root}mtp.{k}", f"mtp.{k}", f"{root}layers.{c.num_hidden_layers + k}")
                if reader.has(f"{p}.enorm.weight")
            ]
            if not found:  # MTP layers are optional: transformers drops them when it saves a model
                break
            ratio = v4.mtp_compress_ratios[k]
            if ratio and ratio not in v4.compress_ratios:
                raise NotImplementedError(
                    f"{found[0]}: an MTP layer of compression ratio {ratio}, which no layer of the "
                    f"model has ({sorted(set(v4.compress_ratios))}), is not supported"
                )
            mtp = V4MTPLayer(self.backend, c, v4, ratio, v4.mtp_hash_layers[k], self.expert_parallel)
            mtp.load(reader, found[0], dtype, c.vocab_size)
            self.mtp.append(mtp)
        # the tensors of MTP layers not loaded (past num_nextn_predict_layers) are left unused
        pattern = re.compile(rf"^(?:{re.escape(root)})?mtp\.(\d+)\.|^{re.escape(root)}layers\.(\d+)\.")
        for name in list(reader.location):
            match = pattern.match(name)
            if match is not None:
                k = int(match[1]) if match[1] is not None else int(match[2]) - c.num_hidden_layers
                if k >= len(self.mtp):
                    reader.skip(name)
