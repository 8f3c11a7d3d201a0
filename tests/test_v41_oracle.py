"""The float64 DeepSeek-V4.1 oracle (deepinfer/testing/v41_oracle.py) against hand-derived cases and
separately written brute-force formulas: dense attention over the visible keys, index scores, the
hyper-connection bookkeeping of a one-layer model, Engram hashing, sharing and causality."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from deepinfer.testing.v41_checkpoint import random_v41_tensors, tiny_v41_config, write_v41_checkpoint
from deepinfer.testing.v41_oracle import (
    V41Oracle,
    engram_hash,
    engram_layout,
    engram_multipliers,
    expected_tensor_shapes,
    ngram_token_ids,
    pool_pairs,
    rope_inv_freq,
    select_topk,
    sinkhorn,
    source_map,
)

F64 = torch.float64
TOKENS = [5, 17, 3, 42, 8, 8, 30, 11, 2, 27, 60, 9]


def _oracle(seed: int = 0, **knobs: object) -> tuple[V41Oracle, dict[str, torch.Tensor]]:
    cfg = tiny_v41_config(**knobs)  # type: ignore[arg-type]
    tensors = random_v41_tensors(cfg, seed=seed)
    return V41Oracle(cfg, tensors), {k: v.double() for k, v in tensors.items()}


# ---- brute force, written without the oracle's helpers --------------------------------------------


def _rms(x: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    return y if w is None else y * w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float, d: int) -> torch.Tensor:
    """Rotate consecutive channel pairs of the last d channels as complex numbers by pos * theta^(-2i/d)."""
    inv = theta ** (-torch.arange(0, d, 2, dtype=F64) / d)
    z = torch.view_as_complex(x[..., -d:].reshape(*x.shape[:-1], d // 2, 2).contiguous())
    ang = pos.to(F64)[:, None] * inv
    if z.dim() == 3:
        ang = ang[:, None, :]
    z = z * torch.polar(torch.ones_like(ang), ang)
    return torch.cat((x[..., :-d], torch.view_as_real(z).flatten(-2)), -1)


def _main_entries(w: dict[str, torch.Tensor], L: int, src: torch.Tensor, ratio: int) -> torch.Tensor:
    """Compressor pre-RoPE entries: one per token (C1) or a softmax-gated pair (C2), then the norm."""
    p = f"layers.{L}.attn.compressor."
    v = src @ w[p + "wkv.weight"].T
    if ratio == 2:
        z = src @ w[p + "wgate.weight"].T
        v = torch.stack(
            [
                (torch.softmax(z[2 * j : 2 * j + 2], 0) * v[2 * j : 2 * j + 2]).sum(0)
                for j in range(src.shape[0] // 2)
            ]
        )
    return _rms(v, w[p + "norm.weight"])


def _dense_attention(
    o: V41Oracle,
    w: dict[str, torch.Tensor],
    L: int,
    x: torch.Tensor,
    src: torch.Tensor,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Layer L's attention output: softmax over [window keys, visible main entries (where keep)] + sink."""
    c = o.cfg
    T, D, d, h = x.shape[0], c.head_dim, c.rope_dim, c.n_heads
    r = c.ratios[L]
    theta = c.compress_rope_theta if r else c.rope_theta
    pos = torch.arange(T)
    p = f"layers.{L}.attn."
    qa = _rms(x @ w[p + "wq_a.weight"].T, w[p + "q_norm.weight"])
    q = _rope((qa @ w[p + "wq_b.weight"].T).view(T, h, D), pos, theta, d)
    k = _rope(_rms(x @ w[p + "wkv.weight"].T, w[p + "kv_norm.weight"]), pos, theta, d)
    ent = None
    if r:
        cp = _main_entries(w, c.kv_map[L], src, r)
        ent = _rope(cp, torch.arange(cp.shape[0]) * r, theta, d)
    out = torch.zeros(T, h, D, dtype=F64)
    for t in range(T):
        keys = [k[s] for s in range(T) if t - c.window < s <= t]
        if ent is not None:
            keys += [
                ent[j] for j in range(ent.shape[0]) if j < (t + 1) // r and (keep is None or bool(keep[t, j]))
            ]
        K = torch.stack(keys)
        for head in range(h):
            e = torch.exp(q[t, head] @ K.T / math.sqrt(D))
            out[t, head] = (e / (e.sum() + torch.exp(w[p + "attn_sink"][head]))) @ K
    out = _rope(out, -pos, theta, d)  # inverse rotation at the query position
    g = c.o_groups
    wo_a = w[p + "wo_a.weight"].view(g, c.o_lora_rank, -1)
    mid = torch.stack([out.reshape(T, g, -1)[:, i] @ wo_a[i].T for i in range(g)], 1).reshape(T, -1)
    return mid @ w[p + "wo_b.weight"].T


