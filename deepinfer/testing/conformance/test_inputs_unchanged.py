"""Ops leave their inputs alone: outputs are new tensors, inputs keep their bits (the contract's
rule unless an op says otherwise: the KV-cache writes, copy_blocks and apply_token_bitmask work in
place).

A backend that pads, scales or rotates an input in place passes a single comparison with the
reference and corrupts the caller's next use of that tensor (the residual stream, the logits
reused for log-probs, the query reused by the next layer's kernel...).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from deepinfer.backend.ops import Backend
from deepinfer.backend.types import AttentionMetadata, AttentionModifiers, RouterConfig
from deepinfer.testing.helpers import (
    make_paged_batch,
    mxfp4_weight,
    quantized_weight,
    randn,
    topk_indices_for,
)


def snapshot(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().cpu().clone() for t in tensors]


def assert_unchanged(what: str, before: list[torch.Tensor], *tensors: torch.Tensor) -> None:
    for i, (b, t) in enumerate(zip(before, tensors, strict=True)):
        now = t.detach().cpu().contiguous()
        assert torch.equal(now.view(torch.uint8), b.view(torch.uint8)), f"{what} modified its input #{i}"


def check(what: str, fn: Callable[[], object], *inputs: torch.Tensor) -> object:
    before = snapshot(*inputs)
    out = fn()
    assert_unchanged(what, before, *inputs)
    outs = out if isinstance(out, tuple) else (out,)
    for o in outs:
        if isinstance(o, torch.Tensor) and o.numel():
            for t in inputs:
                if t.numel():
                    assert o.untyped_storage().data_ptr() != t.untyped_storage().data_ptr(), (
                        f"{what} returned a view of an input"
                    )
    return out


@pytest.mark.parametrize("head_dim,rope", [(576, 64), (20, 4)], ids=["mla", "small"])
def test_attention_inputs(backend: Backend, gen: torch.Generator, head_dim: int, rope: int) -> None:
    dt = backend.capabilities.dtypes[0]
    dev = backend.device.device()
    seq, qlen = [9, 20], [9, 3]
    batch = make_paged_batch(
        backend, seq_lens=seq, query_lens=qlen, block_size=16, head_dim=head_dim, dtype=dt, gen=gen,
        rope_dim=rope,
    )  # fmt: skip
    cache, meta, v = batch.cache, batch.meta, head_dim - rope
    q = randn((batch.num_tokens, 3, head_dim), dt, dev, gen)
    sinks = randn((3,), torch.float32, dev, gen)
    topk = topk_indices_for(seq, qlen, 5, gen).to(dev)
    slots = torch.arange(40, device=dev)
    tensors = (q, sinks, topk, meta.block_tables, meta.seq_lens, meta.query_start_loc)
    before_kv = snapshot(backend.kv_cache.read_kv(cache, slots))
    check("prefill", lambda: backend.attention.prefill(q, cache, meta, scale=0.1, v_dim=v), *tensors)
    check(
        "prefill (window, sinks, top-k)",
        lambda: backend.attention.prefill(
            q, cache, meta, scale=0.1, v_dim=v, modifiers=AttentionModifiers(4, sinks, topk)
        ),
        *tensors,
    )
    dmeta = AttentionMetadata.build(meta.block_tables, seq, [1, 1])
    qd = q[:2].clone()
    check("decode", lambda: backend.attention.decode(qd, cache, dmeta, scale=0.1, v_dim=v), qd)
    assert_unchanged("attention (KV cache)", before_kv, backend.kv_cache.read_kv(cache, slots))
    qkv = randn((29, 3, 2, 16), dt, dev, gen)  # the vision tower's strided q, k, v of one buffer
    cu = torch.tensor([0, 9, 29], dtype=torch.int32, device=dev)
    check(
        "varlen_attention",
        lambda: backend.attention.varlen_attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, 20, scale=0.25),
        qkv,
        cu,
    )


def test_small_inputs(backend: Backend, gen: torch.Generator) -> None:
    dt = backend.capabilities.dtypes[0]
    dev = backend.device.device()
    x = randn((5, 64), dt, dev, gen)
    res = randn((5, 64), dt, dev, gen)
    w = randn((64,), dt, dev, gen)
    check("add_rms_norm", lambda: backend.small.add_rms_norm(x, res, w, 1e-6), x, w, res)
    check("rms_norm", lambda: backend.small.rms_norm(x, w, 1e-6), x, w)
    xr = randn((5, 3, 16), dt, dev, gen)
    pos = torch.tensor([0, 7, 3, 1, 9], device=dev)
    cs = torch.rand((10, 16), generator=gen).to(dev)
    check("rope", lambda: backend.small.rope(xr, pos, cs, True), xr, pos, cs)
    check("rope (half)", lambda: backend.small.rope(xr, pos, cs, False), xr, pos, cs)
    check("silu_and_mul", lambda: backend.small.silu_and_mul(x), x)
    logits = torch.randn((4, 30), generator=gen).to(dev)
    args = (
        torch.tensor([0.0, 1.0, 0.7, 2.0], device=dev),
        torch.tensor([0, 5, 1, 0], device=dev),
        torch.tensor([1.0, 0.9, 1.0, 0.5], device=dev),
        torch.tensor([0.0, 0.1, 0.0, 0.0], device=dev),
        torch.empty((4, 30)).exponential_(1.0, generator=gen).to(dev),
    )
    check("sample", lambda: backend.small.sample(logits, *args), logits, *args)


def test_gemm_and_moe_inputs(backend: Backend, gen: torch.Generator) -> None:
    dt = backend.capabilities.dtypes[0]
    dev = backend.device.device()
    x = randn((6, 32), dt, dev, gen)
    w = randn((24, 32), dt, dev, gen, 0.2)
    b = randn((24,), dt, dev, gen)
    check("linear", lambda: backend.gemm.linear(x, w, b), x, w, b)
    xg = randn((2, 6, 32), dt, dev, gen)
    wg = randn((2, 24, 32), dt, dev, gen, 0.2)
    check("batched_linear", lambda: backend.gemm.batched_linear(xg, wg), xg, wg)
    sizes = torch.tensor([2, 0, 4], device=dev)
    we = randn((3, 24, 32), dt, dev, gen, 0.2)
    check("grouped_gemm", lambda: backend.gemm.grouped_gemm(x, we, sizes), x, we, sizes)

    logits = randn((6, 16), torch.float32, dev, gen)
    bias = randn((16,), torch.float32, dev, gen)
    cfg = RouterConfig("sigmoid", top_k=2, num_groups=4, topk_groups=2, renormalize=True)
    routed = check("route", lambda: backend.moe.route(logits, cfg, bias), logits, bias)
    assert isinstance(routed, tuple)
    weights, ids = routed
    check("permute", lambda: backend.moe.permute(x, ids, 16), x, ids)
    y = randn((12, 32), dt, dev, gen)
    s2d = torch.randperm(12, generator=gen).to(dev)
    check("unpermute", lambda: backend.moe.unpermute(y, s2d, weights), y, s2d, weights)
    w13 = randn((16, 2 * 8, 32), dt, dev, gen, 0.2)
    w2 = randn((16, 32, 8), dt, dev, gen, 0.3)
    check("fused_moe", lambda: backend.moe.fused_moe(x, weights, ids, w13, w2), x, weights, ids, w13, w2)
    counts = torch.tensor([3, 0, 3] + [0] * 13, device=dev)
    check("experts", lambda: backend.moe.experts(x, counts, w13, w2), x, counts, w13, w2)
    w4, s4 = mxfp4_weight((3, 24, 32), dev, gen, 0.2)
    check("grouped_gemm_fp4", lambda: backend.gemm.grouped_gemm_fp4(x, w4, s4, sizes), x, w4, s4, sizes)

    if backend.capabilities.supports_fp8:
        xf = randn((4, 256), dt, dev, gen)
        wq, ws = quantized_weight((130, 256), dev, gen, 0.1)
        check("quantize_fp8", lambda: backend.gemm.quantize_fp8(xf), xf)
        check("linear_fp8", lambda: backend.gemm.linear_fp8(xf, wq, ws), xf, wq, ws)
        eq, es = quantized_weight((2, 130, 256), dev, gen, 0.1)
        gs = torch.tensor([1, 3], device=dev)
        check("grouped_gemm_fp8", lambda: backend.gemm.grouped_gemm_fp8(xf, eq, es, gs), xf, eq, es, gs)
