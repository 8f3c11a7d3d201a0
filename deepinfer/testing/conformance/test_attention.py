"""Paged latent attention, decode and chunked prefill, against the float64 reference.

Each case names its parameters in its failure message (window, sinks, top-k, poisoned rows, block
size, heads, widths) and the worst element's place: request, query row (and position), head and
column. The edge rules of AttentionModifiers each have cases: rows that see no key (zeros, with
and without sinks: `topk_edge*`), repeated and out-of-range top-k ids (`topk_edge*`), NaN in rows
no request has reached (`*poison*`). `aligned*` cases use production shapes (heads 16 / 128,
pages of 64, K 576 / V 512) where kernels take their tiled fast paths.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from deepinfer.backend.ops import Backend
from deepinfer.backend.types import AttentionMetadata, AttentionModifiers
from deepinfer.reference import attention as ref_attention
from deepinfer.testing.helpers import (
    PagedBatch,
    attention_locator,
    make_paged_batch,
    oracle,
    randn,
    topk_indices_for,
)
from deepinfer.testing.tolerances import assert_close


@dataclass(frozen=True)
class Case:
    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...] = ()  # decode cases: all ones
    block_size: int = 16
    head_dim: int = 576  # D: K width
    v_dim: int = 512  # Dv: V = K[:, :Dv]
    heads: int = 2
    window: int | None = None
    sinks: bool = False
    topk: int | None = None
    rope_dim: int | None = None  # None: head_dim - v_dim (V is the whole latent)
    sink_values: tuple[float, ...] | None = None  # fixed sinks (one per head) instead of random
    topk_edge: bool = False  # top-k lists with duplicates, out-of-range ids and an empty row
    q_layout: str = "contig"  # "slice": q a view into wider rows; "transpose": a (H, T, D) buffer
    table_view: bool = False  # block_tables a slice of a wider persistent table (row stride > MB)
    q_scale: float = 1.0  # large: logits of +-100 and more (softmax must subtract its running max)
    shared_blocks: int = 0  # requests share request 0's first blocks (prefix caching)
    poison: bool = False  # slots past each KV length (and unused blocks) hold NaN
    kv_format: str = "auto"  # "fp8": FP8 latent rows (test_fp8_kv_cache.py)

    def describe(self, scale: float) -> str:
        """The case's parameters, for failure messages."""
        parts = [
            f"window={self.window}" if self.window is not None else "no window",
            ("sinks " + str(list(self.sink_values)))
            if self.sink_values
            else "sinks"
            if self.sinks
            else "no sinks",
        ]
        if self.topk is not None:
            edge = " (edge lists: a repeated id, an id past every KV length, a row listing nothing)"
            parts.append(f"top-k {self.topk}" + (edge if self.topk_edge else ""))
        parts += [
            "poisoned rows (NaN past each KV length)" if self.poison else "no poisoned rows",
            f"block_size={self.block_size}",
            f"heads={self.heads}",
            f"D={self.head_dim}",
            f"v_dim={self.v_dim}",
            f"scale={scale:.4g}",
        ]
        if self.q_layout != "contig":
            parts.append(f"q {self.q_layout}")
        if self.table_view:
            parts.append("block table a view")
        if self.shared_blocks:
            parts.append(f"{self.shared_blocks} shared prefix blocks")
        if self.kv_format != "auto":
            parts.append(f"{self.kv_format} KV cache")
        return ", ".join(parts)


def edge_topk_indices(
    seq_lens: list[int], query_lens: list[int], k: int, gen: torch.Generator
) -> torch.Tensor:
    """Top-k lists a sparse-attention indexer may hand over: each row repeats one of its ids,
    names a position past every request's KV length, and the last row lists nothing (-1 only:
    that row sees no key and outputs zeros)."""
    idx = topk_indices_for(seq_lens, query_lens, k, gen, pad=3)
    big = max(seq_lens, default=0) + 5
    for row in idx:
        free = (row < 0).nonzero().flatten()
        row[free[0]] = row[row >= 0][0] if (row >= 0).any() else -1
        row[free[1]] = big
    if idx.shape[0]:
        idx[-1] = -1
    return idx


