"""The reference backend against independent float64 math written here (loops and formulas),
never against itself. Each block restates an op's documented meaning (deepinfer/backend/ops.py)."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.backend.types import AttentionMetadata, AttentionModifiers, KVCacheSpec, RouterConfig
from deepinfer.reference import attention as ref_attention
from deepinfer.reference import gemm as ref_gemm
from deepinfer.reference import memory as ref_memory
from deepinfer.reference import moe as ref_moe
from deepinfer.reference import small as ref_small
from deepinfer.reference.backend import create_reference_backend

F64 = torch.float64


def close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 2e-5, rtol: float = 2e-5) -> None:
    """Default budget: the reference computes softmax, norms and FP8 dequantisation in float32."""
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)


# --------------------------------------------------------------------------- memory


def test_kv_write_read_copy_layout(gen: torch.Generator) -> None:
    spec = KVCacheSpec(num_blocks=5, block_size=3, latent_dim=6, rope_dim=2, dtype=torch.float32)
    cache = ref_memory.allocate_kv_cache(spec, 2, torch.device("cpu"))
    assert len(cache) == 2 and cache[0].tensors[0].shape == (5, 3, 8)
    assert not cache[0].tensors[0].any()
    slots = torch.tensor([0, 4, -1, 12, 7])  # -1 must not wrap to the last slot (14)
    kv = torch.randn((5, 8), generator=gen, dtype=F64)
    ref_memory.write_kv(cache[0], kv, slots)
    t = cache[0].tensors[0]
    for row, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(t[s // 3, s % 3], kv[row].float())
    assert int((t != 0).any(dim=-1).sum()) == 4, "the -1 slot wrote nothing"
    assert not cache[1].tensors[0].any()
    assert torch.equal(ref_memory.read_kv(cache[0], torch.tensor([12, 0])), kv[[3, 0]].float())
    before = t.clone()
    ref_memory.copy_blocks(cache[0], torch.tensor([1, 4]), torch.tensor([3, 0]))
    assert torch.equal(t[3], before[1]) and torch.equal(t[0], before[4])
    assert torch.equal(t[[1, 2, 4]], before[[1, 2, 4]])


# --------------------------------------------------------------------------- attention


def naive_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    query_lens: list[int],
    scale: float,
    v_dim: int,
    window: int | None,
    sinks: torch.Tensor | None,
    topk: torch.Tensor | None,
) -> torch.Tensor:
    """Per query row, per head: visible keys, softmax written out, V = K[:, :v_dim]."""
    out = torch.zeros((q.shape[0], q.shape[1], v_dim), dtype=F64)
    row = 0
    for k, n in zip(keys, query_lens):
        kv_len = k.shape[0]
        for i in range(n):
            p = kv_len - n + i
            visible = [j for j in range(p + 1) if window is None or p - j < window]
            if topk is not None:
                chosen = {int(v) for v in topk[row] if v >= 0}
                visible = [j for j in visible if j in chosen]
            for h in range(q.shape[1]):
                if not visible:
                    continue
                s = [scale * float(q[row, h] @ k[j]) for j in visible]
                m = max(s)
                w = [math.exp(x - m) for x in s]
                denom = sum(w) + (math.exp(float(sinks[h]) - m) if sinks is not None else 0.0)
                out[row, h] = sum(wj * k[j, :v_dim] for wj, j in zip(w, visible)) / denom
            row += 1
    return out


@pytest.mark.parametrize(
    "seq_lens,query_lens,window,use_sinks,topk_k",
    [
        ([1, 9, 17], [1, 1, 1], None, False, None),  # decode, block boundaries (BS 8)
        ([5, 20, 16], [5, 4, 1], None, False, None),  # chunked prefill with cached prefix
        ([12, 7], [0, 7], None, False, None),  # an empty request
        ([19, 30], [6, 3], 5, False, None),  # sliding window
        ([10, 25], [10, 2], None, True, None),  # sinks
        ([14, 22], [4, 22], 9, True, None),  # window + sinks
        ([18, 26], [5, 1], None, False, 4),  # top-k (rows may see nothing)
        ([23], [8], 6, True, 5),  # all three
    ],
)
def test_paged_attention(
    gen: torch.Generator,
    seq_lens: list[int],
    query_lens: list[int],
    window: int | None,
    use_sinks: bool,
    topk_k: int | None,
) -> None:
    heads, d, dv, bs = 3, 12, 8, 8
    keys = [torch.randn((n, d), generator=gen, dtype=F64) for n in seq_lens]
    # scatter each request's rows into shuffled blocks of a pool
    nblocks = [math.ceil(n / bs) for n in seq_lens]
    perm = torch.randperm(sum(nblocks) + 2, generator=gen).tolist()
    table = torch.zeros((len(seq_lens), max(nblocks)), dtype=torch.int32)
    spec = KVCacheSpec(len(perm), bs, dv, d - dv, F64)
    cache = ref_memory.allocate_kv_cache(spec, 1, torch.device("cpu"))[0]
    used = 0
    for b, (k, nb) in enumerate(zip(keys, nblocks)):
        table[b, :nb] = torch.tensor(perm[used : used + nb])
        used += nb
        for j in range(k.shape[0]):
            cache.tensors[0][table[b, j // bs], j % bs] = k[j]
    meta = AttentionMetadata.build(table, seq_lens, query_lens)
    t = sum(query_lens)
    q = torch.randn((t, heads, d), generator=gen, dtype=F64)
    sinks = torch.randn(heads, generator=gen) if use_sinks else None
    topk = None
    if topk_k is not None:
        topk = torch.full((t, topk_k + 1), -1, dtype=torch.int32)
        row = 0
        for kv_len, n in zip(seq_lens, query_lens):
            for _ in range(n):
                topk[row, :topk_k] = torch.randperm(kv_len, generator=gen)[:topk_k]
                row += 1
    scale = d**-0.5
    out = ref_attention.paged_attention(q, cache, meta, scale, dv, AttentionModifiers(window, sinks, topk))
    expected = naive_attention(q, keys, query_lens, scale, dv, window, sinks, topk)
    assert out.shape == (t, heads, dv)
    close(out, expected)


def test_decode_requires_decode_metadata() -> None:
    be = create_reference_backend()
    cache = be.kv_cache.allocate(KVCacheSpec(2, 4, 4, 0, torch.float32), 1)[0]
    meta = AttentionMetadata.build(torch.zeros((1, 1), dtype=torch.int32), [2], [2])
    with pytest.raises(ValueError, match="one query token"):
        be.attention.decode(torch.zeros((2, 1, 4)), cache, meta, scale=1.0, v_dim=4)


# --------------------------------------------------------------------------- fp8 and gemm

E4M3_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()
E4M3_VALUES = torch.unique(E4M3_VALUES[torch.isfinite(E4M3_VALUES)])


def nearest_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e4m3 value by search over all 254 finite codes."""
    idx = (v.reshape(-1, 1) - E4M3_VALUES[None]).abs().argmin(dim=-1)
    return E4M3_VALUES[idx].view_as(v)


