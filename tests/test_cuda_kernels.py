"""Direct tests of the CUDA backend's Triton kernels against float64 oracles written here.

They run on a GPU when one is visible, or in the Triton interpreter on the CPU when
TRITON_INTERPRET=1 is set for the whole process (tests/test_cuda_interpret.py runs this file
that way in a subprocess, so other tests never see the variable). They cover paths the
conformance suite does not reach at its sizes: several KV splits and the combine kernel,
bitwise batch invariance across different split counts, exact FP8 rounding, the grouped GEMM's
tile table and row gather, the MXFP4 grouped GEMM's decode of every code and scale, the
one-launch MoE alignment (sort + tile table) against the torch composition it replaces, the
noise hash bit for bit, the DEEPINFER_CUDA_UNFUSED switch, and DeepSeek-V4's kernels (the mHC
semaphores and split mix, the indexer's multi-block select, compressed attention's splits and
upper-bound host lengths).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from typing import Any

import pytest
import torch

GPU = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or not (GPU or INTERPRET),
    reason="needs triton and a GPU, or TRITON_INTERPRET=1 (tests/test_cuda_interpret.py runs it so)",
)
DEV = torch.device("cuda") if GPU and not INTERPRET else torch.device("cpu")

if importlib.util.find_spec("triton") is not None and (GPU or INTERPRET):
    import triton
    import triton.language as tl
    from deepinfer_cuda import backend as cuda_backend
    from deepinfer_cuda.gemm import CudaGemm
    from deepinfer_cuda.kernels import attention as attn_k
    from deepinfer_cuda.kernels import gemm as gemm_k
    from deepinfer_cuda.kernels import kv_v41
    from deepinfer_cuda.kernels import mla as mla_k
    from deepinfer_cuda.kernels import moe as moe_k
    from deepinfer_cuda.kernels import small as small_k
    from deepinfer_cuda.kernels import v4 as v4_k
    from deepinfer_cuda.kernels import vision as vision_k
    from deepinfer_cuda.kernels.moe import sort_by_expert
    from deepinfer_cuda.kv_cache import cache_tensor

    @triton.jit  # type: ignore[untyped-decorator]
    def _mix32_probe(x_ptr, y_ptr, N, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < N, other=0).to(tl.uint32)
        tl.store(y_ptr + i, small_k.mix32(x).to(tl.int64), mask=i < N)

    @triton.jit  # type: ignore[untyped-decorator]
    def _round_mxfp4_probe(x_ptr, y_ptr, H, ROWS: tl.constexpr, COLS: tl.constexpr):  # type: ignore[no-untyped-def]
        at = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
        ok = at < H * COLS
        x = tl.load(x_ptr + at, mask=ok, other=0.0)
        tl.store(y_ptr + at, kv_v41.round_mxfp4(x, ROWS, COLS), mask=ok)

    @triton.jit  # type: ignore[untyped-decorator]
    def _fp4_rows_probe(  # type: ignore[no-untyped-def]
        x_ptr, w_ptr, s_ptr, out_ptr, K, N, stride_w, stride_s,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DECODE: tl.constexpr,
    ):  # fmt: skip
        # out[i, :N] = moe_k._fp4_rows_dot of x row i with the N packed rows of w
        i = tl.program_id(0)
        rn = tl.arange(0, BLOCK_N)
        n_ok = rn < N
        w_rows = w_ptr + rn[:, None] * stride_w
        s_rows = s_ptr + rn[:, None] * stride_s
        v = moe_k._fp4_rows_dot(x_ptr + i * K, w_rows, s_rows, K, n_ok, BLOCK_N, BLOCK_K, 1, DECODE)
        tl.store(out_ptr + i * N + rn, v, mask=n_ok)


from deepinfer import envs  # noqa: E402
from deepinfer.backend.types import (  # noqa: E402
    AttentionMetadata,
    AttentionModifiers,
    BackendOptions,
    KVCacheSpec,
    PagedKVCache,
    RouterConfig,
)
from deepinfer.reference import gemm as ref_gemm  # noqa: E402
from deepinfer.reference import moe as ref_moe  # noqa: E402
from deepinfer.reference import small as ref_small  # noqa: E402
from deepinfer.reference import v4 as ref_v4  # noqa: E402
from deepinfer.testing.helpers import router_margin  # noqa: E402
from deepinfer.testing.tolerances import assert_bitwise_equal  # noqa: E402


def small_config() -> attn_k.AttentionConfig:
    return attn_k.AttentionConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


def paged(
    seq_lens: list[int], query_lens: list[int], d: int, bs: int, gen: torch.Generator
) -> tuple[torch.Tensor, AttentionMetadata, list[torch.Tensor]]:
    """Random (NB, BS, D) float32 pool, shuffled block tables, metadata, and each request's K rows."""
    need = [-(-n // bs) for n in seq_lens]
    nb = sum(need) + 2
    pool = torch.randn((nb, bs, d), generator=gen)
    perm = torch.randperm(nb, generator=gen)
    table = torch.zeros((len(seq_lens), max(need)), dtype=torch.int32)
    rows, start = [], 0
    for b, (n, k) in enumerate(zip(seq_lens, need)):
        table[b, :k] = perm[start : start + k]
        rows.append(pool[table[b, :k].long()].reshape(-1, d)[:n])
        start += k
    return pool, AttentionMetadata.build(table.to(DEV), seq_lens, query_lens), rows


def oracle_attention(
    q: torch.Tensor,
    rows: list[torch.Tensor],
    seq_lens: list[int],
    query_lens: list[int],
    scale: float,
    v_dim: int,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float64 softmax attention written out per row: the oracle for the kernel."""
    out = torch.zeros((q.shape[0], q.shape[1], v_dim), dtype=torch.float64)
    t = 0
    for k, n, qn in zip(rows, seq_lens, query_lens):
        k = k.double()
        for i in range(qn):
            p = n - qn + i
            lo = 0 if window is None else max(0, p - window + 1)
            s = q[t].double() @ k[lo : p + 1].T * scale  # (H, visible)
            e = torch.exp(s - s.amax(-1, keepdim=True))
            den = e.sum(-1, keepdim=True)
            if sinks is not None:
                den = den + torch.exp(sinks.double()[:, None] - s.amax(-1, keepdim=True))
            out[t] = (e / den) @ k[lo : p + 1, :v_dim]
            t += 1
    return out


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("sinks", [False, True])
def test_decode_with_many_splits(gen: torch.Generator, window: int | None, sinks: bool) -> None:
    seq = [1, 33, 80, 150]
    d, dv, h = 72, 64, 4
    pool, meta, rows = paged(seq, [1] * len(seq), d, 16, gen)
    q = torch.randn((len(seq), h, d), generator=gen)
    sk = torch.randn(h, generator=gen) if sinks else None
    out = attn_k.mla_attention(
        q.to(DEV), pool.to(DEV), meta, scale=d**-0.5, v_dim=dv, latent_dim=dv, window=window,
        sinks=None if sk is None else sk.to(DEV), config=small_config(), split_size=32,
    )  # fmt: skip
    expected = oracle_attention(q, rows, seq, [1] * len(seq), d**-0.5, dv, window, sk)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("window", [None, 70])
@pytest.mark.parametrize("tma", [True, False])
def test_adaptive_splits_with_upper_bound_host_lengths(
    gen: torch.Generator, monkeypatch: pytest.MonkeyPatch, window: int | None, tma: bool
) -> None:
    """A replayed decode graph: the host lengths are the capture's upper bound (the grid has many
    splits), the device lengths are shorter and differ per request. Each program cuts its own
    range; splits past it store an empty partial (unwritten memory the combine must not read).
    132 SMs (an H200) so that four requests are few tiles."""
    monkeypatch.setattr(attn_k, "num_sms", lambda device: 132)
    seq = [1, 17, 64, 150]
    lat, rope, bs, h = 32, 16, 32, 4
    pool, meta, rows = paged(seq, [1] * len(seq), lat + rope, bs, gen)
    upper = 320
    table = torch.zeros((len(seq), upper // bs), dtype=torch.int32)
    table[:, : meta.block_tables.shape[1]] = meta.block_tables.cpu()
    bound = dataclasses.replace(
        meta, block_tables=table.to(DEV), seq_lens_host=(upper,) * len(seq), max_seq_len=upper
    )
    cfg = attn_k.AttentionConfig(16, 16, 4, 1, tma=tma)
    splits = attn_k._num_splits(len(seq), upper, 1, window, cfg, DEV)
    span = upper if window is None else window + 1  # keys a row may see
    assert splits == span // 32  # splits of two 16-key tiles; without a window most are past the ends
    q = torch.randn((len(seq), h, lat + rope), generator=gen)
    sk = torch.randn(h, generator=gen)
    for sinks in (None, sk):
        out = attn_k.mla_attention(
            q.to(DEV), pool.to(DEV), bound, scale=0.2, v_dim=lat, latent_dim=lat, window=window,
            sinks=None if sinks is None else sinks.to(DEV), config=cfg,
        )  # fmt: skip
        expected = oracle_attention(q, rows, seq, [1] * len(seq), 0.2, lat, window, sinks)
        torch.testing.assert_close(out.cpu().double(), expected, rtol=2e-3, atol=2e-3)


def test_prefill_with_splits_and_topk(gen: torch.Generator) -> None:
    seq, ql = [70, 9], [20, 9]
    d, dv, h = 40, 32, 3
    pool, meta, rows = paged(seq, ql, d, 16, gen)
    q = torch.randn((sum(ql), h, d), generator=gen)
    topk = torch.full((sum(ql), 200), -1, dtype=torch.int32)  # every position listed: no-op mask
    topk[:, :70] = torch.arange(70, dtype=torch.int32)
    out = attn_k.mla_attention(
        q.to(DEV), pool.to(DEV), meta, scale=0.2, v_dim=dv, latent_dim=dv, topk_indices=topk.to(DEV),
        config=small_config(), split_size=16,
    )  # fmt: skip
    torch.testing.assert_close(
        out.cpu().double(), oracle_attention(q, rows, seq, ql, 0.2, dv), rtol=2e-3, atol=2e-3
    )


def test_split_kv_is_batch_invariant(gen: torch.Generator) -> None:
    """A short request gets the same bits alone (1 split) and next to a long one (many splits)."""
    seq = [20, 200]
    d, dv, h = 40, 32, 2
    pool, meta, _ = paged(seq, [1, 1], d, 16, gen)
    q = torch.randn((2, h, d), generator=gen).to(DEV)

    def run(q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        out: torch.Tensor = attn_k.mla_attention(
            q, pool.to(DEV), meta, scale=0.2, v_dim=dv, latent_dim=dv, config=small_config(), split_size=32,
            batch_invariant=True,
        )  # fmt: skip
        return out

    both = run(q, meta)
    alone = run(q[:1], AttentionMetadata.build(meta.block_tables[:1], [20], [1]))
    assert_bitwise_equal(alone, both[:1], what="request 0 alone vs batched")


@pytest.mark.parametrize("splits", [1, 5, 37])  # 37: three steps of gemm_k.MERGE_SPLITS
def test_skinny_merge_matmul_merges_split_partials_as_it_reads_them(
    gen: torch.Generator, splits: int
) -> None:
    """skinny_merge_matmul: per head, the split-KV partials merged (empty splits' partials NaN,
    never to reach the result; a row with every split empty is zero) and multiplied by the head's
    weight; against the float64 merge and product, and against combine_splits + skinny_matmul."""
    t, g, k, n = 3, 3, 40, 70
    part = torch.randn((t * g * splits, 64), generator=gen)
    lse = torch.randn((t * g * splits,), generator=gen) * 4
    if splits > 1:
        lse[1::3] = float("-inf")
        part[1::3] = float("nan")
    lse[(1 * g + 2) * splits : (1 * g + 3) * splits] = float("-inf")  # token 1, head 2: nothing
    part[(1 * g + 2) * splits : (1 * g + 3) * splits] = float("nan")
    weight = (torch.randn((g, n, k), generator=gen) * k**-0.5).to(torch.bfloat16)
    y = gemm_k.skinny_merge_matmul(part.to(DEV), lse.to(DEV), splits, t, weight.to(DEV)).cpu()
    assert y.shape == (t, g, n) and y.dtype == torch.bfloat16

    rows_lse = lse.double().view(t, g, splits)
    w = torch.exp2(rows_lse - rows_lse.amax(-1, keepdim=True).nan_to_num(neginf=0.0)).nan_to_num(0.0)
    o = torch.where(torch.isinf(rows_lse)[..., None], 0.0, part.double().view(t, g, splits, 64)[..., :k])
    merged = (w[..., None] * o).sum(2) / w.sum(-1, keepdim=True).clamp_min(1e-300)
    expected = torch.einsum("tgk,gnk->tgn", merged.to(torch.bfloat16).double(), weight.double())
    torch.testing.assert_close(y.double(), expected, rtol=2e-2, atol=2e-2)
    assert y[1, 2].abs().max() == 0

    combined = torch.empty((t, g, k), dtype=torch.bfloat16, device=DEV)
    attn_k.combine_splits(part.to(DEV), lse.to(DEV), None, combined, g, splits, k)
    two = gemm_k.skinny_matmul(combined.transpose(0, 1), weight.to(DEV)).transpose(0, 1).cpu()
    torch.testing.assert_close(y.float(), two.float(), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="partials"):
        gemm_k.skinny_merge_matmul(part.to(DEV), lse.to(DEV), splits, t + 1, weight.to(DEV))
    with pytest.raises(ValueError, match="tokens"):
        gemm_k.skinny_merge_matmul(part.to(DEV), lse.to(DEV), splits, 9, weight.to(DEV))


def test_mla_decode_and_uv_merges_in_the_product_at_decode_sizes(
    gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cuda backend's mla_decode_and_uv merges the attention's splits inside the W_UV
    product's launch at decode sizes (no combine launch), and takes the default composition in
    batch-invariant mode, with modifiers, and past SKINNY_MAX_M requests: each against it."""
    from deepinfer.testing.helpers import make_paged_batch

    calls: list[str] = []
    for name in ("skinny_merge_matmul", "skinny_matmul"):
        real = getattr(gemm_k, name)

        def spy(*a: Any, real: Any = real, name: str = name, **kw: Any) -> torch.Tensor:
            calls.append(name)
            out: torch.Tensor = real(*a, **kw)
            return out

        monkeypatch.setattr(gemm_k, name, spy)
    real_combine = attn_k.combine_splits
    monkeypatch.setattr(
        attn_k, "combine_splits", lambda *a, **kw: calls.append("combine") or real_combine(*a, **kw)
    )
    backend = cuda_backend.create_cuda_backend(BackendOptions())
    batch = make_paged_batch(
        backend, seq_lens=[200], query_lens=[1], block_size=64, head_dim=576, dtype=torch.bfloat16, gen=gen,
        rope_dim=64,
    )  # fmt: skip
    q = torch.randn((1, 16, 576), generator=gen).to(torch.bfloat16).to(DEV)
    w_uv = (torch.randn((16, 128, 512), generator=gen) * 512**-0.5).to(torch.bfloat16).to(DEV)
    fused = backend.attention.mla_decode_and_uv(q, batch.cache, batch.meta, w_uv, scale=0.07, v_dim=512)
    assert calls == ["skinny_merge_matmul"], calls
    calls.clear()
    o = backend.attention.decode(q, batch.cache, batch.meta, scale=0.07, v_dim=512)
    two = backend.gemm.batched_linear(o.transpose(0, 1), w_uv).transpose(0, 1)
    assert calls == ["combine", "skinny_matmul"], calls
    torch.testing.assert_close(fused.cpu().float(), two.cpu().float(), rtol=2e-2, atol=2e-2)
    calls.clear()
    invariant = cuda_backend.create_cuda_backend(BackendOptions(batch_invariant=True))
    invariant.attention.mla_decode_and_uv(q, batch.cache, batch.meta, w_uv, scale=0.07, v_dim=512)
    assert "skinny_merge_matmul" not in calls


@pytest.mark.parametrize(
    "seq_lens, query_lens",
    [([200], [1]), ([16, 33, 200], [1, 1, 1]), ([17, 40], [1, 3])],  # 17: one whole tile, new row past it
)
def test_attention_early_cache_gives_the_same_bits(
    gen: torch.Generator, seq_lens: list[int], query_lens: list[int]
) -> None:
    """early_cache (each program reads the lengths and its first tile, when no new row lies in
    it, before waiting for the previous kernel) is the same arithmetic in the same order: the
    same bits as without it, whether one split serves a row or many, with several query tokens
    per request, and where a program's first tile holds the new row."""
    from deepinfer.testing.helpers import make_paged_batch

    backend = cuda_backend.create_cuda_backend(BackendOptions())
    batch = make_paged_batch(
        backend, seq_lens=seq_lens, query_lens=query_lens, block_size=64, head_dim=576,
        dtype=torch.bfloat16, gen=gen, rope_dim=64,
    )  # fmt: skip
    q = torch.randn((sum(query_lens), 16, 576), generator=gen).to(torch.bfloat16).to(DEV)
    kv = cache_tensor(batch.cache)

    def run(early: bool) -> list[torch.Tensor]:
        out = attn_k.mla_attention_partials(
            q, kv, batch.meta, scale=0.07, v_dim=512, latent_dim=512, early_cache=early
        )
        if isinstance(out, torch.Tensor):
            return [out]
        assert out.splits > 1
        ok = out.lse > float("-inf")  # empty splits' partials are unwritten memory
        return [out.lse, out.part[ok]]

    late, early = run(False), run(True)
    for a, b in zip(late, early):
        assert_bitwise_equal(a, b, what="early_cache")


@pytest.mark.parametrize("rows", [1, 4])  # 4: attn_k.INVARIANT_COMBINE_ROWS
def test_combine_rows_keep_their_bits_in_any_lane(gen: torch.Generator, rows: int) -> None:
    """combine_splits at a fixed rows_per_program: a row's bits do not depend on which lane of a
    program it lands in (batch-invariant mode merges 4 rows per program) or on how many rows
    the launch has; empty splits (never read) and sinks; against a float64 merge."""
    t, h, splits, dv = 13, 3, 5, 40
    part = torch.randn((t * h * splits, 64), generator=gen)
    lse = torch.randn((t * h * splits,), generator=gen) * 4
    lse[::3] = float("-inf")  # empty splits: their partials must not be read
    part[::3] = float("nan")
    sinks = torch.randn((h,), generator=gen)

    def merge(first: int) -> torch.Tensor:  # tokens first.. of the same rows
        n = t - first
        lo, hi = first * h * splits, t * h * splits
        out = torch.empty((n, h, dv), device=DEV)
        p, e = part[lo:hi].to(DEV), lse[lo:hi].to(DEV)
        attn_k.combine_splits(p, e, sinks.to(DEV), out, h, splits, dv, rows)
        return out.cpu()

    assert rows == 1 or rows == attn_k.INVARIANT_COMBINE_ROWS
    full = merge(0)
    for first in (1, 2, 5):  # every row moves to another lane
        assert_bitwise_equal(merge(first), full[first:], what=f"rows from token {first}")
    sink_lse = (sinks * 1.4426950408889634).expand(t, h)[..., None]  # log2 units, as lse
    w = torch.exp2(torch.cat([lse.view(t, h, splits), sink_lse], -1).double())
    o = torch.cat([part.view(t, h, splits, 64)[..., :dv].nan_to_num(), torch.zeros(t, h, 1, dv)], 2).double()
    expected = (w[..., None] * o).sum(2) / w.sum(2)[..., None]
    torch.testing.assert_close(full.double(), expected, rtol=1e-5, atol=1e-5)


def test_invariant_split_follows_max_model_len() -> None:
    assert attn_k.invariant_split(None) == attn_k.INVARIANT_SPLIT
    assert attn_k.invariant_split(192) == 64  # 192 / 16 = 12 -> at least 64
    assert attn_k.invariant_split(4096) == 256
    assert attn_k.invariant_split(4097) == 512
    assert attn_k.invariant_split(1 << 20) == attn_k.INVARIANT_SPLIT


def test_invariant_prefill_rows_equal_decode_steps(gen: torch.Generator) -> None:
    """Batch-invariant mode with 64-key splits: a prompt's rows computed in one prefill launch
    (many rows per tile) and each position computed as a one-token decode step (a few rows per
    tile) give the same bits, and a decode row's bits do not change beside another request."""
    n, lat, rope, h, bs = 150, 64, 16, 4, 16
    pool, meta, rows = paged([n], [n], lat + rope, bs, gen)
    q = torch.randn((n, h, lat + rope), generator=gen)

    def run(q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        out: torch.Tensor = attn_k.mla_attention(
            q.to(DEV), pool.to(DEV), meta, scale=0.2, v_dim=lat, latent_dim=lat, batch_invariant=True,
            split_size=attn_k.invariant_split(192),
        )  # fmt: skip
        return out.cpu()

    prefill = run(q, meta)
    torch.testing.assert_close(
        prefill.double(), oracle_attention(q, rows, [n], [n], 0.2, lat), rtol=2e-3, atol=2e-3
    )
    table = meta.block_tables[:1]
    for pos in (0, 63, 64, 100, n - 1):
        step = run(q[pos : pos + 1], AttentionMetadata.build(table, [pos + 1], [1]))
        assert_bitwise_equal(step, prefill[pos : pos + 1], what=f"decode step at {pos} vs prefill row")
        pair = run(q[[pos, n - 1]], AttentionMetadata.build(table.repeat(2, 1), [pos + 1, n], [1, 1]))
        assert_bitwise_equal(pair[:1], step, what=f"decode step at {pos} beside another request")


@pytest.mark.parametrize("window", [None, 50])
def test_whole_page_tiles_by_tma_match_the_masked_path(gen: torch.Generator, window: int | None) -> None:
    """Pages a multiple of block_n with power-of-two widths take TMA for whole tiles below the KV
    length and the masked loads for the last partial tile. Rows past each length hold NaN here:
    neither path may read them into the output. Several splits, sinks, prefill and decode rows."""
    seq, ql = [1, 32, 95, 160], [1, 1, 30, 1]
    lat, rope, bs, h = 64, 16, 32, 4
    pool, meta, rows = paged(seq, ql, lat + rope, bs, gen)
    written = torch.zeros(pool.shape[:2], dtype=torch.bool)
    for b, n in enumerate(seq):
        for pos in range(n):
            written[meta.block_tables[b, pos // bs].long(), pos % bs] = True
    pool[~written] = float("nan")
    q = torch.randn((sum(ql), h, lat + rope), generator=gen)
    sk = torch.randn(h, generator=gen)
    cfg = small_config()
    assert attn_k._kv_descriptors(pool.to(DEV), lat, cfg)[0] is not None
    assert attn_k._kv_descriptors(pool[:, :24].to(DEV), lat, cfg)[0] is None  # 24 % 16 != 0
    outs = [
        attn_k.mla_attention(
            q.to(DEV), pool.to(DEV), meta, scale=0.1, v_dim=lat, latent_dim=lat, window=window,
            sinks=sk.to(DEV), config=attn_k.AttentionConfig(16, 16, 4, 1, tma=tma), split_size=48,
        ).cpu().double()
        for tma in (True, False)
    ]  # fmt: skip
    expected = oracle_attention(q, rows, seq, ql, 0.1, lat, window, sk)
    for out in outs:
        torch.testing.assert_close(out, expected, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_attention_rejects_bad_inputs(gen: torch.Generator) -> None:
    pool, meta, _ = paged([5], [1], 24, 16, gen)
    with pytest.raises(ValueError, match="width"):
        attn_k.mla_attention(
            torch.zeros((1, 2, 20), device=DEV), pool.to(DEV), meta, scale=1.0, v_dim=16, latent_dim=16
        )
    with pytest.raises(ValueError, match="multiple of block_n"):
        attn_k.mla_attention(
            torch.zeros((1, 2, 24), device=DEV), pool.to(DEV), meta, scale=1.0, v_dim=16, latent_dim=16,
            config=small_config(), split_size=24,
        )  # fmt: skip
    with pytest.raises(ValueError, match="window"):
        attn_k.mla_attention(
            torch.zeros((1, 2, 24), device=DEV),
            pool.to(DEV),
            meta,
            scale=1.0,
            v_dim=16,
            latent_dim=16,
            window=0,
        )


def test_quantize_fp8_rounds_like_torch(gen: torch.Generator) -> None:
    """Bitwise equal to the reference (RNE), including values that round up into the next binade,
    which the interpreter's own fp8 conversion gets wrong without the workaround."""
    x = torch.randn((6, 300), generator=gen) * 3
    x[0, :128] = torch.linspace(-448, 448, 128)
    x[1, :128] = torch.linspace(1.9, 2.0, 128) * torch.tensor([1.0, -1.0]).repeat(64)
    x[2] = 0
    xq, s = gemm_k.quantize_fp8(x.to(DEV))
    rq, rs = ref_gemm.quantize_fp8(x)
    assert_bitwise_equal(s.cpu(), rs, what="scales")
    assert_bitwise_equal(xq.cpu(), rq, what="e4m3 codes")


def test_quantize_rejects_bad_block() -> None:
    with pytest.raises(ValueError, match="power of two"):
        gemm_k.quantize_fp8(torch.zeros((2, 64), device=DEV), block=48)


def test_fp8_gemm_checks_scale_shapes(gen: torch.Generator) -> None:
    xq, xs = ref_gemm.quantize_fp8(torch.randn((3, 256), generator=gen))
    wq, ws = ref_gemm.quantize_weight(torch.randn((128, 256), generator=gen) * 256**-0.5)
    with pytest.raises(ValueError, match="weight_scale"):
        gemm_k.fp8_gemm(xq.to(DEV), xs.to(DEV), wq.to(DEV), ws[:, :1].to(DEV), torch.float32)
    y = gemm_k.fp8_gemm(xq.to(DEV), xs.to(DEV), wq.to(DEV), ws.to(DEV), torch.float32)
    expected = ref_gemm.dequantize_act(xq, xs).double() @ ref_gemm.dequantize_weight(wq, ws).double().T
    # SM90 tensor cores sum each 128-wide FP8 step in a reduced-precision accumulator (Triton's
    # default there, DeepGEMM's promotion interval); outputs here are O(1).
    torch.testing.assert_close(y.cpu().double(), expected, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("m,k,n", [(300, 384, 136), (129, 256, 256), (5, 208, 128)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_fp8_gemm_tma_kernel(gen: torch.Generator, m: int, k: int, n: int, out_dtype: torch.dtype) -> None:
    """The persistent TMA kernel (edge tiles zero-filled by TMA, K not a multiple of 128) against
    float64 math and against the pointer kernel, which reduces K in the same steps."""
    xq, xs = ref_gemm.quantize_fp8(torch.randn((m, k), generator=gen))
    wq, ws = ref_gemm.quantize_weight(torch.randn((n, k), generator=gen) * k**-0.5)
    args = (xq.to(DEV), xs.to(DEV), wq.to(DEV), ws.to(DEV), out_dtype)
    y_tma = gemm_k.fp8_gemm(*args, tma=True).cpu().double()
    y_ptr = gemm_k.fp8_gemm(*args, tma=False).cpu().double()
    expected = ref_gemm.dequantize_act(xq, xs).double() @ ref_gemm.dequantize_weight(wq, ws).double().T
    tol = 2e-3 if out_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y_tma, expected, rtol=tol, atol=tol)
    if out_dtype == torch.float32:  # same K steps, same scaling expression: near-identical sums
        torch.testing.assert_close(y_tma, y_ptr, rtol=1e-5, atol=1e-5)


def test_fp8_gemm_tma_rejects_unaligned_rows(gen: torch.Generator) -> None:
    xq, xs = ref_gemm.quantize_fp8(torch.randn((4, 200), generator=gen))  # 200-byte rows
    wq, ws = ref_gemm.quantize_weight(torch.randn((128, 200), generator=gen))
    args = (xq.to(DEV), xs.to(DEV), wq.to(DEV), ws.to(DEV), torch.float32)
    with pytest.raises(ValueError, match="16-byte"):
        gemm_k.fp8_gemm(*args, tma=True)
    assert torch.isfinite(gemm_k.fp8_gemm(*args)).all()  # auto: the pointer kernel


def test_fp8_gemm_block32_runs_on_the_pointer_kernel(gen: torch.Generator) -> None:
    """DeepSeek-V4.1's 32 x 32 blocks: block_k = 32 on the pointer kernel (the TMA kernel's one
    weight scale per 128-wide tile does not hold them: refused), in batch-invariant mode too,
    where a row's bits do not depend on the rows beside it."""
    xq, xs = ref_gemm.quantize_fp8(torch.randn((6, 200), generator=gen), 32)
    wq, ws = ref_gemm.quantize_weight(torch.randn((96, 200), generator=gen) * 200**-0.5, 32, ue8m0=True)
    args = (xq.to(DEV), xs.to(DEV), wq.to(DEV), ws.to(DEV), torch.float32)
    with pytest.raises(ValueError, match="128-blocks"):
        gemm_k.fp8_gemm(*args, tma=True, block=32)
    with pytest.raises(ValueError, match="x_scale"):  # 32-block scales read as 128-block ones
        gemm_k.fp8_gemm(*args)
    expected = (
        ref_gemm.dequantize_act(xq, xs, 32).double() @ ref_gemm.dequantize_weight(wq, ws, 32).double().T
    )
    y = gemm_k.fp8_gemm(*args, block=32).cpu().double()
    torch.testing.assert_close(y, expected, rtol=2e-3, atol=2e-3)
    inv = gemm_k.fp8_gemm(*args, batch_invariant=True, block=32).cpu()
    one = gemm_k.fp8_gemm(args[0][2:3], args[1][2:3], *args[2:], batch_invariant=True, block=32).cpu()
    assert torch.equal(inv[2:3], one)


def test_tile_table_covers_every_row_once() -> None:
    sizes = torch.tensor([0, 5, 16, 0, 33, 1], dtype=torch.int64)
    grp, rows, n = gemm_k.tile_table(sizes.to(DEV), int(sizes.sum()), 16)
    grp, rows = grp.cpu(), rows.cpu()
    owner = torch.full((int(sizes.sum()),), -1)
    for t in range(n):
        s, e = rows[t].tolist()
        assert e - s <= 16
        assert (owner[s:e] == -1).all(), "a row belongs to two tiles"
        owner[s:e] = grp[t]
    assert torch.equal(owner, torch.repeat_interleave(torch.arange(6), sizes))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_invariant_grouped_gemm_rows_equal_across_tiles(gen: torch.Generator, dtype: torch.dtype) -> None:
    """Batch-invariant grouped GEMM: BLOCK_K is fixed, the other tile sizes follow the rows (on
    SM90): three rows alone (16-row tiles there) and among 1100 (64-row tiles) have the same bits."""
    k, n, e, rows = 192, 72, 2, 1100
    x = torch.randn((rows, k), generator=gen).to(dtype)
    w = (torch.randn((e, n, k), generator=gen) * k**-0.5).to(dtype)
    sizes = torch.tensor([700, rows - 700], dtype=torch.int32)
    big, small = (gemm_k.grouped_config(r, False, True, DEV) for r in (rows, 3))
    if DEV.type == "cuda" and torch.cuda.get_device_capability(DEV) == (9, 0):
        assert big.block_m != small.block_m and big.block_k == small.block_k
    full = gemm_k.grouped_gemm(x.to(DEV), w.to(DEV), sizes.to(DEV), out_dtype=dtype, batch_invariant=True)
    for start, g in ((0, 0), (700, 1)):
        alone_sizes = torch.tensor([3 if i == g else 0 for i in range(e)], dtype=torch.int32)
        rows3, wd = x[start : start + 3].to(DEV), w.to(DEV)
        alone = gemm_k.grouped_gemm(rows3, wd, alone_sizes.to(DEV), out_dtype=dtype, batch_invariant=True)
        assert_bitwise_equal(alone.cpu(), full[start : start + 3].cpu(), what=f"group {g}'s rows alone")
    expected = torch.cat([x[:700].double() @ w[0].double().T, x[700:].double() @ w[1].double().T])
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(full.cpu().double(), expected, rtol=tol, atol=tol)


def test_grouped_gemm_with_gather(gen: torch.Generator) -> None:
    """fused_moe's first GEMM: sorted row r reads x[gather[r]]."""
    t, k, e, n, top = 7, 48, 3, 40, 2
    x = torch.randn((t, k), generator=gen)
    w = torch.randn((e, n, k), generator=gen) * k**-0.5
    ids = torch.stack([torch.randperm(e, generator=gen)[:top] for _ in range(t)])
    order, src_to_dst, counts = sort_by_expert(ids.to(DEV), e)
    y = gemm_k.grouped_gemm(
        x.to(DEV), w.to(DEV), counts, out_dtype=torch.float32, gather=order // top, num_rows=t * top
    )
    flat = ids.reshape(-1)
    src = order.cpu()
    expected = torch.stack([x[s // top].double() @ w[flat[s]].double().T for s in src.tolist()])
    torch.testing.assert_close(y.cpu().double(), expected, rtol=2e-3, atol=2e-3)
    assert torch.equal(counts.cpu(), torch.bincount(flat, minlength=e))
    assert torch.equal(src_to_dst.cpu()[src], torch.arange(t * top))


def test_grouped_gemm_fp4_decodes_every_code_and_scale_exactly() -> None:
    """Each of the 16 e2m1 codes in both nibbles, under UE8M0 scales from 2^-127 (byte 0) to
    2^125 (byte 252: 6 x 2^125 is near float32's largest), multiplied by identity rows in
    float32: the kernel's decode gives exactly the format's dequantised weights."""
    from deepinfer.backend import fp4

    n, k = 16, 64
    codes = (torch.arange(n)[:, None] + torch.arange(k)[None, :]) % 16  # (N, K): every code in every slot
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)[None]  # (1, N, K/2)
    scales = torch.tensor([0, 1, 126, 127, 128, 200, 252, 100] * 4, dtype=torch.uint8).view(1, n, 2)
    x = torch.eye(k)  # row i picks column i of W^T: y = W^T exactly
    want = fp4.dequantize_weight(packed[0], scales[0]).T
    for pairs in (True, False):  # the nibble-pair decode and the per-element one it replaced
        sizes = torch.tensor([k], device=DEV)
        y = gemm_k.grouped_gemm_fp4(x.to(DEV), packed.to(DEV), scales.to(DEV), sizes, pairs=pairs)
        assert torch.equal(y.cpu(), want), (pairs, (y.cpu() - want).abs().max())


def fp4_rows_every_code(decode: str) -> None:
    """_fp4_rows_dot under `decode` (moe_k.FP4_DECODE) on identity rows: each of the 16 e2m1
    codes in both nibbles under UE8M0 scales from 2^-127 to 2^125 (as the grouped GEMM's test),
    K = 96 (a partial step of BLOCK_K 64 and 3 scale groups): exactly the format's dequantised
    weights, for bfloat16 rows (float32 ones for PAIR and GROUP too); ASM's inline assembly and
    SCALED's tl.dot_scaled only on a GPU (the interpreter runs float32 ops and MMA for them)."""
    from deepinfer.backend import fp4

    n, k = 16, 96
    codes = (torch.arange(n)[:, None] + torch.arange(k)[None, :]) % 16
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)  # (N, K/2)
    scales = torch.tensor([0, 1, 126, 127, 128, 200, 252, 100] * 6, dtype=torch.uint8).view(n, 3)
    want = fp4.dequantize_weight(packed, scales).T  # (K, N)
    for dtype in (torch.bfloat16, torch.float32) if decode in ("PAIR", "GROUP") else (torch.bfloat16,):
        x = torch.eye(k, dtype=dtype).to(DEV)
        out = torch.full((k, n), float("nan"), device=DEV)
        _fp4_rows_probe[(k,)](
            x, packed.to(DEV), scales.to(DEV), out, k, n, packed.stride(0), scales.stride(0),
            BLOCK_N=16, BLOCK_K=64, DECODE=moe_k.FP4_DECODE[decode],
        )  # fmt: skip
        assert torch.equal(out.cpu(), want), (decode, dtype, (out.cpu() - want).abs().max())


@pytest.mark.parametrize("decode", list(moe_k.FP4_DECODE) if GPU or INTERPRET else ["PAIR"])
def test_fp4_rows_decode_every_code_and_scale_exactly(decode: str) -> None:
    fp4_rows_every_code(decode)


def test_grouped_gemm_fp4_rejects_bad_shapes() -> None:
    x = torch.zeros((3, 64), device=DEV)
    w = torch.zeros((2, 8, 32), dtype=torch.uint8, device=DEV)
    sizes = torch.tensor([1, 2], device=DEV)
    with pytest.raises(ValueError, match="need \\(E, N, K/2\\) and \\(E, N, ceil\\(K/32\\)\\)"):
        gemm_k.grouped_gemm_fp4(x, w, torch.zeros((2, 8, 1), dtype=torch.uint8, device=DEV), sizes)
    with pytest.raises(ValueError, match="uint8 weights and scales"):
        gemm_k.grouped_gemm_fp4(x, w.float(), torch.zeros((2, 8, 2), dtype=torch.uint8, device=DEV), sizes)


def test_weighted_combine_and_write_kv(gen: torch.Generator) -> None:
    y = torch.randn((6, 10), generator=gen)
    idx = torch.tensor([5, 0, 2, 1, 4, 3])
    w = torch.rand((3, 2), generator=gen)
    out = small_k.weighted_combine(y.to(DEV), idx.to(DEV), w.to(DEV))
    expected = (y[idx].view(3, 2, 10).double() * w.double()[..., None]).sum(1)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-6, atol=1e-6)
    cache = torch.zeros((2, 4, 10), device=DEV)
    small_k.write_kv(cache, y.to(DEV), torch.tensor([7, -1, 0, 3, -1, 4], device=DEV))
    flat = cache.view(8, 10).cpu()
    assert torch.equal(flat[[7, 0, 3, 4]], y[[0, 2, 3, 5]]) and not flat[[1, 2, 5, 6]].any()


def ids_with_idle_experts(t: int, k: int, e: int, gen: torch.Generator) -> torch.Tensor:
    """(T, K) int32 distinct experts per token drawn from every third expert only, so that most
    experts (the first and the last included) receive no rows."""
    pool = torch.arange(1, e - 1, 3)
    return torch.stack([pool[torch.randperm(pool.numel(), generator=gen)[:k]] for _ in range(t)]).to(
        torch.int32
    )


@pytest.mark.parametrize(
    "t,k,e,block_m",
    [(0, 8, 256, 16), (1, 8, 256, 16), (37, 3, 9, 64), (131, 6, 64, 16), (101, 8, 256, 16), (9, 8, 384, 128)],
)
def test_align_matches_the_torch_composition(
    gen: torch.Generator, t: int, k: int, e: int, block_m: int
) -> None:
    """One launch (a program per block of rows): order (stable), token, src_to_dst, counts and
    the tile table equal to sort_by_expert + order // K + gemm.tile_table, bit for bit. T*K is
    never a multiple of the kernel's row block here except 0 (808 rows = 25 blocks of 32 and 8
    rows for E = 256); idle experts sit first, last and between used ones."""
    assert t * k <= moe_k.ALIGN_MAX_ROWS  # the one-launch kernel (a program per row block), not torch
    ids = ids_with_idle_experts(t, k, e, gen) if t else torch.empty((0, k), dtype=torch.int32)
    a = moe_k.align(ids.to(DEV), e, block_m)
    order, src_to_dst, counts = sort_by_expert(ids, e)
    group, rows, n = gemm_k.tile_table(counts, t * k, block_m)
    assert t == 0 or (counts[0] == 0 and counts[-1] == 0)
    for got, want, what in [
        (a.order, order, "order"), (a.token, order // k, "token"), (a.src_to_dst, src_to_dst, "src_to_dst"),
        (a.counts, counts, "counts"),
    ]:  # fmt: skip
        assert_bitwise_equal(got.cpu(), want, what=what)
    assert a.tiles is not None and a.tiles.num_tiles == n and a.tiles.block_m == block_m
    assert_bitwise_equal(a.tiles.group.cpu(), group, what="tile_group")
    assert_bitwise_equal(a.tiles.rows.cpu(), rows, what="tile_rows")
    no_tiles = moe_k.align(ids.to(DEV), e)
    assert no_tiles.tiles is None and torch.equal(no_tiles.order.cpu(), order)


def test_align_with_repeated_ids_and_int64_ids(gen: torch.Generator) -> None:
    """A token may name one expert twice (the contract does not forbid it; expert parallelism
    passes (n, 1) ids): stability still holds, int64 ids as int32."""
    ids = torch.randint(0, 5, (57, 4), generator=gen)
    a = moe_k.align(ids.to(DEV), 7, 16)
    order, src_to_dst, counts = sort_by_expert(ids, 7)
    assert torch.equal(a.order.cpu(), order) and torch.equal(a.src_to_dst.cpu(), src_to_dst)
    assert torch.equal(a.counts.cpu(), counts)


def test_align_above_the_single_program_limit(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ALIGN_MAX_ROWS the torch sort takes over; the tile table stays one launch."""
    monkeypatch.setattr(moe_k, "ALIGN_MAX_ROWS", 64)
    ids = ids_with_idle_experts(40, 4, 30, gen)
    a = moe_k.align(ids.to(DEV), 30, 16)
    order, src_to_dst, counts = sort_by_expert(ids, 30)
    group, rows, _ = gemm_k.tile_table(counts, 160, 16)
    assert torch.equal(a.order.cpu(), order) and torch.equal(a.token.cpu(), order // 4)
    assert torch.equal(a.src_to_dst.cpu(), src_to_dst) and torch.equal(a.counts.cpu(), counts)
    assert (
        a.tiles is not None
        and torch.equal(a.tiles.rows.cpu(), rows)
        and torch.equal(a.tiles.group.cpu(), group)
    )


def test_tile_table_kernel_and_grouped_gemm_with_a_shared_table(gen: torch.Generator) -> None:
    sizes = torch.tensor([0, 5, 16, 0, 33, 1, 0], dtype=torch.int64)
    m = int(sizes.sum())
    tiles = moe_k.tile_table(sizes.to(DEV), m, 16)
    group, rows, n = gemm_k.tile_table(sizes, m, 16)
    assert (
        tiles.num_tiles == n and torch.equal(tiles.group.cpu(), group) and torch.equal(tiles.rows.cpu(), rows)
    )
    x = torch.randn((m, 24), generator=gen)
    w = torch.randn((7, 20, 24), generator=gen)
    cfg = gemm_k.grouped_config(m, False, False)
    assert cfg.block_m == 16
    args = (x.to(DEV), w.to(DEV), sizes.to(DEV))
    shared = gemm_k.grouped_gemm(*args, out_dtype=torch.float32, config=cfg, tiles=tiles)
    own = gemm_k.grouped_gemm(*args, out_dtype=torch.float32, config=cfg)
    assert_bitwise_equal(shared.cpu(), own.cpu(), what="grouped GEMM with a precomputed tile table")
    with pytest.raises(ValueError, match="tile table"):
        gemm_k.grouped_gemm(*args, out_dtype=torch.float32, tiles=moe_k.tile_table(sizes.to(DEV), m, 64))


def test_mix32_is_the_reference_hash() -> None:
    """The integer hash of the noise kernel, bit for bit (uint32 wrap-around = the reference's
    masked int64 arithmetic), on edge values and a spread of others."""
    x = torch.cat([
        torch.tensor([0, 1, 2**16, 2**31 - 1, 2**31, 2**32 - 1]),
        torch.randint(0, 2**32, (2000,), generator=torch.Generator().manual_seed(1)),
    ])  # fmt: skip
    y = torch.empty_like(x, device=DEV)
    _mix32_probe[(triton.cdiv(x.numel(), 512),)](x.to(DEV), y, x.numel(), BLOCK=512)
    assert_bitwise_equal(y.cpu(), ref_small.mix32(x), what="mix32")


def test_route_ties_go_to_the_lowest_id() -> None:
    """Equal selection scores: lowest expert ids first, as torch.topk on the CPU orders them;
    groups too (equal group scores keep the lowest groups)."""
    logits = torch.zeros((2, 32))
    logits[1, 20] = 1.0  # one clear winner, then ties
    for config in (
        RouterConfig("sigmoid", top_k=4),
        RouterConfig("sigmoid", top_k=4, num_groups=4, topk_groups=2, group_score="top2_sum"),
    ):
        _, ids = moe_k.route(logits.to(DEV), config)
        assert ids.cpu().tolist() == [[0, 1, 2, 3], [20, 0, 1, 2]], config


# name: (config, experts, correction bias, hash routing)
ONE_LAUNCH_ROUTERS = {
    "E64-groups-bias": (
        RouterConfig(
            "sigmoid", top_k=6, num_groups=8, topk_groups=3, group_score="top2_sum", renormalize=True,
            routed_scaling_factor=2.5,
        ), 64, True, False,
    ),
    "E64-softmax-shared2": (RouterConfig("softmax", top_k=6, shared_experts=2), 64, False, False),
    "E256-8groups-bias-shared1": (
        RouterConfig(
            "sigmoid", top_k=8, num_groups=8, topk_groups=4, group_score="top2_sum", renormalize=True,
            routed_scaling_factor=2.5, shared_experts=1,
        ), 256, True, False,
    ),
    "E40-sqrtsoftplus-hash": (
        RouterConfig("sqrtsoftplus", top_k=4, renormalize=True, routed_scaling_factor=1.5), 40, False, True
    ),
}  # fmt: skip


def _router_inputs(
    gen: torch.Generator, name: str, t: int, d: int
) -> tuple[RouterConfig, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(config, x (T, D) bf16, a strided view, gate (E, D) float32, bias or None, hash ids or None)."""
    config, e, with_bias, hashed = ONE_LAUNCH_ROUTERS[name]
    x = torch.randn((t, d + 8), generator=gen).to(torch.bfloat16).to(DEV)[:, 3 : 3 + d]
    gate = torch.randn((e, d), generator=gen) * d**-0.5
    bias = torch.randn(e, generator=gen) * 0.2 if with_bias else None
    hash_ids = (
        torch.stack([torch.randperm(e, generator=gen)[: config.top_k] for _ in range(t)]) if hashed else None
    )
    dev = [None if v is None else v.to(DEV) for v in (gate, bias, hash_ids)]
    return config, x, dev[0], dev[1], dev[2]  # type: ignore[return-value]


@pytest.mark.parametrize(
    "name,t",
    [("E64-groups-bias", 1), ("E64-groups-bias", 20), ("E64-softmax-shared2", 7),
     ("E256-8groups-bias-shared1", 1), ("E256-8groups-bias-shared1", 6), ("E40-sqrtsoftplus-hash", 1),
     ("E40-sqrtsoftplus-hash", 13)],
)  # fmt: skip
def test_router_select_experts_one_launch_is_router_logits_plus_route(
    gen: torch.Generator, name: str, t: int
) -> None:
    """select_experts' one launch (each row routed by its last logits program) gives the bits of
    router_logits + route, on a strided bf16 x with D past one BLOCK_D step (600); called twice
    in a row, the same bits again (every row's ticket is back at zero)."""
    assert t <= moe_k.ROUTER_GEMV_MAX_TOKENS
    config, x, gate, bias, hash_ids = _router_inputs(gen, name, t, 600)
    want = moe_k.route(moe_k.router_logits(x, gate), config, bias, hash_ids)
    for call in ("first", "second"):
        got = moe_k.select_experts(x, gate, config, bias, hash_ids)
        for g, w, what in zip(got, want, ("weights", "ids")):
            assert_bitwise_equal(g.cpu(), w.cpu(), what=f"{what}, {call} call")
        assert not moe_k._TICKETS.get(x.device, t).any(), "tickets not reset"
    empty = moe_k.select_experts(x[:0], gate, config, bias, None if hash_ids is None else hash_ids[:0])
    assert empty[0].shape == empty[1].shape == (0, config.top_k + config.shared_experts)


@pytest.mark.parametrize("name,t", [("E64-softmax-shared2", 3), ("E256-8groups-bias-shared1", 2)])
def test_router_tiles_same_bits_both_ways_and_the_same_routes(
    gen: torch.Generator, name: str, t: int
) -> None:
    """Each router tile (the one-warp programs of few tokens, the default, another): select_experts
    gives the bits of router_logits + route with the same tile (route's warps order a row's
    softmax sum); across tiles the routes agree where no two scores nearly tie. The rule: the
    few-token tile up to ROUTER_FEW_TOKENS on a GPU, the default above it, in batch-invariant
    mode and in the interpreter."""
    config, x, gate, bias, hash_ids = _router_inputs(gen, name, t, 600)
    routes = []
    for tile in (moe_k.ROUTER_FEW_TILE, moe_k.ROUTER_TILE, moe_k.RouterTile(2, 256, 2)):
        want = moe_k.route(moe_k.router_logits(x, gate, tile), config, bias, hash_ids, tile)
        got = moe_k.select_experts(x, gate, config, bias, hash_ids, tile)
        for g, w, what in zip(got, want, ("weights", "ids")):
            assert_bitwise_equal(g.cpu(), w.cpu(), what=f"{what}, tile {tile}")
        routes.append(got)
    logits = x.cpu().double() @ gate.cpu().double().T
    clear = router_margin(logits, config, None if bias is None else bias.cpu().double()) > 1e-4
    for w, i in routes[1:]:
        assert torch.equal(i.cpu()[clear], routes[0][1].cpu()[clear])
        torch.testing.assert_close(w.cpu()[clear], routes[0][0].cpu()[clear], rtol=1e-5, atol=1e-6)
    few = moe_k.ROUTER_TILE if INTERPRET else moe_k.ROUTER_FEW_TILE
    assert moe_k.router_tile(moe_k.ROUTER_FEW_TOKENS) == few
    assert moe_k.router_tile(moe_k.ROUTER_FEW_TOKENS + 1) == moe_k.ROUTER_TILE
    assert moe_k.router_tile(1, batch_invariant=True) == moe_k.ROUTER_TILE


def test_router_select_experts_in_a_graph_and_the_backend_paths(
    gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replayed three times with new inputs (a CUDA graph on a GPU, plain calls in the
    interpreter): each replay equals router_logits + route (the tickets reset inside the graph).
    The backend: one launch up to ROUTER_GEMV_MAX_TOKENS, fused, outside batch-invariant mode;
    else router_logits + route; the same pairs either way (as the float64 logits route them)."""
    config, x, gate, bias, _ = _router_inputs(gen, "E256-8groups-bias-shared1", 3, 96)
    static = x.clone()
    graph = None
    if GPU and not INTERPRET:
        moe_k.select_experts(static, gate, config, bias)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe_k.select_experts(static, gate, config, bias)
    for _ in range(3):
        static.copy_(torch.randn(static.shape, generator=gen).to(static.dtype))
        if graph is not None:
            graph.replay()
        else:
            out = moe_k.select_experts(static, gate, config, bias)
        want = moe_k.route(moe_k.router_logits(static, gate), config, bias)
        assert_bitwise_equal(out[0].cpu(), want[0].cpu(), what="replayed weights")
        assert_bitwise_equal(out[1].cpu(), want[1].cpu(), what="replayed ids")

    config, _, gate, bias, _ = _router_inputs(gen, "E64-groups-bias", 0, 96)
    assert bias is not None
    calls: list[int] = []
    one_launch = moe_k.select_experts
    monkeypatch.setattr(moe_k, "ROUTER_GEMV_MAX_TOKENS", 4)  # interpreter-sized
    monkeypatch.setattr(
        moe_k, "select_experts", lambda x, *a, **kw: calls.append(x.shape[0]) or one_launch(x, *a, **kw)
    )
    plain = cuda_backend.create_cuda_backend(BackendOptions())
    invariant = cuda_backend.create_cuda_backend(BackendOptions(batch_invariant=True))
    monkeypatch.setenv(envs.CUDA_UNFUSED.name, "1")
    unfused = cuda_backend.create_cuda_backend(BackendOptions())
    limit = moe_k.ROUTER_GEMV_MAX_TOKENS
    rows = torch.randn((limit + 1, 96), generator=gen).to(torch.bfloat16)
    for backend, t, launches in [
        (plain, limit, [limit]), (plain, limit + 1, []), (invariant, 2, []), (unfused, 2, []),
    ]:  # fmt: skip
        calls.clear()
        w, i = backend.moe.select_experts(rows[:t].to(DEV), gate, config, bias)
        assert calls == launches, (backend.options, t)
        logits = rows[:t].double() @ gate.cpu().double().T
        rw, ri = ref_moe.route(logits, config, bias.cpu().double())  # float32 scores
        clear = router_margin(logits, config, bias.cpu().double()) > 1e-4  # no near-ties
        assert int(clear.sum()) >= 0.8 * t
        order, ref_order = i.cpu().long().argsort(1), ri.argsort(1)
        assert torch.equal(i.cpu().long().gather(1, order)[clear], ri.gather(1, ref_order)[clear])
        got_w, ref_w = w.cpu().double().gather(1, order)[clear], rw.gather(1, ref_order)[clear]
        torch.testing.assert_close(got_w, ref_w.double(), rtol=1e-5, atol=1e-6)


def test_unfused_switch(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """DEEPINFER_CUDA_UNFUSED=1 at creation: the composed paths, with the same results (the MoE
    layer bit for bit: same sort, same tile table, same kernels)."""
    monkeypatch.setenv(envs.CUDA_MOE_DECODE.name, "0")  # the grouped path at every size
    fused = cuda_backend.create_cuda_backend(BackendOptions())
    monkeypatch.setenv(envs.CUDA_UNFUSED.name, "1")
    unfused = cuda_backend.create_cuda_backend(BackendOptions())
    parts = ("moe", "kv_cache", "small", "attention")  # attention: DeepSeek-V4's ops
    assert all(getattr(fused, p).fused for p in parts) and not any(getattr(unfused, p).fused for p in parts)
    config = RouterConfig(
        "sigmoid", top_k=4, num_groups=4, topk_groups=2, group_score="top2_sum", renormalize=True
    )
    logits, bias = torch.randn((9, 32), generator=gen), torch.randn(32, generator=gen) * 0.1
    (w1, i1), (w2, i2) = (b.moe.route(logits.to(DEV), config, bias.to(DEV)) for b in (fused, unfused))
    rw, ri = ref_moe.route(logits, config, bias)
    assert torch.equal(i1.cpu(), ri) and torch.equal(i2.cpu(), ri)
    for w in (w1, w2):  # the reference's torch ops on the device or the kernel: float32 rounding apart
        torch.testing.assert_close(w.cpu(), rw, rtol=1e-6, atol=1e-6)
    x = torch.randn((9, 40), generator=gen).to(DEV)
    w13, w_2 = torch.randn((32, 48, 40), generator=gen) * 0.2, torch.randn((32, 40, 24), generator=gen) * 0.2
    y1, y2 = (b.moe.fused_moe(x, w1, i1, w13.to(DEV), w_2.to(DEV)) for b in (fused, unfused))
    assert_bitwise_equal(y1.cpu(), y2.cpu(), what="fused_moe, fused vs unfused")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_write_kv_casts_in_the_kernel_like_torch(gen: torch.Generator, dtype: torch.dtype) -> None:
    """float32 rows (a strided view) cast in the kernel, round to nearest even: ties included
    (the interpreter's own bf16 cast truncates), and the carry into the next binade."""
    ties = torch.tensor(
        [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-11, 1 + 3 * 2**-11, 2 - 2**-9, 65519.0]
    )
    wide = torch.randn((5, 20), generator=gen) * 4
    wide[0, 2 : 2 + ties.numel()] = ties
    kv = wide[:, 2:18]  # (5, 16), row stride 20
    cache = torch.zeros((2, 4, 16), dtype=dtype, device=DEV)
    slots = torch.tensor([6, 0, -1, 3, 7])
    small_k.write_kv(cache, kv.to(DEV), slots.to(DEV))
    flat = cache.view(8, 16).cpu()
    keep = slots >= 0
    assert_bitwise_equal(flat[slots[keep]], kv[keep].to(dtype), what="write_kv cast")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_matmul_is_each_matmul_bit_for_bit(gen: torch.Generator, dtype: torch.dtype) -> None:
    """The batch-invariant batched_linear: one launch over G groups equals G matmul calls bit for
    bit (and the float64 product), with strided inputs (a transposed head view) and row counts
    that do not fill a tile; one row alone equals its row in the batch."""
    g, m, k, n = 3, 70, 48, 80
    x = torch.randn((m, g, k), generator=gen).to(dtype).to(DEV).transpose(0, 1)  # (G, M, K) strided
    w = torch.randn((g, n, k), generator=gen).to(dtype).to(DEV)
    out = gemm_k.batched_matmul(x, w)
    for i in range(g):
        assert_bitwise_equal(out[i], gemm_k.matmul(x[i], w[i]), what=f"group {i}")
    expected = torch.bmm(x.double(), w.double().transpose(1, 2))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol * k**0.5)
    assert_bitwise_equal(gemm_k.batched_matmul(x[:, 5:6], w), out[:, 5:6], what="one row alone")
    assert gemm_k.batched_matmul(x[:, :0], w).shape == (g, 0, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_invariant_matmul_split_chunks_equal_one_program(
    gen: torch.Generator, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch-invariant matmul reduces K in INVARIANT_K_CHUNK chunks added in order: split
    over programs (small M) or walked in one (large M), the same bits, bias included; K = 300
    leaves a partial last chunk and step. The float64 product bounds both."""
    monkeypatch.setattr(gemm_k, "INVARIANT_K_CHUNK", 128)
    cfg = gemm_k.GemmConfig(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=2)
    m, k, n = 20, 300, 40
    x = torch.randn((m, k), generator=gen).to(dtype).to(DEV)
    w = torch.randn((n, k), generator=gen).to(dtype).to(DEV)
    bias = torch.randn((n,), generator=gen).to(dtype).to(DEV)
    ways = [
        gemm_k._launch_dense(x, w, dtype, cfg, bias=bias, k_chunk=128, split=split) for split in (False, True)
    ]
    assert_bitwise_equal(ways[0], ways[1], what="chunks split over programs vs walked in one")
    monkeypatch.setattr(gemm_k, "SPLIT_BELOW_TILES_PER_SM", 0)  # matmul walks the chunks itself
    assert_bitwise_equal(gemm_k.matmul(x, w, bias, config=cfg), ways[0], what="matmul, unsplit")
    monkeypatch.setattr(gemm_k, "SPLIT_BELOW_TILES_PER_SM", 10**6)
    assert_bitwise_equal(gemm_k.matmul(x[3:4], w, bias, config=cfg), ways[0][3:4], what="one row, split")
    expected = x.double() @ w.double().T + bias.double()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(ways[0].double(), expected, rtol=tol, atol=tol * k**0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_invariant_batched_matmul_split_in_one_launch_resets_its_tickets(
    gen: torch.Generator, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Split chunks over G products in one launch: each tile's last program adds the chunk sums
    (its ticket counts the chunks in and is left at zero). Replayed three times with new inputs
    (a CUDA graph on a GPU, plain calls in the interpreter), with a launch of another shape in
    between: every replay equals the chunks walked in one program and G split matmul calls bit
    for bit, and the float64 product within tolerance. K = 300: a partial last chunk and step;
    N = 40: a partial column tile; M = 5 and 1: a partial row tile."""
    monkeypatch.setattr(gemm_k, "INVARIANT_K_CHUNK", 128)
    monkeypatch.setattr(gemm_k, "SPLIT_BELOW_TILES_PER_SM", 10**6)  # split at every size
    cfg = gemm_k.GemmConfig(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=2)
    g, m, k, n = 3, 5, 300, 40
    static = torch.zeros((m, g, k), dtype=dtype, device=DEV).transpose(0, 1)  # (G, M, K) strided
    w = torch.randn((g, n, k), generator=gen).to(dtype).to(DEV)
    graph = None
    if GPU and not INTERPRET:
        gemm_k.batched_matmul(static, w, config=cfg)  # compile and take the tickets outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = gemm_k.batched_matmul(static, w, config=cfg)
    tickets = gemm_k._TILE_TICKETS.get(DEV, 1)
    for _ in range(3):
        static.copy_(torch.randn((g, m, k), generator=gen).to(dtype))
        if graph is not None:
            graph.replay()
        else:
            out = gemm_k.batched_matmul(static, w, config=cfg)
        assert not tickets.any(), "a tile's ticket was left counted"
        walk = gemm_k._launch_dense(static, w, dtype, cfg, k_chunk=128, split=False)
        assert_bitwise_equal(out, walk, what="split in one launch vs walked in one program")
        for i in range(g):
            assert_bitwise_equal(out[i], gemm_k.matmul(static[i], w[i], config=cfg), what=f"product {i}")
        one = gemm_k.batched_matmul(static[:, 2:3], w, config=cfg)  # M = 1, other tiles
        assert_bitwise_equal(one, walk[:, 2:3], what="one row alone")
        expected = torch.bmm(static.double(), w.double().transpose(1, 2))
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol * k**0.5)


@pytest.mark.parametrize("m", [1, 3, 8])
def test_skinny_matmul_against_float64_split_and_whole(gen: torch.Generator, m: int) -> None:
    """The decode-sized GEMM: x (M, K) @ w (N, K)^T with K split over programs (the ranges' float32
    partials added in order by each tile's last program) and whole, against the float64 product;
    batched over heads from a strided (transposed) x into a strided out, as MLA calls it. N = 100
    leaves a partial weight-row tile, K = 200 a partial step. The tickets are left at zero, and
    bad inputs get an error naming the shapes."""
    k, n, g = 200, 100, 3
    x = torch.randn((m, k), generator=gen).to(torch.bfloat16).to(DEV)
    w = torch.randn((n, k), generator=gen).to(torch.bfloat16).to(DEV)
    expected = x.double() @ w.double().T
    small = gemm_k.SkinnyConfig(block_n=32, block_k=32, programs_per_sm=64, num_warps=4, num_stages=2)
    slab = dataclasses.replace(small, slab=64, pdl=True)  # whole 64-wide K ranges (PDL on SM90 only)
    for cfg in (small, dataclasses.replace(small, programs_per_sm=1), slab):  # split K, one range, slabs
        out = gemm_k.skinny_matmul(x, w, config=cfg)
        assert out.shape == (m, n) and out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2 * k**0.5)
    assert not gemm_k._SKINNY_TICKETS.get(DEV, 1).any(), "a tile's ticket was left counted"
    xs = torch.randn((m, g, k), generator=gen).to(torch.bfloat16).to(DEV).transpose(0, 1)  # (G, M, K)
    ws = torch.randn((g, n, k), generator=gen).to(torch.bfloat16).to(DEV)
    out = torch.empty((m, g, n), dtype=torch.bfloat16, device=DEV)
    gemm_k.skinny_matmul(xs, ws, out.transpose(0, 1), config=small)
    expected = torch.bmm(xs.double(), ws.double().transpose(1, 2)).transpose(0, 1)
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2 * k**0.5)
    with pytest.raises(ValueError, match="skinny_matmul"):
        gemm_k.skinny_matmul(torch.zeros((9, k), dtype=torch.bfloat16, device=DEV), w)
    with pytest.raises(ValueError, match="skinny_matmul"):
        gemm_k.skinny_matmul(x.float(), w.float())


def test_argmax_in_one_launch(gen: torch.Generator) -> None:
    """small.argmax: each row's first maximum from its blocks' maxima (the row's last program
    picks the first block holding the maximum), the tickets left at zero for the next launch (a
    graph replays them), and the CudaSmall op on it; bad shapes and dtypes get an error naming them."""
    vocab = 3 * small_k.ARGMAX_BLOCK + 5  # four blocks, the last of 5 columns
    logits = torch.randn((3, vocab), generator=gen)
    logits[0, 1] = logits[0, 2 * small_k.ARGMAX_BLOCK] = 7.0  # tied across blocks: the first
    logits[1, vocab - 1] = 7.0  # in the partial last block
    logits[2, :] = float("-inf")
    out = torch.full((3,), -1, dtype=torch.int64, device=DEV)
    assert small_k.argmax(logits.to(DEV), out) is out
    assert out.cpu().tolist() == [1, vocab - 1, 0] == logits.argmax(-1).tolist()
    assert not small_k._ARGMAX_TICKETS.get(DEV, 1).any(), "a row's ticket was left counted"
    small = cuda_backend.create_cuda_backend(BackendOptions()).small
    assert small.argmax(logits.to(DEV)).cpu().tolist() == [1, vocab - 1, 0]
    logits[0, 5] = float("nan")  # unspecified, but a column of the row
    assert 0 <= small_k.argmax(logits.to(DEV))[0].item() < vocab
    with pytest.raises(ValueError, match="argmax"):
        small_k.argmax(logits.to(DEV).half())
    with pytest.raises(ValueError, match="argmax"):
        small_k.argmax(logits.to(DEV), torch.empty((3,), dtype=torch.int32, device=DEV))


def test_argmax_and_query_switches(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """DEEPINFER_CUDA_ARGMAX=0: the greedy draw as the contract's two reductions (the same ids);
    DEEPINFER_CUDA_WIDE_QUERY=0: MLA's query and cache write in one launch up to 64 rows, not
    mla.DECODE_MAX_T (the benchmark's ablation rows), both read when the backend is created."""
    logits = torch.randn((2, 3 * small_k.ARGMAX_BLOCK), generator=gen).to(DEV)
    calls: list[int] = []
    real = small_k.argmax

    def spy(*a: Any) -> torch.Tensor:
        calls.append(1)
        y: torch.Tensor = real(*a)
        return y

    monkeypatch.setattr(small_k, "argmax", spy)
    default = cuda_backend.create_cuda_backend(BackendOptions())
    assert default.attention.query_rows == mla_k.DECODE_MAX_T == 128
    monkeypatch.setenv(envs.CUDA_ARGMAX.name, "0")
    monkeypatch.setenv(envs.CUDA_WIDE_QUERY.name, "0")
    off = cuda_backend.create_cuda_backend(BackendOptions())
    assert off.attention.query_rows == 64
    assert torch.equal(off.small.argmax(logits), default.small.argmax(logits))
    assert calls == [1]  # the default's only


def test_small_host_copies_by_kernel(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """small.copy_words: the step's small copies (contiguous, whole 32-bit words, at most
    COPY_MAX_BYTES) in one launch, the bytes unchanged; other copies are left to the caller
    (False, nothing written). CudaDevice.to_host / to_device take it unless
    DEEPINFER_CUDA_KERNEL_COPIES=0."""
    src = torch.randint(-(2**40), 2**40, (3, 7), generator=gen).to(DEV)
    dst = torch.zeros_like(src)
    assert small_k.copy_words(src, dst) and torch.equal(dst, src)
    odd = torch.zeros(7, dtype=torch.uint8, device=DEV)
    big = torch.zeros(small_k.COPY_MAX_BYTES // 4 + 1, dtype=torch.int32, device=DEV)
    for a, b in ((odd, odd.clone() + 1), (big, big.clone()), (src[:, ::2], dst[:, ::2].contiguous())):
        before = b.clone()
        assert not small_k.copy_words(a, b) and torch.equal(b, before)
    calls: list[int] = []
    real = small_k.copy_words

    def spy(a: torch.Tensor, b: torch.Tensor) -> bool:
        calls.append(a.numel())
        return real(a, b)

    monkeypatch.setattr(small_k, "copy_words", spy)
    device = cuda_backend.create_cuda_backend(BackendOptions()).device
    host = device.pinned_empty((3, 7), torch.int64)
    device.to_host(src, host)
    device.synchronize()
    assert torch.equal(host, src.cpu()) and calls == [21]
    monkeypatch.setenv(envs.CUDA_KERNEL_COPIES.name, "0")
    off = cuda_backend.create_cuda_backend(BackendOptions()).device
    off.to_device(host, dst)
    off.synchronize()
    assert torch.equal(dst, src) and calls == [21]


def test_linear_takes_the_skinny_kernel_at_decode_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    """CudaGemm.linear and batched_linear: the skinny kernel up to SKINNY_MAX_M rows of bfloat16,
    cuBLAS above it, for float32 and for weights over SKINNY_MAX_WEIGHT_BYTES, never in
    batch-invariant mode, off with DEEPINFER_CUDA_SKINNY=0."""
    calls: list[tuple[int, ...]] = []
    real = gemm_k.skinny_matmul

    def spy(
        x: torch.Tensor, w: torch.Tensor, out: Any = None, config: Any = None, pdl: bool = True
    ) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return real(x, w, out, config, pdl)

    monkeypatch.setattr(gemm_k, "skinny_matmul", spy)
    w = torch.randn((24, 64)).to(torch.bfloat16).to(DEV)
    gemm = CudaGemm(BackendOptions())
    for rows in (1, gemm_k.SKINNY_MAX_M, gemm_k.SKINNY_MAX_M + 1):
        x = torch.randn((rows, 64)).to(torch.bfloat16).to(DEV)
        torch.testing.assert_close(gemm.linear(x, w).float(), (x.float() @ w.float().T), rtol=2e-2, atol=5e-2)
    gemm.linear(torch.randn((1, 64), device=DEV), w.float())
    xs = torch.randn((2, 4, 64)).to(torch.bfloat16).to(DEV).transpose(0, 1)  # (G=4, M=2, K)
    out = gemm.batched_linear(xs, w.view(4, 6, 64))
    torch.testing.assert_close(out.float(), torch.bmm(xs.float(), w.view(4, 6, 64).float().transpose(1, 2)),
                               rtol=2e-2, atol=5e-2)  # fmt: skip
    assert out.transpose(0, 1).is_contiguous(), "the heads' products are laid out (M, G, N)"
    assert calls == [(1, 64), (gemm_k.SKINNY_MAX_M, 64), (4, 2, 64)]
    monkeypatch.setattr(gemm_k, "SKINNY_MAX_WEIGHT_BYTES", w.numel() * 2 - 1)  # a larger weight: cuBLAS
    gemm.linear(x[:1], w)
    assert len(calls) == 3
    CudaGemm(BackendOptions(batch_invariant=True)).linear(x[:1], w)
    monkeypatch.setenv(envs.CUDA_SKINNY.name, "0")
    cuda_backend.create_cuda_backend(BackendOptions()).gemm.linear(x[:1], w)
    assert len(calls) == 3, "batch-invariant mode and DEEPINFER_CUDA_SKINNY=0 keep the other paths"


def test_pdl_only_on_sm90_and_later_and_off_with_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Programmatic dependent launch: on CUDA devices of compute capability 9 or more, never on the
    CPU (the interpreter), off with DEEPINFER_CUDA_PDL=0 (the ablation bench_e2e measures), which
    the backend reads when it is created and every part passes to its launches."""
    from deepinfer_cuda.kernels import common

    cuda = torch.device("cuda", 0)
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    assert common.pdl_enabled(cuda)
    assert not common.pdl_enabled(torch.device("cpu"))
    assert not common.pdl_enabled(cuda, False)
    on = cuda_backend.create_cuda_backend(BackendOptions())
    monkeypatch.setenv(envs.CUDA_PDL.name, "0")
    off = cuda_backend.create_cuda_backend(BackendOptions())
    parts = ("kv_cache", "attention", "gemm", "moe", "small")
    assert all(getattr(on, p).pdl for p in parts) and not any(getattr(off, p).pdl for p in parts)
    switches: list[bool] = []
    real = small_k.pdl_enabled

    def spy(device: torch.device, switch: bool = True) -> bool:
        switches.append(switch)
        return real(device, switch)

    monkeypatch.setattr(small_k, "pdl_enabled", spy)
    x, w = torch.randn((2, 8), device=DEV), torch.ones(8, device=DEV)
    on.small.rms_norm(x, w, 1e-6)
    off.small.rms_norm(x, w, 1e-6)
    assert switches == [True, False], "the backend's switch reaches the launch"
    capability[0] = (8, 0)
    assert not common.pdl_enabled(cuda), "Ampere has no programmatic dependent launch"
    capability[0] = (10, 0)
    assert common.pdl_enabled(cuda)


def test_invariant_matmul_rows_equal_across_tile_choices(gen: torch.Generator) -> None:
    """The batch-invariant linear picks its tiles (and whether to split K's chunks over programs)
    by M; a row's bits must not change with them. M = 1, 40, 300 and 600 cross every choice on
    an SM90 GPU (on the interpreter: one tile, split or not)."""
    k, n = 1100, 96
    x = torch.randn((600, k), generator=gen).to(torch.bfloat16).to(DEV)
    w = (torch.randn((n, k), generator=gen) * k**-0.5).to(torch.bfloat16).to(DEV)
    full = gemm_k.matmul(x, w)
    for m in (1, 40, 300):
        assert_bitwise_equal(gemm_k.matmul(x[:m], w), full[:m], what=f"the first {m} rows alone")
    torch.testing.assert_close(full.double(), x.double() @ w.double().T, rtol=3e-2, atol=3e-2)


# --------------------------------------------------------------------------- MLA query


def _mla_query_inputs(
    gen: torch.Generator, t: int, h: int, n: int, c: int, r: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q_nope, q_pe column slices of one (T, H, N + R + 3) buffer, w_uk (H, C, N), unsorted
    positions as a strided view (a column of a (T, 2) table), the (P, R) rope table."""
    q = torch.randn((t, h, n + r + 3), generator=gen).to(dtype).to(DEV)
    w_uk = (torch.randn((h, c, n), generator=gen) * n**-0.5).to(dtype).to(DEV)
    positions = torch.randint(0, 900, (t, 2), generator=gen).to(DEV)[:, 1]
    inv = 1.0 / 10000.0 ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
    ang = torch.arange(900, dtype=torch.float64)[:, None] * inv[None, :]
    table = torch.cat([ang.cos(), ang.sin()], dim=-1).float().to(DEV)
    return q[..., :n], q[..., n + 1 : n + 1 + r], w_uk, positions, table


def _per_head(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """(T, H, N) x (H, C, N) -> (T, H, C) through torch.bmm, as the contract's default computes it."""
    return torch.bmm(q_nope.transpose(0, 1), w_uk.transpose(1, 2)).transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("t", [1, 7, 64, 65, 130])
def test_mla_query_matches_the_composition(gen: torch.Generator, dtype: torch.dtype, t: int) -> None:
    """One launch = the composition it replaces (small.rope, bmm, cat) within a rounding of the
    output dtype (the product: float32 sums in another order), and the float64 product within
    the dtype's budget. T = 1..64 take the decode tile, 65 and 130 the prefill tile (a partial
    second and third block)."""
    h, n, c, r = 3, 128, 160, 64
    q_nope, q_pe, w_uk, positions, table = _mla_query_inputs(gen, t, h, n, c, r, dtype)
    for interleaved in (True, False):
        out = mla_k.mla_query(q_nope, q_pe, w_uk, positions, table, interleaved)
        rope = small_k.rope(q_pe, positions, table, interleaved)
        composed = torch.cat([_per_head(q_nope, w_uk), rope], -1)
        one = torch.finfo(dtype).eps + 64 * torch.finfo(torch.float32).eps
        torch.testing.assert_close(out.double(), composed.double(), rtol=one, atol=one)
        rope64 = ref_small.rope(q_pe.cpu().double(), positions.cpu(), table.cpu().double(), interleaved)
        expected = torch.cat([_per_head(q_nope.double(), w_uk.double()).cpu(), rope64], -1)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.cpu().double(), expected, rtol=tol, atol=tol)


def test_mla_query_rows_equal_alone_in_invariant_mode(gen: torch.Generator) -> None:
    """Batch-invariant mode: one tile for every T, so a row's bits at T = 1 are its bits among
    200 rows (where the default mode takes the prefill tile)."""
    assert mla_k.query_tile(1, True) == mla_k.query_tile(200, True)
    assert mla_k.query_tile(200, False) != mla_k.query_tile(200, True)
    q_nope, q_pe, w_uk, positions, table = _mla_query_inputs(gen, 200, 2, 128, 96, 16, torch.bfloat16)
    full = mla_k.mla_query(q_nope, q_pe, w_uk, positions, table, True, batch_invariant=True)
    for i in (0, 63, 64, 199):
        alone = mla_k.mla_query(
            q_nope[i : i + 1], q_pe[i : i + 1], w_uk, positions[i : i + 1], table, True, batch_invariant=True
        )
        assert_bitwise_equal(alone, full[i : i + 1], what=f"mla_query row {i} alone")


def test_mla_query_odd_sizes_and_bad_inputs(gen: torch.Generator) -> None:
    """N and C that fill no tile, N > 128 (two K steps), R = 0, T = 0; shapes that disagree raise."""
    for t, h, n, c, r in ((5, 3, 7, 33, 6), (4, 2, 200, 20, 4), (3, 2, 24, 40, 0), (0, 2, 24, 40, 8)):
        q_nope, q_pe, w_uk, positions, table = _mla_query_inputs(gen, t, h, n, c, r, torch.float32)
        out = mla_k.mla_query(q_nope, q_pe, w_uk, positions, table, False)
        assert out.shape == (t, h, c + r)
        latent = _per_head(q_nope.double(), w_uk.double())
        torch.testing.assert_close(out[..., :c].double(), latent, rtol=1e-5, atol=1e-5)
        if r:
            rope = ref_small.rope(q_pe.cpu().double(), positions.cpu(), table.cpu().double(), False)
            torch.testing.assert_close(out[..., c:].cpu().double(), rope, rtol=1e-5, atol=1e-5)
    q_nope, q_pe, w_uk, positions, table = _mla_query_inputs(gen, 4, 2, 16, 32, 8, torch.float32)
    with pytest.raises(ValueError, match="do not match"):
        mla_k.mla_query(q_nope, q_pe, w_uk[:, :, :8], positions, table, False)
    with pytest.raises(ValueError, match="positions"):
        mla_k.mla_query(q_nope, q_pe, w_uk, positions[:3], table, False)
    with pytest.raises(ValueError, match="one dtype"):
        mla_k.mla_query(q_nope, q_pe, w_uk.double(), positions, table, False)


@pytest.mark.parametrize("t", [1, 5, 20])  # 20 > 16: two row tiles; past H = 3 a tail writes several tokens
def test_mla_query_early_inputs_gives_the_same_bits(gen: torch.Generator, t: int) -> None:
    """early_inputs (the tail programs read positions, slots, cos / sin and the norm weight before
    waiting for the previous kernel) is the same arithmetic: the same query and the same cache
    rows as without it, with a skipped slot (-1), against small.write_mla_kv."""
    h, n, c, r = 3, 32, 64, 16
    q_nope, q_pe, w_uk, positions, table = _mla_query_inputs(gen, t, h, n, c, r, torch.bfloat16)
    kv = torch.randn((t, c + r), generator=gen).to(torch.bfloat16).to(DEV)
    kvw = (1 + 0.1 * torch.randn((c,), generator=gen)).to(torch.bfloat16).to(DEV)
    slots = torch.randperm(4 * 8, generator=gen)[:t].to(DEV)
    if t > 1:
        slots[t // 2] = -1

    def run(early: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
        cache = torch.zeros((4, 8, c + r), dtype=torch.bfloat16, device=DEV)
        if early is None:  # the two small ops
            small_k.write_mla_kv(cache, kv, c, kvw, 1e-6, positions, table, True, slots)
            return mla_k.mla_query(q_nope, q_pe, w_uk, positions, table, True), cache
        write = mla_k.CacheWrite(cache, kv, kvw, 1e-6, slots)
        out = mla_k.mla_query(q_nope, q_pe, w_uk, positions, table, True, write=write, early_inputs=early)
        return out, cache

    (q0, c0), (q1, c1), (q2, c2) = run(False), run(True), run(None)
    assert_bitwise_equal(q1, q0, what="query")
    assert_bitwise_equal(q1, q2, what="query against the launch without the write")
    assert_bitwise_equal(c1, c0, what="cache rows")
    assert_bitwise_equal(c1, c2, what="cache rows against write_mla_kv")
    assert c1.abs().sum() > 0


def test_mla_query_fused_and_unfused(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend's mla_query is the one kernel launch; DEEPINFER_CUDA_UNFUSED=1 (or dtypes the
    kernel does not take) keeps the contract's composition; both agree within a rounding."""
    launches: list[int] = []
    kernel = mla_k.mla_query

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        launches.append(1)
        out: torch.Tensor = kernel(*args, **kwargs)
        return out

    monkeypatch.setattr(mla_k, "mla_query", counted)
    fused = cuda_backend.create_cuda_backend(BackendOptions())
    monkeypatch.setenv(envs.CUDA_UNFUSED.name, "1")
    unfused = cuda_backend.create_cuda_backend(BackendOptions())
    q_nope, q_pe, w_uk, positions, table = _mla_query_inputs(gen, 9, 4, 32, 48, 8, torch.bfloat16)
    args = (q_nope, q_pe, w_uk, positions, table, True)
    y1 = fused.attention.mla_query(*args)
    assert len(launches) == 1
    y2 = unfused.attention.mla_query(*args)
    assert len(launches) == 1, "DEEPINFER_CUDA_UNFUSED=1 must keep the composition"
    torch.testing.assert_close(y1.double(), y2.double(), rtol=2**-7, atol=2**-7)
    y3 = fused.attention.mla_query(q_nope, q_pe.double(), w_uk, positions, table, True)
    assert len(launches) == 1 and y3.dtype == torch.bfloat16  # mixed dtypes: the composition


# --------------------------------------------------------------------------- DeepSeek-V4


def _hc_inputs(
    gen: torch.Generator, t: int, n: int, dm: int, head: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    mix = n if head else (2 + n) * n
    return (
        torch.randn((t, n, dm), generator=gen),
        torch.randn((mix, n * dm), generator=gen) * 0.3,
        torch.randn((mix,), generator=gen) * 0.5,
        1 + torch.randn((1 if head else 3,), generator=gen) * 0.3,
    )


@pytest.mark.parametrize("t", [1, 40, 300])
def test_hc_pre_and_head_split_mix(gen: torch.Generator, t: int) -> None:
    """The mix split over K (16 splits here) and summed by each tile's last program, for one
    tile, several, and the wide tiles of large steps; the reference in float32. Calling twice
    gives the same bits (the semaphores are back at zero after every launch)."""
    n, dm = 4, 256
    assert v4_k.hc_splits(n * dm) == (16, 64)
    s, fn, base, scale = _hc_inputs(gen, t, n, dm, head=False)
    args = (1e-6, 1e-6, 20)
    got = v4_k.hc_pre(s.to(DEV), fn.to(DEV), base.to(DEV), scale.to(DEV), *args)
    want = ref_v4.hc_pre(s, fn, base, scale, *args)
    for g, w, name in zip(got, want, ("collapsed", "post", "comb")):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-4, atol=1e-4, msg=name)
    again = v4_k.hc_pre(s.to(DEV), fn.to(DEV), base.to(DEV), scale.to(DEV), *args)
    for g, a in zip(got, again):
        assert_bitwise_equal(g, a, what="hc_pre twice")
    s, fn, base, scale = _hc_inputs(gen, t, n, dm, head=True)
    got_head = v4_k.hc_head(s.to(DEV), fn.to(DEV), base.to(DEV), scale.to(DEV), 1e-6, 1e-6)
    want_head = ref_v4.hc_head(s, fn, base, scale, 1e-6, 1e-6)
    torch.testing.assert_close(got_head.cpu(), want_head, rtol=1e-4, atol=1e-4)


def test_hc_is_batch_invariant(gen: torch.Generator) -> None:
    """Batch-invariant mode: a token alone, in a batch of 40 and in one of 300 (wide tiles
    otherwise) gets the same bits from hc_pre, hc_head and hc_post."""
    n, dm = 3, 200
    s, fn, base, scale = (x.to(DEV) for x in _hc_inputs(gen, 300, n, dm, head=False))
    hs, hfn, hbase, hscale = (x.to(DEV) for x in _hc_inputs(gen, 300, n, dm, head=True))
    y = torch.randn((300, dm), generator=gen).to(DEV)
    outs = []
    for rows in (slice(7, 8), slice(0, 40), slice(0, 300)):
        pre = v4_k.hc_pre(s[rows], fn, base, scale, 1e-6, 1e-6, 20, batch_invariant=True)
        head = v4_k.hc_head(hs[rows], hfn, hbase, hscale, 1e-6, 1e-6, batch_invariant=True)
        post = v4_k.hc_post(y[rows], s[rows], pre[1], pre[2])
        first = 7 - (rows.start or 0)
        outs.append([x[first] for x in (*pre, head, post)])
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert_bitwise_equal(a, b, what="one token alone vs batched")


def _hc_mixes_f64(
    s: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mixes in float64, written out: (pre, post, comb) of streams (T, N, Dm)."""
    t, n, _ = s.shape
    flat = s.double().flatten(1)
    flat = flat / torch.sqrt((flat**2).mean(-1, keepdim=True) + 1e-6)
    m = flat @ fn.double().T
    b, sc = base.double(), scale.double()
    pre = 1 / (1 + torch.exp(-(m[:, :n] * sc[0] + b[:n]))) + 1e-6
    post = 2 / (1 + torch.exp(-(m[:, n : 2 * n] * sc[1] + b[n : 2 * n])))
    logits = m[:, 2 * n :].reshape(t, n, n) * sc[2] + b[2 * n :].reshape(n, n)
    e = torch.exp(logits - logits.amax(-1, keepdim=True))
    comb = e / e.sum(-1, keepdim=True) + 1e-6
    comb = comb / (comb.sum(-2, keepdim=True) + 1e-6)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + 1e-6)
        comb = comb / (comb.sum(-2, keepdim=True) + 1e-6)
    return pre, post, comb


@pytest.mark.parametrize("t,n,dm", [(1, 4, 256), (40, 3, 200), (300, 2, 72)])
def test_hc_mixes_and_collapse_against_float64(gen: torch.Generator, t: int, n: int, dm: int) -> None:
    """hc_mixes (split mix, finish storing pre) and hc_collapse against float64 sums; post and
    comb are hc_pre's bits, and collapsing by hc_mixes' pre gives hc_pre's output."""
    s, fn, base, scale = _hc_inputs(gen, t, n, dm, head=False)
    s = s.to(torch.bfloat16)
    args = (1e-6, 1e-6, 20)
    pre, post, comb = v4_k.hc_mixes(s.to(DEV), fn.to(DEV), base.to(DEV), scale.to(DEV), *args)
    want = _hc_mixes_f64(s, fn, base, scale, 20)
    for g, w, name in zip((pre, post, comb), want, ("pre", "post", "comb")):
        assert g.dtype == torch.float32, name
        torch.testing.assert_close(g.cpu().double(), w, rtol=1e-4, atol=1e-5, msg=name)
    full = v4_k.hc_pre(s.to(DEV), fn.to(DEV), base.to(DEV), scale.to(DEV), *args)
    assert_bitwise_equal(post, full[1], what="hc_mixes post vs hc_pre")
    assert_bitwise_equal(comb, full[2], what="hc_mixes comb vs hc_pre")
    other = torch.rand((t, n), generator=gen)
    for p in (pre.cpu(), other):
        got = v4_k.hc_collapse(s.to(DEV), p.to(DEV))
        assert got.dtype == torch.bfloat16 and got.shape == (t, dm)
        want_c = torch.einsum("tn,tnd->td", p.double(), s.double())
        torch.testing.assert_close(got.cpu().double(), want_c, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(v4_k.hc_collapse(s.to(DEV), pre), full[0], rtol=1e-2, atol=1e-2)


def test_hc_mixes_and_collapse_edge_shapes_and_bad_input(gen: torch.Generator) -> None:
    """No tokens: empty outputs; pre that does not fit the streams: a clear error."""
    s, fn, base, scale = _hc_inputs(gen, 0, 4, 16, head=False)
    pre, post, comb = v4_k.hc_mixes(s.to(DEV), fn.to(DEV), base.to(DEV), scale.to(DEV), 1e-6, 1e-6, 20)
    assert pre.shape == (0, 4) and post.shape == (0, 4) and comb.shape == (0, 4, 4)
    assert v4_k.hc_collapse(s.to(DEV), pre).shape == (0, 16)
    with pytest.raises(ValueError, match="hc_collapse"):
        v4_k.hc_collapse(torch.zeros((2, 4, 16), device=DEV), torch.zeros((2, 3), device=DEV))
    with pytest.raises(ValueError, match="hc_mixes"):
        v4_k.hc_mixes(torch.zeros((2, 4, 16), device=DEV), fn[:, :8].to(DEV), base.to(DEV), scale.to(DEV),
                      1e-6, 1e-6, 20)  # fmt: skip


def _entry_pool(
    seq_lens: list[int], ratio: int, d: int, bs: int, gen: torch.Generator
) -> tuple[PagedKVCache, torch.Tensor, list[torch.Tensor]]:
    """A float32 pool of compressed entries (L // ratio per request) under shuffled tables, NaN in
    every row no request owns."""
    counts = [n // ratio for n in seq_lens]
    need = [max(1, -(-c // bs)) for c in counts]
    nb = sum(need) + 1
    pool = torch.full((nb, bs, d), float("nan"))
    perm = torch.randperm(nb, generator=gen)
    table = torch.zeros((len(seq_lens), max(need)), dtype=torch.int32)
    rows, at = [], 0
    for b, (c, k) in enumerate(zip(counts, need)):
        table[b, :k] = perm[at : at + k]
        at += k
        r = torch.randn((c, d), generator=gen)
        for w in range(c):
            pool[table[b, w // bs].long(), w % bs] = r[w]
        rows.append(r)
    return PagedKVCache(KVCacheSpec(nb, bs, d, 0, torch.float32), (pool,)), table, rows


@pytest.mark.parametrize("select_block", [16, 1024])
def test_indexer_topk_select_blocks_and_upper_bounds(gen: torch.Generator, select_block: int) -> None:
    """The select kernel over several blocks of entries (the threshold and the ties in later
    blocks), with the host lengths a replayed graph gives (upper bounds), and with a scores
    budget that runs each request alone (a request with no entry among them): the ids of the
    reference as sets; rows whose scores all tie (zero queries) keep the lowest ids."""
    seq, ql, ratio, topk, hi, di = [203, 150, 9, 1], [1, 3, 1, 1], 2, 20, 3, 8
    keys, table, _ = _entry_pool(seq, ratio, di, 8, gen)
    meta = AttentionMetadata.build(table.to(DEV), seq, ql)
    q = torch.randn((sum(ql), hi, di), generator=gen)
    q[1] = 0  # every score 0
    w = torch.randn((sum(ql), hi), generator=gen)
    want = ref_v4.indexer_topk(q, w, keys, AttentionMetadata.build(table, seq, ql), ratio, topk, 0.3)
    bound = dataclasses.replace(meta, seq_lens_host=(400,) * 4, max_seq_len=400)
    assert v4_k._score_groups(meta.seq_lens_host, meta.query_lens_host, ratio, 1) == [
        (0, 1),
        (1, 2),
        (2, 3),
        (3, 4),
    ]
    for m, budget in ((meta, v4_k.SCORES_BUDGET_BYTES), (bound, v4_k.SCORES_BUDGET_BYTES), (meta, 1)):
        got = v4_k.indexer_topk(
            q.to(DEV), w.to(DEV), keys.tensors[0].to(DEV), m, ratio=ratio, topk=topk, scale=0.3,
            block_n=16, select_block=select_block, scores_budget=budget,
        ).cpu()  # fmt: skip
        for row in range(sum(ql)):
            if row == 1:
                assert got[row].tolist() == list(range(topk))
                continue
            assert sorted(got[row].tolist()) == sorted(want[row].tolist()), row


def _f64_best(scores: list[float], allowed: list[int], k: int) -> list[int]:
    """The k best of `allowed` by float64 score, ties to the lower id (sorted)."""
    return sorted(sorted(allowed, key=lambda i: (-scores[i], i))[:k])


@pytest.mark.parametrize("key_format", [None, "mxfp4"], ids=["float-keys", "mxfp4-keys"])
@pytest.mark.parametrize("select_block", [16, 1024])
def test_indexer_candidate_blocks_against_float64(
    gen: torch.Generator, select_block: int, key_format: str | None
) -> None:
    """DeepSeek-V4.1's two stages (candidate blocks from one layer's scores, then the top-k inside
    them) against float64 brute force: block maxima over partial blocks, the newest block forced in,
    selects over several blocks of columns, fewer candidates than top-k, rows whose scores all tie
    (zero queries: the lowest ids), graph-replay host lengths (upper bounds) and a scores budget
    that runs each request alone. MXFP4 keys (V4.1's published index-key rows, every pool row
    quantised): the kernels dequantise them in registers and round the queries to MXFP4 there;
    float64 scores the keys and the query heads rounded by the oracle's own kv_round."""
    from deepinfer.backend import kv_formats_v41 as kvf
    from deepinfer.testing.v41_oracle import kv_round

    di = 8 if key_format is None else 32  # whole 32-value scale blocks
    seq, ql, ratio, hi, bs, kb = [203, 150, 9, 1], [1, 3, 1, 1], 2, 3, 3, 8
    keys, table, rows = _entry_pool(seq, ratio, di, 8, gen)
    if key_format is not None:
        rows = [kv_round(r.double(), key_format) for r in rows]
    meta = AttentionMetadata.build(table.to(DEV), seq, ql)
    q = torch.randn((sum(ql), hi, di), generator=gen)
    q[1] = 0  # every score 0
    w = torch.randn((sum(ql), hi), generator=gen)
    queries = [
        (r, b, seq[b] - ql[b] + i)
        for b in range(len(seq))
        for i, r in enumerate(range(sum(ql[:b]), sum(ql[: b + 1])))
    ]
    scores64 = {}
    q64 = q.double() if key_format is None else kv_round(q.double(), key_format)
    for r, b, pos in queries:
        n_vis = (pos + 1) // ratio
        k64 = rows[b][:n_vis].double()
        s64 = (torch.relu(q64[r] @ k64.T) * 0.3 * w[r].double()[:, None]).sum(0)
        scores64[r] = s64.tolist()
    bound = dataclasses.replace(meta, seq_lens_host=(400,) * 4, max_seq_len=400)
    pool = keys.tensors[0]
    if key_format is not None:
        pool = kvf.quantize_rows(pool, key_format)  # type: ignore[arg-type]
    pool = pool.to(DEV)
    for m, budget in ((meta, v4_k.SCORES_BUDGET_BYTES), (bound, v4_k.SCORES_BUDGET_BYTES), (meta, 1)):
        for topk in (5, 30):  # 30 > kb * bs = 24 candidate entries
            ids, blocks = v4_k.indexer_candidate_blocks(
                q.to(DEV), w.to(DEV), pool, m, ratio=ratio, topk=topk, scale=0.3, block_size=bs,
                topk_blocks=kb, block_n=16, select_block=select_block, scores_budget=budget,
                key_format=key_format,
            )  # fmt: skip
            inside = v4_k.indexer_topk_in_blocks(
                q.to(DEV), w.to(DEV), pool, m, blocks, ratio=ratio, topk=topk, scale=0.3, block_size=bs,
                block_n=16, select_block=select_block, scores_budget=budget, key_format=key_format,
            )  # fmt: skip
            ids, blocks, inside = ids.cpu(), blocks.cpu(), inside.cpu()
            for r, _, _ in queries:
                sc = scores64[r]
                n_vis, nb = len(sc), -(-len(sc) // bs)
                best = [max(sc[j * bs : (j + 1) * bs]) for j in range(nb)]
                if nb:
                    best[-1] = float("inf")
                want_blocks = _f64_best(best, list(range(nb)), kb)
                assert sorted(i for i in blocks[r].tolist() if i >= 0) == want_blocks, (r, blocks[r])
                assert sorted(i for i in ids[r].tolist() if i >= 0) == _f64_best(sc, list(range(n_vis)), topk)
                cand = [e for e in range(n_vis) if e // bs in want_blocks]
                assert sorted(i for i in inside[r].tolist() if i >= 0) == _f64_best(sc, cand, topk), r
                assert (inside[r] >= 0).sum() == min(topk, len(cand)) and (inside[r][len(cand) :] == -1).all()
    with pytest.raises(ValueError, match="indexer_topk_in_blocks"):
        v4_k.indexer_topk_in_blocks(
            q.to(DEV),
            w.to(DEV),
            pool,
            meta,
            blocks[:2].to(DEV),
            ratio=ratio,
            topk=5,
            scale=0.3,
            block_size=bs,
            key_format=key_format,
        )


def _compressed_case(
    gen: torch.Generator, topk_width: int
) -> tuple[torch.Tensor, PagedKVCache, PagedKVCache, torch.Tensor, AttentionMetadata, torch.Tensor, Any]:
    seq, ql, d, h, ratio = [1, 90, 203, 40], [1, 1, 1, 6], 32, 5, 4
    pool, meta, _ = paged(seq, ql, d, 8, gen)
    tokens = PagedKVCache(KVCacheSpec(pool.shape[0], 8, d, 0, torch.float32), (pool,))
    entries, entry_table, _ = _entry_pool(seq, ratio, d, 4, gen)
    q = torch.randn((sum(ql), h, d), generator=gen)
    topk = None
    if topk_width:
        topk = torch.randint(-1, 55, (sum(ql), topk_width), generator=gen, dtype=torch.int32)
        topk[:, -1] = topk[:, 0]
    return q, tokens, entries, entry_table, meta, torch.randn(h, generator=gen), topk


@pytest.mark.parametrize("topk_width", [0, 40])
def test_compressed_attention_splits_and_upper_bounds(
    gen: torch.Generator, monkeypatch: pytest.MonkeyPatch, topk_width: int
) -> None:
    """Adaptive splits (132 SMs), splits of one 16-key tile each, and the host lengths of a
    replayed graph (upper bounds): all as the reference, with NaN in every row no request owns."""
    monkeypatch.setattr(v4_k, "num_sms", lambda device: 132)
    q, tokens, entries, entry_table, meta, sinks, topk = _compressed_case(gen, topk_width)
    mods = AttentionModifiers(window=20, sinks=sinks, topk_indices=topk)
    cpu_meta = AttentionMetadata.build(
        meta.block_tables.cpu(), list(meta.seq_lens_host), list(meta.query_lens_host)
    )
    want = ref_v4.compressed_attention(
        q, tokens, entries, cpu_meta, 0.2, 4, mods, compressed_block_tables=entry_table
    )
    upper = 64 * 8
    table = torch.zeros((4, upper // 8), dtype=torch.int32)
    table[:, : meta.block_tables.shape[1]] = meta.block_tables.cpu()
    bound = dataclasses.replace(
        meta, block_tables=table.to(DEV), seq_lens_host=(upper,) * 4, max_seq_len=upper
    )
    cfg = attn_k.AttentionConfig(16, 16, 4, 1)
    for m, split_tiles in ((meta, None), (meta, 1), (bound, None)):
        got = v4_k.compressed_attention(
            q.to(DEV), tokens.tensors[0].to(DEV), entries.tensors[0].to(DEV), m, scale=0.2, ratio=4,
            window=20, sinks=sinks.to(DEV), topk_indices=None if topk is None else topk.to(DEV),
            compressed_block_tables=entry_table.to(DEV), config=cfg, split_tiles=split_tiles,
        ).cpu()  # fmt: skip
        torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("topk_width", [0, 40])
def test_compressed_attention_small_grid(
    gen: torch.Generator, monkeypatch: pytest.MonkeyPatch, topk_width: int
) -> None:
    """A decode-sized grid in bfloat16 under the default config with small_grid
    (DEEPINFER_CUDA_V4_SMALL_GRID): small head tiles and one-tile splits (SMALL_BLOCK_M,
    SMALL_MIN_SPLIT_TILES) as the reference, and as the whole-head tiles the same call takes
    when the grid is not small."""
    monkeypatch.setattr(v4_k, "num_sms", lambda device: 132)
    _, tokens, entries, entry_table, meta, _, topk = _compressed_case(gen, topk_width)
    h = 40  # one 64-row head tile by default, three of SMALL_BLOCK_M rows in the small grid
    q = torch.randn((meta.num_tokens, h, tokens.spec.head_dim), generator=gen).bfloat16()
    sinks = torch.randn(h, generator=gen)
    kv, ckv = tokens.tensors[0].bfloat16(), entries.tensors[0].bfloat16()
    mods = AttentionModifiers(window=20, sinks=sinks, topk_indices=topk)
    cpu_meta = AttentionMetadata.build(
        meta.block_tables.cpu(), list(meta.seq_lens_host), list(meta.query_lens_host)
    )
    t16 = PagedKVCache(dataclasses.replace(tokens.spec, dtype=torch.bfloat16), (kv,))
    e16 = PagedKVCache(dataclasses.replace(entries.spec, dtype=torch.bfloat16), (ckv,))
    want = ref_v4.compressed_attention(
        q.float(), t16, e16, cpu_meta, 0.2, 4, mods, compressed_block_tables=entry_table
    )
    outs = []
    for programs in (v4_k.SMALL_GRID_PROGRAMS, 0):
        monkeypatch.setattr(v4_k, "SMALL_GRID_PROGRAMS", programs)
        outs.append(
            v4_k.compressed_attention(
                q.to(DEV), kv.to(DEV), ckv.to(DEV), meta, scale=0.2, ratio=4, window=20,
                sinks=sinks.to(DEV), topk_indices=None if topk is None else topk.to(DEV),
                compressed_block_tables=entry_table.to(DEV), small_grid=True,
            ).cpu().float()
        )  # fmt: skip
    for got in outs:
        torch.testing.assert_close(got, want.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("formats", [("fp8", "fp4"), ("fp8", "fp8")], ids=["fp8-fp4", "fp8-fp8"])
def test_quantized_rows_splits_and_upper_bounds(
    gen: torch.Generator, monkeypatch: pytest.MonkeyPatch, formats: tuple[str, str]
) -> None:
    """DeepSeek-V4.1's rows: the same caches quantised (every row, the NaN ones no request owns
    too), read by the kernel in its adaptive splits, one-tile splits and a replayed graph's upper
    bounds, as the reference over the dequantised rows; then the indexer's scores over MXFP4 keys
    (the queries rounded to MXFP4 in registers) pick what the reference picks."""
    from deepinfer.backend import kv_formats_v41 as kvf

    monkeypatch.setattr(v4_k, "num_sms", lambda device: 132)
    q, tokens, entries, entry_table, meta, sinks, topk = _compressed_case(gen, 40)
    fmt_w, fmt_e = formats

    def quantized(cache: PagedKVCache, fmt: str) -> PagedKVCache:
        rows = kvf.quantize_rows(cache.tensors[0], fmt)  # type: ignore[arg-type]
        spec = dataclasses.replace(cache.spec, latent_dim=rows.shape[-1], dtype=torch.uint8)
        return PagedKVCache(spec, (rows,))

    qt, qe = quantized(tokens, fmt_w), quantized(entries, fmt_e)
    mods = AttentionModifiers(window=20, sinks=sinks, topk_indices=topk)
    cpu_meta = AttentionMetadata.build(
        meta.block_tables.cpu(), list(meta.seq_lens_host), list(meta.query_lens_host)
    )

    def reader(fmt: str) -> Any:
        return lambda cache, slots: kvf.dequantize_rows(ref_v4.read_kv(cache, slots), fmt)

    want = ref_v4.compressed_attention(
        q, qt, qe, cpu_meta, 0.2, 4, mods, reader(fmt_w), entry_table, read_compressed=reader(fmt_e)
    )
    upper = 64 * 8
    table = torch.zeros((4, upper // 8), dtype=torch.int32)
    table[:, : meta.block_tables.shape[1]] = meta.block_tables.cpu()
    bound = dataclasses.replace(
        meta, block_tables=table.to(DEV), seq_lens_host=(upper,) * 4, max_seq_len=upper
    )
    cfg = attn_k.AttentionConfig(16, 16, 4, 1)
    for m, split_tiles in ((meta, None), (meta, 1), (bound, None)):
        got = v4_k.compressed_attention(
            q.to(DEV), qt.tensors[0].to(DEV), qe.tensors[0].to(DEV), m, scale=0.2, ratio=4, window=20,
            sinks=sinks.to(DEV), topk_indices=topk.to(DEV), compressed_block_tables=entry_table.to(DEV),
            config=cfg, split_tiles=split_tiles, kv_format=fmt_w, ckv_format=fmt_e,
        ).cpu()  # fmt: skip
        torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
    keys = quantized(entries, "mxfp4")
    key_meta = AttentionMetadata.build(entry_table, list(meta.seq_lens_host), list(meta.query_lens_host))
    qi, w = torch.randn((q.shape[0], 3, 32), generator=gen), torch.randn((q.shape[0], 3), generator=gen)
    want_ids = ref_v4.indexer_topk(  # the FP4 indexer: MXFP4 queries beside MXFP4 keys
        kvf.round_index_queries(qi, "mxfp4"), w, keys, key_meta, 4, 7, 0.3, reader("mxfp4")
    )
    dev_meta = AttentionMetadata.build(
        entry_table.to(DEV), list(meta.seq_lens_host), list(meta.query_lens_host)
    )
    got_ids = v4_k.indexer_topk(
        qi.to(DEV),
        w.to(DEV),
        keys.tensors[0].to(DEV),
        dev_meta,
        ratio=4,
        topk=7,
        scale=0.3,
        key_format="mxfp4",
    ).cpu()
    assert torch.equal(got_ids.sort(-1).values, want_ids.sort(-1).values)


def test_compressed_attention_is_batch_invariant(gen: torch.Generator) -> None:
    """Batch-invariant mode: request 1's decode row alone and in the batch, bit for bit."""
    q, tokens, entries, entry_table, meta, sinks, topk = _compressed_case(gen, 40)
    assert topk is not None

    def run(rows: slice, reqs: slice, seq: list[int], ql: list[int]) -> torch.Tensor:
        m = AttentionMetadata.build(meta.block_tables[reqs], seq, ql)
        out: torch.Tensor = v4_k.compressed_attention(
            q[rows].to(DEV), tokens.tensors[0].to(DEV), entries.tensors[0].to(DEV), m, scale=0.2,
            ratio=4, window=20, sinks=sinks.to(DEV), topk_indices=topk[rows].to(DEV),
            compressed_block_tables=entry_table[reqs].to(DEV), batch_invariant=True,
            config=attn_k.AttentionConfig(16, 16, 4, 1), split_tiles=2,
        )  # fmt: skip
        return out

    both = run(slice(0, 9), slice(0, 4), [1, 90, 203, 40], [1, 1, 1, 6])
    alone = run(slice(1, 2), slice(1, 2), [90], [1])
    assert_bitwise_equal(alone, both[1:2], what="request 1 alone vs batched")


def _decode_moe_case(gen: torch.Generator, tokens: int, fp8: bool) -> tuple[list[Any], torch.Tensor]:
    """fused_moe inputs (x, weights, ids, w13, w2, w13_scale, w2_scale) on DEV and the float64
    oracle. Odd sizes (Dm = 200, I = 136: partial K steps and column tiles; FP8 Dm = 256 with
    I = 136), an expert picked by several tokens, expert 5 by every token (a shared expert)."""
    from deepinfer.backend import fp8 as fp8_fmt

    e, h, inter = 6, 256 if fp8 else 200, 136
    x = torch.randn((tokens, h), generator=gen)
    w13 = torch.randn((e, 2 * inter, h), generator=gen) * h**-0.5
    w2 = torch.randn((e, h, inter), generator=gen) * inter**-0.5
    ids = torch.tensor([[0, 3, 5], [3, 1, 5], [2, 4, 5], [3, 0, 5]])[:tokens]
    weights = torch.rand((tokens, 3), generator=gen)
    scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    w13_real, w2_real = w13, w2
    if fp8:
        q13 = [fp8_fmt.quantize_weight(w) for w in w13]
        q2 = [fp8_fmt.quantize_weight(w) for w in w2]
        w13, w2 = torch.stack([q for q, _ in q13]), torch.stack([q for q, _ in q2])
        scales = (torch.stack([s for _, s in q13]), torch.stack([s for _, s in q2]))
        w13_real = fp8_fmt.dequantize_weight(w13, scales[0])
        w2_real = fp8_fmt.dequantize_weight(w2, scales[1])

    def quantised(v: torch.Tensor) -> torch.Tensor:  # FP8: activations pass through e4m3 too
        if not fp8:
            return v.double()
        return fp8_fmt.dequantize_act(*ref_gemm.quantize_fp8(v.float()[None]))[0].double()

    expected = torch.zeros((tokens, h), dtype=torch.float64)
    for t in range(tokens):
        for k in range(3):
            ex = int(ids[t, k])
            gate_up = quantised(x[t]) @ w13_real[ex].double().T
            act = quantised(torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:])
            expected[t] += weights[t, k].double() * (act @ w2_real[ex].double().T)
    args = [v.to(DEV) if v is not None else None for v in (x, weights, ids, w13, w2, *scales)]
    return args, expected


@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
@pytest.mark.parametrize("tokens", [1, 4])
def test_decode_moe_against_float64_and_the_grouped_path(
    gen: torch.Generator, tokens: int, fp8: bool
) -> None:
    """The decode-sized MoE (up with silu_and_mul, down with the combine: no sort) against a
    float64 oracle and the grouped path; tilings with partial tiles, the combine fused (the last
    program of a token's copies on a column tile sums them) or launched after."""
    args, expected = _decode_moe_case(gen, tokens, fp8)
    grouped_backend = cuda_backend.create_cuda_backend(BackendOptions())
    grouped_backend.moe.decode = False
    grouped = grouped_backend.moe.fused_moe(*args)
    tol = 2e-2 if fp8 else 2e-3  # FP8: an activation near an e4m3 rounding edge may round apart
    configs = [
        moe_k.DecodeConfig(),
        moe_k.DecodeConfig(up_n=64, up_k=64, down_n=16, down_k=32, fused_combine=False),
        moe_k.DecodeConfig(up_n=16, up_k=256, down_n=128, down_k=64, fused_combine=True),
    ]
    outs = [moe_k.decode_moe(*args, config=cfg) for cfg in configs]
    for cfg, y in zip(configs, outs):
        what = f"decode_moe {cfg}"
        assert y.dtype == args[0].dtype and y.shape == args[0].shape
        torch.testing.assert_close(
            y.cpu().double(), expected, rtol=tol, atol=tol, msg=functools.partial("{}: {}".format, what)
        )
        torch.testing.assert_close(
            y.cpu(), grouped.cpu(), rtol=1e-5, atol=1e-5, msg=functools.partial("{}: {}".format, what)
        )
    # each copy is computed alone: a token's row does not depend on the others in the batch
    x, weights, ids = args[:3]
    alone = moe_k.decode_moe(x[-1:], weights[-1:], ids[-1:], *args[3:])
    assert_bitwise_equal(alone.cpu(), outs[0][-1:].cpu(), what="decode_moe, last row alone")


def test_decode_moe_in_bfloat16_and_edge_sizes(gen: torch.Generator) -> None:
    """bfloat16 rounds where the grouped path rounds (gate / up, the activation, each expert's
    output): equal to it within one bfloat16 step; no tokens, and top-1 routing."""
    args, expected = _decode_moe_case(gen, 3, False)
    args = [v.to(torch.bfloat16) if v is not None and v.is_floating_point() else v for v in args]
    grouped_backend = cuda_backend.create_cuda_backend(BackendOptions())
    grouped_backend.moe.decode = False
    y = moe_k.decode_moe(*args)
    grouped = grouped_backend.moe.fused_moe(*args)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.cpu().double(), expected, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(y.cpu().float(), grouped.cpu().float(), rtol=8e-3, atol=8e-3)
    x, weights, ids, *w = args
    assert moe_k.decode_moe(x[:0], weights[:0], ids[:0], *w).shape == (0, x.shape[1])
    top1 = moe_k.decode_moe(x, weights[:, :1], ids[:, :1], *w)
    torch.testing.assert_close(
        top1.cpu().float(), grouped_backend.moe.fused_moe(x, weights[:, :1], ids[:, :1], *w).cpu().float(),
        rtol=8e-3, atol=8e-3,
    )  # fmt: skip


def test_decode_moe_starts_the_shared_experts_from_their_place_not_the_ids(gen: torch.Generator) -> None:
    """shared_experts = S: the last S columns' experts come from their place (E - S .. E - 1),
    not from ids (on a GPU those copies compute before the router ends): the same bits as reading
    them when ids hold them; other ids there would change the result; S past K or E is refused."""
    args, _ = _decode_moe_case(gen, 4, False)
    x, weights, ids, w13, w2 = args[:5]
    plain = moe_k.decode_moe(*args)
    assert_bitwise_equal(moe_k.decode_moe(*args, shared_experts=1).cpu(), plain.cpu(), what="S = 1")
    wrong = ids.clone()
    wrong[:, -1] = 0  # the kernel must not read the shared column's ids
    early = moe_k.decode_moe(x, weights, wrong, w13, w2, shared_experts=1)
    assert_bitwise_equal(early.cpu(), plain.cpu(), what="S = 1 with other ids in the shared column")
    assert not torch.equal(moe_k.decode_moe(x, weights, wrong, w13, w2).cpu(), plain.cpu())
    with pytest.raises(ValueError, match="shared_experts=4"):
        moe_k.decode_moe(*args, shared_experts=4)


def test_fused_moe_starts_shared_experts_early_only_right_after_their_routing(
    gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend passes the router's S shared experts to the decode kernels only for the x and
    ids of the last one-launch routing, with w13 holding E + S experts, under inference mode too
    (as the engine runs), and not with DEEPINFER_CUDA_MOE_EARLY=0."""
    seen: list[int] = []
    real = moe_k.decode_moe

    def spy(*a: Any, shared_experts: int = 0, **kw: Any) -> torch.Tensor:
        seen.append(shared_experts)
        y: torch.Tensor = real(*a, shared_experts=shared_experts, **kw)
        return y

    monkeypatch.setattr(moe_k, "decode_moe", spy)
    backend = cuda_backend.create_cuda_backend(BackendOptions())
    e, s, h, inter = 5, 1, 64, 32
    with torch.inference_mode():  # the engine's tensors: no version counter
        x = torch.randn((2, h), generator=gen).to(DEV)
    gate = torch.randn((e, h), generator=gen).to(DEV)
    w13 = (torch.randn((e + s, 2 * inter, h), generator=gen) * h**-0.5).to(DEV)
    w2 = (torch.randn((e + s, h, inter), generator=gen) * inter**-0.5).to(DEV)
    config = RouterConfig("softmax", top_k=2, shared_experts=s)
    weights, ids = backend.moe.select_experts(x, gate, config)
    early = backend.moe.fused_moe(x, weights, ids, w13, w2)
    backend.moe.select_experts(x, gate, config)
    late = backend.moe.fused_moe(x.clone(), weights, ids, w13, w2)  # not the routed x
    assert seen == [s, 0]
    assert_bitwise_equal(early.cpu(), late.cpu(), what="shared experts early or not")
    weights, ids = backend.moe.select_experts(x, gate, config)
    backend.moe.fused_moe(x, weights, ids, torch.cat([w13, w13[:1]]), torch.cat([w2, w2[:1]]))  # E + S + 1
    weights, ids = backend.moe.select_experts(x, gate, config)
    backend.moe.fused_moe(x, weights, ids.clone(), w13, w2)  # not the routed ids
    backend.moe.fused_moe(x, weights, ids, w13, w2)  # a second call: no routing just before
    monkeypatch.setenv(envs.CUDA_MOE_EARLY.name, "0")
    backend = cuda_backend.create_cuda_backend(BackendOptions())
    weights, ids = backend.moe.select_experts(x, gate, config)
    backend.moe.fused_moe(x, weights, ids, w13, w2)
    assert seen == [s, 0, 0, 0, 0, 0]


def test_fused_moe_takes_the_decode_path_by_size_switch_and_mode(
    gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fused_moe: decode kernels up to DECODE_MAX_COPIES copies of unquantised experts, the
    grouped path above, for FP8 experts, with DEEPINFER_CUDA_MOE_DECODE=0, and in batch-invariant
    mode; the tiles' env variable."""
    args, _ = _decode_moe_case(gen, 4, False)
    calls: list[int] = []
    real = moe_k.decode_moe

    def counted(*a: Any, **kw: Any) -> torch.Tensor:
        calls.append(1)
        y: torch.Tensor = real(*a, **kw)
        return y

    monkeypatch.setattr(moe_k, "decode_moe", counted)

    def moe(options: BackendOptions, max_copies: int = 12) -> Any:
        part = cuda_backend.create_cuda_backend(options).moe
        part.max_copies = max_copies  # the limit its creation read (DECODE_MAX_COPIES unless pinned)
        return part

    y = moe(BackendOptions()).fused_moe(*args)
    assert calls == [1]
    assert_bitwise_equal(y.cpu(), real(*args).cpu(), what="fused_moe through the decode path")
    moe(BackendOptions(), max_copies=11).fused_moe(*args)
    fp8_args, _ = _decode_moe_case(gen, 4, True)
    moe(BackendOptions()).fused_moe(*fp8_args)  # FP8 experts: the grouped path (decode kernels: slower)
    moe(BackendOptions(batch_invariant=True)).fused_moe(*args)
    monkeypatch.setenv(envs.CUDA_MOE_DECODE.name, "0")
    moe(BackendOptions()).fused_moe(*args)
    assert calls == [1]

    monkeypatch.delenv(envs.CUDA_MOE_DECODE.name)
    monkeypatch.setenv(envs.CUDA_MOE_DECODE_TILES.name, "64,256,8,3,16,512,4,4,0,48")
    pinned = cuda_backend.create_cuda_backend(BackendOptions()).moe
    tiles = moe_k.DecodeConfig(64, 256, 8, 3, 16, 512, 4, 4, False)
    assert (pinned.decode_tiles, pinned.max_copies) == (tiles, 48)
    monkeypatch.setenv(envs.CUDA_MOE_DECODE_TILES.name, "64,256")
    with pytest.raises(ValueError, match="UP_N,UP_K"):
        cuda_backend.create_cuda_backend(BackendOptions())


def test_decode_tiles_follow_the_copies_unless_pinned(
    gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """decode_config: one token's copies (up to ONE_TOKEN_COPIES) take ONE_TOKEN_CONFIG, more take
    DecodeConfig() (on a GPU; the interpreter's own wide tiles here), and the env variable, read
    when the backend is created, pins every size; the one-token tiles agree with the others
    within rounding."""
    args, expected = _decode_moe_case(gen, 1, False)
    y = moe_k.decode_moe(*args, config=moe_k.ONE_TOKEN_CONFIG)
    torch.testing.assert_close(y.cpu().double(), expected, rtol=2e-3, atol=2e-3)
    other = moe_k.decode_moe(*args, config=moe_k.DecodeConfig())
    torch.testing.assert_close(y.cpu(), other.cpu(), rtol=1e-5, atol=1e-5)

    monkeypatch.delenv(envs.CUDA_MOE_DECODE_TILES.name, raising=False)
    monkeypatch.setattr(moe_k, "INTERPRET", False)
    one, more = moe_k.ONE_TOKEN_COPIES, moe_k.ONE_TOKEN_COPIES + 1
    assert moe_k.decode_config(one) == moe_k.ONE_TOKEN_CONFIG != moe_k.DecodeConfig()
    assert moe_k.decode_config(more) == moe_k.DecodeConfig()
    assert cuda_backend.create_cuda_backend(BackendOptions()).moe.decode_tiles is None  # by size
    monkeypatch.setenv(envs.CUDA_MOE_DECODE_TILES.name, "64,128,4,3,64,128,4,3,1,32")
    pinned = cuda_backend.create_cuda_backend(BackendOptions()).moe
    configs: list[moe_k.DecodeConfig | None] = []
    real = moe_k.decode_moe

    def spy(*a: Any, config: moe_k.DecodeConfig | None = None, **kw: Any) -> torch.Tensor:
        configs.append(config)
        y: torch.Tensor = real(*a, config=config, **kw)
        return y

    monkeypatch.setattr(moe_k, "decode_moe", spy)
    for tokens in (1, 4):  # 3 copies (one token's tiles by size) and 12 (the larger steps')
        pinned.fused_moe(*_decode_moe_case(gen, tokens, False)[0])
    assert configs == [moe_k.DecodeConfig()] * 2


# --------------------------------------------------------------------------- DeepSeek-V4's published format


def fp8_weights(shape: tuple[int, ...], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 weights with power-of-two (UE8M0) block scales, stacked over a leading axis."""
    from deepinfer.backend.fp8 import quantize_weight

    k = shape[-1]
    w = torch.randn(shape, generator=gen) * k**-0.5
    parts = [quantize_weight(p, ue8m0=True) for p in w.reshape(-1, *shape[-2:])]
    q = torch.stack([p[0].view(torch.uint8) for p in parts]).view(torch.float8_e4m3fn)
    return q.view(shape).to(DEV), torch.stack([p[1] for p in parts]).view(*shape[:-2], *parts[0][1].shape).to(
        DEV
    )


def fp8_linear_oracle(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    xq, xs = ref_gemm.quantize_fp8(x.cpu().double())
    return ref_gemm.fp8_gemm(xq, xs, w.cpu(), s.cpu(), torch.float64)


@pytest.mark.parametrize("m", [1, 5, 20])
def test_skinny_fp8_matmul_against_float64(gen: torch.Generator, m: int) -> None:
    """linear_fp8 at decode sizes in one launch: x quantised per row and 128 columns in the kernel,
    the e4m3 slab dequantised in registers, K split over slabs (K = 640: the last one partial),
    N = 200 a partial scale-block row; 20 rows take the 32-row x^T operand. Batched over groups
    from a strided x into a strided out (the grouped wo_a). Against the reference's quantise +
    fp8_gemm in float64; tickets left at zero; bad inputs named."""
    k, n, g = 640, 200, 3
    w, s = fp8_weights((n, k), gen)
    x = torch.randn((m, k), generator=gen).to(torch.bfloat16).to(DEV)
    cfgs = [None, gemm_k.SkinnyConfig(block_n=32, block_k=128, num_warps=4, slab=256, pdl=True)]
    for cfg in cfgs:
        y = gemm_k.skinny_fp8_matmul(x, w, s, config=cfg)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        want = fp8_linear_oracle(x, w, s)
        torch.testing.assert_close(y.cpu().double(), want, rtol=6e-2, atol=6e-2)
        assert float((y.cpu().double() - want).norm() / want.norm()) < 0.015
    assert not gemm_k._SKINNY_TICKETS.get(DEV, 1).any(), "a tile's ticket was left counted"
    wg, sg = fp8_weights((g, 256, 256), gen)
    xg = torch.randn((m, g, 256), generator=gen).to(torch.bfloat16).to(DEV).transpose(0, 1)  # (G, M, K)
    out = torch.empty((m, g, 256), dtype=torch.bfloat16, device=DEV)
    gemm_k.skinny_fp8_matmul(xg, wg, sg, out.transpose(0, 1))
    for i in range(g):
        want = fp8_linear_oracle(xg[i], wg[i], sg[i])
        torch.testing.assert_close(out[:, i].cpu().double(), want, rtol=6e-2, atol=6e-2)
        assert float((out[:, i].cpu().double() - want).norm() / want.norm()) < 0.015
    with pytest.raises(ValueError, match="skinny_fp8_matmul"):
        gemm_k.skinny_fp8_matmul(torch.zeros((65, k), dtype=torch.bfloat16, device=DEV), w, s)
    with pytest.raises(ValueError, match="skinny_fp8_matmul"):
        gemm_k.skinny_fp8_matmul(x, w, s[:, :2])


def fp8_contract_oracle(
    x: torch.Tensor, w: torch.Tensor, s: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """linear_fp8's meaning in float64: x (M, K) quantised by the contract's quantize_fp8 (its
    float32 scale and quotient, as defined), both operands dequantised exactly and multiplied in
    float64 -> (the product (M, N), the sum of its terms' magnitudes: the scale of any
    accumulation error)."""
    from deepinfer.backend.fp8 import expand_block_scale

    k = x.shape[-1]
    xq, xs = ref_gemm.quantize_fp8(x.cpu())
    xd = xq.double() * xs.double().repeat_interleave(128, dim=-1)[:, :k]
    wd = w.cpu().double() * expand_block_scale(s.cpu().double(), w.shape[0], k)
    return xd @ wd.T, xd.abs() @ wd.abs().T


def assert_fp8_mma_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> None:
    """y = linear_fp8(x, w, s) from e4m3 x e4m3 products: within the output's rounding (half an
    ulp of bf16 is 2^-9 of the value; 2^-8 allowed) plus the float32 accumulation (2^-16 of the
    terms' magnitudes: 128 products a block, then the scaled block sums) in the interpreter, where
    tl.dot multiplies exactly; on SM90 the FP8 MMA keeps about 14 bits of its 128-term sums
    (2^-11)."""
    want, mag = fp8_contract_oracle(x, w, s)
    err = (y.cpu().double() - want).abs()
    bound = 2.0**-8 * want.abs() + (2.0**-16 if INTERPRET else 2.0**-11) * mag
    worst = float((err - bound).max())
    assert worst <= 0, f"max excess {worst:.3g} over the bound (max error {float(err.max()):.3g})"


@pytest.mark.parametrize("m", [1, 7, 16, 64])
def test_skinny_fp8_mma_against_float64(gen: torch.Generator, m: int) -> None:
    """The skinny FP8 kernel's e4m3 x e4m3 variant (SkinnyConfig.fp8_mma): x quantised per row and
    128 columns exactly as the contract's quantize_fp8, each 128-wide K block multiplied on the
    tensor cores and promoted to float32 with its two scales. N = 200 and 72 (partial weight-row
    tiles and scale blocks), K = 640 and 600 over 256- and 512-column slabs (split K, the last slab
    partial or one block short; 600: a partial 128-block) and K = 200 in one slab (no split);
    M = 1 to 64 (the x^T operand 16 to 64 wide). Batched over groups from a strided x into a
    strided out (the grouped wo_a), and float16 x. Against the float64 oracle of the contract;
    tickets left at zero; a block_n the warpgroup MMA cannot take refused."""
    cfg = functools.partial(gemm_k.SkinnyConfig, block_k=128, pdl=True, fp8_mma=True)
    cases = [
        (200, 640, cfg(block_n=64, slab=256, num_warps=4)),
        (200, 600, cfg(block_n=128, slab=512, num_warps=4)),
        (72, 640, cfg(block_n=128, slab=128, num_warps=8)),
        (72, 200, cfg(block_n=64, slab=256, num_warps=4)),
    ]
    for n, k, c in cases:
        w, s = fp8_weights((n, k), gen)
        x = torch.randn((m, k), generator=gen).to(torch.bfloat16).to(DEV)
        y = gemm_k.skinny_fp8_matmul(x, w, s, config=c)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        assert_fp8_mma_close(y, x, w, s)
    assert not gemm_k._SKINNY_TICKETS.get(DEV, 1).any(), "a tile's ticket was left counted"
    g = 3
    wg, sg = fp8_weights((g, 192, 384), gen)
    xg = torch.randn((m, g, 384), generator=gen).to(torch.bfloat16).to(DEV).transpose(0, 1)  # (G, M, K)
    out = torch.empty((m, g, 192), dtype=torch.bfloat16, device=DEV)
    gemm_k.skinny_fp8_matmul(xg, wg, sg, out.transpose(0, 1), config=cases[0][2])
    for i in range(g):
        assert_fp8_mma_close(out[:, i], xg[i], wg[i], sg[i])
    w, s = fp8_weights((200, 640), gen)
    x16 = (4 * torch.randn((m, 640), generator=gen)).to(torch.float16).to(DEV)
    y16 = gemm_k.skinny_fp8_matmul(x16, w, s, config=cases[0][2])
    assert y16.dtype == torch.float16
    assert_fp8_mma_close(y16, x16, w, s)
    with pytest.raises(ValueError, match="fp8_mma takes block_n 64 or 128"):
        gemm_k.skinny_fp8_matmul(x16, w, s, config=cfg(block_n=32, slab=256))


def test_fp8_linears_take_the_skinny_kernel_at_decode_sizes(
    gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CudaGemm.linear_fp8 and batched_linear_fp8: the skinny FP8 kernel up to SKINNY_FP8_MAX_M rows
    and SKINNY_FP8_MAX_WEIGHT_BYTES, the contract's quantise + fp8_gemm (grouped_gemm_fp8) above,
    in batch-invariant mode and with DEEPINFER_CUDA_V4_DECODE=0; results agree within the FP8
    budget either way."""
    calls: list[int] = []
    real = gemm_k.skinny_fp8_matmul

    def spy(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(x.shape[-2])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(gemm_k, "skinny_fp8_matmul", spy)
    w, s = fp8_weights((128, 256), gen)
    wg, sg = fp8_weights((2, 128, 256), gen)
    on = cuda_backend.create_cuda_backend(BackendOptions())
    monkeypatch.setenv(envs.CUDA_V4_DECODE.name, "0")
    off = cuda_backend.create_cuda_backend(BackendOptions())
    monkeypatch.delenv(envs.CUDA_V4_DECODE.name)
    invariant = cuda_backend.create_cuda_backend(BackendOptions(batch_invariant=True))
    for m, taken in ((1, True), (64, True), (65, False)):
        x = torch.randn((m, 256), generator=gen).to(torch.bfloat16).to(DEV)
        xg = torch.randn((2, m, 256), generator=gen).to(torch.bfloat16).to(DEV)
        for b, expect in ((on, taken), (off, False), (invariant, False)):
            calls.clear()
            y = b.gemm.linear_fp8(x, w, s)
            yg = b.gemm.batched_linear_fp8(xg, wg, sg)
            assert calls == ([m, m] if expect else []), (m, b is on, calls)
            torch.testing.assert_close(y.cpu().double(), fp8_linear_oracle(x, w, s), rtol=0.12, atol=0.12)
            assert yg.shape == (2, m, 128)
            for i in range(2):
                want = fp8_linear_oracle(xg[i], wg[i], sg[i])
                torch.testing.assert_close(yg[i].cpu().double(), want, rtol=0.12, atol=0.12)
    # a weight above the byte limit (each of the 2 groups is under it, the pair is not)
    monkeypatch.setattr(gemm_k, "SKINNY_FP8_MAX_WEIGHT_BYTES", w.numel())
    x = torch.randn((1, 256), generator=gen).to(torch.bfloat16).to(DEV)
    calls.clear()
    y = on.gemm.linear_fp8(x, w, s)
    yg = on.gemm.batched_linear_fp8(x.expand(2, 1, 256), wg, sg)
    assert calls == [1], calls  # the single weight at the limit only
    torch.testing.assert_close(y.cpu().double(), fp8_linear_oracle(x, w, s), rtol=0.12, atol=0.12)
    torch.testing.assert_close(yg[1].cpu().double(), fp8_linear_oracle(x, wg[1], sg[1]), rtol=0.12, atol=0.12)


def mxfp4_experts(
    e: int, dm: int, inter: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from deepinfer.backend import fp4

    p13, s13 = fp4.quantize_weight(torch.randn((e, 2 * inter, dm), generator=gen) * dm**-0.5)
    p2, s2 = fp4.quantize_weight(torch.randn((e, dm, inter), generator=gen) * inter**-0.5)
    return p13.to(DEV), p2.to(DEV), s13.to(DEV), s2.to(DEV)


def clamped_moe_oracle(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w: tuple[torch.Tensor, ...], limit: float
) -> torch.Tensor:
    from deepinfer.backend import fp4

    p13, p2, s13, s2 = (t.cpu() for t in w)
    d13, d2 = fp4.dequantize_weight(p13, s13, torch.float64), fp4.dequantize_weight(p2, s2, torch.float64)
    inter = d2.shape[2]
    out = torch.zeros((x.shape[0], d2.shape[1]), dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = x[t].cpu().double() @ d13[e].T
            a = torch.nn.functional.silu(h[:inter].clamp(max=limit)) * h[inter:].clamp(-limit, limit)
            out[t] += float(weights[t, k]) * (a @ d2[e].T)
    return out


@pytest.mark.parametrize("decode", list(moe_k.FP4_DECODE) if GPU or INTERPRET else ["PAIR"])
def test_decode_moe_mxfp4_with_the_clamped_swiglu(gen: torch.Generator, decode: str) -> None:
    """decode_moe's FP4 flag: MXFP4 w13 / w2 read as GEMV rows (both nibbles of each byte, a scale
    per 32 values; Dm = 96 and I = 80 leave partial steps and scale groups), the clamped SwiGLU
    between, the fused combine; against float64 on the dequantised weights. On a GPU also
    V4-Flash's widths (Dm 4096, I 2048) with the default tiles. Every FP4_DECODE variant (ASM
    as MMA in the interpreter)."""
    limit = 0.6
    sizes = [(6, 96, 80, 3, 2)] + ([(8, 4096, 2048, 2, 6)] if GPU and not INTERPRET else [])
    for e, dm, inter, t, k in sizes:
        w = mxfp4_experts(e, dm, inter, gen)
        x = torch.randn((t, dm), generator=gen).to(torch.bfloat16).to(DEV)
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).int().to(DEV)
        weights = torch.rand((t, k), generator=gen).to(DEV)
        y = moe_k.decode_moe(x, weights, ids, *w, swiglu_limit=limit, fp4_decode=decode)
        want = clamped_moe_oracle(x, weights, ids, w, limit)
        assert y.shape == (t, dm) and y.dtype == torch.bfloat16
        torch.testing.assert_close(y.cpu().double(), want, rtol=3e-2, atol=3e-2 * float(want.abs().max()))
        cfg = dataclasses.replace(moe_k.FP4_DECODE_CONFIG, fused_combine=False)  # the third launch
        y3 = moe_k.decode_moe(x, weights, ids, *w, swiglu_limit=limit, config=cfg, fp4_decode=decode)
        torch.testing.assert_close(y3.cpu().double(), want, rtol=3e-2, atol=3e-2 * float(want.abs().max()))


def test_fused_moe_takes_the_mxfp4_decode_kernels_by_size_and_switch(
    gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CudaMoe.fused_moe on MXFP4 experts: decode_moe up to FP4_DECODE_MAX_COPIES token copies, the
    contract's composition over grouped_gemm_fp4 above it, in batch-invariant mode and with
    DEEPINFER_CUDA_V4_DECODE=0 (whose grouped GEMM then decodes element by element); every path
    within bf16 rounding of float64."""
    calls: list[int] = []
    real = moe_k.decode_moe

    def spy(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(moe_k, "decode_moe", spy)
    e, dm, inter, k, limit = 8, 64, 48, 2, 0.8
    w = mxfp4_experts(e, dm, inter, gen)
    on = cuda_backend.create_cuda_backend(BackendOptions())
    monkeypatch.setenv(envs.CUDA_V4_DECODE.name, "0")
    off = cuda_backend.create_cuda_backend(BackendOptions())
    monkeypatch.delenv(envs.CUDA_V4_DECODE.name)
    invariant = cuda_backend.create_cuda_backend(BackendOptions(batch_invariant=True))
    most = moe_k.FP4_DECODE_MAX_COPIES // k
    for t in (1, most, most + 1):
        x = torch.randn((t, dm), generator=gen).to(torch.bfloat16).to(DEV)
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).int().to(DEV)
        weights = torch.rand((t, k), generator=gen).to(DEV)
        want = clamped_moe_oracle(x, weights, ids, w, limit)
        for b, expect in ((on, t <= most), (off, False), (invariant, False)):
            calls.clear()
            y = b.moe.fused_moe(x, weights, ids, *w[:2], *w[2:], swiglu_limit=limit)
            assert calls == ([t] if expect else []), (t, calls)
            torch.testing.assert_close(y.cpu().double(), want, rtol=3e-2, atol=3e-2 * float(want.abs().max()))


def test_fused_moe_passes_the_fp4_decode_switch(
    gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DEEPINFER_CUDA_FP4_DECODE names one of decode_moe's MXFP4 decodes (the switch's choices are
    FP4_DECODE's names); a backend built with it hands that decode to decode_moe, whose result
    stays within bf16 rounding of float64; an unknown name is an error naming the valid ones.
    Pinned decode tiles (DEEPINFER_CUDA_MOE_DECODE_TILES) set the MXFP4 path's copy limit too."""
    assert envs.CUDA_FP4_DECODE.choices == tuple(moe_k.FP4_DECODE)
    seen: list[str] = []
    real = moe_k.decode_moe

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(kwargs["fp4_decode"])
        return real(*args, **kwargs)

    monkeypatch.setattr(moe_k, "decode_moe", spy)
    e, dm, inter, t, k, limit = 6, 64, 48, 2, 2, 0.8
    w = mxfp4_experts(e, dm, inter, gen)
    x = torch.randn((t, dm), generator=gen).to(torch.bfloat16).to(DEV)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).int().to(DEV)
    weights = torch.rand((t, k), generator=gen).to(DEV)
    want = clamped_moe_oracle(x, weights, ids, w, limit)
    monkeypatch.setenv(envs.CUDA_FP4_DECODE.name, "group")
    moe = cuda_backend.create_cuda_backend(BackendOptions()).moe
    y = moe.fused_moe(x, weights, ids, *w, swiglu_limit=limit)
    assert seen == ["GROUP"]
    torch.testing.assert_close(y.cpu().double(), want, rtol=3e-2, atol=3e-2 * float(want.abs().max()))
    with pytest.raises(ValueError, match="PAIR"):
        real(x, weights, ids, *w, swiglu_limit=limit, fp4_decode="NIBBLE")
    # pinned decode tiles carry their copy limit to the MXFP4 path too (past FP4_DECODE_MAX_COPIES)
    t = moe_k.FP4_DECODE_MAX_COPIES // k + 1
    x = torch.randn((t, dm), generator=gen).to(torch.bfloat16).to(DEV)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).int().to(DEV)
    weights = torch.rand((t, k), generator=gen).to(DEV)
    monkeypatch.setenv(envs.CUDA_MOE_DECODE_TILES.name, f"32,64,4,3,32,64,4,3,1,{t * k}")
    seen.clear()
    y = cuda_backend.create_cuda_backend(BackendOptions()).moe.fused_moe(
        x, weights, ids, *w, swiglu_limit=limit
    )
    assert seen == ["GROUP"]
    want = clamped_moe_oracle(x, weights, ids, w, limit)
    torch.testing.assert_close(y.cpu().double(), want, rtol=3e-2, atol=3e-2 * float(want.abs().max()))


def _varlen_f64(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], scale: float
) -> torch.Tensor:
    """Bidirectional attention inside each segment, float64, written out per segment and head."""
    out, at = torch.zeros((*q.shape[:2], v.shape[-1]), dtype=torch.float64), 0
    for n in lens:
        for h in range(q.shape[1] if n else 0):
            s = q[at : at + n, h].double() @ k[at : at + n, h].double().T * scale
            out[at : at + n, h] = torch.softmax(s, dim=-1) @ v[at : at + n, h].double()
        at += n
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,d", [([1, 64, 0, 65], 64), ([130, 3], 40)])
def test_varlen_attention_against_float64(
    gen: torch.Generator, dtype: torch.dtype, lens: list[int], d: int
) -> None:
    """Segments of one row, exactly one tile, one row past a tile, several key tiles, an empty
    segment; q, k, v strided slices of one qkv buffer; D not a power of two."""
    t, h = sum(lens), 2
    qkv = (torch.randn((t, 3, h, d), generator=gen) * 1.5).to(dtype).to(DEV)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    got = vision_k.varlen_attention(q, k, v, cu, max(lens), d**-0.5)
    assert got.shape == (t, h, d) and got.dtype == dtype
    want = _varlen_f64(q.cpu(), k.cpu(), v.cpu(), lens, d**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu().double(), want, rtol=tol, atol=tol)
    # the last segment alone gives the same bits as among the others (no state across segments)
    a, n = t - lens[-1], lens[-1]
    last = torch.tensor([0, n], dtype=torch.int32, device=DEV)
    alone = vision_k.varlen_attention(q[a:], k[a:], v[a:], last, n, d**-0.5)
    assert_bitwise_equal(alone, got[a:], what="segment alone vs among others")


def test_varlen_attention_bad_input() -> None:
    x = torch.zeros((4, 2, 16), device=DEV)
    cu = torch.tensor([0, 4], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="dtype"):
        vision_k.varlen_attention(x, x, x.double(), cu, 4, 1.0)
    with pytest.raises(ValueError, match="stride"):
        vision_k.varlen_attention(x.transpose(1, 2).contiguous().transpose(1, 2), x, x, cu, 4, 1.0)
    assert vision_k.varlen_attention(x[:0], x[:0], x[:0], cu[:1], 0, 1.0).shape == (0, 2, 16)


def test_vision_tower_on_the_cuda_backend(tmp_path: Any) -> None:
    """DeepSeek-V4.1's tower (models.vision) over the cuda backend's ops (the varlen kernel on
    the strided q / k / v the tower passes, rope, norms, biased GEMMs) against the float64
    vision oracle: two images of other aspect ratios in one pass, float32."""
    from safetensors.torch import save_file

    from deepinfer.models.config_v41 import parse_vision
    from deepinfer.models.loader import CheckpointReader
    from deepinfer.models.vision import VisionModel
    from deepinfer.testing.v41_checkpoint import TINY_VISION, random_v41_tensors, tiny_v41_config
    from deepinfer.testing.vision_oracle import VisionOracle

    raw = tiny_v41_config(vision=True, hidden=24)
    raw["vision_config"] = dict(TINY_VISION, hidden_size=32, num_heads=2)  # heads of 16
    tensors = {
        k: t for k, t in random_v41_tensors(raw, 4).items() if k.startswith(("vision.", "aligner.", "image_"))
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    v = parse_vision(raw["vision_config"])
    assert v is not None
    model = VisionModel(cuda_backend.create_cuda_backend(BackendOptions()), v, 24, torch.float32)
    model.load(CheckpointReader(tmp_path, DEV, allow_fp8=False, backend_name="cuda"), "")
    g = torch.Generator().manual_seed(0)
    images = [
        torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8) for h, w in ((56, 84), (84, 28))
    ]
    oracle = VisionOracle(raw, tensors)
    for got, image in zip(model.encode([im.to(DEV) for im in images]), images):
        torch.testing.assert_close(got.cpu().double(), oracle.span(image), rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- FP8 latent caches


def fp8_paged(
    seq_lens: list[int], query_lens: list[int], lat: int, rope: int, bs: int, gen: torch.Generator
) -> tuple[torch.Tensor, AttentionMetadata, list[torch.Tensor]]:
    """paged()'s pool stored as FP8 latent rows by the kernel (kv_fp8.write_fp8_rows), and each
    request's rows as the format keeps them in float64 (oracles.e4m3_rows64, not the kernel's)."""
    from deepinfer_cuda.kernels import kv_fp8

    from deepinfer.backend.kv_formats_mla import fp8_row_bytes, fp8_tile
    from deepinfer.testing.oracles import e4m3_rows64

    pool, meta, rows = paged(seq_lens, query_lens, lat + rope, bs, gen)
    nb = pool.shape[0]
    fp8 = torch.zeros((nb, bs, fp8_row_bytes(lat, rope)), dtype=torch.uint8, device=DEV)
    kv_fp8.write_fp8_rows(
        fp8, pool.view(-1, lat + rope).to(DEV), torch.arange(nb * bs, device=DEV), lat, rope
    )
    kept = e4m3_rows64(lat, fp8_tile(lat))
    return fp8, meta, [kept(r.double()) for r in rows]


@pytest.mark.parametrize(("lat", "rope", "dtype"), [(256, 16, torch.bfloat16), (24, 8, torch.float32)])
def test_fp8_rows_store_is_the_format(gen: torch.Generator, lat: int, rope: int, dtype: torch.dtype) -> None:
    """The quantising store against the format's definition (kv_formats_mla.quantize_mla_rows):
    the same values bit for bit (a value rounding to zero may keep its sign in one and not the
    other), tiles of very different magnitudes, an all-zero tile, padding slots untouched."""
    from deepinfer_cuda.kernels import kv_fp8

    from deepinfer.backend.kv_formats_mla import dequantize_mla_rows, fp8_row_bytes, quantize_mla_rows

    t = 11
    mag = torch.exp2(torch.randint(-14, 9, (t, lat + rope), generator=gen).float())
    kv = (torch.randn((t, lat + rope), generator=gen) * mag).to(dtype)
    kv[2, : min(lat, 128)] = 0
    cache = torch.full((4, 4, fp8_row_bytes(lat, rope)), 7, dtype=torch.uint8, device=DEV)
    slots = torch.tensor([3, -1, 0, 15, 7, 8, -1, 1, 2, 12, 4])
    wide = torch.cat([kv, kv[:, :3]], dim=1)[:, : lat + rope]  # a strided view
    kv_fp8.write_fp8_rows(cache, wide.to(DEV), slots.to(DEV), lat, rope)
    flat = cache.view(-1, cache.shape[-1]).cpu()
    keep = slots >= 0
    got = dequantize_mla_rows(flat[slots[keep]], lat, rope)
    want = dequantize_mla_rows(quantize_mla_rows(kv[keep], lat), lat, rope)
    bad = got != want  # == : a zero's sign may differ, nothing else
    assert not bad.any(), (
        f"FP8 row store: {int(bad.sum())} values differ, the first at {bad.nonzero()[0].tolist()}"
    )
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert (flat[untouched] == 7).all(), "padding rows were written"
    with pytest.raises(ValueError, match="FP8 rows take"):
        kv_fp8.write_fp8_rows(cache, kv[:, :-2].to(DEV), slots.to(DEV), lat, rope - 2)


@pytest.mark.parametrize(("window", "scale_tiles"), [(None, True), (40, True), (None, False)])
def test_fp8_decode_with_many_splits(
    gen: torch.Generator, monkeypatch: pytest.MonkeyPatch, window: int | None, scale_tiles: bool
) -> None:
    """Decode over FP8 rows dequantised in registers (two tiles: scales broadcast per tile, or
    loaded per value), in several KV splits and the combine, with V the latent and V a prefix of
    it: the float64 attention over the rows the format keeps."""
    monkeypatch.setattr(attn_k, "FP8_SCALE_TILES", scale_tiles)
    assert attn_k._fp8_tiles(256, 128) == (2 if scale_tiles else 0)
    seq = [1, 33, 80, 150]
    lat, rope, h = 256, 16, 4
    pool, meta, rows = fp8_paged(seq, [1] * len(seq), lat, rope, 16, gen)
    q = torch.randn((len(seq), h, lat + rope), generator=gen)
    sk = torch.randn(h, generator=gen)
    for dv in (lat, 64):
        out = attn_k.mla_attention(
            q.to(DEV), pool, meta, scale=0.1, v_dim=dv, latent_dim=lat, window=window, sinks=sk.to(DEV),
            config=small_config(), split_size=32, fp8_tile=128,
        )  # fmt: skip
        expected = oracle_attention(q, rows, seq, [1] * len(seq), 0.1, dv, window, sk)
        torch.testing.assert_close(out.cpu().double(), expected, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("split_size", [16, None], ids=["fixed_splits", "adaptive_splits"])
def test_fp8_decode_many_requests_over_poisoned_rows(gen: torch.Generator, split_size: int | None) -> None:
    """A decode batch's structure at small sizes: many requests, keys long against the 16-key tile
    and page, many KV splits (empty ones for the short requests) and the combine, over an FP8 pool
    whose unwritten rows and unused blocks (the table's padding points at one) are 0xFF bytes: NaN
    e4m3 values, NaN scales, NaN rope. No NaN may reach the output: the float64 oracle."""
    from deepinfer_cuda.kernels import kv_fp8

    from deepinfer.backend.kv_formats_mla import fp8_row_bytes
    from deepinfer.testing.oracles import e4m3_rows64

    seq = [1, 16, 47, 64, 100, 130, 200, 33]
    lat, rope, h, bs = 128, 16, 2, 16
    pool, meta, rows = paged(seq, [1] * len(seq), lat + rope, bs, gen)
    table = meta.block_tables.cpu().clone()
    used = [table[b, : -(-n // bs)].clone() for b, n in enumerate(seq)]
    spare = min(set(range(pool.shape[0])) - set(torch.cat(used).tolist()))  # paged() leaves two unused
    for b, n in enumerate(seq):
        table[b, -(-n // bs) :] = spare
    slots = torch.cat(
        [u.long()[torch.arange(n) // bs] * bs + torch.arange(n) % bs for u, n in zip(used, seq)]
    )
    fp8 = torch.full((pool.shape[0], bs, fp8_row_bytes(lat, rope)), 0xFF, dtype=torch.uint8, device=DEV)
    kv_fp8.write_fp8_rows(fp8, torch.cat(rows).to(DEV), slots.to(DEV), lat, rope)
    meta = AttentionMetadata.build(table.to(DEV), seq, [1] * len(seq))
    q = torch.randn((len(seq), h, lat + rope), generator=gen)
    out = attn_k.mla_attention(
        q.to(DEV), fp8, meta, scale=0.1, v_dim=lat, latent_dim=lat, config=small_config(),
        split_size=split_size, fp8_tile=128,
    )  # fmt: skip
    assert torch.isfinite(out).all(), "NaN from an unwritten row or an empty split"
    kept = e4m3_rows64(lat, 128)
    expected = oracle_attention(q, [kept(r.double()) for r in rows], seq, [1] * len(seq), 0.1, lat)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize(
    ("split_size", "tma"),
    [(32, False), (None, False), (32, True)],
    ids=["fixed_splits", "adaptive_splits", "tma"],
)
def test_fp8_float16_read_across_magnitudes(
    gen: torch.Generator, monkeypatch: pytest.MonkeyPatch, split_size: int | None, tma: bool
) -> None:
    """The float16 read of FP8 rows (bfloat16 queries, V the latent: kv_fp8.load_fp8_latent_half)
    where float16 cannot hold the values themselves: tile scales from 2^-30 to 2^14 that grow
    along each request (the reference scale rises within a split, its accumulator rescaled), a
    tile 2^-20 below its neighbours, query heads from 2^-24 to 2^12. Against the float64
    attention over the rows the format keeps, and no worse than the bfloat16 read's error. tma: the
    latent bytes of whole tiles by TMA (attention.FP8_TMA), a request's last partial tile by pointers."""
    from deepinfer_cuda.kernels import kv_fp8

    from deepinfer.backend.kv_formats_mla import fp8_row_bytes
    from deepinfer.testing.oracles import e4m3_rows64

    seq = [3, 70, 150, 41]
    lat, rope, h, bs = 256, 20, 4, 16  # rows of 304 bytes: 16-byte multiples, as TMA needs
    monkeypatch.setattr(attn_k, "FP8_HALF_READ", True)
    assert attn_k._fp8_half(attn_k._fp8_tiles(lat, 128), torch.bfloat16, lat, lat)
    pool, meta, _ = paged(seq, [1] * len(seq), lat + rope, bs, gen)
    table = meta.block_tables.cpu()
    rows = []
    for n in seq:
        x = torch.randn((n, lat + rope), generator=gen)
        grow = torch.linspace(-30, 14, n).round()[:, None]  # each row's tile exponents rise with position
        x[:, :lat] *= torch.exp2(grow + torch.randint(-3, 4, (n, 2), generator=gen)).repeat_interleave(128, 1)
        x[::5, 128:lat] *= 2.0**-20  # one tile far below the row's other
        rows.append(x.to(torch.bfloat16).float())
    slots = torch.cat(
        [table[b].long()[torch.arange(n) // bs] * bs + torch.arange(n) % bs for b, n in enumerate(seq)]
    )
    fp8 = torch.zeros((pool.shape[0], bs, fp8_row_bytes(lat, rope)), dtype=torch.uint8, device=DEV)
    kv_fp8.write_fp8_rows(fp8, torch.cat(rows).to(DEV), slots.to(DEV), lat, rope)
    q = torch.randn((len(seq), h, lat + rope), generator=gen)
    q *= torch.exp2(torch.tensor([-24.0, 0.0, 12.0, -6.0]))[None, :, None]
    q[:, 2, :lat] *= 2.0**-16  # this head's scores come from the rope part mostly
    q = q.to(torch.bfloat16)
    kept = e4m3_rows64(lat, 128)
    # the scale keeps the softmax away from one-hot: scores of rows near 2^14 at the ends
    scale = 2.0**-22
    expected = oracle_attention(q.double(), [kept(r.double()) for r in rows], seq, [1] * len(seq), scale, lat)
    monkeypatch.setattr(attn_k, "FP8_TMA", tma)
    if tma:
        assert attn_k._fp8_descriptor(fp8, lat, small_config()) is not None
    errors = {}
    for half in (True, False):
        monkeypatch.setattr(attn_k, "FP8_HALF_READ", half)
        out = attn_k.mla_attention(
            q.to(DEV), fp8, meta, scale=scale, v_dim=lat, latent_dim=lat, config=small_config(),
            split_size=split_size, fp8_tile=128,
        ).cpu().double()  # fmt: skip
        assert torch.isfinite(out).all()
        # each (token, head) row against its own magnitude: outputs span 2^-30 .. 2^14 per column tile
        for t0 in (0, 128):
            want, got = expected[..., t0 : t0 + 128], out[..., t0 : t0 + 128]
            mag = want.abs().amax(-1, keepdim=True)
            rel = ((got - want).abs() / mag).amax()
            assert rel < 1e-2, f"half={half}: columns {t0}+ off by {float(rel):.2e} of their row's largest"
            errors[half, t0] = float(rel)
    for t0 in (0, 128):
        assert errors[True, t0] <= 2 * errors[False, t0] + 1e-3, errors


def test_fp8_prefill_and_adaptive_splits(gen: torch.Generator) -> None:
    """Chunked prefill rows over FP8 rows of a narrow latent (one tile of 24), adaptive splits,
    bfloat16 queries; and a cache that is not FP8 rows of q's widths is refused."""
    seq, ql = [70, 9], [20, 9]
    lat, rope, h = 24, 8, 3
    pool, meta, rows = fp8_paged(seq, ql, lat, rope, 16, gen)
    q = torch.randn((sum(ql), h, lat + rope), generator=gen).to(torch.bfloat16)
    out = attn_k.mla_attention(
        q.to(DEV), pool, meta, scale=0.2, v_dim=lat, latent_dim=lat, config=small_config(), fp8_tile=24
    )
    expected = oracle_attention(q.double(), rows, seq, ql, 0.2, lat)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=2.5e-2, atol=2.5e-2)
    with pytest.raises(ValueError, match="FP8 rows take"):
        attn_k.mla_attention(
            q.to(DEV), pool[..., :-2], meta, scale=0.2, v_dim=lat, latent_dim=lat, fp8_tile=24
        )


@pytest.mark.parametrize("half", [False, True], ids=["bf16_read", "float16_read"])
def test_fp8_cache_through_the_backend(
    gen: torch.Generator, monkeypatch: pytest.MonkeyPatch, half: bool
) -> None:
    """The backend's FP8 path end to end: write_mla_kv (norm, rope, the quantising store), then
    decode and mla_decode_and_uv reading the rows (in bfloat16, or in float16 with
    DEEPINFER_CUDA_FP8_HALF_READ=1, which the backend reads when it is created); the V4 ops refuse
    an FP8 cache by name."""
    from deepinfer.testing.oracles import e4m3_rows64

    if half:
        monkeypatch.setenv(envs.CUDA_FP8_HALF_READ.name, "1")
    halves: list[int] = []  # launches of the float16 read's queries
    real = attn_k.half_query_rows
    monkeypatch.setattr(attn_k, "half_query_rows", lambda *a: halves.append(1) or real(*a))
    be = cuda_backend.create_cuda_backend(BackendOptions())
    monkeypatch.delenv(envs.CUDA_FP8_HALF_READ.name, raising=False)  # the backend keeps what it read
    assert be.capabilities.supports_fp8_kv_cache
    lat, rope, h, bs = 128, 16, 4, 16
    seq = [5, 40]
    spec = KVCacheSpec(6, bs, lat, rope, torch.bfloat16, "fp8")
    cache = be.kv_cache.allocate(spec, 1)[0]
    assert cache.tensors[0].dtype == torch.uint8 and cache.tensors[0].shape == (6, bs, spec.bytes_per_token)
    table = torch.tensor([[4, 0, 0], [1, 5, 2]], dtype=torch.int32)
    slots = torch.cat(
        [table[b].long()[torch.arange(n) // bs] * bs + torch.arange(n) % bs for b, n in enumerate(seq)]
    )
    kv = torch.randn((sum(seq), lat + rope), generator=gen).to(torch.bfloat16)
    w = torch.ones(lat, dtype=torch.bfloat16)
    cs = torch.cat([torch.ones(64, rope // 2), torch.zeros(64, rope // 2)], dim=1)  # rope at angle 0
    be.kv_cache.write_mla_kv(
        cache, kv.to(DEV), w.to(DEV), 1e-6, torch.zeros(sum(seq), dtype=torch.long, device=DEV), cs.to(DEV),
        False, slots.to(DEV),
    )  # fmt: skip
    # the stored rows: the format's of the normalised rows, an e4m3 step apart at most where the
    # backend's bf16 norm rounds a value across a rounding midpoint
    normed = ref_small.rms_norm(kv[:, :lat].float(), w.float(), 1e-6)
    rows64 = e4m3_rows64(lat, 128)(torch.cat([normed, kv[:, lat:].float()], dim=1).double())
    stored = be.kv_cache.read_kv(cache, slots.to(DEV)).cpu().double()
    assert ((stored - rows64).abs() <= 2.0**-3 * rows64.abs() + 1e-6).all()
    rows = [stored[: seq[0]], stored[seq[0] :]]
    meta = AttentionMetadata.build(table.to(DEV), seq, [1, 1])
    q = torch.randn((2, h, lat + rope), generator=gen).to(torch.bfloat16)
    out = be.attention.decode(q.to(DEV), cache, meta, scale=0.1, v_dim=lat)
    torch.testing.assert_close(
        out.cpu().double(),
        oracle_attention(q.double(), rows, seq, [1, 1], 0.1, lat),
        rtol=2.5e-2,
        atol=2.5e-2,
    )
    w_uv = torch.randn((h, 8, lat), generator=gen).to(torch.bfloat16)
    uv = be.attention.mla_decode_and_uv(q.to(DEV), cache, meta, w_uv.to(DEV), scale=0.1, v_dim=lat)
    want = torch.einsum("bhv,hov->bho", out.cpu().double(), w_uv.double())
    torch.testing.assert_close(uv.cpu().double(), want, rtol=2.5e-2, atol=2.5e-2 * float(want.abs().max()))
    assert len(halves) == (2 if half else 0), "decode and mla_decode_and_uv: the read the switch asks for"
    with pytest.raises(ValueError, match="does not read FP8 latent caches"):
        cache_tensor(cache)


def _v41_rows(t: int, w: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """(t, w) rows for the V4.1 row stores: blocks of 16 values at magnitudes 2^-14 .. 2^8, an
    all-zero row head, a tiny block, negative zeros, and rows of e2m1 midpoints (ties) at a
    power-of-two scale (every format's blocks) and at the e4m3 scale 0.75 (fp4's blocks)."""
    mag = torch.exp2(torch.randint(-14, 9, (t, w // 16), generator=gen).float()).repeat_interleave(16, dim=1)
    x = torch.randn((t, w), generator=gen) * mag
    x[1, :32] = 0.0
    x[1, 32:48] = -0.0
    x[2, :32] *= 1e-30
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)
    ties[1::2] *= -1
    x[3] = ties.repeat(w // 32) * 2.0**-3  # amax 6 * 2^-3 in every block: scale 2^-3 (fp4: e4m3)
    x[4] = ties.repeat(w // 32) * 0.75  # fp4: the e4m3 scale 0.75, not a power of two
    return x.to(dtype)


@pytest.mark.parametrize(
    ("fmt", "w", "dtype"),
    [("fp8", 512, torch.bfloat16), ("fp4", 512, torch.bfloat16), ("mxfp4", 128, torch.bfloat16),
     ("fp8", 32, torch.float32), ("fp4", 32, torch.float32), ("mxfp4", 32, torch.float32)],
)  # fmt: skip
def test_v41_row_stores_are_the_reference_quantiser(
    gen: torch.Generator, monkeypatch: pytest.MonkeyPatch, fmt: str, w: int, dtype: torch.dtype
) -> None:
    """DeepSeek-V4.1's fused quantise + store (kernels/kv_v41.py; the published widths in
    bfloat16, one or two scale blocks in float32) writes the bytes kv_formats_v41.quantize_rows
    gives, bit for bit, from a strided view: e2m1 ties to the even code, zero and tiny blocks,
    negative zeros; slot -1 skips a row and the rows no slot names keep their bytes. Through the
    backend's write_kv_rows too, and its unfused switch."""
    from deepinfer.backend import kv_formats_v41 as kvf

    t = 9
    x = _v41_rows(t, w, dtype, gen)
    wide = torch.cat([x, x[:, :5]], dim=1)[:, :w]  # a strided view
    row = kvf.row_bytes(fmt, w)  # type: ignore[arg-type]
    slots = torch.tensor([3, -1, 0, 15, 7, 8, 1, 2, 12])
    keep = slots >= 0
    want = kvf.quantize_rows(x[keep], fmt)  # type: ignore[arg-type]
    cache = torch.full((4, 4, row), 0xA5, dtype=torch.uint8, device=DEV)
    kv_v41.write_kv_rows(cache, wide.to(DEV), slots.to(DEV), fmt)  # type: ignore[arg-type]
    flat = cache.view(-1, row).cpu()
    bad = flat[slots[keep]] != want
    assert not bad.any(), f"{fmt}: {int(bad.sum())} bytes differ, the first at {bad.nonzero()[0].tolist()}"
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert (flat[untouched] == 0xA5).all(), "rows no slot names were written"
    spec = KVCacheSpec(4, 4, row, 0, torch.uint8)
    for unfused in ("0", "1"):
        monkeypatch.setenv(envs.CUDA_UNFUSED.name, unfused)
        backend = cuda_backend.create_cuda_backend(BackendOptions())
        assert backend.kv_cache.fused == (unfused == "0")
        cache = PagedKVCache(spec, (torch.zeros((4, 4, row), dtype=torch.uint8, device=DEV),))
        backend.kv_cache.write_kv_rows(cache, wide.to(DEV), slots.to(DEV), fmt)  # type: ignore[arg-type]
        assert torch.equal(cache.tensors[0].view(-1, row).cpu()[slots[keep]], want), unfused
    with pytest.raises(ValueError, match="take"):
        kv_v41.write_kv_rows(cache.tensors[0], x[:, :-32].to(DEV), slots.to(DEV), fmt)  # type: ignore[arg-type]


def test_index_queries_round_in_registers_as_the_reference() -> None:
    """kv_v41.round_mxfp4 (the FP4 indexer's queries in the score kernels) against
    kv_formats_v41.round_index_queries bit for bit: 3 heads (padded to 16 rows) of 64 values,
    magnitudes 2^-20 .. 2^20, an all-zero head, ties at the e2m1 midpoints."""
    from deepinfer.backend import kv_formats_v41 as kvf

    gen = torch.Generator().manual_seed(5)
    mag = torch.exp2(torch.randint(-20, 21, (3, 2), generator=gen).float()).repeat_interleave(32, dim=1)
    q = torch.randn((3, 64), generator=gen) * mag
    q[1] = 0.0
    q[2, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4) * 2.0**-7
    y = torch.empty_like(q, device=DEV)
    _round_mxfp4_probe[(1,)](q.to(DEV), y, 3, ROWS=16, COLS=64)
    want = kvf.round_index_queries(q, "mxfp4")
    assert torch.equal(y.cpu(), want), (y.cpu() - want).abs().max()