def make_q(
    case: Case, tokens: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator
) -> torch.Tensor:
    """(T, H, D) queries, contiguous or a non-contiguous view (stride(-1) stays 1)."""
    h, d, sc = case.heads, case.head_dim, case.q_scale
    if case.q_layout == "slice":  # e.g. the absorbed query as part of a wider projection output
        return randn((tokens, h + 1, d + 8), dtype, device, gen, sc)[:, 1:, 3 : 3 + d]
    if case.q_layout == "transpose":  # per-head products leave (H, T, D)
        return randn((h, tokens, d), dtype, device, gen, sc).transpose(0, 1)
    assert case.q_layout == "contig", case.q_layout
    return randn((tokens, h, d), dtype, device, gen, sc)


def softmax_scale(head_dim: int, gen: torch.Generator) -> float:
    """The `scale` a case passes: D^-0.5 times a factor in [1/3, 3] away from 1. Models do not
    pass D^-0.5 (DeepSeek's absorbed MLA: qk_head_dim^-0.5 = 192^-0.5 times the YaRN mscale^2,
    over a 576-wide K), so a kernel that derives the scale from the head size must fail."""
    factor = 1.3 + 1.7 * float(torch.rand((), generator=gen))
    return float(head_dim**-0.5 * (factor if torch.rand((), generator=gen) < 0.5 else 1 / factor))


def run_case(backend: Backend, case: Case, dtype: torch.dtype, gen: torch.Generator, decode: bool) -> None:
    seq, qlen = list(case.seq_lens), list(case.query_lens)
    batch = make_paged_batch(
        backend, seq_lens=seq, query_lens=qlen, block_size=case.block_size, head_dim=case.head_dim,
        dtype=dtype, gen=gen, rope_dim=case.head_dim - case.v_dim if case.rope_dim is None else case.rope_dim,
        shared_blocks=case.shared_blocks, poison_unwritten=case.poison, kv_format=case.kv_format,
    )  # fmt: skip
    device = backend.device.device()
    meta = batch.meta
    if case.table_view:  # the columns past the view hold a real block: reading them is wrong
        table = batch.meta.block_tables
        wide = torch.full((table.shape[0] + 2, table.shape[1] + 3), batch.cache.spec.num_blocks - 1)
        wide[: table.shape[0], : table.shape[1]] = table.cpu()
        meta = AttentionMetadata.build(
            wide.to(torch.int32).to(device)[: table.shape[0], : table.shape[1]], seq, qlen
        )
        assert not meta.block_tables.is_contiguous()
    q = make_q(case, batch.num_tokens, dtype, device, gen)
    if case.sink_values is not None:
        assert len(case.sink_values) == case.heads
        sinks: torch.Tensor | None = torch.tensor(case.sink_values, dtype=torch.float32, device=device)
    else:
        sinks = randn((case.heads,), torch.float32, device, gen) if case.sinks else None
    topk = None
    if case.topk is not None:
        pick = edge_topk_indices if case.topk_edge else topk_indices_for
        topk = pick(seq, qlen, case.topk, gen)
    scale = softmax_scale(case.head_dim, gen)
    op = backend.attention.decode if decode else backend.attention.prefill
    mods = AttentionModifiers(case.window, sinks, None if topk is None else topk.to(device))
    out = op(q, batch.cache, meta, scale=scale, v_dim=case.v_dim, modifiers=mods)
    ref_mods = AttentionModifiers(case.window, None if sinks is None else oracle(sinks), topk)
    expected = ref_attention.paged_attention(
        oracle(q), batch.ref_cache, batch.ref_meta, scale, case.v_dim, ref_mods
    )
    what = "decode" if decode else "prefill"
    assert out.dtype == dtype and out.device.type == device.type, (
        f"{what} returned {out.dtype} on {out.device.type}, expected {dtype} on {device.type}"
    )
    assert_close(
        out, expected, dtype, what=what, locate=attention_locator(batch.meta), case=case.describe(scale)
    )