def test_quantize_fp8_round_trip(gen: torch.Generator) -> None:
    m, k = 4, 300  # 3 channel blocks, the last one partial
    x = torch.randn((m, k), generator=gen) * 5
    x[1] = 0
    xq, scale = ref_gemm.quantize_fp8(x)
    assert xq.dtype == torch.float8_e4m3fn and scale.shape == (m, 3)
    for r in range(m):
        for c in range(3):
            blk = x[r, c * 128 : (c + 1) * 128].double()
            amax = max(float(blk.abs().max()), 1e-10)
            assert math.isclose(float(scale[r, c]), amax / 448.0, rel_tol=1e-6)
            codes = xq[r, c * 128 : (c + 1) * 128].double()
            assert torch.equal(codes, nearest_e4m3(blk / float(scale[r, c])))
            assert float(codes.abs().max()) == (448.0 if r != 1 else 0.0)
    deq = ref_gemm.dequantize_act(xq, scale).double()
    assert ((deq - x.double()).abs() <= x.double().abs() / 16 + scale.max().double() * 2**-10).all()
    eq, es = ref_gemm.quantize_fp8(x[:0])  # an empty batch
    assert eq.shape == (0, k) and es.shape == (0, 3)


def test_quantize_weight_blocks(gen: torch.Generator) -> None:
    w = torch.randn((150, 200), generator=gen)
    wq, ws = ref_gemm.quantize_weight(w)
    assert ws.shape == (2, 2)
    for bn in range(2):
        for bk in range(2):
            blk = w[bn * 128 : (bn + 1) * 128, bk * 128 : (bk + 1) * 128].double()
            assert math.isclose(float(ws[bn, bk]), float(blk.abs().max()) / 448.0, rel_tol=1e-6)
            codes = wq[bn * 128 : (bn + 1) * 128, bk * 128 : (bk + 1) * 128].double()
            assert torch.equal(codes, nearest_e4m3(blk / float(ws[bn, bk])))


