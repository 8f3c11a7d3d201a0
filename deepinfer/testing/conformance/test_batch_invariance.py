"""Batch invariance: a row's result is BITWISE the same alone and inside a larger batch.

Runs only for backends whose capabilities claim it, created with batch_invariant=True. The
batched result is also compared with the float64 reference: batch-invariant mode often runs
other kernels (fixed tiles, always-split attention), which must be right as well as invariant.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.backend.ops import Backend
from deepinfer.backend.types import AttentionMetadata, AttentionModifiers, RouterConfig
from deepinfer.reference import attention as ref_attention
from deepinfer.reference import gemm as ref_gemm
from deepinfer.reference import moe as ref_moe
from deepinfer.reference import small as ref_small
from deepinfer.testing.helpers import make_paged_batch, mxfp4_weight, oracle, randn, request_rows
from deepinfer.testing.tolerances import assert_bitwise_equal, assert_close

ROWS = [0, 5, 16]  # rows checked alone


def test_linear(invariant_backend: Backend, dtype: torch.dtype, gen: torch.Generator) -> None:
    dev = invariant_backend.device.device()
    x = randn((33, 200), dtype, dev, gen)
    w = randn((130, 200), dtype, dev, gen, 200**-0.5)
    b = randn((130,), dtype, dev, gen)
    full = invariant_backend.gemm.linear(x, w, b)
    assert_close(full, ref_gemm.linear(oracle(x), oracle(w), oracle(b), False), dtype, what="linear")
    for i in ROWS:
        alone = invariant_backend.gemm.linear(x[i : i + 1], w, b)
        assert_bitwise_equal(alone, full[i : i + 1], what=f"linear row {i}")
    part = invariant_backend.gemm.linear(x[:7], w, b)
    assert_bitwise_equal(part, full[:7], what="linear first 7 rows")


def test_batched_linear(invariant_backend: Backend, dtype: torch.dtype, gen: torch.Generator) -> None:
    dev = invariant_backend.device.device()
    x = randn((33, 4, 96), dtype, dev, gen).transpose(0, 1)  # (G, M, K) view of (M, G, K)
    w = randn((4, 80, 96), dtype, dev, gen, 96**-0.5)
    full = invariant_backend.gemm.batched_linear(x, w)
    assert_close(full, ref_gemm.batched_linear(oracle(x), oracle(w)), dtype, what="batched_linear")
    for i in ROWS:
        alone = invariant_backend.gemm.batched_linear(x[:, i : i + 1], w)
        assert_bitwise_equal(alone, full[:, i : i + 1], what=f"batched_linear row {i}")


def test_mla_query(invariant_backend: Backend, dtype: torch.dtype, gen: torch.Generator) -> None:
    """80 rows (past the decode sizes, where a backend may pick other tiles) and each alone."""
    dev = invariant_backend.device.device()
    t, h, n, c, r = 80, 4, 96, 80, 16
    q = randn((t, h, n + r), dtype, dev, gen)
    q_nope, q_pe = q[..., :n], q[..., n:]
    w_uk = randn((h, c, n), dtype, dev, gen, n**-0.5)
    positions = torch.randint(0, 500, (t,), generator=gen)
    inv = 1.0 / 10000.0 ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
    ang = torch.arange(500, dtype=torch.float64)[:, None] * inv[None, :]
    table = torch.cat([ang.cos(), ang.sin()], dim=-1).float()
    full = invariant_backend.attention.mla_query(q_nope, q_pe, w_uk, positions.to(dev), table.to(dev), True)
    latent = ref_gemm.batched_linear(oracle(q_nope).transpose(0, 1), oracle(w_uk)).transpose(0, 1)
    rotated = ref_small.rope(oracle(q_pe), positions, table.double(), True)
    assert_close(full, torch.cat([latent, rotated], dim=-1), dtype, what="mla_query")
    for i in [*ROWS, 79]:
        alone = invariant_backend.attention.mla_query(
            q_nope[i : i + 1], q_pe[i : i + 1], w_uk, positions[i : i + 1].to(dev), table.to(dev), True
        )
        assert_bitwise_equal(alone, full[i : i + 1], what=f"mla_query row {i}")


def test_rms_norm(invariant_backend: Backend, dtype: torch.dtype, gen: torch.Generator) -> None:
    dev = invariant_backend.device.device()
    x = randn((33, 257), dtype, dev, gen)
    res = randn((33, 257), dtype, dev, gen)
    w = randn((257,), dtype, dev, gen)
    y, h = invariant_backend.small.add_rms_norm(x, res, w, 1e-6)
    ry, rh = ref_small.add_rms_norm(oracle(x), oracle(res), oracle(w), 1e-6)
    assert_close(y, ry, dtype, what="add_rms_norm y")
    assert_close(h, rh, dtype, what="add_rms_norm h")
    plain = invariant_backend.small.rms_norm(x, w, 1e-6)
    assert_close(plain, ref_small.rms_norm(oracle(x), oracle(w), 1e-6), dtype, what="rms_norm")
    for i in ROWS:
        yi, hi = invariant_backend.small.add_rms_norm(x[i : i + 1], res[i : i + 1], w, 1e-6)
        assert_bitwise_equal(yi, y[i : i + 1], what=f"add_rms_norm row {i}")
        assert_bitwise_equal(hi, h[i : i + 1], what=f"add_rms_norm residual row {i}")
        pi = invariant_backend.small.rms_norm(x[i : i + 1], w, 1e-6)
        assert_bitwise_equal(pi, plain[i : i + 1], what=f"rms_norm row {i}")


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_attention(
    invariant_backend: Backend, dtype: torch.dtype, gen: torch.Generator, decode: bool
) -> None:
    seq = [1, 40, 129, 64, 17]
    qlen = [1] * 5 if decode else [1, 13, 60, 64, 2]
    be = invariant_backend
    batch = make_paged_batch(
        be, seq_lens=seq, query_lens=qlen, block_size=16, head_dim=576, dtype=dtype, gen=gen, rope_dim=64
    )
    q = randn((batch.num_tokens, 4, 576), dtype, be.device.device(), gen)
    op = be.attention.decode if decode else be.attention.prefill
    full = op(q, batch.cache, batch.meta, scale=576**-0.5, v_dim=512)
    expected = ref_attention.paged_attention(oracle(q), batch.ref_cache, batch.ref_meta, 576**-0.5, 512)
    assert_close(full, expected, dtype, what="attention")
    for b in range(len(seq)):
        rows = request_rows(batch.meta, b)
        meta = AttentionMetadata.build(batch.meta.block_tables[b : b + 1], [seq[b]], [qlen[b]])
        alone = op(q[rows], batch.cache, meta, scale=576**-0.5, v_dim=512)
        assert_bitwise_equal(alone, full[rows], what=f"attention request {b}")


def test_fused_moe(invariant_backend: Backend, dtype: torch.dtype, gen: torch.Generator) -> None:
    dev = invariant_backend.device.device()
    tokens, experts, top_k, dm, inter = 17, 8, 3, 64, 40
    x = randn((tokens, dm), dtype, dev, gen)
    w13 = randn((experts, 2 * inter, dm), dtype, dev, gen, dm**-0.5)
    w2 = randn((experts, dm, inter), dtype, dev, gen, inter**-0.5)
    ids = (
        torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
        .to(torch.int32)
        .to(dev)
    )
    weights = torch.rand((tokens, top_k), generator=gen).to(dev)
    full = invariant_backend.moe.fused_moe(x, weights, ids, w13, w2)
    x_sorted, src_to_dst, counts = ref_moe.permute(oracle(x), ids.cpu(), experts)
    h = ref_moe.experts(x_sorted, counts, oracle(w13), oracle(w2))
    assert_close(full, ref_moe.unpermute(h, src_to_dst, oracle(weights)), dtype, what="fused_moe")
    for i in ROWS:
        alone = invariant_backend.moe.fused_moe(x[i : i + 1], weights[i : i + 1], ids[i : i + 1], w13, w2)
        assert_bitwise_equal(alone, full[i : i + 1], what=f"fused_moe row {i}")


def test_select_experts(invariant_backend: Backend, dtype: torch.dtype, gen: torch.Generator) -> None:
    """The whole router over 70 tokens (past any decode-sized path) and a row alone: same bits."""
    dev = invariant_backend.device.device()
    config = RouterConfig(
        "sigmoid", top_k=4, num_groups=4, topk_groups=2, group_score="top2_sum", renormalize=True,
        routed_scaling_factor=2.5, shared_experts=1,
    )  # fmt: skip
    x = randn((70, 96), dtype, dev, gen)
    gate = randn((32, 96), torch.float32, dev, gen, 96**-0.5)
    bias = randn((32,), torch.float32, dev, gen, 0.1)
    full = invariant_backend.moe.select_experts(x, gate, config, bias)
    for i in ROWS:
        alone = invariant_backend.moe.select_experts(x[i : i + 1], gate, config, bias)
        for a, f, what in zip(alone, full, ("weights", "ids"), strict=True):
            assert_bitwise_equal(a, f[i : i + 1], what=f"select_experts {what} row {i}")


def test_decode_long(invariant_backend: Backend, dtype: torch.dtype, gen: torch.Generator) -> None:
    """Past 1024 keys (where fixed-split kernels split the KV axis), with a window and sinks."""
    seq, qlen, decode = [1060, 7], [1, 1], True
    be = invariant_backend
    batch = make_paged_batch(
        be, seq_lens=seq, query_lens=qlen, block_size=32, head_dim=20, dtype=dtype, gen=gen, rope_dim=4
    )
    dev = be.device.device()
    q = randn((batch.num_tokens, 2, 20), dtype, dev, gen)
    sinks = randn((2,), torch.float32, dev, gen)
    op = be.attention.decode if decode else be.attention.prefill
    mods = AttentionModifiers(window=1050, sinks=sinks)
    full = op(q, batch.cache, batch.meta, scale=20**-0.5, v_dim=16, modifiers=mods)
    expected = ref_attention.paged_attention(
        oracle(q), batch.ref_cache, batch.ref_meta, 20**-0.5, 16, AttentionModifiers(1050, oracle(sinks))
    )
    assert_close(full, expected, dtype, what="attention")
    for b in range(len(seq)):
        rows = request_rows(batch.meta, b)
        meta = AttentionMetadata.build(batch.meta.block_tables[b : b + 1], [seq[b]], [qlen[b]])
        alone = op(q[rows], batch.cache, meta, scale=20**-0.5, v_dim=16, modifiers=mods)
        assert_bitwise_equal(alone, full[rows], what=f"attention request {b}")


def test_attention_rows_the_same_in_any_step(
    short_invariant_backend: Backend, dtype: torch.dtype, gen: torch.Generator
) -> None:
    """One request's rows from a whole-prompt prefill, from a later chunk of it, and as one-token
    decode steps, beside another request or alone: the same bits (a request prefilled in other
    chunks, or recomputed after preemption, keeps its tokens), with max_model_len = 192. Latent
    64 + rope 16: power-of-two widths, as MLA's 512 + 64."""
    be, n = short_invariant_backend, 150
    dev = be.device.device()
    batch = make_paged_batch(
        be, seq_lens=[n, 90], query_lens=[n, 1], block_size=16, head_dim=80, dtype=dtype, gen=gen,
        rope_dim=16,
    )  # fmt: skip
    q = randn((batch.num_tokens, 4, 80), dtype, dev, gen)
    scale = 80**-0.5
    full = be.attention.prefill(q, batch.cache, batch.meta, scale=scale, v_dim=64)
    expected = ref_attention.paged_attention(oracle(q), batch.ref_cache, batch.ref_meta, scale, 64)
    assert_close(full, expected, dtype, what="attention")
    table = batch.meta.block_tables[:1]
    chunk = be.attention.prefill(
        q[70:n], batch.cache, AttentionMetadata.build(table, [n], [n - 70]), scale=scale, v_dim=64
    )
    assert_bitwise_equal(chunk, full[70:n], what="rows 70.. as a later chunk")
    for p in (0, 63, 64, 100, n - 1):
        meta = AttentionMetadata.build(table, [p + 1], [1])
        step = be.attention.decode(q[p : p + 1], batch.cache, meta, scale=scale, v_dim=64)
        assert_bitwise_equal(step, full[p : p + 1], what=f"position {p} as a decode step")
    both = AttentionMetadata.build(batch.meta.block_tables, [n, 90], [1, 1])
    pair = be.attention.decode(q[[n - 1, n]], batch.cache, both, scale=scale, v_dim=64)
    assert_bitwise_equal(pair[:1], full[n - 1 : n], what="the last position beside another request")


def test_grouped_gemm_fp4(invariant_backend: Backend, dtype: torch.dtype, gen: torch.Generator) -> None:
    """MXFP4 experts: a row alone in its group gives the bits it gives among the group's rows."""
    dev = invariant_backend.device.device()
    sizes = [9, 0, 24]
    x = randn((sum(sizes), 96), dtype, dev, gen)
    packed, scales = mxfp4_weight((len(sizes), 80, 96), dev, gen, 96**-0.5)
    gemm = invariant_backend.gemm
    full = gemm.grouped_gemm_fp4(x, packed, scales, torch.tensor(sizes, device=dev))
    expected = ref_gemm.grouped_gemm_fp4(oracle(x), packed.cpu(), scales.cpu(), torch.tensor(sizes))
    assert_close(full, expected, dtype, what="grouped_gemm_fp4")
    for i in ROWS:
        group = 0 if i < sizes[0] else 2
        alone_sizes = torch.tensor([int(g == group) for g in range(len(sizes))], device=dev)
        alone = gemm.grouped_gemm_fp4(x[i : i + 1], packed, scales, alone_sizes)
        assert_bitwise_equal(alone, full[i : i + 1], what=f"grouped_gemm_fp4 row {i}")