DECODE_CASES = {
    "block_boundaries": Case((1, 15, 16, 17, 33)),
    "bs64": Case((1, 63, 64, 65, 130), block_size=64),
    "single": Case((7,)),
    "empty_batch": Case((), ()),
    "window": Case((1, 9, 40, 70), window=8),
    "window_1": Case((3, 20), window=1),
    "window_gt_len": Case((5, 18), window=100),
    "sinks": Case((1, 12, 33), sinks=True),
    "window_sinks_kv512": Case((4, 30, 50), head_dim=512, v_dim=512, window=16, sinks=True),
    "topk": Case((1, 17, 40, 64), topk=8),
    "topk_window": Case((20, 45), topk=12, window=10),
    "small_odd_dims": Case((1, 6, 11), block_size=5, head_dim=9, v_dim=7, heads=3),
    "small_dims": Case((2, 19), block_size=4, head_dim=20, v_dim=16, heads=5),
    "many_heads": Case((33, 64, 100), heads=16),
    # block sizes that are not powers of two; KV lengths that fill their last block exactly
    "bs1": Case((1, 2, 7), block_size=1, head_dim=20, v_dim=16, heads=3),
    "bs6_full_blocks": Case((6, 12, 18, 5), block_size=6, head_dim=20, v_dim=16),
    "bs48_full_blocks": Case((48, 96), block_size=48),
    "v_lt_latent": Case((5, 17), head_dim=24, v_dim=12, rope_dim=4),
    "v_lt_latent_mla": Case((9, 33), v_dim=256, rope_dim=64),
    "sinks_extreme": Case((3, 20), heads=4, head_dim=20, v_dim=16, sink_values=(-1e4, 60.0, -60.0, 8.0)),
    "window_1_sinks": Case((1, 9), window=1, sinks=True, head_dim=20, v_dim=16),
    "topk_edge": Case((5, 19, 40), topk=6, topk_edge=True, head_dim=20, v_dim=16),
    "topk_edge_sinks": Case((5, 19, 40), topk=6, topk_edge=True, sinks=True, head_dim=20, v_dim=16),
    "topk_edge_mla": Case((12, 30), topk=6, topk_edge=True),
    "q_transposed_mla": Case((4, 21), heads=3, q_layout="transpose"),
    "q_sliced": Case((4, 21), heads=3, head_dim=20, v_dim=16, q_layout="slice"),
    "heads_80": Case((3, 40), head_dim=20, v_dim=16, heads=80),
    "heads_1_mla": Case((5, 33), heads=1),
    "shared_prefix": Case((40, 35, 17, 8), head_dim=20, v_dim=16, block_size=8, shared_blocks=2),
    "sharp": Case((7, 40), head_dim=20, v_dim=16, q_scale=40.0, sinks=True),
    "table_view": Case((5, 17, 32), block_size=8, head_dim=20, v_dim=16, table_view=True),
    "table_view_mla": Case((5, 40), table_view=True),
    # past 1024 keys: long enough for backends that split the KV axis (then merge the splits)
    "long_sinks": Case((1060, 3), head_dim=20, v_dim=16, block_size=32, sinks=True),
    "long_window_topk": Case((1100,), head_dim=20, v_dim=16, block_size=32, window=1090, topk=40),
    # pages of 64 and 128 positions (whole-page tiles), rows never written holding NaN
    "bs64_poison": Case((1, 63, 64, 65, 130, 200), block_size=64, poison=True),
    "bs128_poison_window_sinks": Case((100, 129, 300), block_size=128, window=70, sinks=True, poison=True),
    "bs64_poison_heads_64": Case((64, 190), block_size=64, heads=64, poison=True),
    "bs64_poison_topk": Case((33, 160), block_size=64, topk=20, poison=True),
    # production shapes: DeepSeek's 576 / 512 latent, pages of 64, 16 and 128 heads, lengths that
    # fill whole pages next to ones that do not (where tiled and TMA kernels take their fast path)
    "aligned_mla_heads_16": Case((64, 128, 256, 192), block_size=64, heads=16),
    "aligned_mla_heads_128": Case((128, 64), block_size=64, heads=128),
    "aligned_mla_heads_16_window_sinks": Case((256, 129), block_size=64, heads=16, window=128, sinks=True),
}


@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_decode(backend: Backend, dtype: torch.dtype, gen: torch.Generator, name: str) -> None:
    case = DECODE_CASES[name]
    case = Case(**{**case.__dict__, "query_lens": (1,) * len(case.seq_lens)})
    run_case(backend, case, dtype, gen, decode=True)