def block_fp8_product(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """sum over 128-channel blocks c: (xq[:, c] * xs[:, c]) @ (wq[n-block, c] * ws[n-block, c])^T."""
    m, k = xq.shape
    n = wq.shape[0]
    out = torch.zeros((m, n), dtype=F64)
    for c in range(math.ceil(k / 128)):
        cols = slice(c * 128, (c + 1) * 128)
        xb = xq[:, cols].double() * xs[:, c : c + 1].double()
        for bn in range(math.ceil(n / 128)):
            rows = slice(bn * 128, (bn + 1) * 128)
            out[:, rows] += xb @ (wq[rows, cols].double() * float(ws[bn, c])).T
    return out


def test_fp8_gemm_block_scales(gen: torch.Generator) -> None:
    xq, xs = ref_gemm.quantize_fp8(torch.randn((5, 260), generator=gen))
    wq, ws = ref_gemm.quantize_weight(torch.randn((140, 260), generator=gen) / 16)
    y = ref_gemm.fp8_gemm(xq, xs, wq, ws, torch.float32)
    assert y.dtype == torch.float32
    close(y, block_fp8_product(xq, xs, wq, ws), atol=1e-4, rtol=1e-4)
    yb = ref_gemm.fp8_gemm(xq, xs, wq, ws, torch.float32, batch_invariant=True)
    close(yb, block_fp8_product(xq, xs, wq, ws), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_linear(gen: torch.Generator, batch_invariant: bool) -> None:
    x = torch.randn((6, 13), generator=gen, dtype=F64)
    w = torch.randn((9, 13), generator=gen, dtype=F64)
    b = torch.randn(9, generator=gen, dtype=F64)
    expected = torch.tensor(
        [[sum(x[i, j] * w[o, j] for j in range(13)) + b[o] for o in range(9)] for i in range(6)]
    )
    close(ref_gemm.linear(x, w, b, batch_invariant), expected, atol=1e-12, rtol=1e-12)
    close(ref_gemm.linear(x, w, None, batch_invariant), expected - b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_batched_linear(gen: torch.Generator, batch_invariant: bool) -> None:
    x = torch.randn((5, 3, 4), generator=gen, dtype=F64).transpose(0, 1)  # (G=3, M=5, K=4) strided view
    w = torch.randn((3, 6, 4), generator=gen, dtype=F64)
    expected = torch.tensor(
        [
            [[sum(x[g, i, j] * w[g, o, j] for j in range(4)) for o in range(6)] for i in range(5)]
            for g in range(3)
        ]
    )
    close(ref_gemm.batched_linear(x, w, batch_invariant), expected, atol=1e-12, rtol=1e-12)
    assert ref_gemm.batched_linear(x[:, :0], w, batch_invariant).shape == (3, 0, 6)


def test_grouped_gemm(gen: torch.Generator) -> None:
    sizes = [2, 0, 3, 1]
    x = torch.randn((6, 7), generator=gen, dtype=F64)
    w = torch.randn((4, 5, 7), generator=gen, dtype=F64)
    group_of_row = [0, 0, 2, 2, 2, 3]
    expected = torch.stack([w[g] @ x[r] for r, g in enumerate(group_of_row)])
    close(ref_gemm.grouped_gemm(x, w, torch.tensor(sizes)), expected, atol=1e-12, rtol=1e-12)
    assert ref_gemm.grouped_gemm(x[:0], w, torch.zeros(4, dtype=torch.long)).shape == (0, 5)


def test_grouped_gemm_fp8(gen: torch.Generator) -> None:
    sizes = [3, 0, 2]
    x = torch.randn((5, 140), generator=gen)
    pairs = [ref_gemm.quantize_weight(torch.randn((130, 140), generator=gen) / 12) for _ in range(3)]
    wq, ws = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    y = ref_gemm.grouped_gemm_fp8(x, wq, ws, torch.tensor(sizes))
    xq, xs = ref_gemm.quantize_fp8(x)  # activations are quantised per token per 128 channels first
    expected = torch.cat(
        [block_fp8_product(xq[:3], xs[:3], wq[0], ws[0]), block_fp8_product(xq[3:], xs[3:], wq[2], ws[2])]
    )
    close(y, expected, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- routers


def score(v: float, scoring: str, row: list[float]) -> float:
    if scoring == "softmax":
        m = max(row)
        return math.exp(v - m) / sum(math.exp(u - m) for u in row)
    if scoring == "sigmoid":
        return 1 / (1 + math.exp(-v))
    return math.sqrt(math.log1p(math.exp(v)))


def naive_route(
    logits: list[float], cfg: RouterConfig, bias: list[float] | None, hashed: list[int] | None
) -> dict[int, float]:
    """{expert: weight} of one token, straight from RouterConfig's documentation."""
    e = len(logits)
    s = [score(v, cfg.scoring, logits) for v in logits]
    sel = [s[i] + (bias[i] if bias else 0.0) for i in range(e)]
    if hashed is not None:
        chosen = hashed
    else:
        size = e // cfg.num_groups
        groups = [list(range(g * size, (g + 1) * size)) for g in range(cfg.num_groups)]

        def group_score(g: list[int]) -> float:
            vals = sorted((sel[i] for i in g), reverse=True)
            return vals[0] if cfg.group_score == "max" or cfg.num_groups == 1 else vals[0] + vals[1]

        kept = sorted(groups, key=group_score, reverse=True)[: cfg.topk_groups if cfg.num_groups > 1 else 1]
        eligible = [i for g in kept for i in g]
        chosen = sorted(eligible, key=lambda i: sel[i], reverse=True)[: cfg.top_k]
    w = {i: s[i] for i in chosen}  # unbiased scores
    if cfg.renormalize:
        total = sum(w.values())
        w = {i: v / total for i, v in w.items()}
    return {i: v * cfg.routed_scaling_factor for i, v in w.items()}


ROUTER_CASES = [
    (RouterConfig("softmax", top_k=2), 12, False),
    (RouterConfig("softmax", top_k=3, num_groups=4, topk_groups=2, routed_scaling_factor=4.0), 16, False),
    (
        RouterConfig(
            "sigmoid", top_k=4, num_groups=4, topk_groups=2, group_score="top2_sum", renormalize=True,
            routed_scaling_factor=2.5,
        ),
        32,
        True,
    ),
    (RouterConfig("sqrtsoftplus", top_k=3, renormalize=True, routed_scaling_factor=1.5), 20, True),
]  # fmt: skip


@pytest.mark.parametrize("cfg,experts,with_bias", ROUTER_CASES)
def test_route(gen: torch.Generator, cfg: RouterConfig, experts: int, with_bias: bool) -> None:
    logits = torch.randn((9, experts), generator=gen, dtype=F64) * 2
    # a large bias on a few experts: it must change WHICH experts win, never their weights
    bias = (torch.randn(experts, generator=gen, dtype=F64) * 0.5) if with_bias else None
    weights, ids = ref_moe.route(logits, cfg, bias)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    for t in range(9):
        expected = naive_route(logits[t].tolist(), cfg, None if bias is None else bias.tolist(), None)
        got = dict(zip(ids[t].tolist(), weights[t].tolist()))
        assert set(got) == set(expected), f"token {t}"
        for i in got:
            assert math.isclose(got[i], expected[i], rel_tol=1e-5, abs_tol=1e-6)


def test_route_bias_is_selection_only(gen: torch.Generator) -> None:
    cfg = RouterConfig("sigmoid", top_k=2)
    logits = torch.tensor([[3.0, 2.0, -1.0, 0.0]], dtype=F64)
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0], dtype=F64)
    weights, ids = ref_moe.route(logits, cfg, bias)
    assert sorted(ids[0].tolist()) == [0, 2]  # expert 2 wins by its bias ...
    w = dict(zip(ids[0].tolist(), weights[0].tolist()))
    assert math.isclose(w[2], 1 / (1 + math.exp(1.0)), rel_tol=1e-6)  # ... but keeps its unbiased score


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_route_hash(gen: torch.Generator, scoring: str) -> None:
    cfg = RouterConfig(scoring, top_k=2, renormalize=True)  # type: ignore[arg-type]
    logits = torch.randn((5, 8), generator=gen, dtype=F64)
    hashed = torch.tensor([[7, 1], [0, 3], [2, 5], [6, 4], [1, 0]])
    weights, ids = ref_moe.route(logits, cfg, torch.randn(8, dtype=F64), hash_ids=hashed)
    assert torch.equal(ids.long(), hashed)
    for t in range(5):
        expected = naive_route(logits[t].tolist(), cfg, None, hashed[t].tolist())
        for i, w in zip(ids[t].tolist(), weights[t].tolist()):
            assert math.isclose(w, expected[i], rel_tol=1e-5)


def test_route_unknown_scoring() -> None:
    with pytest.raises(ValueError, match="unknown router scoring"):
        ref_moe.route(torch.zeros((1, 4)), RouterConfig("relu", top_k=1))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- permute / experts


def test_permute_unpermute(gen: torch.Generator) -> None:
    t, k, e = 5, 2, 4
    x = torch.randn((t, 3), generator=gen, dtype=F64)
    ids = torch.tensor([[2, 0], [1, 2], [2, 3], [0, 1], [3, 2]])
    x_sorted, src_to_dst, counts = ref_moe.permute(x, ids, e)
    # expert-major, source order inside an expert
    order = [s for ex in range(e) for s in range(t * k) if int(ids.view(-1)[s]) == ex]
    assert counts.tolist() == [sum(int(v) == ex for v in ids.view(-1)) for ex in range(e)]
    for dst, src in enumerate(order):
        assert int(src_to_dst[src]) == dst
        assert torch.equal(x_sorted[dst], x[src // k])
    weights = torch.rand((t, k), generator=gen)
    y = torch.randn((t * k, 3), generator=gen, dtype=F64)
    out = ref_moe.unpermute(y, src_to_dst, weights)
    expected = torch.stack(
        [
            torch.stack([weights[i, j].double() * y[order.index(i * k + j)] for j in range(k)]).sum(0)
            for i in range(t)
        ]
    )
    close(out, expected, atol=1e-6, rtol=1e-6)
    empty = ref_moe.unpermute(y[:0], src_to_dst[:0], weights[:0])
    assert empty.shape == (0, 3)


def silu(v: torch.Tensor) -> torch.Tensor:
    return v / (1 + torch.exp(-v))


def test_experts_and_fused_moe(gen: torch.Generator) -> None:
    e, dm, inter = 3, 6, 4
    w13 = torch.randn((e, 2 * inter, dm), generator=gen, dtype=F64)
    w2 = torch.randn((e, dm, inter), generator=gen, dtype=F64)
    x = torch.randn((4, dm), generator=gen, dtype=F64)
    ids = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1]])
    weights = torch.rand((4, 2), generator=gen)

    def mlp(v: torch.Tensor, ex: int) -> torch.Tensor:
        h = w13[ex] @ v
        return w2[ex] @ (silu(h[:inter]) * h[inter:])

    be = create_reference_backend()
    out = be.moe.fused_moe(x, weights, ids, w13, w2)
    expected = torch.stack(
        [
            torch.stack([weights[t, j].double() * mlp(x[t], int(ids[t, j])) for j in range(2)]).sum(0)
            for t in range(4)
        ]
    )
    close(out, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="both"):
        ref_moe.experts(x, torch.tensor([4, 0, 0]), w13, w2, torch.ones(1), None)


# --------------------------------------------------------------------------- small ops


def test_rms_norm(gen: torch.Generator) -> None:
    x = torch.randn((3, 10), generator=gen, dtype=F64)
    r = torch.randn((3, 10), generator=gen, dtype=F64)
    w = torch.randn(10, generator=gen, dtype=F64)
    y = ref_small.rms_norm(x, w, 1e-6)
    close(y, x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w)
    y, h = ref_small.add_rms_norm(x, r, w, 1e-6)
    close(h, x + r)
    close(y, (x + r) / torch.sqrt(((x + r) ** 2).mean(-1, keepdim=True) + 1e-6) * w)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_complex(gen: torch.Generator, interleaved: bool) -> None:
    t, h, rot, base = 5, 2, 8, 10000.0
    freqs = base ** (-torch.arange(0, rot, 2, dtype=F64) / rot)
    ang = torch.arange(64, dtype=F64)[:, None] * freqs
    cache = torch.cat([ang.cos(), ang.sin()], -1).float()
    x = torch.randn((t, h, rot), generator=gen, dtype=F64)
    pos = torch.tensor([0, 3, 63, 17, 3])
    if interleaved:
        z = torch.complex(x[..., 0::2], x[..., 1::2])
    else:
        z = torch.complex(x[..., : rot // 2], x[..., rot // 2 :])
    z = z * torch.polar(torch.ones_like(ang[pos]), ang[pos])[:, None, :]
    if interleaved:
        expected = torch.stack([z.real, z.imag], dim=-1).flatten(-2)
    else:
        expected = torch.cat([z.real, z.imag], dim=-1)
    close(ref_small.rope(x, pos, cache, interleaved), expected, atol=1e-6, rtol=1e-6)


def test_silu_and_mul(gen: torch.Generator) -> None:
    x = torch.randn((4, 10), generator=gen, dtype=F64)
    close(ref_small.silu_and_mul(x), silu(x[:, :5]) * x[:, 5:])


def test_apply_token_bitmask(gen: torch.Generator) -> None:
    b, v = 3, 70
    words = torch.randint(-(2**31), 2**31, (b, 3), generator=gen, dtype=torch.int64).to(torch.int32)
    logits = torch.randn((b, v), generator=gen)
    original = logits.clone()
    ref_small.apply_token_bitmask(logits, words)
    for r in range(b):
        for tok in range(v):
            allowed = (int(words[r, tok // 32]) & 0xFFFFFFFF) >> (tok % 32) & 1
            assert float(logits[r, tok]) == (float(original[r, tok]) if allowed else float("-inf"))
    ref_small.apply_token_bitmask(logits[:0], words[:0])  # an empty batch


def naive_keep(logits: list[float], temp: float, top_k: int, top_p: float, min_p: float) -> list[int]:
    """Tokens that survive the filters, from SmallOps.sample's documentation."""
    v = len(logits)
    scaled = [x / temp for x in logits]
    order = sorted(range(v), key=lambda i: scaled[i], reverse=True)
    if 0 < top_k < v:
        order = order[:top_k]
    m = max(scaled[i] for i in order)
    total = sum(math.exp(scaled[i] - m) for i in order)
    probs = {i: math.exp(scaled[i] - m) / total for i in order}
    keep: list[int] = []
    mass = 0.0
    for i in order:  # smallest prefix reaching top_p
        if mass >= top_p and keep:
            break
        keep.append(i)
        mass += probs[i]
    pmax = probs[order[0]]
    return [i for i in keep if probs[i] >= min_p * pmax or i == order[0]]


SAMPLE_ROWS = [  # temperature, top_k, top_p, min_p
    (1.0, 0, 1.0, 0.0),
    (0.5, 4, 1.0, 0.0),
    (1.5, 0, 0.7, 0.0),
    (1.0, 0, 1.0, 0.3),
    (0.8, 6, 0.9, 0.1),
    (1.0, 1, 1.0, 0.0),
    (1.0, 100, 1.0, 0.0),
]


def test_sample_filters_and_race(gen: torch.Generator) -> None:
    v = 12
    logits = torch.randn((len(SAMPLE_ROWS), v), generator=gen) * 2
    temp, top_k, top_p, min_p = (torch.tensor(c) for c in zip(*SAMPLE_ROWS))
    kept = [naive_keep(logits[r].tolist(), *SAMPLE_ROWS[r]) for r in range(len(SAMPLE_ROWS))]
    scaled = logits / temp.float()[:, None]
    survivors = torch.isfinite(ref_small.filter_logits(scaled, top_k.long(), top_p.float(), min_p.float()))
    for r in range(len(SAMPLE_ROWS)):
        assert sorted(survivors[r].nonzero().flatten().tolist()) == sorted(kept[r]), f"filter row {r}"
    for _ in range(20):
        noise = torch.empty((len(SAMPLE_ROWS), v)).exponential_(generator=gen)
        out = ref_small.sample(logits, temp.float(), top_k.long(), top_p.float(), min_p.float(), noise)
        for r, row in enumerate(SAMPLE_ROWS):
            # exponential race over the kept tokens: argmax p_i / noise_i
            scores = {i: math.exp(float(logits[r, i]) / row[0]) / float(noise[r, i]) for i in kept[r]}
            assert int(out[r]) == max(scores, key=lambda i: scores[i]), f"row {r}"


def test_sample_greedy_rows() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, -1.0, 4.9]])
    noise = torch.tensor([[1.0, 1e6, 1e-6], [1e6, 1e-6, 1.0]])  # would flip a sampled row
    out = ref_small.sample(
        logits, torch.zeros(2), torch.zeros(2, dtype=torch.long), torch.ones(2), torch.zeros(2), noise
    )
    assert out.tolist() == [1, 0]


def test_sample_distribution(gen: torch.Generator) -> None:
    """The exponential race draws token i with probability p_i."""
    n, logits = 4000, torch.tensor([1.0, 0.0, -1.0, 0.5])
    probs = torch.softmax(logits.double(), 0)
    noise = torch.empty((n, 4)).exponential_(generator=gen)
    rows = logits.expand(n, 4)
    out = ref_small.sample(
        rows, torch.ones(n), torch.zeros(n, dtype=torch.long), torch.ones(n), torch.zeros(n), noise
    )
    freq = torch.bincount(out, minlength=4).double() / n
    assert ((freq - probs).abs() < 4 * torch.sqrt(probs * (1 - probs) / n)).all(), (freq, probs)


def test_filter_logits_by_hand() -> None:
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # ranks: 1, 3, 2, 0
    logits = probs.log().expand(4, 4).clone()
    top_k = torch.tensor([0, 3, 0, 0])
    top_p = torch.tensor([0.75, 1.0, 0.95, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.35])  # keeps p >= 0.175
    kept = torch.isfinite(ref_small.filter_logits(logits, top_k, top_p, min_p))
    assert kept.tolist() == [
        [False, True, False, True],  # top-p 0.75: 0.5 + 0.3 reaches it
        [False, True, True, True],  # top-k 3
        [False, True, True, True],  # top-p 0.95: 0.5 + 0.3 + 0.15
        [False, True, False, True],  # min-p
    ]
