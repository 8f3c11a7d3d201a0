"""Paged latent attention, decode and chunked prefill, against the float64 reference."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from deepinfer.backend.ops import Backend
from deepinfer.reference import attention as ref_attention
from deepinfer.testing.helpers import make_paged_batch, oracle, randn, topk_indices_for
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


def run_case(backend: Backend, case: Case, dtype: torch.dtype, gen: torch.Generator, decode: bool) -> None:
    seq, qlen = list(case.seq_lens), list(case.query_lens)
    batch = make_paged_batch(
        backend, seq_lens=seq, query_lens=qlen, block_size=case.block_size, head_dim=case.head_dim,
        dtype=dtype, gen=gen, rope_dim=case.head_dim - case.v_dim,
    )  # fmt: skip
    device = backend.device.device()
    q = randn((batch.num_tokens, case.heads, case.head_dim), dtype, device, gen)
    sinks = randn((case.heads,), torch.float32, device, gen) if case.sinks else None
    topk = topk_indices_for(seq, qlen, case.topk, gen) if case.topk is not None else None
    scale = case.head_dim**-0.5
    op = backend.attention.decode if decode else backend.attention.prefill
    out = op(
        q, batch.cache, batch.meta, scale=scale, v_dim=case.v_dim, window=case.window, sinks=sinks,
        topk_indices=None if topk is None else topk.to(device),
    )  # fmt: skip
    expected = ref_attention.paged_attention(
        oracle(q), batch.ref_cache, batch.ref_meta, scale, case.v_dim, case.window,
        None if sinks is None else oracle(sinks), topk,
    )  # fmt: skip
    assert out.dtype == dtype and out.device.type == device.type
    assert_close(out, expected, dtype, what="decode" if decode else "prefill")


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
}


@pytest.mark.parametrize("name", list(PREFILL_CASES))
def test_prefill(backend: Backend, dtype: torch.dtype, gen: torch.Generator, name: str) -> None:
    run_case(backend, PREFILL_CASES[name], dtype, gen, decode=False)


HEAVY_CASES = {
    "decode_long": (Case((1, 300, 513, 1000), heads=16, block_size=64), True),
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
    assert_close(a, oracle(b), dt, what="decode vs prefill")