PREFILL_CASES = {
    "fresh": Case((5, 16, 17), (5, 16, 17)),
    "chunked": Case((40, 1, 70, 33), (9, 1, 3, 17)),  # cached prefix + new rows, length-1, boundaries
    "bs64": Case((64, 130, 65), (64, 66, 2), block_size=64),
    "empty_request": Case((12, 30, 7), (3, 0, 7)),
    "empty_batch": Case((), ()),
    "decode_rows": Case((9, 20), (1, 1)),
    "window": Case((30, 47), (30, 12), window=7),
    "sinks": Case((18, 33), (18, 5), sinks=True),
    "window_sinks_kv512": Case((25, 40), (25, 9), head_dim=512, v_dim=512, window=8, sinks=True),
    "topk": Case((24, 50), (24, 6), topk=10),
    "topk_window_sinks": Case((31,), (13,), topk=9, window=12, sinks=True),
    "small_odd_dims": Case((6, 13), (6, 4), block_size=5, head_dim=9, v_dim=7, heads=3),
    "small_dims": Case((2, 19), (2, 19), block_size=4, head_dim=20, v_dim=16, heads=5),
    # whole sequences (query length == KV length, full blocks) next to decode rows, one call
    "fresh_and_decode": Case((16, 9, 1, 24), (16, 1, 1, 24), block_size=8),
    "bs1": Case((5, 9), (5, 3), block_size=1, head_dim=20, v_dim=16),
    "bs6_full_blocks": Case((12, 18, 7), (12, 6, 1), block_size=6, head_dim=20, v_dim=16),
    "bs48_full_blocks": Case((48, 96), (48, 5), block_size=48),
    "window_1": Case((10, 7, 3), (10, 3, 1), window=1, head_dim=20, v_dim=16),
    "window_gt_len": Case((9, 20), (9, 5), window=64, head_dim=20, v_dim=16),
    "window_fresh_and_decode": Case((14, 8), (14, 1), window=5, head_dim=20, v_dim=16),
    "sinks_extreme": Case(
        (6, 11), (6, 2), heads=4, head_dim=20, v_dim=16, sink_values=(-1e4, 60.0, -60.0, 8.0)
    ),
    "topk_edge": Case((20, 33), (20, 4), topk=7, topk_edge=True, head_dim=20, v_dim=16),
    "topk_edge_window_sinks_mla": Case((25,), (6,), topk=5, topk_edge=True, window=9, sinks=True),
    "v_lt_latent": Case((13, 8), (5, 8), head_dim=24, v_dim=12, rope_dim=4),
    "v_lt_latent_mla": Case((20, 9), (20, 1), v_dim=256, rope_dim=64),
    "q_sliced": Case((10, 17), (10, 4), heads=3, head_dim=20, v_dim=16, q_layout="slice"),
    "q_transposed_mla": Case((10, 17), (10, 4), heads=3, q_layout="transpose"),
    "heads_24": Case((7, 30), (7, 5), head_dim=20, v_dim=16, heads=24),
    "shared_prefix_mla": Case((48, 40, 20), (48, 8, 4), shared_blocks=2),
    "sharp": Case((7, 40), (7, 6), head_dim=20, v_dim=16, q_scale=40.0, window=20),
    "empty_request_no_kv": Case((12, 0, 7), (3, 0, 7), head_dim=20, v_dim=16),
    "empty_request_no_kv_mla": Case((0, 12, 0), (0, 3, 0)),
    "table_view": Case((12, 30), (12, 5), block_size=8, head_dim=20, v_dim=16, table_view=True),
    "table_view_mla": Case((16, 40), (16, 3), table_view=True),
    "long_sinks": Case((1100, 9), (3, 9), head_dim=20, v_dim=16, block_size=32, sinks=True),
    "bs64_poison": Case((64, 130, 65, 200), (64, 66, 2, 7), block_size=64, poison=True),
    "bs128_poison_window_sinks": Case(
        (150, 300), (150, 20), block_size=128, window=40, sinks=True, poison=True
    ),
    "bs64_poison_heads_32": Case((70, 129), (5, 2), block_size=64, heads=32, poison=True),
    "aligned_mla_heads_16": Case((128, 256, 64), (128, 64, 64), block_size=64, heads=16),
    "aligned_mla_heads_128_chunk": Case((192,), (64,), block_size=64, heads=128),
}