def _own_index_scores(
    o: V41Oracle, w: dict[str, torch.Tensor], L: int, x: torch.Tensor, src: torch.Tensor
) -> torch.Tensor:
    c = o.cfg
    T, r = x.shape[0], c.ratios[L]
    p = f"layers.{L}.attn."
    qa = _rms(x @ w[p + "wq_a.weight"].T, w[p + "q_norm.weight"])
    qi = _rope(
        (qa @ w[p + "indexer.wq_b.weight"].T).view(T, c.index_heads, -1),
        torch.arange(T),
        c.compress_rope_theta,
        c.rope_dim,
    )
    kp = f"layers.{c.index_k_map[L]}.attn.indexer."
    cp = _main_entries(w, c.kv_map[L], src, r)
    ki = _rope(
        _rms(cp @ w[kp + "wk.weight"].T, w[kp + "k_norm.weight"]),
        torch.arange(cp.shape[0]) * r,
        c.compress_rope_theta,
        c.rope_dim,
    )
    wt = x @ w[p + "indexer.weights_proj.weight"].T
    s = torch.full((T, cp.shape[0]), -math.inf, dtype=F64)
    for t in range(T):
        for j in range((t + 1) // r):
            s[t, j] = sum(wt[t, hh] * max(0.0, float(qi[t, hh] @ ki[j])) for hh in range(c.index_heads))
    return s


# ---- building blocks -----------------------------------------------------------------------------


def test_sinkhorn_output_is_doubly_stochastic() -> None:
    x = sinkhorn(
        torch.randn(6, 4, 4, dtype=F64, generator=torch.Generator().manual_seed(1)), iters=100, eps=1e-9
    )
    assert (x > 0).all()
    torch.testing.assert_close(x.sum(-1), torch.ones(6, 4, dtype=F64), atol=1e-6, rtol=0)
    torch.testing.assert_close(x.sum(-2), torch.ones(6, 4, dtype=F64), atol=1e-6, rtol=0)


def test_source_map_is_nearest_listed_source_at_or_below() -> None:
    assert source_map([5, 2], 8) == [0, 1, 2, 2, 2, 5, 5, 5]
    with pytest.raises(ValueError, match="inside"):
        source_map([9], 8)


def test_c2_pooling_of_a_constant_pair_is_the_value_and_is_a_convex_mix() -> None:
    g = torch.Generator().manual_seed(2)
    z, v = torch.randn(6, 5, dtype=F64, generator=g), torch.randn(6, 5, dtype=F64, generator=g)
    v_const = v[0::2].repeat_interleave(2, 0)
    torch.testing.assert_close(pool_pairs(z, v_const), v[0::2])
    pooled = pool_pairs(z, v)
    lo, hi = torch.minimum(v[0::2], v[1::2]), torch.maximum(v[0::2], v[1::2])
    assert ((pooled >= lo - 1e-12) & (pooled <= hi + 1e-12)).all()
    assert pool_pairs(z[:5], v[:5]).shape == (2, 5)  # the incomplete pair makes no entry


def test_select_topk_breaks_ties_to_lower_id_and_pads_with_minus_one() -> None:
    s = torch.tensor(
        [[1.0, 3.0, 1.0, 1.0, -math.inf], [-math.inf, 2.0, -math.inf, -math.inf, -math.inf]], dtype=F64
    )
    assert select_topk(s, 3).tolist() == [[1, 0, 2], [1, -1, -1]]
    assert select_topk(s[:, :2], 4).tolist() == [[1, 0, -1, -1], [1, -1, -1, -1]]


def test_yarn_keeps_high_frequencies_and_divides_low_ones_by_the_factor() -> None:
    base = rope_inv_freq(64, 160000.0, None)
    yarn = {"original_max_position_embeddings": 4096, "factor": 16.0, "beta_fast": 32, "beta_slow": 1}
    scaled = rope_inv_freq(64, 160000.0, yarn)
    # Wavelength 2*pi/f against the original context: short ones keep f, long ones get f / factor.
    wavelengths = 2 * math.pi / base
    short, long = wavelengths < 4096 / 32, wavelengths > 4096 / 1
    torch.testing.assert_close(scaled[short], base[short])
    torch.testing.assert_close(scaled[long], base[long] / 16)
    assert (scaled <= base + 1e-18).all() and short.any() and long.any()
    torch.testing.assert_close(rope_inv_freq(64, 160000.0, yarn | {"factor": 1.0}), base)


# ---- attention ----------------------------------------------------------------------------------


def test_attention_with_full_window_and_top_k_equals_dense_causal_attention() -> None:
    """window >= T and index_topk >= entries: every layer attends all its past keys and visible entries.
    Layer 0 is C2 (T odd: the last token's pair is incomplete), layer 1 C1, layer 2 window-only."""
    T = 9
    o, w = _oracle(
        layers=3, ratios=[2, 1, 0], window=T, index_topk=T, yarn=False, kv_source_layer_ids=[0, 1, 2]
    )
    tr = o.forward(TOKENS[:T])
    for L in range(3):
        src = tr.attn_in[L] if o.cfg.n_prefill_layer > L else tr.h_star
        torch.testing.assert_close(
            tr.attn_out[L], _dense_attention(o, w, L, tr.attn_in[L], src), atol=1e-10, rtol=0
        )
    assert tr.main_kv[0].shape[0] == T // 2


def test_sliding_window_and_top_k_restrict_what_each_query_sees() -> None:
    """Small window and top-k: top-k = the highest index scores (own formula); attention = dense over
    the window keys (the query included) and the selected entries only."""
    T = 11
    o, w = _oracle(layers=3, ratios=[0, 2, 1], window=3, index_topk=2, yarn=False, kv_source_layer_ids=[1, 2])
    tr = o.forward(TOKENS[:T])
    for L in (0, 1, 2):
        x = tr.attn_in[L]
        src = x if o.cfg.n_prefill_layer > L else tr.h_star
        keep = None
        if o.cfg.ratios[L]:
            scores = _own_index_scores(o, w, L, x, src)
            for t in range(T):
                visible = (t + 1) // o.cfg.ratios[L]
                want = set(torch.argsort(scores[t, :visible], descending=True)[:2].tolist())
                assert set(tr.topk[L][t][tr.topk[L][t] >= 0].tolist()) == want
            keep = torch.zeros(T, scores.shape[1], dtype=torch.bool)
            for t in range(T):
                keep[t, tr.topk[L][t][tr.topk[L][t] >= 0]] = True
        torch.testing.assert_close(
            tr.attn_out[L], _dense_attention(o, w, L, x, src, keep), atol=1e-10, rtol=0
        )


@pytest.mark.parametrize("shifted", [True, False])
def test_logits_at_a_position_do_not_depend_on_later_tokens(shifted: bool) -> None:
    o, _ = _oracle(
        layers=5,
        ratios=[0, 2, 2, 1, 1],
        window=3,
        index_topk=2,
        kv_source_layer_ids=[1, 3, 4],
        index_source_layer_ids=[1, 2, 3, 4],
        engram=True,
        engram_layer_ids=[0, 2],
        hc_shifted=shifted,
    )
    a = o.logits(TOKENS)
    for p in (0, 3, 6, 9):
        changed = TOKENS[: p + 1] + [(t * 7 + 1) % 64 for t in TOKENS[p + 1 :]]
        b = o.logits(changed)
        torch.testing.assert_close(b[: p + 1], a[: p + 1], atol=1e-12, rtol=0)
        assert (b[p + 1 :] - a[p + 1 :]).abs().max() > 1e-6


# ---- hyper-connections ------------------------------------------------------------------------------


def _hc_constant(
    w: dict[str, torch.Tensor], name: str, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """With fn = 0 the mixes are the biases: pre = sigmoid + eps, post = 2 sigmoid, comb = Sinkhorn."""
    b = w[name]
    return (
        torch.sigmoid(b[:n]) + 1e-6,
        2 * torch.sigmoid(b[n : 2 * n]),
        sinkhorn(b[2 * n :].view(n, n), 20, 1e-6),
    )


@pytest.mark.parametrize("shifted", [True, False])
def test_one_layer_hyper_connections_match_a_hand_derivation(shifted: bool) -> None:
    cfg = tiny_v41_config(layers=1, ratios=[1], hc_shifted=shifted, hc_mult=3)
    tensors = {k: v.double() for k, v in random_v41_tensors(cfg, seed=3).items()}
    for k in [k for k in tensors if k.endswith("_fn")]:
        tensors[k].zero_()
    tr = V41Oracle(cfg, tensors).forward(TOKENS[:7])
    n, w = 3, tensors
    e = w["embed.weight"][TOKENS[:7]]
    pre_a, post_a, comb_a = _hc_constant(w, "layers.0.hc_attn_base", n)
    pre_f, post_f, comb_f = _hc_constant(w, "layers.0.hc_ffn_base", n)
    # streams start as n copies of e; every sublayer input is RMSNorm(sum_i mix_i R_i)
    first = e if shifted else pre_a.sum() * e  # shifted: the first sublayer reads stream 0
    torch.testing.assert_close(tr.attn_in[0], _rms(first, w["layers.0.attn_norm.weight"]), atol=1e-12, rtol=0)
    R1 = [post_a[j] * tr.attn_out[0] + comb_a[:, j].sum() * e for j in range(n)]
    ffn_mix = pre_a if shifted else pre_f  # shifted: the attention sublayer's pre-mix feeds the FFN
    torch.testing.assert_close(
        tr.ffn_in[0],
        _rms(sum(ffn_mix[j] * R1[j] for j in range(n)), w["layers.0.ffn_norm.weight"]),
        atol=1e-12,
        rtol=0,
    )
    R2 = [post_f[j] * tr.ffn_out[0] + sum(comb_f[i, j] * R1[i] for i in range(n)) for j in range(n)]
    last = pre_f if shifted else torch.sigmoid(w["hc_head_base"]) + 1e-6  # shifted: no HC head
    h = sum(last[j] * R2[j] for j in range(n))
    torch.testing.assert_close(tr.final_hidden, h, atol=1e-12, rtol=0)
    torch.testing.assert_close(tr.logits, _rms(h, w["norm.weight"]) @ w["head.weight"].T, atol=1e-12, rtol=0)


def test_shifted_and_unshifted_hyper_connections_differ() -> None:
    a, _ = _oracle(seed=4, hc_shifted=True)
    cfg = tiny_v41_config(hc_shifted=False)
    tensors = random_v41_tensors(cfg, seed=4)
    assert {k for k in tensors if k.startswith("hc_head")} == {"hc_head_fn", "hc_head_base", "hc_head_scale"}
    assert not any(k.startswith("hc_head") for k in expected_tensor_shapes(a.cfg))
    b = V41Oracle(cfg, tensors)
    assert (a.logits(TOKENS) - b.logits(TOKENS)).abs().max() > 1e-3


# ---- sharing and YOCO ---------------------------------------------------------------------------


def test_cross_layer_sharing_and_yoco_shared_hidden() -> None:
    """Encoder layers 0-2 are C2, decoder 3-5 C1 (n_prefill_layer 3).
    KV segments {0,1,2} {3,4} {5}; index-K {0,1,2} {3} {4} {5}; top-k {0,1} {2} {3} {4} {5}."""
    o, w = _oracle(
        layers=6,
        ratios=[2, 2, 2, 1, 1, 1],
        window=2,
        index_topk=2,
        kv_source_layer_ids=[0, 3, 5],
        index_k_source_layer_ids=[0, 3, 4, 5],
        index_source_layer_ids=[0, 2, 3, 4, 5],
        yarn=False,
    )
    assert o.cfg.n_prefill_layer == 3
    names = set(expected_tensor_shapes(o.cfg))
    assert (
        "layers.1.attn.compressor.wkv.weight" not in names
        and "layers.4.attn.compressor.wkv.weight" not in names
    )
    assert "layers.1.attn.indexer.wq_b.weight" not in names and "layers.2.attn.indexer.wk.weight" not in names
    assert "layers.4.attn.indexer.wk.weight" in names
    tr = o.forward(TOKENS)
    assert torch.equal(tr.main_kv[1], tr.main_kv[0]) and torch.equal(tr.main_kv[2], tr.main_kv[0])
    assert torch.equal(tr.main_kv[4], tr.main_kv[3])
    assert torch.equal(tr.topk[1], tr.topk[0]) and 1 not in tr.index_scores
    assert torch.equal(tr.index_k[2], tr.index_k[0])  # own top-k, shared index K
    assert not torch.equal(tr.index_k[4], tr.index_k[3])  # layer 4 projects its own index K
    # YOCO: the decoder-half KV source 5 compresses h* (layer 3's attn-norm output), not its own input.
    assert torch.equal(tr.h_star, tr.attn_in[3])
    theta, d, pos = o.cfg.compress_rope_theta, o.cfg.rope_dim, torch.arange(len(TOKENS))
    want = _rope(_main_entries(w, 5, tr.h_star, 1), pos, theta, d)
    torch.testing.assert_close(tr.main_kv[5], want, atol=1e-12, rtol=0)
    from_own_input = _rope(_main_entries(w, 5, tr.attn_in[5], 1), pos, theta, d)
    assert (tr.main_kv[5] - from_own_input).abs().max() > 1e-3


def test_invalid_sharing_and_ratios_are_refused() -> None:
    with pytest.raises(ValueError, match="only 0, 1, 2"):
        V41Oracle(tiny_v41_config(ratios=[0, 4, 1, 1]), {})
    with pytest.raises(ValueError, match="ratio"):  # layer 2 (C1) cannot share layer 1's C2 KV
        V41Oracle(tiny_v41_config(layers=4, ratios=[0, 2, 1, 1], kv_source_layer_ids=[1]), {})
    with pytest.raises(ValueError, match="index-k segment"):  # index-K segment {1, 2} across KV {1} {2}
        V41Oracle(
            tiny_v41_config(ratios=[0, 1, 1, 1], kv_source_layer_ids=[1, 2], index_k_source_layer_ids=[1]), {}
        )
    cfg = tiny_v41_config()
    tensors = random_v41_tensors(cfg)
    del tensors["layers.1.attn.compressor.wgate.weight"]
    with pytest.raises(ValueError, match=r"compressor\.wgate"):
        V41Oracle(cfg, tensors)


# ---- candidate blocks ---------------------------------------------------------------------------


def test_candidate_blocks_restrict_later_layers_top_k() -> None:
    T = 40
    tokens = [(7 * i + 3) % 64 for i in range(T)]
    knobs = dict(
        layers=3,
        ratios=[1, 1, 1],
        window=2,
        index_topk=4,
        candidate_source_layer_id=0,
        candidate_block_size=2,
    )
    tight, _ = _oracle(**knobs, candidate_topk_blocks=8)  # type: ignore[arg-type]
    tr = tight.forward(tokens)
    blocks = tr.candidates[0]
    for t in range(T):
        nb = -(-(t + 1) // 2)  # visible blocks
        row = blocks[t][blocks[t] >= 0]
        assert len(row) == min(8, nb) and nb - 1 in row.tolist()  # the last visible block always kept
        for L in (1, 2):
            picked = tr.topk[L][t][tr.topk[L][t] >= 0]
            assert set((picked // 2).tolist()) <= set(row.tolist())
    assert any(
        not set((tr.index_scores[1][t].argsort(descending=True)[:4] // 2).tolist()) <= set(blocks[t].tolist())
        for t in range(T)
    ), "the restriction never mattered: pick a longer sequence"
    loose, _ = _oracle(**knobs, candidate_topk_blocks=24)  # type: ignore[arg-type]
    tr = loose.forward(tokens)
    for L in (1, 2):
        assert torch.equal(tr.topk[L], select_topk(tr.index_scores[L], 4))


# ---- Engram -----------------------------------------------------------------------------------


def test_engram_tables_and_hash_match_a_hand_computation() -> None:
    o, _ = _oracle(engram=True, engram_layer_ids=[0, 1])
    # engram_vocab_size 40, 2 heads, n-grams 2 and 3: the next unused primes above 39, in order
    assert engram_layout(o.cfg) == {0: [41, 43, 47, 53], 1: [59, 61, 67, 71]}
    m = np.random.default_rng(10007 * 1).integers(0, (2**63 - 1) // 64 // 2, size=3, dtype=np.int64) * 2 + 1
    assert engram_multipliers(1, o.cfg).tolist() == m.tolist()
    a, b, c = 9, 7, 5  # tokens p, p-1, p-2 (compressed ids)
    two = (a * int(m[0])) ^ (b * int(m[1]))
    three = two ^ (c * int(m[2]))
    want = [two % 59, two % 61 + 59, three % 67 + 59 + 61, three % 71 + 59 + 61 + 67]
    got = engram_hash(torch.tensor([[a, b, c]]), engram_multipliers(1, o.cfg), [59, 61, 67, 71], 2)
    assert got.tolist() == [want]
    assert ngram_token_ids(torch.tensor([4, 5, 6]), 3, pad=2).tolist() == [[4, 2, 2], [5, 4, 2], [6, 5, 4]]


def test_engram_with_a_zero_value_projection_leaves_the_model_unchanged() -> None:
    with_engram = tiny_v41_config(engram=True, engram_layer_ids=[0, 1])
    tensors = random_v41_tensors(with_engram, seed=5)
    plain = {k: v for k, v in tensors.items() if ".engram." not in k}
    base = V41Oracle(tiny_v41_config(), plain).logits(TOKENS)
    o = V41Oracle(with_engram, tensors)
    assert (o.logits(TOKENS) - base).abs().max() > 1e-4
    H = o.cfg.hidden
    for L in (0, 1):
        tensors[f"layers.{L}.engram.wkv.weight"][
            o.cfg.hc_mult * H :
        ].zero_()  # the value rows (after the keys)
    torch.testing.assert_close(V41Oracle(with_engram, tensors).logits(TOKENS), base, atol=1e-12, rtol=0)


# ---- checkpoint on disk, greedy ------------------------------------------------------------------


def test_written_checkpoint_loads_back_and_greedy_follows_the_argmax(tmp_path: object) -> None:
    cfg = tiny_v41_config(engram=True)
    tensors = random_v41_tensors(cfg, seed=6)
    d = write_v41_checkpoint(tmp_path, cfg, tensors)  # type: ignore[arg-type]
    loaded = V41Oracle(json.loads((d / "config.json").read_text()), load_file(str(d / "model.safetensors")))
    o = V41Oracle(cfg, tensors)
    torch.testing.assert_close(loaded.logits(TOKENS), o.logits(TOKENS), atol=0, rtol=0)
    out = o.greedy(TOKENS[:4], 3)
    full = o.logits(TOKENS[:4] + out)
    assert out == [int(full[3 + i].argmax()) for i in range(3)]
    assert full.std() > 0.3  # the random init is not degenerate


def test_engram_gates_its_value_into_each_stream_by_hand() -> None:
    """Shifted HC, Engram at layer 0: the first attention input is RMSNorm of stream 0 after Engram,
    e + g_0 v with g_0 = sigmoid(signed sqrt(<rms(e) * q_w * k_w, rms(k_0)> / sqrt(H)))."""
    o, w = _oracle(seed=7, engram=True, engram_layer_ids=[0], hc_shifted=True)
    c = o.cfg
    ids = torch.tensor(TOKENS)
    rows = engram_hash(ngram_token_ids(ids, 3, pad=2), engram_multipliers(0, c), engram_layout(c)[0], 2)
    kv = (w["layers.0.engram.embed.weight"][rows].flatten(1) @ w["layers.0.engram.wkv.weight"].T).view(
        len(ids), -1, c.hidden
    )
    e, k0, v = w["embed.weight"][ids], kv[:, 0], kv[:, c.hc_mult]
    q_w, k_w = w["layers.0.engram.q_weight"][0], w["layers.0.engram.k_weight"][0]
    a = (_rms(e) * q_w * k_w * _rms(k0)).sum(-1) / math.sqrt(c.hidden)
    g = torch.sigmoid(torch.sign(a) * torch.sqrt(torch.clamp(a.abs(), min=1e-6)))
    tr = o.forward(TOKENS)
    torch.testing.assert_close(
        tr.attn_in[0], _rms(e + g[:, None] * v, w["layers.0.attn_norm.weight"]), atol=1e-12, rtol=0
    )


def test_moe_is_sqrtsoftplus_routing_with_clamped_swiglu_experts() -> None:
    o, w = _oracle(seed=8, swiglu_limit=0.5)
    c = o.cfg
    tr = o.forward(TOKENS)

    def expert(x: torch.Tensor, p: str, limit: float | None) -> torch.Tensor:
        gate, up = x @ w[p + "w1.weight"].T, x @ w[p + "w3.weight"].T
        if limit is not None:
            gate, up = torch.clamp(gate, max=limit), torch.clamp(up, -limit, limit)
        return (gate * torch.sigmoid(gate) * up) @ w[p + "w2.weight"].T

    for L in range(c.n_layers):
        f = f"layers.{L}.ffn."
        x = tr.ffn_in[L]
        for limit, must_match in ((0.5, True), (None, False)):
            want = torch.zeros_like(x)
            for t in range(x.shape[0]):
                s = torch.sqrt(torch.log1p(torch.exp(w[f + "gate.weight"] @ x[t])))
                chosen = torch.argsort(s + w[f + "gate.bias"], descending=True)[: c.top_k]
                for e in chosen.tolist():
                    weight = s[e] / s[chosen].sum() * c.routed_scaling
                    want[t] += weight * expert(x[t : t + 1], f"{f}experts.{e}.", limit)[0]
            want += expert(x, f + "shared_experts.", limit)
            if must_match:
                torch.testing.assert_close(tr.ffn_out[L], want, atol=1e-12, rtol=0)
            else:  # the clamp is active in this configuration
                assert (tr.ffn_out[L] - want).abs().max() > 1e-3
