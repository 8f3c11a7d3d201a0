"""DeepSeek-V4's ops against float64 oracles written here from their definitions (not the
reference code): clamped SwiGLU, the compressor's gated pooling, the mHC weights and mixes, the
lightning indexer's top-k (and DeepSeek-V4.1's candidate blocks) and attention over a sliding
window plus compressed entries; then a tiny V4 model on the backend against the reference in
float64."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer.backend.ops import Backend
from deepinfer.backend.types import AttentionMetadata, AttentionModifiers, KVCacheSpec, PagedKVCache
from deepinfer.models.loader import load_model
from deepinfer.reference.backend import create_reference_backend
from deepinfer.testing.checkpoints import tiny_v4_config, write_random_v4_checkpoint
from deepinfer.testing.helpers import oracle, randn, random_block_tables, slots_of
from deepinfer.testing.op_trace import OpCall, first_divergence, recording
from deepinfer.testing.paged_runner import PagedRunner
from deepinfer.testing.plugin import skip_not_applicable
from deepinfer.testing.tolerances import Tolerance, assert_close, tolerance

# --------------------------------------------------------------------------- elementwise and pooling


@pytest.mark.parametrize("rows", [0, 1, 7, 33])
def test_clamped_silu_and_mul(backend: Backend, dtype: torch.dtype, gen: torch.Generator, rows: int) -> None:
    dev, limit = backend.device.device(), 1.5
    x = randn((rows, 2 * 24), dtype, dev, gen, 2.0)  # many values past the limit
    got = backend.small.clamped_silu_and_mul(x, limit)
    g, u = oracle(x).chunk(2, dim=-1)
    g = torch.where(g > limit, torch.full_like(g, limit), g)
    u = torch.maximum(torch.minimum(u, torch.full_like(u, limit)), torch.full_like(u, -limit))
    assert_close(got, g / (1 + torch.exp(-g)) * u, dtype, what="clamped_silu_and_mul")


@pytest.mark.parametrize("windows,slots", [(0, 4), (1, 4), (5, 8), (3, 256)])
def test_gated_pool(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, windows: int, slots: int
) -> None:
    dev, d = backend.device.device(), 20
    kv = randn((windows, slots, d), dtype, dev, gen)
    gate = randn((windows, slots, d), torch.float32, dev, gen, 3.0)
    absent = torch.rand((windows, slots), generator=gen) < 0.3
    if windows:
        absent[0] = True  # a window with no slot at all pools to zeros
    gate = gate.masked_fill(absent[..., None].to(dev), float("-inf"))
    got = backend.small.gated_pool(kv, gate)
    kv64, g64, live = oracle(kv), oracle(gate), ~absent[..., None]
    top = torch.where(live, g64, torch.full_like(g64, -1e300)).amax(dim=1, keepdim=True)
    e = torch.where(live, torch.exp(g64 - top), torch.zeros_like(g64))  # absent slots weigh 0
    total = e.sum(dim=1)
    want = torch.where(total > 0, (e * kv64).sum(dim=1) / total.clamp(min=1e-300), torch.zeros_like(total))
    assert_close(got, want, dtype, what="gated_pool")


@pytest.mark.parametrize("windows,slots", [(0, 4), (1, 4), (5, 8), (3, 128)])
def test_compressor_pool(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, windows: int, slots: int
) -> None:
    """gated_pool of the logits gate + bias (float32), absent slots out: strided series of wider
    rows, as the compressor reads them."""
    dev, d = backend.device.device(), 20
    kv = randn((windows, slots, 2 * d), dtype, dev, gen)[..., d:]  # the second series of a row
    gate = randn((windows, slots, 2 * d), dtype, dev, gen, 3.0)[..., :d]
    bias = randn((slots, d), torch.float32, dev, gen)
    present = torch.rand((windows, slots), generator=gen) >= 0.3
    if windows:
        present[0] = False  # a window with no slot at all pools to zeros
    got = backend.small.compressor_pool(kv, gate, bias, present.to(dev))
    kv64, g64, live = oracle(kv), oracle(gate) + oracle(bias), present[..., None]
    top = torch.where(live, g64, torch.full_like(g64, -1e300)).amax(dim=1, keepdim=True)
    e = torch.where(live, torch.exp(g64 - top), torch.zeros_like(g64))
    total = e.sum(dim=1)
    want = torch.where(total > 0, (e * kv64).sum(dim=1) / total.clamp(min=1e-300), torch.zeros_like(total))
    assert got.dtype == dtype
    assert_close(got, want, dtype, what="compressor_pool")


def _rope_table(positions: int, rot: int) -> torch.Tensor:
    """(P, R) float32 [cos | sin] of angle p * 10000^(-2i/R)."""
    inv = 1.0 / 10000 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    ang = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=-1).float()


@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
@pytest.mark.parametrize(
    "tokens,heads,dim,rot", [(0, 2, 16, 8), (1, 1, 8, 8), (5, 3, 40, 16), (9, 20, 72, 8)]
)
def test_rope_tail(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, inverse: bool, tokens: int, heads: int,
    dim: int, rot: int,
) -> None:  # fmt: skip
    """The first D - R channels as they are, the last R's interleaved pairs (a, b) rotated to
    (a cos - b sin, b cos + a sin), by -angle where inverse; a new tensor, x unchanged."""
    dev = backend.device.device()
    x = randn((tokens, heads, 2 * dim), dtype, dev, gen)[:, :, ::2]  # a strided view
    before = x.cpu().clone()
    table = _rope_table(100, rot)
    positions = torch.randint(0, 100, (tokens,), generator=gen)
    got = backend.small.rope_tail(x, positions.to(dev), table.to(dev), inverse)
    assert got.shape == x.shape and got.dtype == dtype
    assert torch.equal(x.cpu(), before), "rope_tail changed its input"
    x64, t64 = oracle(x), table.double()[positions]
    cos, sin = t64[:, None, : rot // 2], t64[:, None, rot // 2 :]
    sin = -sin if inverse else sin
    a, b = x64[..., dim - rot :: 2], x64[..., dim - rot + 1 :: 2]
    want = x64.clone()
    want[..., dim - rot :: 2], want[..., dim - rot + 1 :: 2] = a * cos - b * sin, b * cos + a * sin
    assert torch.equal(got[..., : dim - rot].cpu(), x[..., : dim - rot].cpu()), "head channels changed"
    assert_close(got, want, dtype, what="rope_tail")


def _entries_oracle(
    seq_lens: list[int], query_lens: list[int], slots: list[int], tables: list[list[int]],
    entry_tables: list[list[int]], key_tables: list[list[int]] | None, m: int, overlap: bool, bs: int,
    uniform: bool,
) -> list[tuple[list[int], list[bool], int, int, int]]:  # fmt: skip
    """Per entry (state slots, present, out slot, position, key slot), from the definition:
    request b closes entry w where (w+1)m - 1 is among its positions [end - q, end) and its row
    there writes (slot >= 0); uniform steps list ceil(q / m) candidates a request, a candidate
    that does not close at w' = min(w, closed - 1) with its positions clamped to end - 1."""
    out = []
    row0 = 0
    for b, (end, q) in enumerate(zip(seq_lens, query_lens)):
        start = end - q
        closed = end // m
        cands = range(start // m, start // m + -(-q // m)) if uniform else range(start // m, closed)
        for w in cands:
            closing_row = row0 + (w + 1) * m - 1 - start
            closes = w < closed and slots[min(max(closing_row, 0), len(slots) - 1)] >= 0
            w = min(w, max(closed - 1, 0))
            first = (w - 1) * m if overlap else w * m
            ps = [first + s for s in range(2 * m if overlap else m)]
            present = [p >= 0 for p in ps]
            ps = [min(max(p, 0), end - 1) if uniform else max(p, 0) for p in ps]

            def row(table: list[int], r: int) -> int:
                return table[min(r // bs, len(table) - 1)] * bs + r % bs

            state = [row(tables[b], p) for p in ps]
            entry = row(entry_tables[b], w) if closes else -1
            key = entry if key_tables is None else row(key_tables[b], w) if closes else -1
            out.append((state, present, entry, w * m, key))
        row0 += q
    return out


ENTRY_CASES = {
    # name: (seq_lens, query_lens, padding rows (slot -1))
    "decode": ([13, 4, 1, 29, 8], [1] * 5, {2}),
    "verify": ([15, 7, 3, 26], [3] * 4, {5, 11}),
    "ragged": ([21, 9, 12], [9, 1, 12], set()),
}


@pytest.mark.parametrize("ratio,overlap,keys", [(4, True, True), (4, True, False), (8, False, False)])
@pytest.mark.parametrize("name", list(ENTRY_CASES))
def test_compressed_entries(
    backend: Backend, gen: torch.Generator, name: str, ratio: int, overlap: bool, keys: bool
) -> None:
    """Entries closing in a step against a brute force from the definition: decode and
    verification steps (every request q tokens: candidates found from the device lengths, which
    the host ones only bound), and a ragged step (the closing entries only)."""
    dev, bs = backend.device.device(), 4
    seq_lens, query_lens, padding = ENTRY_CASES[name]
    uniform = len(set(query_lens)) == 1
    tables, _ = random_block_tables(seq_lens, bs, gen)
    entry_tables, _ = random_block_tables([n // ratio + 1 for n in seq_lens], bs, gen)
    key_tables = random_block_tables([n // ratio + 1 for n in seq_lens], bs, gen)[0] if keys else None
    slots: list[int] = []
    for b, (end, q) in enumerate(zip(seq_lens, query_lens)):
        slots += slots_of(tables[b], torch.arange(end - q, end), bs).tolist()
    for r in padding:
        slots[r] = -1
    host_lens = tuple(n + 7 for n in seq_lens) if uniform else tuple(seq_lens)  # graph steps: bounds
    meta = AttentionMetadata(
        block_tables=tables.to(dev), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32,
                                     device=dev),
        seq_lens_host=host_lens, query_lens_host=tuple(query_lens), max_query_len=max(query_lens),
        max_seq_len=max(host_lens),
    )  # fmt: skip
    got = backend.kv_cache.compressed_entries(
        meta, torch.tensor(slots, dtype=torch.int64, device=dev), entry_tables.to(dev),
        None if key_tables is None else key_tables.to(dev), ratio=ratio, overlap=overlap, block_size=bs,
    )  # fmt: skip
    want = _entries_oracle(
        seq_lens, query_lens, slots, tables.tolist(), entry_tables.tolist(),
        None if key_tables is None else key_tables.tolist(), ratio, overlap, bs, uniform,
    )  # fmt: skip
    if not want:
        assert got is None
        return
    assert got is not None
    state, present, out, pos, key = got
    assert state.dtype == out.dtype == pos.dtype == key.dtype == torch.int64 and present.dtype == torch.bool
    assert state.tolist() == [e[0] for e in want], "state_slots"
    assert present.tolist() == [e[1] for e in want], "present"
    assert out.tolist() == [e[2] for e in want], "out_slots"
    assert pos.tolist() == [e[3] for e in want], "positions"
    assert key.tolist() == [e[4] for e in want], "key_slots"
    assert any(e[2] >= 0 for e in want) and (not uniform or any(e[2] < 0 for e in want)), "a weak case"


# --------------------------------------------------------------------------- hyper-connections


def _hc_oracle(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t, n, _ = streams.shape
    flat = streams.flatten(1)
    flat = flat / torch.sqrt((flat**2).mean(-1, keepdim=True) + 1e-6)
    mix = flat @ fn.T

    def sig(v: torch.Tensor) -> torch.Tensor:
        return 1 / (1 + torch.exp(-v))

    pre = sig(mix[:, :n] * scale[0] + base[:n]) + 1e-6
    post = 2 * sig(mix[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    logits = mix[:, 2 * n :].reshape(t, n, n) * scale[2] + base[2 * n :].reshape(n, n)
    e = torch.exp(logits - logits.max(-1, keepdim=True).values)
    comb = e / e.sum(-1, keepdim=True) + 1e-6
    for i in range(2 * iters - 1):  # alternately columns, rows, columns, ...
        dim = -2 if i % 2 == 0 else -1
        comb = comb / (comb.sum(dim, keepdim=True) + 1e-6)
    collapsed = torch.einsum("tn,tnd->td", pre, streams)
    return collapsed, post, comb


# odd stream counts and widths, several tiles of tokens, a mix wide enough to be split
@pytest.mark.parametrize("tokens,n,dm", [(0, 4, 16), (1, 4, 64), (9, 3, 40), (37, 4, 300)])
def test_hc_pre_post_head(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, tokens: int, n: int, dm: int
) -> None:
    dev, iters = backend.device.device(), 20
    streams = randn((tokens, n, dm), dtype, dev, gen)
    fn = randn(((2 + n) * n, n * dm), torch.float32, dev, gen, 0.3)
    base = randn(((2 + n) * n,), torch.float32, dev, gen, 0.5)
    scale = 1 + randn((3,), torch.float32, dev, gen, 0.3)
    collapsed, post, comb = backend.small.hc_pre(streams, fn, base, scale, 1e-6, 1e-6, iters)
    want_c, want_p, want_m = _hc_oracle(oracle(streams), oracle(fn), oracle(base), oracle(scale), iters)
    assert_close(collapsed, want_c, dtype, what="hc_pre collapsed")
    assert_close(post, want_p, torch.float32, what="hc_pre post")
    assert_close(comb, want_m, torch.float32, what="hc_pre comb")
    # Sinkhorn ends on a column normalisation: every column of comb sums to 1 (less hc_eps)
    assert_close(comb.sum(-2), torch.ones(tokens, n), torch.float32, what="comb column sums")

    y = randn((tokens, dm), dtype, dev, gen)
    got = backend.small.hc_post(y, streams, post, comb)
    p64, m64, s64, y64 = oracle(post), oracle(comb), oracle(streams), oracle(y)
    want = torch.zeros((tokens, n, dm), dtype=torch.float64)
    for k in range(n):
        want[:, k] = p64[:, k, None] * y64 + sum(m64[:, j, k, None] * s64[:, j] for j in range(n))
    assert_close(got, want, dtype, what="hc_post")

    head_fn = randn((n, n * dm), torch.float32, dev, gen, 0.3)
    head_base = randn((n,), torch.float32, dev, gen, 0.5)
    head_scale = 1 + randn((1,), torch.float32, dev, gen, 0.3)
    got = backend.small.hc_head(streams, head_fn, head_base, head_scale, 1e-6, 1e-6)
    flat = s64.flatten(1)
    flat = flat / torch.sqrt((flat**2).mean(-1, keepdim=True) + 1e-6)
    pre = 1 / (1 + torch.exp(-(flat @ oracle(head_fn).T * oracle(head_scale)[0] + oracle(head_base)))) + 1e-6
    assert_close(got, torch.einsum("tn,tnd->td", pre, s64), dtype, what="hc_head")


@pytest.mark.parametrize("tokens,n,dm", [(0, 4, 16), (1, 4, 64), (9, 3, 40), (37, 2, 300)])
def test_hc_mixes_and_collapse(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, tokens: int, n: int, dm: int
) -> None:
    """DeepSeek-V4.1's shifted hyper-connections: the three mixes without applying pre, and the
    collapse of the streams by a pre mix computed elsewhere (the sublayer before)."""
    dev, iters = backend.device.device(), 20
    streams = randn((tokens, n, dm), dtype, dev, gen)
    fn = randn(((2 + n) * n, n * dm), torch.float32, dev, gen, 0.3)
    base = randn(((2 + n) * n,), torch.float32, dev, gen, 0.5)
    scale = 1 + randn((3,), torch.float32, dev, gen, 0.3)
    pre, post, comb = backend.small.hc_mixes(streams, fn, base, scale, 1e-6, 1e-6, iters)
    s64 = oracle(streams)
    want_c, want_p, want_m = _hc_oracle(s64, oracle(fn), oracle(base), oracle(scale), iters)
    assert_close(post, want_p, torch.float32, what="hc_mixes post")
    assert_close(comb, want_m, torch.float32, what="hc_mixes comb")
    assert_close(backend.small.hc_collapse(streams, pre), want_c, dtype, what="hc_collapse(hc_mixes pre)")
    other = torch.rand((tokens, n), generator=gen, dtype=torch.float32).to(dev)  # another sublayer's mix
    want = torch.einsum("tn,tnd->td", oracle(other), s64)
    assert_close(backend.small.hc_collapse(streams, other), want, dtype, what="hc_collapse")


# --------------------------------------------------------------------------- indexer and attention


class Step:
    """A ragged step with a token cache (one row per position) and a compressed cache (one row
    per entry w = position w of the same block tables, or with own_entry_tables of tables and a
    pool of its own, entry_tables), filled through the backend's write_kv."""

    def __init__(
        self,
        backend: Backend,
        seq_lens: list[int],
        query_lens: list[int],
        ratio: int,
        d: int,
        dtype: torch.dtype,
        gen: torch.Generator,
        block_size: int = 4,
        own_entry_tables: bool = False,
    ) -> None:
        dev = backend.device.device()
        self.seq_lens, self.query_lens, self.ratio = seq_lens, query_lens, ratio
        table, num_blocks = random_block_tables(seq_lens, block_size, gen)
        entry_table, entry_blocks = table, num_blocks
        if own_entry_tables:
            entry_table, entry_blocks = random_block_tables([n // ratio for n in seq_lens], block_size, gen)
        self.tokens = backend.kv_cache.allocate(KVCacheSpec(num_blocks, block_size, d, 0, dtype), 1)[0]
        self.entries = backend.kv_cache.allocate(KVCacheSpec(entry_blocks, block_size, d, 0, dtype), 1)[0]
        for cache, blocks in ((self.tokens, num_blocks), (self.entries, entry_blocks)):
            every = torch.arange(blocks * block_size)  # rows no request reaches must never be read
            nan = torch.full((every.numel(), d), float("nan"), dtype=dtype)
            backend.kv_cache.write_kv(cache, nan.to(dev), every.to(dev))
        self.token_rows: list[torch.Tensor] = []
        self.entry_rows: list[torch.Tensor] = []
        for b, n in enumerate(seq_lens):
            rows, comp = randn((n, d), dtype, "cpu", gen), randn((n // ratio, d), dtype, "cpu", gen)
            self._write(backend, self.tokens, table[b], rows, block_size)
            self._write(backend, self.entries, entry_table[b], comp, block_size)
            self.token_rows.append(oracle(rows))
            self.entry_rows.append(oracle(comp))
        self.meta = AttentionMetadata.build(table.to(dev), seq_lens, query_lens)
        self.entry_tables = entry_table.to(device=dev, dtype=torch.int32) if own_entry_tables else None

    @staticmethod
    def _write(
        backend: Backend, cache: PagedKVCache, table: torch.Tensor, rows: torch.Tensor, bs: int
    ) -> None:
        if rows.shape[0]:
            slots = slots_of(table, torch.arange(rows.shape[0]), bs)
            backend.kv_cache.write_kv(
                cache, rows.to(backend.device.device()), slots.to(backend.device.device())
            )

    def queries(self) -> list[tuple[int, int, int]]:
        """(row, request, position) of every query row."""
        out, row = [], 0
        for b, (kv_len, n) in enumerate(zip(self.seq_lens, self.query_lens)):
            for i in range(n):
                out.append((row, b, kv_len - n + i))
                row += 1
        return out

    def visible_entries(self, position: int) -> int:
        return (position + 1) // self.ratio


CASES = {
    "mixed": ([37, 9, 3, 64], [5, 9, 1, 1]),
    "decode": ([40, 17, 8], [1, 1, 1]),
    "prefill-from-zero": ([23, 0, 12], [23, 0, 12]),
}


# name -> (seq_lens, query_lens, topk): CASES with top-3, then rows of hundreds of entries (top-k
# far above and far below it) and rows whose scores all tie (zero queries)
INDEXER_CASES = {
    **{name: (*case, 3) for name, case in CASES.items()},
    "long": ([1210, 37, 530], [2, 3, 1], 100),
    "long-ties": ([1210, 530], [2, 1], 100),
}


@pytest.mark.parametrize("name", list(INDEXER_CASES))
def test_indexer_topk(backend: Backend, gen: torch.Generator, name: str) -> None:
    seq_lens, query_lens, topk = INDEXER_CASES[name]
    ratio, heads, di = 4, 5, 12
    step = Step(backend, seq_lens, query_lens, ratio, di, torch.float32, gen)
    dev, t = backend.device.device(), sum(query_lens)
    q = randn((t, heads, di), torch.float32, dev, gen)
    if name.endswith("ties"):  # every score of rows 0, 2, ... is 0: any choice of ids is right
        q[::2] = 0
    weights = randn((t, heads), torch.float32, dev, gen)
    got = backend.attention.indexer_topk(
        q, weights, step.entries, step.meta, ratio=ratio, topk=topk, scale=0.3
    )
    assert got.shape == (t, topk) and got.dtype == torch.int32
    q64, w64 = oracle(q), oracle(weights)
    for row, b, pos in step.queries():
        n_vis = step.visible_entries(pos)
        keys = step.entry_rows[b][:n_vis]
        scores = (torch.relu(q64[row] @ keys.T) * 0.3 * w64[row][:, None]).sum(0)  # (n_vis,)
        ids = [i for i in got[row].tolist() if i >= 0]
        assert len(ids) == len(set(ids)) == min(topk, n_vis), f"row {row} (position {pos}): ids {ids}"
        assert all(i < n_vis for i in ids), f"row {row} (position {pos}): {ids} past {n_vis} visible entries"
        picked = torch.zeros(n_vis, dtype=torch.bool)
        picked[ids] = True
        if ids and not picked.all():  # every pick scores at least as high as every entry left out
            assert float(scores[picked].min()) >= float(scores[~picked].max()) - 1e-4, (
                f"row {row} (position {pos}): picked {ids}, scores {scores.tolist()}"
            )


@pytest.mark.parametrize("name", list(CASES))
def test_indexer_topk_ties_go_to_lower_ids(backend: Backend, gen: torch.Generator, name: str) -> None:
    """Every score ties (zero queries): each row picks the lowest visible ids, whatever entries
    and rows the step holds besides (a verification step picks what a decode step picks)."""
    seq_lens, query_lens = CASES[name]
    ratio, topk, heads, di = 4, 3, 5, 12
    step = Step(backend, seq_lens, query_lens, ratio, di, torch.float32, gen)
    dev, t = backend.device.device(), sum(query_lens)
    q = torch.zeros((t, heads, di), dtype=torch.float32, device=dev)
    weights = randn((t, heads), torch.float32, dev, gen)
    got = backend.attention.indexer_topk(
        q, weights, step.entries, step.meta, ratio=ratio, topk=topk, scale=0.3
    ).tolist()
    for row, _, pos in step.queries():
        n = min(topk, step.visible_entries(pos))
        assert sorted(i for i in got[row] if i >= 0) == list(range(n)), (
            f"row {row} (position {pos}): {got[row]}"
        )


# DeepSeek-V4.1's candidate blocks. name -> (seq_lens, query_lens, topk, block_size, topk_blocks):
# partial last blocks (3 entries a block), fewer candidate entries than top-k ("long-short": 8
# blocks of 3 < 30), all scores tied ("-ties": zero queries on rows 0, 2, ...)
CANDIDATE_CASES = {
    **{name: (*case, 3, 3, 8) for name, case in CASES.items()},
    "long": ([1210, 37, 530], [2, 3, 1], 20, 3, 8),
    "long-short": ([1210, 530], [2, 1], 30, 3, 8),
    "long-ties": ([1210, 530], [2, 1], 20, 3, 8),
}


def _candidate_step(
    backend: Backend, gen: torch.Generator, name: str
) -> tuple[Step, torch.Tensor, torch.Tensor, int, int, int, int]:
    seq_lens, query_lens, topk, block, n_blocks = CANDIDATE_CASES[name]
    ratio, heads, di = 4, 5, 12
    step = Step(backend, seq_lens, query_lens, ratio, di, torch.float32, gen)
    dev, t = backend.device.device(), sum(query_lens)
    q = randn((t, heads, di), torch.float32, dev, gen)
    if name.endswith("ties"):
        q[::2] = 0
    return step, q, randn((t, heads), torch.float32, dev, gen), ratio, topk, block, n_blocks


def _row_scores(
    step: Step, q: torch.Tensor, weights: torch.Tensor, row: int, b: int, pos: int
) -> torch.Tensor:
    """float64 (visible entries,) scores sum_h w_h relu(q_h . k) * 0.3 of one query row."""
    keys = step.entry_rows[b][: step.visible_entries(pos)]
    return (torch.relu(oracle(q)[row] @ keys.T) * 0.3 * oracle(weights)[row][:, None]).sum(0)


def check_best(
    ids: list[int], scores: torch.Tensor, allowed: list[int], k: int, tied: bool, what: str
) -> None:
    """ids (-1 unused) are min(k, |allowed|) distinct members of `allowed` scoring at least as high
    as every member left out; with tied scores (exact float64 zeros, +inf), the best and among
    equals the lowest."""
    got = [i for i in ids if i >= 0]
    assert len(got) == len(set(got)) == min(k, len(allowed)), f"{what}: {ids} of {allowed}"
    assert set(got) <= set(allowed), f"{what}: {ids} outside {allowed}"
    left = [i for i in allowed if i not in got]
    if tied:
        want = sorted(allowed, key=lambda i: (-float(scores[i]), i))[: len(got)]
        assert sorted(got) == sorted(want), f"{what}: ties must go to the lowest ids, got {ids}"
    elif got and left:
        assert float(scores[got].min()) >= float(scores[left].max()) - 1e-4, (
            f"{what}: {ids}, {scores.tolist()}"
        )


def check_candidate_blocks(
    blocks: list[int], scores: torch.Tensor, block: int, n_blocks: int, tied: bool, what: str
) -> None:
    """One row's candidate blocks (-1 unused) against its visible entries' float64 scores: the
    blocks ranked by their best entry, the newest entry's block always kept (+inf), ties to the
    lower block id (check_best)."""
    nb = -(-scores.shape[0] // block)
    best = torch.tensor([float(scores[j * block : (j + 1) * block].max()) for j in range(nb)])
    if nb:
        best[-1] = float("inf")
        assert nb - 1 in blocks, f"{what}: the newest block {nb - 1} is missing"
    check_best(blocks, best, list(range(nb)), n_blocks, tied, f"{what} blocks")


@pytest.mark.parametrize("name", list(CANDIDATE_CASES))
def test_indexer_candidate_blocks(backend: Backend, gen: torch.Generator, name: str) -> None:
    """The first stage: indexer_topk's ids, and blocks ranked by their best visible entry, the
    newest entry's block always first (+inf), ties to the lower block id."""
    step, q, weights, ratio, topk, block, n_blocks = _candidate_step(backend, gen, name)
    ids, blocks = backend.attention.indexer_candidate_blocks(
        q, weights, step.entries, step.meta, ratio=ratio, topk=topk, scale=0.3, block_size=block,
        topk_blocks=n_blocks,
    )  # fmt: skip
    t = q.shape[0]
    assert ids.shape == (t, topk) and blocks.shape == (t, n_blocks)
    assert ids.dtype == blocks.dtype == torch.int32
    for row, b, pos in step.queries():
        scores = _row_scores(step, q, weights, row, b, pos)
        n_vis, tied = scores.shape[0], name.endswith("ties") and row % 2 == 0
        check_best(ids[row].tolist(), scores, list(range(n_vis)), topk, tied, f"row {row} ids")
        check_candidate_blocks(blocks[row].tolist(), scores, block, n_blocks, tied, f"row {row}")


@pytest.mark.parametrize("name", list(CANDIDATE_CASES))
def test_indexer_topk_in_blocks(backend: Backend, gen: torch.Generator, name: str) -> None:
    """The second stage: the top-k among the visible entries of each row's listed blocks (random
    distinct ids, some past the visible blocks, -1 padded), ties to the lower entry id."""
    step, q, weights, ratio, topk, block, n_blocks = _candidate_step(backend, gen, name)
    t, most = q.shape[0], max(step.seq_lens) // ratio // block + 2
    listed = torch.full((t, n_blocks), -1, dtype=torch.int32)
    for row in range(t):
        n = int(torch.randint(0, n_blocks + 1, (1,), generator=gen)) if row % 3 else n_blocks
        n = min(n, most)
        listed[row, :n] = torch.randperm(most, generator=gen)[:n].to(torch.int32)
    got = backend.attention.indexer_topk_in_blocks(
        q, weights, step.entries, step.meta, listed.to(q.device), ratio=ratio, topk=topk, scale=0.3,
        block_size=block,
    )  # fmt: skip
    assert got.shape == (t, topk) and got.dtype == torch.int32
    for row, b, pos in step.queries():
        scores = _row_scores(step, q, weights, row, b, pos)
        mine = set(listed[row].tolist())
        allowed = [i for i in range(scores.shape[0]) if i // block in mine]
        tied = name.endswith("ties") and row % 2 == 0
        check_best(got[row].tolist(), scores, allowed, topk, tied, f"row {row}")


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("topk_width", [0, 4, 70], ids=["hca", "csa", "csa-long-list"])
@pytest.mark.parametrize("own_tables", [False, True], ids=["shared-tables", "entry-tables"])
def test_compressed_attention(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, name: str, topk_width: int, own_tables: bool
) -> None:
    """entry-tables: the entries in a pool of their own, paged by compressed_block_tables.
    csa-long-list: top-k lists longer than a tile of keys, an id repeated far apart in its list."""
    seq_lens, query_lens = CASES[name]
    with_topk = topk_width > 0
    ratio, heads, d, window, scale = (4, 3, 24, 6, 0.2) if with_topk else (8, 3, 24, 5, 0.2)
    step = Step(backend, seq_lens, query_lens, ratio, d, dtype, gen, own_entry_tables=own_tables)
    dev, t = backend.device.device(), sum(query_lens)
    q = randn((t, heads, d), dtype, dev, gen)
    sinks = randn((heads,), torch.float32, dev, gen)
    topk = None
    if with_topk:  # random ids, some past the visible entries, some repeated, -1 padded
        shape = (t, topk_width)
        topk = torch.randint(-1, max(seq_lens) // ratio + 2, shape, generator=gen, dtype=torch.int32)
        if t:
            topk[0, 1] = topk[0, -1] = topk[0, 0]
        topk = topk.to(dev)
    mods = AttentionModifiers(window=window, sinks=sinks, topk_indices=topk)
    got = backend.attention.compressed_attention(
        q, step.tokens, step.entries, step.meta, scale=scale, ratio=ratio, modifiers=mods,
        compressed_block_tables=step.entry_tables,
    )  # fmt: skip
    want = torch.zeros((t, heads, d), dtype=torch.float64)
    q64, s64 = oracle(q), oracle(sinks)
    picked = None if topk is None else topk.cpu().long()
    for row, b, pos in step.queries():
        entries = torch.arange(step.visible_entries(pos))
        if picked is not None:
            entries = entries[torch.isin(entries, picked[row])]
        # (L, D): the window's tokens (never empty: the query's own) and the allowed entries
        k = torch.cat([step.token_rows[b][max(0, pos - window + 1) : pos + 1], step.entry_rows[b][entries]])
        logits = q64[row] @ k.T * scale  # (H, L)
        top = torch.maximum(logits.max(-1).values, s64)
        e = torch.exp(logits - top[:, None])
        want[row] = (e @ k) / (e.sum(-1) + torch.exp(s64 - top))[:, None]
    assert_close(
        got, want, dtype, what="compressed_attention", case=f"{name}, ratio {ratio}, window {window}"
    )


# --------------------------------------------------------------------------- a tiny model

# 3 layers (sliding window only, CSA, HCA) = 6 sublayers, each within the per-op budget; the
# hyper-connection mixes add a few roundings per sublayer
V4_MODEL_DEPTH = 8
# prompts past the window (6) and over several compressed entries (ratios 4 and 8)
V4_PROMPTS = {0: [(7 * i + 3) % 120 + 2 for i in range(13)], 1: [(5 * i + 11) % 120 + 2 for i in range(18)]}
V4_CHUNK = 7
# decode positions 13-15 and 18-20: compressed entries close in decode steps (request 0's HCA
# and CSA entries at 15, request 1's CSA entry at 19)
V4_DECODE = [[9, 40], [77, 3], [15, 100]]


def _run_v4(
    backend: Backend, root: Path, dtype: torch.dtype, trace: list[OpCall] | None = None
) -> list[torch.Tensor]:
    """Logits of every row of each step: chunked prefill of both prompts, then decode steps
    (with every op call of the steps appended to `trace`, when given)."""
    model = load_model(root, backend, dtype=dtype)
    if trace is None:
        return _steps_v4(model, backend)
    with recording(backend) as calls:
        out = _steps_v4(model, backend)
    trace.extend(calls)
    return out


def _steps_v4(model: torch.nn.Module, backend: Backend) -> list[torch.Tensor]:
    runner = PagedRunner(model, backend, num_blocks=32, block_size=4)  # type: ignore[arg-type]
    out, done = [], dict.fromkeys(V4_PROMPTS, 0)
    while any(done[r] < len(p) for r, p in V4_PROMPTS.items()):
        chunks = []
        for r, p in V4_PROMPTS.items():
            if done[r] < len(p):
                chunks.append((r, p[done[r] : done[r] + V4_CHUNK]))
                done[r] += len(chunks[-1][1])
        out.append(runner.step(chunks, all_logits=True).cpu())
    for tokens in V4_DECODE:
        out.append(runner.step([(r, [t]) for r, t in zip(V4_PROMPTS, tokens)]).cpu())
    return out


def test_tiny_v4_model(backend: Backend, dtype: torch.dtype, tmp_path: Path) -> None:
    """A tiny DeepSeek-V4 (every layer type, hash and routed MoE, mHC) on the backend under test
    against the reference in float64: chunked prefill over the paged caches, then decode steps.
    Every token goes to all experts and the indexer keeps every entry, so no near-tie in a choice
    can flip between precisions: the logits must stay within V4_MODEL_DEPTH x the per-op budget."""
    config = tiny_v4_config(num_experts_per_tok=4, index_topk=16)
    root = write_random_v4_checkpoint(tmp_path / "tiny-v4", config, seed=3)
    _check_v4(backend, root, dtype, tolerance(dtype))


@pytest.mark.usefixtures("fp8")
def test_tiny_v4_model_fp8_fp4(backend: Backend, dtype: torch.dtype, tmp_path: Path) -> None:
    """The same in DeepSeek-V4's published format: FP8 linears with UE8M0 block scales (wo_a as a
    grouped FP8 GEMM: o_lora_rank 128 fills whole scale blocks) and MXFP4 routed experts. The
    FP8 GEMMs quantise activations, so the budget is the FP8 one (with its relative L2 bound)."""
    if dtype == torch.float64:
        skip_not_applicable("FP8 GEMMs produce float32 or narrower activations, not float64")
    config = tiny_v4_config(num_experts_per_tok=4, index_topk=16, o_lora_rank=128)
    root = write_random_v4_checkpoint(tmp_path / "tiny-v4-fp8-fp4", config, seed=3, quantized=True)
    _check_v4(backend, root, dtype, tolerance(dtype, fp8_act=True))


def _check_v4(backend: Backend, root: Path, dtype: torch.dtype, tol: Tolerance) -> None:
    """The logits within the model budget; a failure names the first op whose output diverges
    (both runs again with every op call recorded: deepinfer.testing.op_trace)."""
    expected = _run_v4(create_reference_backend(), root, torch.float64)
    actual = _run_v4(backend, root, dtype)
    try:
        _assert_v4_within(actual, expected, tol, dtype)
    except AssertionError as exc:
        traces: tuple[list[OpCall], list[OpCall]] = ([], [])
        _run_v4(create_reference_backend(), root, torch.float64, traces[1])
        _run_v4(backend, root, dtype, traces[0])
        budget = Tolerance(tol.atol * V4_MODEL_DEPTH, tol.rtol * V4_MODEL_DEPTH)
        first = first_divergence(*traces, budget)
        raise AssertionError(f"{exc}; first op whose output diverges: {first}") from None


def _assert_v4_within(
    actual: list[torch.Tensor], expected: list[torch.Tensor], tol: Tolerance, dtype: torch.dtype
) -> None:
    """Every step's logits within V4_MODEL_DEPTH x the per-op budget (and its relative L2 bound)."""
    atol, rtol = tol.atol * V4_MODEL_DEPTH, tol.rtol * V4_MODEL_DEPTH
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        err = (a.double() - e).abs()
        bound = atol + rtol * e.abs()
        assert bool((err <= bound).all()), (
            f"step {i} ({dtype}): {int((err > bound).sum())}/{err.numel()} logits outside "
            f"atol={atol:.3g} rtol={rtol:.3g}; max abs error {err.max().item():.3e}"
        )
        if tol.rel_l2 is not None:
            rel = float(err.norm() / e.norm())
            assert rel <= tol.rel_l2 * V4_MODEL_DEPTH, f"step {i} ({dtype}): relative L2 error {rel:.3e}"