@pytest.mark.parametrize("name", list(PREFILL_CASES))
def test_prefill(backend: Backend, dtype: torch.dtype, gen: torch.Generator, name: str) -> None:
    run_case(backend, PREFILL_CASES[name], dtype, gen, decode=False)


# (case, Vh): decode sizes a backend may fuse (one request; 4 requests of 16 heads at production
# widths), past them (9 requests), modifiers, poisoned rows, q a transposed view, no requests
UV_CASES = {
    "one_request_heads_16": (Case((160,), block_size=64, heads=16), 128),
    "aligned_mla_heads_16": (Case((64, 128, 256, 192), block_size=64, heads=16), 128),
    "nine_requests": (Case((3, 9, 17, 30, 5, 64, 2, 40, 11), head_dim=20, v_dim=16, heads=2), 24),
    "long_two_requests": (Case((1060, 3), head_dim=20, v_dim=16, block_size=32, heads=4), 8),
    "sinks_window": (Case((1, 12, 33), sinks=True, window=9), 40),
    "bs64_poison": (Case((1, 63, 64, 65, 130, 200), block_size=64, poison=True), 24),
    "q_transposed_mla": (Case((4, 21), heads=3, q_layout="transpose"), 16),
    "empty_batch": (Case((), ()), 16),
}


@pytest.mark.parametrize("name", list(UV_CASES))
def test_mla_decode_and_uv(backend: Backend, dtype: torch.dtype, gen: torch.Generator, name: str) -> None:
    """attention.mla_decode_and_uv: decode, then each head's product with W_UV (H, Vh, v_dim),
    against the float64 reference of both."""
    case, vh = UV_CASES[name]
    run_uv_case(backend, case, vh, dtype, gen)


def run_uv_case(backend: Backend, case: Case, vh: int, dtype: torch.dtype, gen: torch.Generator) -> None:
    seq = list(case.seq_lens)
    qlen = [1] * len(seq)
    batch = make_paged_batch(
        backend, seq_lens=seq, query_lens=qlen, block_size=case.block_size, head_dim=case.head_dim,
        dtype=dtype, gen=gen, rope_dim=case.head_dim - case.v_dim, poison_unwritten=case.poison,
        kv_format=case.kv_format,
    )  # fmt: skip
    device = backend.device.device()
    q = make_q(case, batch.num_tokens, dtype, device, gen)
    w_uv = randn((case.heads, vh, case.v_dim), dtype, device, gen, case.v_dim**-0.5)
    sinks = randn((case.heads,), torch.float32, device, gen) if case.sinks else None
    scale = softmax_scale(case.head_dim, gen)
    mods = AttentionModifiers(case.window, sinks, None)
    out = backend.attention.mla_decode_and_uv(
        q, batch.cache, batch.meta, w_uv, scale=scale, v_dim=case.v_dim, modifiers=mods
    )
    ref_mods = AttentionModifiers(case.window, None if sinks is None else oracle(sinks), None)
    o = ref_attention.paged_attention(oracle(q), batch.ref_cache, batch.ref_meta, scale, case.v_dim, ref_mods)
    expected = torch.bmm(o.transpose(0, 1), oracle(w_uv).transpose(1, 2)).transpose(0, 1)
    assert out.dtype == dtype, f"mla_decode_and_uv returned {out.dtype}, expected {dtype}"
    assert_close(
        out, expected, dtype, what="mla_decode_and_uv", locate=attention_locator(batch.meta),
        case=case.describe(scale) + f", Vh={vh}",
    )  # fmt: skip


HEAVY_CASES = {
    "decode_long": (Case((1, 300, 513, 1000), heads=16, block_size=64), True),
    "decode_long_128_heads_poison": (Case((700, 2100, 64), heads=128, block_size=64, poison=True), True),
    "prefill_long": (Case((257, 600), (257, 200), heads=16, block_size=64), False),
    "prefill_long_window_sinks": (
        Case((700,), (300,), heads=8, head_dim=512, v_dim=512, window=128, sinks=True),
        False,
    ),
}


