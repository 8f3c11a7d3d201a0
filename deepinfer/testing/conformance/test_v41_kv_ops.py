"""DeepSeek-V4.1's quantised KV ops (KVCacheOps.write_kv_rows / read_kv_rows,
AttentionOps.quantized_attention / quantized_indexer_topk, and the candidate-block ops
indexer_candidate_blocks / indexer_topk_in_blocks with key_format) against float64: the rounding
of each row format within the bounds its step sizes give, then attention, indexer scoring and
candidate blocks over the cached rows against float64 math over the same rows rounded
independently (testing.v41_oracle.kv_round, written from the formats' definitions, not from
backend.kv_formats_v41). Over MXFP4 index keys the indexer's queries are MXFP4 too (the published
FP4 indexer), so the float64 scores round each query head with kv_round as well; FP4 codes tie
often, and exact float64 ties go to the lower ids (_check_picks).

Rows no request reaches hold 0xFF bytes (NaN e4m3 codes, an infinite UE8M0 scale): they must
never reach an output.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.backend.kv_formats_v41 import RowFormat, row_bytes
from deepinfer.backend.ops import Backend
from deepinfer.backend.types import AttentionMetadata, AttentionModifiers, KVCacheSpec, PagedKVCache
from deepinfer.testing.conformance.test_v4_ops import check_best, check_candidate_blocks
from deepinfer.testing.helpers import oracle, randn, random_block_tables, slots_of
from deepinfer.testing.tolerances import assert_close
from deepinfer.testing.v41_oracle import kv_round

FORMATS: tuple[RowFormat, ...] = ("fp8", "fp4", "mxfp4")


def _cache(
    backend: Backend, fmt: RowFormat | None, width: int, blocks: int, bs: int, dtype: torch.dtype
) -> PagedKVCache:
    """A cache of rows in `fmt` (uint8 bytes; None: `width` values of dtype), every row poisoned."""
    dev = backend.device.device()
    if fmt is None:
        cache = backend.kv_cache.allocate(KVCacheSpec(blocks, bs, width, 0, dtype), 1)[0]
        poison = torch.full((blocks * bs, width), float("nan"), dtype=dtype)
    else:
        cache = backend.kv_cache.allocate(KVCacheSpec(blocks, bs, row_bytes(fmt, width), 0, torch.uint8), 1)[
            0
        ]
        poison = torch.full((blocks * bs, row_bytes(fmt, width)), 0xFF, dtype=torch.uint8)
    backend.kv_cache.write_kv(cache, poison.to(dev), torch.arange(blocks * bs).to(dev))
    return cache


def _rounding_bound(x: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    """|stored - x| bounds per value from the formats' steps (x float64 (n, W)):
    fp8: e4m3 keeps 3 mantissa bits, so round-to-nearest errs by at most 2^-4 of |x| for normal
      codes, and by half the subnormal spacing, 2^-10 x scale, below 2^-6 x scale; the scale is
      the power of two in [amax / 448, 2 amax / 448), so scale <= amax / 224;
    fp4: the block's scale s = e4m3(amax / 6) errs from amax / 6 by delta <= max(2^-4 amax / 6,
      2^-10) (3 mantissa bits; half the subnormal spacing 2^-9, where tiny blocks round s to 0);
      e2m1's widest spacing is 2 (between 4 and 6) in units of s, so rounding errs by at most
      s <= amax / 6 + delta where s is above amax / 6, and where it is below, clipping at 6 s adds
      amax - 6 s <= 6 delta: amax / 6 + 6 delta in all;
    mxfp4: power-of-two scale s in [amax / 6, 2 amax / 6): nothing clips, rounding errs by at most
      s (half of e2m1's widest spacing 2) <= amax / 3."""
    block = 16 if fmt == "fp4" else 32
    amax = x.reshape(x.shape[0], x.shape[1] // block, block).abs().amax(-1).repeat_interleave(block, dim=-1)
    if fmt == "fp8":
        return x.abs() * 2**-4 + amax / 224 * 2**-10
    if fmt == "fp4":
        return amax / 6 + 6 * torch.clamp(amax / 6 * 2**-4, min=2**-10)
    return amax / 3


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [0, 1, 9])
def test_write_kv_rows_rounds_within_the_format(
    backend: Backend, gen: torch.Generator, fmt: RowFormat, rows: int
) -> None:
    """Written rows (slot -1 skipped) read back within the format's rounding of their values, each
    block of values scaled on its own (a block of zeros stays zero, a tiny block keeps its scale)."""
    dev, w, bs = backend.device.device(), 64, 4
    cache = _cache(backend, fmt, w, 4, bs, torch.float32)
    x = randn((rows, w), torch.float32, "cpu", gen, 3.0)
    if rows > 2:
        x[1, :32] = 0.0
        x[2, 32:] *= 1e-30
    slots = torch.randperm(16, generator=gen)[:rows]
    if rows > 1:
        slots[-1] = -1
    backend.kv_cache.write_kv_rows(cache, x.to(dev), slots.to(dev), fmt)
    kept = slots >= 0
    got = backend.kv_cache.read_kv_rows(cache, slots[kept].to(dev), fmt)
    assert got.shape == (int(kept.sum()), w) and got.dtype == torch.float32
    x64 = oracle(x[kept])
    err = (oracle(got) - x64).abs()
    bound = _rounding_bound(x64, fmt)
    assert bool((err <= bound + 1e-300).all()), f"{fmt}: error {float((err - bound).max())} past the bound"
    if rows > 2:
        assert bool((oracle(got)[1, :32] == 0).all())


class QuantStep:
    """A ragged step: a token cache (one row per position) and an entry cache (one row per entry w,
    in a pool of its own), written through write_kv_rows in their formats; the float64 rows the
    attention must see are kv_round of the written values."""

    def __init__(
        self,
        backend: Backend,
        seq_lens: list[int],
        query_lens: list[int],
        ratio: int,
        d: int,
        formats: tuple[RowFormat | None, RowFormat | None],
        dtype: torch.dtype,
        gen: torch.Generator,
        bs: int = 4,
    ) -> None:
        dev = backend.device.device()
        self.seq_lens, self.query_lens, self.ratio = seq_lens, query_lens, ratio
        table, blocks = random_block_tables(seq_lens, bs, gen)
        etable, eblocks = random_block_tables([n // ratio for n in seq_lens], bs, gen)
        self.tokens = _cache(backend, formats[0], d, blocks, bs, dtype)
        self.entries = _cache(backend, formats[1], d, eblocks, bs, dtype)
        self.token_rows: list[torch.Tensor] = []
        self.entry_rows: list[torch.Tensor] = []
        for b, n in enumerate(seq_lens):
            for cache, tab, count, fmt, out in (
                (self.tokens, table[b], n, formats[0], self.token_rows),
                (self.entries, etable[b], n // ratio, formats[1], self.entry_rows),
            ):
                rows = randn((count, d), dtype, "cpu", gen)
                if count:
                    slots = slots_of(tab, torch.arange(count), bs)
                    backend.kv_cache.write_kv_rows(cache, rows.to(dev), slots.to(dev), fmt)
                out.append(oracle(rows) if fmt is None else kv_round(oracle(rows), fmt))
        self.meta = AttentionMetadata.build(table.to(dev), seq_lens, query_lens)
        self.entry_tables = etable.to(device=dev, dtype=torch.int32)

    def queries(self) -> list[tuple[int, int, int]]:
        out, row = [], 0
        for b, (kv_len, n) in enumerate(zip(self.seq_lens, self.query_lens)):
            out += [(row + i, b, kv_len - n + i) for i in range(n)]
            row += n
        return out


CASES = {
    "mixed": ([37, 9, 3, 64], [5, 9, 1, 1]),
    "decode": ([40, 17, 8], [1, 1, 1]),
    "prefill-from-zero": ([23, 0, 12], [23, 0, 12]),
}
# (window format, entry format): the published default, FP8 entries, the window alone
LAYOUTS: dict[str, tuple[RowFormat, RowFormat | None]] = {
    "fp8-fp4": ("fp8", "fp4"),
    "fp8-fp8": ("fp8", "fp8"),
    "window-only": ("fp8", None),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_quantized_attention(
    backend: Backend, dtype: torch.dtype, gen: torch.Generator, name: str, layout: str
) -> None:
    """The window's rows and the top-k entries (ids past the visible ones, repeats and -1 among
    them) from their quantised rows, sinks in the denominator, against float64 over the rounded
    rows: the budget is the attention's own in `dtype` (the rows are exact in it: an e4m3 or
    e2m1 code times its scale has at most 6 significant bits)."""
    seq_lens, query_lens = CASES[name]
    window_fmt, entry_fmt = LAYOUTS[layout]
    ratio, heads, d, window, scale = 2, 3, 64, 6, 0.2
    step = QuantStep(backend, seq_lens, query_lens, ratio, d, (window_fmt, entry_fmt or "fp8"), dtype, gen)
    dev, t = backend.device.device(), sum(query_lens)
    q = randn((t, heads, d), dtype, dev, gen)
    sinks = randn((heads,), torch.float32, dev, gen)
    topk = torch.randint(-1, max(seq_lens) // ratio + 2, (t, 5), generator=gen, dtype=torch.int32)
    if t:
        topk[0, 1] = topk[0, 0]
    topk = topk.to(dev)
    only_window = entry_fmt is None
    mods = AttentionModifiers(window=window, sinks=sinks, topk_indices=None if only_window else topk)
    got = backend.attention.quantized_attention(
        q, step.tokens, None if only_window else step.entries, step.meta, scale=scale, ratio=ratio,
        window_format=window_fmt, entry_format=entry_fmt, modifiers=mods,
        compressed_block_tables=None if only_window else step.entry_tables,
    )  # fmt: skip
    want = torch.zeros((t, heads, d), dtype=torch.float64)
    q64, s64, picked = oracle(q), oracle(sinks), topk.cpu().long()
    for row, b, pos in step.queries():
        keys = [step.token_rows[b][max(0, pos - window + 1) : pos + 1]]
        if not only_window:
            entries = torch.arange((pos + 1) // ratio)
            keys.append(step.entry_rows[b][entries[torch.isin(entries, picked[row])]])
        k = torch.cat(keys)
        logits = q64[row] @ k.T * scale  # (H, L)
        top = torch.maximum(logits.max(-1).values, s64)
        e = torch.exp(logits - top[:, None])
        want[row] = (e @ k) / (e.sum(-1) + torch.exp(s64 - top))[:, None]
    assert_close(got, want, dtype, what="quantized_attention", case=f"{name}, {layout}")


def _index_queries(q: torch.Tensor) -> torch.Tensor:
    """float64 (T, Hi, Di) queries as the FP4 indexer scores them: each head's Di values MXFP4."""
    return kv_round(oracle(q), "mxfp4")


def _check_picks(
    ids: list[int], scores: torch.Tensor, allowed: list[int], k: int, tied: bool, what: str
) -> None:
    """check_best, and the contract's tie rule where float64 scores tie exactly at zero (no head
    scores above zero: zero in float32 too; weights of either sign put other scores on both
    sides): the picks among those entries are the lowest ids."""
    check_best(ids, scores, allowed, k, tied, what)
    got = {i for i in ids if i >= 0}
    zeros = [i for i in allowed if float(scores[i]) == 0.0]
    taken = [i for i in zeros if i in got]
    assert taken == zeros[: len(taken)], f"{what}: zero-score ties must go to the lowest ids, got {ids}"


@pytest.mark.parametrize("name", [*CASES, "long"])
def test_quantized_indexer_topk(backend: Backend, gen: torch.Generator, name: str) -> None:
    """MXFP4 index keys and queries: each row's picks score at least as high, in float64 over the
    keys and the query heads rounded independently, as every visible entry left out (1e-4: the
    float32 scores' rounding), and exact zero ties go to the lower ids."""
    seq_lens, query_lens = CASES.get(name, ([530, 37], [2, 3]))
    topk = 100 if name == "long" else 3
    ratio, heads, di = 2, 5, 32
    step = QuantStep(backend, seq_lens, query_lens, ratio, di, ("mxfp4", "mxfp4"), torch.float32, gen)
    dev, t = backend.device.device(), sum(query_lens)
    q = randn((t, heads, di), torch.float32, dev, gen)
    weights = randn((t, heads), torch.float32, dev, gen)
    meta = AttentionMetadata.build(step.entry_tables, seq_lens, query_lens)  # the keys' tables
    got = backend.attention.quantized_indexer_topk(
        q, weights, step.entries, meta, ratio=ratio, topk=topk, scale=0.3, key_format="mxfp4"
    )
    assert got.shape == (t, topk) and got.dtype == torch.int32
    for row, b, pos in step.queries():
        scores = _row_scores(step, q, weights, row, b, pos)
        _check_picks(got[row].tolist(), scores, list(range(scores.shape[0])), topk, False, f"row {row}")


# DeepSeek-V4.1's candidate blocks over MXFP4 index keys. name -> (seq_lens, query_lens, topk,
# block_size, topk_blocks): partial last blocks (3 entries a block), fewer candidate entries than
# top-k ("long-short": 8 blocks of 3 < 30), all scores tied ("-ties": zero queries on rows 0, 2, ...)
CANDIDATE_CASES = {
    "mixed": ([37, 9, 3, 64], [5, 9, 1, 1], 3, 3, 8),
    "long": ([530, 37], [2, 3], 20, 3, 8),
    "long-short": ([530, 37], [2, 3], 30, 3, 8),
    "long-ties": ([530, 37], [2, 3], 20, 3, 8),
}


def _candidate_step(
    backend: Backend, gen: torch.Generator, name: str
) -> tuple[QuantStep, AttentionMetadata, torch.Tensor, torch.Tensor, int, int, int, int]:
    """MXFP4 keys written through write_kv_rows, their tables as the metadata's block tables."""
    seq_lens, query_lens, topk, block, n_blocks = CANDIDATE_CASES[name]
    ratio, heads, di = 2, 5, 32
    step = QuantStep(backend, seq_lens, query_lens, ratio, di, ("mxfp4", "mxfp4"), torch.float32, gen)
    dev, t = backend.device.device(), sum(query_lens)
    q = randn((t, heads, di), torch.float32, dev, gen)
    if name.endswith("ties"):
        q[::2] = 0
    weights = randn((t, heads), torch.float32, dev, gen)
    meta = AttentionMetadata.build(step.entry_tables, seq_lens, query_lens)  # the keys' tables
    return step, meta, q, weights, ratio, topk, block, n_blocks


def _row_scores(
    step: QuantStep, q: torch.Tensor, weights: torch.Tensor, row: int, b: int, pos: int
) -> torch.Tensor:
    """float64 (visible entries,) scores sum_h w_h relu(q_h . k) * 0.3 over the rounded keys and
    query heads."""
    keys = step.entry_rows[b][: (pos + 1) // step.ratio]
    return (torch.relu(_index_queries(q)[row] @ keys.T) * 0.3 * oracle(weights)[row][:, None]).sum(0)


@pytest.mark.parametrize("name", list(CANDIDATE_CASES))
def test_quantized_indexer_candidate_blocks(backend: Backend, gen: torch.Generator, name: str) -> None:
    """The first stage over MXFP4 keys (key_format; the queries MXFP4 too): indexer_topk's ids,
    and blocks ranked by their best visible entry in float64 over the rounded keys and queries,
    the newest entry's block always first (+inf), ties to the lower block id."""
    step, meta, q, weights, ratio, topk, block, n_blocks = _candidate_step(backend, gen, name)
    ids, blocks = backend.attention.indexer_candidate_blocks(
        q, weights, step.entries, meta, ratio=ratio, topk=topk, scale=0.3, block_size=block,
        topk_blocks=n_blocks, key_format="mxfp4",
    )  # fmt: skip
    t = q.shape[0]
    assert ids.shape == (t, topk) and blocks.shape == (t, n_blocks)
    assert ids.dtype == blocks.dtype == torch.int32
    for row, b, pos in step.queries():
        scores = _row_scores(step, q, weights, row, b, pos)
        n_vis, tied = scores.shape[0], name.endswith("ties") and row % 2 == 0
        _check_picks(ids[row].tolist(), scores, list(range(n_vis)), topk, tied, f"row {row} ids")
        check_candidate_blocks(blocks[row].tolist(), scores, block, n_blocks, tied, f"row {row}")


@pytest.mark.parametrize("name", list(CANDIDATE_CASES))
def test_quantized_indexer_topk_in_blocks(backend: Backend, gen: torch.Generator, name: str) -> None:
    """The second stage over MXFP4 keys (key_format; the queries MXFP4 too): the top-k among the
    visible entries of each row's listed blocks (random distinct ids, some past the visible
    blocks, -1 padded) in float64 over the rounded keys and queries, ties to the lower entry id."""
    step, meta, q, weights, ratio, topk, block, n_blocks = _candidate_step(backend, gen, name)
    t, most = q.shape[0], max(step.seq_lens) // ratio // block + 2
    listed = torch.full((t, n_blocks), -1, dtype=torch.int32)
    for row in range(t):
        n = int(torch.randint(0, n_blocks + 1, (1,), generator=gen)) if row % 3 else n_blocks
        listed[row, : min(n, most)] = torch.randperm(most, generator=gen)[: min(n, most)].to(torch.int32)
    got = backend.attention.indexer_topk_in_blocks(
        q, weights, step.entries, meta, listed.to(q.device), ratio=ratio, topk=topk, scale=0.3,
        block_size=block, key_format="mxfp4",
    )  # fmt: skip
    assert got.shape == (t, topk) and got.dtype == torch.int32
    for row, b, pos in step.queries():
        scores = _row_scores(step, q, weights, row, b, pos)
        mine = set(listed[row].tolist())
        allowed = [i for i in range(scores.shape[0]) if i // block in mine]
        tied = name.endswith("ties") and row % 2 == 0
        _check_picks(got[row].tolist(), scores, allowed, topk, tied, f"row {row}")