@pytest.mark.heavy
@pytest.mark.parametrize("name", list(HEAVY_CASES))
def test_attention_heavy(backend: Backend, dtype: torch.dtype, gen: torch.Generator, name: str) -> None:
    case, decode = HEAVY_CASES[name]
    if decode:
        case = Case(**{**case.__dict__, "query_lens": (1,) * len(case.seq_lens)})
    run_case(backend, case, dtype, gen, decode=decode)


def test_decode_rejects_prefill_metadata(backend: Backend, gen: torch.Generator) -> None:
    dt = backend.capabilities.dtypes[0]
    batch = make_paged_batch(
        backend, seq_lens=[5, 8], query_lens=[1, 2], block_size=4, head_dim=24, dtype=dt, gen=gen, rope_dim=8
    )
    q = randn((3, 2, 24), dt, backend.device.device(), gen)
    with pytest.raises(ValueError):
        backend.attention.decode(q, batch.cache, batch.meta, scale=0.2, v_dim=16)


def test_modifiers_reject_invalid_values() -> None:
    """The contract's argument object checks what it can without touching the device."""
    with pytest.raises(ValueError, match="window"):
        AttentionModifiers(window=0)
    with pytest.raises(ValueError, match="sinks"):
        AttentionModifiers(sinks=torch.zeros(2, 2))
    for bad in (torch.zeros(3, dtype=torch.int32), torch.zeros(3, 2)):
        with pytest.raises(ValueError, match="topk_indices"):
            AttentionModifiers(topk_indices=bad)


def test_prefill_equals_decode_on_decode_rows(backend: Backend, gen: torch.Generator) -> None:
    """Both kernels mean the same thing where both apply."""
    dt = backend.capabilities.dtypes[0]
    batch = make_paged_batch(
        backend, seq_lens=[3, 18, 40], query_lens=[1, 1, 1], block_size=8, head_dim=576, dtype=dt, gen=gen,
        rope_dim=64,
    )  # fmt: skip
    q = randn((3, 4, 576), dt, backend.device.device(), gen)
    a = backend.attention.decode(q, batch.cache, batch.meta, scale=576**-0.5, v_dim=512)
    b = backend.attention.prefill(q, batch.cache, batch.meta, scale=576**-0.5, v_dim=512)
    assert_close(a, oracle(b), dt, what="decode vs prefill", locate=attention_locator(batch.meta))


def test_graph_computes_its_own_lengths(backend: Backend, gen: torch.Generator) -> None:
    """A backend that claims DeviceOps.graph_lengths_on_device: a captured decode whose KV lengths
    the graph computes itself (from an input refilled before each replay) replays with each
    replay's lengths, as an eager call given them does."""
    if not backend.capabilities.supports_graphs or not backend.device.graph_lengths_on_device:
        pytest.skip("the backend does not claim graphs that compute attention lengths")
    dt, device = backend.capabilities.dtypes[0], backend.device.device()
    batch = make_paged_batch(
        backend, seq_lens=[20, 40, 9], query_lens=[1, 1, 1], block_size=8, head_dim=576, dtype=dt, gen=gen,
        rope_dim=64,
    )  # fmt: skip
    q = randn((3, 4, 576), dt, device, gen)
    before = torch.zeros(3, dtype=torch.int32, device=device)  # (B,) refilled: the lengths less one
    out = torch.zeros((3, 4, 512), dtype=dt, device=device)
    upper = (40, 40, 40)  # host lengths: upper bounds

    def step() -> None:
        meta = AttentionMetadata(
            block_tables=batch.meta.block_tables, seq_lens=before + 1,
            query_start_loc=batch.meta.query_start_loc, seq_lens_host=upper, query_lens_host=(1, 1, 1),
            max_query_len=1, max_seq_len=40,
        )  # fmt: skip
        out.copy_(backend.attention.decode(q, batch.cache, meta, scale=576**-0.5, v_dim=512))

    graph = backend.device.capture_graph(step)
    assert graph is not None
    for lens in ([20, 40, 9], [5, 17, 1]):
        before.copy_(torch.tensor(lens, dtype=torch.int32).to(device) - 1)
        graph.replay()
        meta = AttentionMetadata.build(batch.meta.block_tables, lens, [1, 1, 1])
        want = backend.attention.decode(q, batch.cache, meta, scale=576**-0.5, v_dim=512)
        assert_close(
            out, oracle(want), dt, what=f"graph-computed lengths {lens}", locate=attention_locator(meta)
        )


# --------------------------------------------------------------------------- the edge rules, one by one


def _edge_batch(backend: Backend, gen: torch.Generator, decode: bool) -> tuple[PagedBatch, torch.Tensor]:
    seq, qlen = ([9, 30, 17], [1, 1, 1]) if decode else ([9, 30, 17], [4, 6, 17])
    dt = backend.capabilities.dtypes[0]
    batch = make_paged_batch(
        backend, seq_lens=seq, query_lens=qlen, block_size=8, head_dim=20, dtype=dt, gen=gen, rope_dim=4,
        poison_unwritten=True,
    )  # fmt: skip
    q = randn((batch.num_tokens, 3, 20), dt, backend.device.device(), gen)
    return batch, q


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no_sinks", "sinks"])
def test_row_that_sees_no_key_is_zero(
    backend: Backend, gen: torch.Generator, decode: bool, with_sinks: bool
) -> None:
    """Edge rule: a query row whose top-k list names nothing it may see (all -1, only future
    positions, only ids past the KV length) outputs exactly zeros, never NaN, with or without
    sinks; the other rows are unaffected."""
    batch, q = _edge_batch(backend, gen, decode)
    meta = batch.meta
    dev = backend.device.device()
    topk = topk_indices_for(list(meta.seq_lens_host), list(meta.query_lens_host), 4, gen)
    dead = [0, topk.shape[0] - 1]  # first and last query rows
    topk[dead[0]] = -1  # lists nothing
    topk[dead[1]] = torch.tensor([10_000, 10_001, -1, 10_002, -1, 10_003], dtype=torch.int32)  # past the KV
    sinks = randn((3,), torch.float32, dev, gen) if with_sinks else None
    op = backend.attention.decode if decode else backend.attention.prefill
    out = op(
        q, batch.cache, meta, scale=0.3, v_dim=16,
        modifiers=AttentionModifiers(sinks=sinks, topk_indices=topk.to(dev)),
    ).cpu()  # fmt: skip
    for row in dead:
        got = out[row]
        if not torch.equal(got, torch.zeros_like(got)):
            where = attention_locator(meta)((row,))
            raise AssertionError(
                f"{'decode' if decode else 'prefill'}: {where} sees no key and must output zeros "
                f"({'with' if with_sinks else 'without'} sinks); got max |value| "
                f"{got.float().abs().nan_to_num(float('inf')).max().item():.3g}"
                f"{' (NaN present)' if torch.isnan(got).any() else ''}"
            )
    assert torch.isfinite(out).all(), "attention output holds NaN/inf outside the rows that see no key"


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_topk_ids_are_a_set(backend: Backend, gen: torch.Generator, decode: bool) -> None:
    """Edge rule: repeating a top-k id, adding ids past the KV length or -1 entries, and reordering
    a row change nothing (compared with the plain list, same backend, same dtype budget)."""
    batch, q = _edge_batch(backend, gen, decode)
    meta = batch.meta
    dev = backend.device.device()
    dt = backend.capabilities.dtypes[0]
    plain = topk_indices_for(list(meta.seq_lens_host), list(meta.query_lens_host), 5, gen, pad=0)
    noisy = torch.cat(
        [
            plain.flip(-1),
            plain[:, :2],
            torch.full_like(plain[:, :2], 99_999),
            torch.full_like(plain[:, :1], -1),
        ],
        dim=-1,
    )  # reordered, two ids repeated, two past every KV length, one unused
    op = backend.attention.decode if decode else backend.attention.prefill

    def run(ids: torch.Tensor) -> torch.Tensor:
        mods = AttentionModifiers(topk_indices=ids.to(dev))
        return op(q, batch.cache, meta, scale=0.3, v_dim=16, modifiers=mods)

    assert_close(
        run(noisy), oracle(run(plain)), dt, what="top-k with repeated / out-of-range / -1 ids",
        locate=attention_locator(meta), case="the same ids as a set must give the plain list's result",
    )  # fmt: skip
