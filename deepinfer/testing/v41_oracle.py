"""Float64 oracle of the DeepSeek-V4.1-Flash text model, written from the published math.

Whole-sequence and plain PyTorch: no paging, no KV cache, no quantisation, and nothing imported
from `deepinfer.models` or `deepinfer.backend`, so a model implementation can be checked against it.
Facts and sources: /work/shared/reference/deepseek-v4.1.md (section numbers below refer to it).

Entry points
------------
- `V41Oracle(config, tensors)`: `config` is the config.json dict in DeepSeek's schema (top level
  `model_type == "deepseek_v41"`, the model in `text_config`); `tensors` maps DeepSeek's HF names
  (`embed.weight`, `layers.{L}.attn.wq_a.weight`, `layers.{L}.ffn.experts.{e}.w1.weight`, ...) to
  float tensors (bf16 / fp32; dequantise FP8 / FP4 before). Every name is checked up front.
- `oracle.logits(tokens, ngram_ids=None)`: `(T, vocab)` float64 logits of a 1-D token sequence.
- `oracle.forward(tokens, ngram_ids=None)`: a `V41Trace` with the logits and per-layer
  intermediates (sublayer inputs and outputs, main KV, index scores, top-k entries, candidate
  blocks, the YOCO shared hidden) for tests that check one piece at a time.
- `oracle.greedy(prompt, n)`: `n` greedy tokens, re-running the whole sequence each step.
- Engram input: `ngram_ids` is `(T, engram_max_ngram_size)` int64, row p = compressed ids of
  tokens p, p-1, ... (pad before the start), as DeepSeek's C++ side builds it. When omitted it is
  built from `tokens` through `engram_lookup` (raw -> compressed id table; identity if None).
- Pure pieces, usable alone: `rms_norm`, `rope_inv_freq`, `apply_rope`, `sinkhorn`,
  `hc_mixes`, `pool_pairs`, `index_scores`, `select_topk`, `source_map`, `engram_layout`,
  `engram_multipliers`, `engram_hash`, `ngram_token_ids`.

Semantics fixed here (DeepSeek engine defaults, its YOCO prefill truncation mode off):
- A query at position p sees SWA keys p-W+1..p (itself included) and main entries j < (p+1)//r
  (r = compress ratio; a C2 entry exists once both of its tokens exist, so the incomplete pair is
  never visible). The window keys and the selected entries are concatenated: a token that is both
  in the window and selected is attended twice (once as its SWA key, once as its main entry; they
  are different vectors), with no deduplication (DS `tilelang_ops/kv_index_cat.py`).
- Top-k keeps the highest index scores; ties go to the lower entry id (DeepSelect's tie order is
  not documented); fewer visible entries than `index_topk` means all of them.
- Index score: `sum_h w_h * relu(q_h . k)` with `w = weights_proj(x)` as is: DeepSeek's runtime
  passes the raw projection to the kernel (`index_attn.py`), no softmax scale and no head-count
  factor (a positive factor would not change the top-k anyway).
- Engram hash multipliers are bounded by `engram_compressed_vocab_size` (falling back to
  `vocab_size`); DeepSeek's loader recomputes that size from tokenizer.json. The `wkv` output is
  `hc_mult` keys followed by one value (TileKernels `engram_gate_fwd`).

Not from DeepSeek's source (kernels not in the sdist; taken from TileKernels' torch references or
chosen): the Sinkhorn / split-mix formulas, the MoE weight normalisation without an epsilon, the
tie order of every top-k. Not modelled: FP8/FP4 rounding of weights; YOCO prefill truncation
(`compact` / `mask`). The DFlash (DSpark) draft layers: `V41DSparkOracle` (1.10-1.11).

KV formats (1.13, `kv_cache_dtype`; "bf16", the default, keeps every cache exact): the window K,
the main entries (after their RoPE) and the index keys are rounded to their cached formats before
anything reads them, prefill included (DS "cast_back"): FP8 rows (e4m3, one power-of-two scale per
32 values, the smallest that maps the block's amax within 448), FP4 main rows (e2m1, one e4m3
scale per 16 values, amax / 6 rounded to e4m3, values past +-6 clipped; "fp8": FP8 rows instead),
FP4 index keys (e2m1, one power-of-two scale per 32, the smallest that maps amax within 6), and
the indexer's queries with them (1.4: the index Q is FP4 too; each head's values rounded as a key).
Rounding is to the nearest representable value, ties to the even one.

Images: `forward(tokens, images=[(start, rows), ...])` takes each image's span rows (L, H) (from
`deepinfer.testing.vision_oracle`) at prompt positions start .. start + L - 1; those positions'
token ids are the image ids past the vocabulary, never looked up. Image positions take the
image routing bias `ffn.gate.bias_vl` (the text bias where the checkpoint has none), are not
updated by Engram (masked) and read as the Engram pad id inside other tokens' n-grams (DeepSeek's
sentinel value for image tokens is not in its Python source: pad is chosen here).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

F64 = torch.float64

# --------------------------------------------------------------------------------------------
# KV formats (1.13): quantise-dequantise in float64
# --------------------------------------------------------------------------------------------


def _round_float(a: torch.Tensor, mantissa_bits: int, min_exp: int, top: float) -> torch.Tensor:
    """Magnitudes a >= 0 to the nearest value of a float format with `mantissa_bits`, normal
    exponents from min_exp (below: subnormal steps of 2^(min_exp - mantissa_bits)), at most `top`;
    ties to an even mantissa."""
    _, e = torch.frexp(a)  # a = m 2^e, m in [0.5, 1): floor(log2 a) = e - 1
    step = torch.exp2((torch.clamp(e - 1, min=min_exp) - mantissa_bits).to(F64))
    return torch.clamp(torch.round(a / step) * step, max=top)  # torch.round: half to even


def e4m3(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * _round_float(x.abs(), 3, -6, 448.0)


def e2m1(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * _round_float(x.abs(), 1, 0, 6.0)


def _pow2_at_least(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= x > 0."""
    m, e = torch.frexp(x)
    return torch.exp2(torch.where(m == 0.5, e - 1, e).to(F64))


def kv_round(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x (..., W) rounded as its cache row stores it: "fp8" / "fp4" / "mxfp4" (module docstring)."""
    block = 16 if fmt == "fp4" else 32
    b = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = b.abs().amax(-1, keepdim=True)
    if fmt == "fp8":
        scale = _pow2_at_least(torch.clamp(amax, min=2.0**-126 * 448) / 448)
        out = e4m3(b / scale) * scale
    elif fmt == "mxfp4":
        scale = _pow2_at_least(torch.clamp(amax, min=2.0**-126 * 6) / 6)
        out = e2m1(b / scale) * scale
    else:
        scale = e4m3(amax / 6)
        safe = torch.where(scale > 0, scale, 1.0)
        out = torch.where(scale > 0, e2m1(torch.clamp(b / safe, -6, 6)) * scale, 0.0)
    return out.reshape(x.shape)


# name -> formats of (window K, main entries, index keys)
KV_FORMATS = {
    "bf16": (None, None, None),
    "auto": ("fp8", "fp4", "mxfp4"),
    "fp4": ("fp8", "fp4", "mxfp4"),
    "fp8": ("fp8", "fp8", "mxfp4"),
}


def _maybe_round(x: torch.Tensor, fmt: str | None) -> torch.Tensor:
    return x if fmt is None else kv_round(x, fmt)


# --------------------------------------------------------------------------------------------
# config (1.1)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class V41Config:
    """The fields of `text_config` the text model reads, checked."""

    n_layers: int
    hidden: int
    vocab: int
    n_heads: int
    head_dim: int  # D: one K=V head, the last `rope_dim` channels rotated
    rope_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    window: int
    eps: float
    rope_theta: float
    compress_rope_theta: float
    rope_scaling: dict[str, Any] | None
    ratios: tuple[int, ...]  # per main layer: 0, 1 or 2
    index_topk: int
    index_heads: int
    index_head_dim: int
    kv_map: tuple[int, ...]  # layer -> layer whose main KV it uses
    index_k_map: tuple[int, ...]  # layer -> layer whose index K it uses
    index_map: tuple[int, ...]  # layer -> layer whose top-k it uses
    candidate_source: int | None
    candidate_topk_blocks: int
    candidate_block_size: int
    n_prefill_layer: int  # first C1 layer: YOCO decoder half is [n_prefill_layer, n_layers)
    n_experts: int
    n_shared: int
    top_k: int
    moe_inter: int
    routed_scaling: float
    swiglu_limit: float | None
    hc_mult: int
    hc_eps: float
    hc_iters: int
    hc_shifted: bool
    engram_layers: tuple[int, ...]
    engram_max_ngram: int
    engram_vocab: int
    engram_heads: int
    engram_head_dim: int
    engram_hash_vocab: int  # vocabulary size the hash multipliers are bounded by
    engram_pad: int
    tie_word_embeddings: bool

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> V41Config:
        if config.get("model_type") != "deepseek_v41":
            raise ValueError(f"model_type must be 'deepseek_v41', got {config.get('model_type')!r}")
        if "text_config" not in config:
            raise ValueError("config has no text_config (DeepSeek's V4.1 schema nests the model in it)")
        t = config["text_config"]
        for key, want in (("hidden_act", "silu"), ("num_key_value_heads", 1), ("attention_bias", False)):
            if t.get(key, want) != want:
                raise ValueError(f"text_config.{key} must be {want!r}, got {t[key]!r}")
        for key, want in (
            ("scoring_func", "sqrtsoftplus"),
            ("topk_method", "noaux_tc"),
            ("norm_topk_prob", True),
        ):
            if t[key] != want:
                raise ValueError(f"text_config.{key} must be {want!r}, got {t[key]!r}")
        n = int(t["num_hidden_layers"])
        nextn = int(t.get("num_nextn_predict_layers", 0))
        ratios = [int(r) for r in t["compress_ratios"]]
        if len(ratios) != n + nextn:
            raise ValueError(
                f"compress_ratios has {len(ratios)} entries, expected num_hidden_layers + nextn = {n + nextn}"
            )
        if any(r not in (0, 1, 2) for r in ratios):
            raise ValueError(f"compress_ratios may hold only 0, 1, 2 (C4/C128 were removed), got {ratios}")
        ratios = ratios[:n]
        if 1 not in ratios:
            raise ValueError("V4.1 needs at least one C1 layer: the first one starts the YOCO decoder half")
        heads, groups = int(t["num_attention_heads"]), int(t["o_groups"])
        if heads % groups:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of o_groups {groups}")
        head_dim, rope_dim = int(t["head_dim"]), int(t["qk_rope_head_dim"])
        if rope_dim % 2 or rope_dim > head_dim or rope_dim > int(t["index_head_dim"]):
            raise ValueError(f"qk_rope_head_dim {rope_dim} must be even and fit head_dim and index_head_dim")
        kv_ids = t["kv_source_layer_ids"]
        cfg = cls(
            n_layers=n,
            hidden=int(t["hidden_size"]),
            vocab=int(t["vocab_size"]),
            n_heads=heads,
            head_dim=head_dim,
            rope_dim=rope_dim,
            q_lora_rank=int(t["q_lora_rank"]),
            o_lora_rank=int(t["o_lora_rank"]),
            o_groups=groups,
            window=int(t["sliding_window"]),
            eps=float(t["rms_norm_eps"]),
            rope_theta=float(t["rope_theta"]),
            compress_rope_theta=float(t["compress_rope_theta"]),
            rope_scaling=t.get("rope_scaling") or None,
            ratios=tuple(ratios),
            index_topk=int(t["index_topk"]),
            index_heads=int(t["index_n_heads"]),
            index_head_dim=int(t["index_head_dim"]),
            kv_map=tuple(source_map(kv_ids, n)),
            index_k_map=tuple(source_map(t.get("index_k_source_layer_ids", kv_ids), n)),
            index_map=tuple(source_map(t["index_source_layer_ids"], n)),
            candidate_source=t.get("candidate_source_layer_id"),
            candidate_topk_blocks=int(t.get("candidate_topk_blocks") or 0),
            candidate_block_size=int(t.get("candidate_block_size") or 0),
            n_prefill_layer=ratios.index(1),
            n_experts=int(t["n_routed_experts"]),
            n_shared=int(t["n_shared_experts"]),
            top_k=int(t["num_experts_per_tok"]),
            moe_inter=int(t["moe_intermediate_size"]),
            routed_scaling=float(t["routed_scaling_factor"]),
            swiglu_limit=None if t.get("swiglu_limit") is None else float(t["swiglu_limit"]),
            hc_mult=int(t["hc_mult"]),
            hc_eps=float(t["hc_eps"]),
            hc_iters=int(t["hc_sinkhorn_iters"]),
            hc_shifted=bool(t.get("hc_shifted", True)),
            engram_layers=tuple(t.get("engram_layer_ids") or ()),
            engram_max_ngram=int(t.get("engram_max_ngram_size") or 0),
            engram_vocab=int(t.get("engram_vocab_size") or 0),
            engram_heads=int(t.get("engram_n_heads") or 0),
            engram_head_dim=int(t.get("engram_head_dim") or 0),
            engram_hash_vocab=int(t.get("engram_compressed_vocab_size") or t["vocab_size"]),
            engram_pad=int(t.get("engram_pad_token_id", 2)),
            tie_word_embeddings=bool(t.get("tie_word_embeddings", False)),
        )
        cfg._check_sharing()
        return cfg

    def _check_sharing(self) -> None:
        """DS `cross_layer.py` validation: segments, equal ratio / top-k, chain topk ⊆ index-K ⊆ KV."""
        for name, m in (("kv", self.kv_map), ("index-k", self.index_k_map), ("index", self.index_map)):
            for layer, src in enumerate(m):
                if src != layer and (self.ratios[layer] == 0 or self.ratios[layer] != self.ratios[src]):
                    raise ValueError(
                        f"{name} sharing: layer {layer} (ratio {self.ratios[layer]}) cannot use source {src} "
                        f"(ratio {self.ratios[src]}); consumers must be compressed layers of its ratio"
                    )
        for fine_name, fine, coarse_name, coarse in (
            ("index", self.index_map, "index-k", self.index_k_map),
            ("index-k", self.index_k_map, "kv", self.kv_map),
        ):
            for layer, src in enumerate(fine):
                if coarse[src] != coarse[layer]:
                    raise ValueError(
                        f"{fine_name} segment of layer {layer} crosses a {coarse_name} segment boundary"
                    )
        if self.kv_map[self.n_prefill_layer] != self.n_prefill_layer:
            raise ValueError(f"a KV-share segment crosses the YOCO boundary at layer {self.n_prefill_layer}")
        cs = self.candidate_source
        if cs is not None:
            if self.index_map[cs] != cs or self.ratios[cs] == 0:
                raise ValueError(f"candidate_source_layer_id {cs} must be a compressed index-source layer")
            if any(self.ratios[layer] != self.ratios[cs] for layer in range(cs, self.n_layers)):
                raise ValueError("every layer from candidate_source_layer_id on must have the source's ratio")
            if self.candidate_topk_blocks <= 0 or self.candidate_topk_blocks % 8:
                raise ValueError(
                    f"candidate_topk_blocks must be a multiple of 8 above 0, got {self.candidate_topk_blocks}"
                )
            if not 0 < self.candidate_block_size <= 16:
                raise ValueError(f"candidate_block_size must be in 1..16, got {self.candidate_block_size}")
            if self.candidate_topk_blocks * self.candidate_block_size < self.index_topk:
                raise ValueError("candidate_topk_blocks * candidate_block_size must be >= index_topk")
        bad = [layer for layer in self.engram_layers if layer >= self.n_prefill_layer]
        if bad:
            raise ValueError(
                f"Engram layers {bad} are in the YOCO decoder half (from layer {self.n_prefill_layer})"
            )


def source_map(source_ids: Sequence[int], n_layers: int) -> list[int]:
    """Layer -> nearest listed source at or below it; layers below the first source map to themselves."""
    ids = sorted(int(i) for i in source_ids)
    if not ids or ids[0] < 0 or ids[-1] >= n_layers:
        raise ValueError(
            f"source layer ids {list(source_ids)} must be non-empty and inside 0..{n_layers - 1}"
        )
    return [max((s for s in ids if s <= layer), default=layer) for layer in range(n_layers)]


# --------------------------------------------------------------------------------------------
# small math: norm, RoPE (1.3), hyper-connections (1.7)
# --------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def rope_inv_freq(dim: int, base: float, yarn: dict[str, Any] | None) -> torch.Tensor:
    """(dim/2,) inverse frequencies; YaRN with mscale off (cos/sin are not rescaled)."""
    extra = 1.0 / base ** (torch.arange(0, dim, 2, dtype=F64) / dim)
    if yarn is None:
        return extra
    factor, orig = float(yarn["factor"]), float(yarn["original_max_position_embeddings"])

    def corr_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = float(max(math.floor(corr_dim(float(yarn["beta_fast"]))), 0))
    high = float(min(math.ceil(corr_dim(float(yarn["beta_slow"]))), dim - 1))
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=F64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: keep the original (extrapolated) frequency, 0: interpolate by `factor`
    return extra / factor * (1 - keep) + extra * keep


def apply_rope(
    x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """Interleaved RoPE on the last 2*len(inv_freq) channels of x (..., T, [heads,] d); pos (T,)."""
    d = 2 * inv_freq.numel()
    ang = pos.to(F64)[:, None] * inv_freq[None, :]  # (T, d/2)
    if inverse:
        ang = -ang
    while ang.dim() < x.dim():  # broadcast over head dims between T and channels
        ang = ang.unsqueeze(-2)
    cos, sin = ang.cos(), ang.sin()
    tail = x[..., -d:]
    a, b = tail[..., 0::2], tail[..., 1::2]
    rot = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., :-d], rot), dim=-1)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """(..., n, n): softmax over rows + eps, a column normalisation, then iters-1 (row, column) rounds."""
    x = logits.softmax(-1) + eps
    x = x / (x.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        x = x / (x.sum(-1, keepdim=True) + eps)
        x = x / (x.sum(-2, keepdim=True) + eps)
    return x


def hc_mixes(
    R: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, cfg: V41Config
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Streams R (T, n, H) -> pre (T, n), post (T, n), comb (T, n, n) (row: source stream, column: target)."""
    n = cfg.hc_mult
    flat = R.flatten(1)
    m = (flat @ fn.T) * torch.rsqrt(
        flat.pow(2).mean(-1, keepdim=True) + cfg.eps
    )  # fn has the norm weight folded in
    m = m * torch.cat((scale[0].expand(n), scale[1].expand(n), scale[2].expand(n * n))) + base
    pre = torch.sigmoid(m[:, :n]) + cfg.hc_eps
    post = 2.0 * torch.sigmoid(m[:, n : 2 * n])  # hc_post_mult_value 2.0
    comb = sinkhorn(m[:, 2 * n :].view(-1, n, n), cfg.hc_iters, cfg.hc_eps)
    return pre, post, comb


def hc_post(R: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """R'_j = post_j * out + sum_i comb[i, j] R_i."""
    return post[:, :, None] * out[:, None, :] + torch.einsum("tij,tih->tjh", comb, R)


# --------------------------------------------------------------------------------------------
# compressed KV (1.3) and the sparse indexer (1.4)
# --------------------------------------------------------------------------------------------


def pool_pairs(z: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """C2 pooling: (T, D) gate logits and values -> (T // 2, D), per-channel softmax over each pair."""
    e = z.shape[0] // 2
    zz, vv = z[: 2 * e].view(e, 2, z.shape[1]), v[: 2 * e].view(e, 2, v.shape[1])
    return (zz.softmax(dim=1) * vv).sum(dim=1)


def index_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, ratio: int) -> torch.Tensor:
    """q (T, h, d), w (T, h), k (E, d) -> (T, E) scores sum_h w_h relu(q_h . k), -inf where not visible."""
    s = torch.einsum("th,the->te", w, torch.relu(torch.einsum("thd,ed->the", q, k)))
    pos = torch.arange(q.shape[0])
    visible = torch.arange(k.shape[0])[None, :] < ((pos + 1) // ratio)[:, None]
    return s.masked_fill(~visible, -math.inf)


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """(T, E) -> (T, k) entry ids, best first, ties to the lower id, -1 for missing (-inf scores)."""
    order = torch.sort(-scores, dim=-1, stable=True).indices[:, :k]
    picked = scores.gather(1, order)
    out = torch.where(picked > -math.inf, order, torch.full_like(order, -1))
    if out.shape[1] < k:
        out = F.pad(out, (0, k - out.shape[1]), value=-1)
    return out


def candidate_blocks(scores: torch.Tensor, block: int, n_blocks: int) -> torch.Tensor:
    """Candidate source: (T, E) scores -> (T, n_blocks) block ids (-1 missing) by per-block maximum.
    The last visible block always wins (DS `candidate_block_max`: its score is +inf)."""
    T, E = scores.shape
    nb = -(-E // block)
    padded = F.pad(scores, (0, nb * block - E), value=-math.inf)
    best = padded.view(T, nb, block).amax(-1)
    visible_entries = (scores > -math.inf).sum(-1)
    last = (visible_entries + block - 1) // block - 1
    rows = torch.nonzero(last >= 0).squeeze(-1)
    best[rows, last[rows]] = math.inf
    return select_topk(best, n_blocks)


def restrict_to_blocks(scores: torch.Tensor, blocks: torch.Tensor, block: int) -> torch.Tensor:
    """Keep the scores of entries inside the given blocks, -inf elsewhere."""
    E = scores.shape[1]
    entry_block = torch.arange(E) // block
    inside = (entry_block[None, None, :] == blocks[:, :, None]).any(1)
    return scores.masked_fill(~inside, -math.inf)


def sparse_attention(
    q: torch.Tensor,
    k_swa: torch.Tensor,
    main: torch.Tensor | None,
    topk: torch.Tensor | None,
    window: int,
    sink: torch.Tensor,
) -> torch.Tensor:
    """q (T, h, D), k_swa (T, D), main (E, D), topk (T, k) -> (T, h, D). K = V; a sink logit per head."""
    T, _, D = q.shape
    scale = D**-0.5
    out = torch.empty_like(q)
    for p in range(T):
        keys = [k_swa[max(0, p - window + 1) : p + 1]]
        if main is not None and topk is not None:
            ids = topk[p][topk[p] >= 0]
            keys.append(main[ids])
        kv = torch.cat(keys)  # (S, D)
        logits = q[p] @ kv.T * scale  # (h, S)
        full = torch.cat((logits, sink[:, None]), dim=-1).softmax(-1)  # the sink has no value
        out[p] = full[:, :-1] @ kv
    return out


# --------------------------------------------------------------------------------------------
# MoE (1.8) and Engram (1.9)
# --------------------------------------------------------------------------------------------


def swiglu(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, limit: float | None
) -> torch.Tensor:
    gate, up = x @ w1.T, x @ w3.T
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (F.silu(gate) * up) @ w2.T


def route(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, cfg: V41Config
) -> tuple[torch.Tensor, torch.Tensor]:
    """sqrtsoftplus scores, top-k of score + bias (ties to the lower id), normalised selected scores."""
    s = torch.sqrt(F.softplus(x @ weight.T))
    idx = select_topk(s + bias, cfg.top_k)
    w = s.gather(1, idx)
    return idx, w / w.sum(-1, keepdim=True) * cfg.routed_scaling


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True


def engram_layout(cfg: V41Config) -> dict[int, list[int]]:
    """Layer -> table size per (n-gram size, head), n = 2..max: primes above engram_vocab_size,
    unique across all layers and heads in config order (DS `EngramLayout`)."""
    seen: set[int] = set()
    out: dict[int, list[int]] = {}
    for layer in cfg.engram_layers:
        sizes: list[int] = []
        for _ in range(2, cfg.engram_max_ngram + 1):
            start = cfg.engram_vocab - 1
            for _ in range(cfg.engram_heads):
                p = start + 1
                while not _is_prime(p) or p in seen:
                    p += 1
                seen.add(p)
                sizes.append(p)
                start = p
        out[layer] = sizes
    return out


def engram_multipliers(layer: int, cfg: V41Config) -> torch.Tensor:
    """(max_ngram,) odd int64 multipliers from NumPy's RNG seeded 10007 * layer (DS `NgramHashMapping`)."""
    bound = max(1, (np.iinfo(np.int64).max // cfg.engram_hash_vocab) // 2)
    rng = np.random.default_rng(10007 * int(layer))
    return torch.from_numpy(rng.integers(0, bound, size=(cfg.engram_max_ngram,), dtype=np.int64) * 2 + 1)


def ngram_token_ids(compressed: torch.Tensor, max_ngram: int, pad: int) -> torch.Tensor:
    """(T,) compressed ids -> (T, max_ngram): row p = ids of tokens p, p-1, ..., pad before the start."""
    T = compressed.shape[0]
    out = torch.full((T, max_ngram), pad, dtype=torch.int64)
    for r in range(min(max_ngram, T)):
        out[r:, r] = compressed[: T - r]
    return out


def engram_hash(
    ngram_ids: torch.Tensor, multipliers: torch.Tensor, sizes: Sequence[int], n_heads: int
) -> torch.Tensor:
    """(T, max_ngram) ids -> (T, (max-1) * heads) table rows: XOR of t_r * m_r, mod the head's prime,
    plus the head's row offset (heads of one layer are stacked in one table)."""
    prod = ngram_ids.to(torch.int64) * multipliers[None, :]
    offsets = np.cumsum([0, *sizes[:-1]])
    cols = []
    mix = prod[:, 0]
    for r in range(1, ngram_ids.shape[1]):
        mix = mix ^ prod[:, r]
        for h in range(n_heads):
            c = (r - 1) * n_heads + h
            cols.append(mix % sizes[c] + int(offsets[c]))
    return torch.stack(cols, dim=-1)


# --------------------------------------------------------------------------------------------
# the model
# --------------------------------------------------------------------------------------------


@dataclass
class V41Trace:
    """What one forward computed. Per-layer dicts are keyed by layer id (only where they apply)."""

    logits: torch.Tensor  # (T, vocab)
    final_hidden: torch.Tensor  # (T, H) after the stream collapse, before the final norm
    attn_in: dict[int, torch.Tensor] = field(default_factory=dict)  # attn-norm output (T, H)
    attn_out: dict[int, torch.Tensor] = field(default_factory=dict)  # after wo_b (T, H)
    ffn_in: dict[int, torch.Tensor] = field(default_factory=dict)
    ffn_out: dict[int, torch.Tensor] = field(default_factory=dict)
    main_kv: dict[int, torch.Tensor] = field(
        default_factory=dict
    )  # (E, D) after RoPE, every compressed layer
    index_k: dict[int, torch.Tensor] = field(
        default_factory=dict
    )  # (E, index_head_dim), every compressed layer
    index_scores: dict[int, torch.Tensor] = field(default_factory=dict)  # (T, E), index-source layers
    topk: dict[int, torch.Tensor] = field(default_factory=dict)  # (T, index_topk), every compressed layer
    candidates: dict[int, torch.Tensor] = field(default_factory=dict)  # (T, blocks), candidate source
    h_star: torch.Tensor | None = None  # YOCO shared hidden
    # the streams entering each layer (after the previous post, before Engram) (T, n, H)
    streams_in: dict[int, torch.Tensor] = field(default_factory=dict)


class V41Oracle:
    """DeepSeek-V4.1 text model in float64; see the module docstring."""

    def __init__(
        self,
        config: dict[str, Any],
        tensors: dict[str, torch.Tensor],
        engram_lookup: Sequence[int] | None = None,
        kv_cache_dtype: str = "bf16",
        round_index_queries: bool = True,
    ):
        """round_index_queries False: the index Q stays float under FP4 index keys (tests showing
        that the queries' rounding changes the tokens)."""
        self.cfg = V41Config.from_dict(config)
        self.kv_formats = KV_FORMATS[kv_cache_dtype]  # (window, main, index) formats
        self.query_format = self.kv_formats[2] if round_index_queries else None
        self.w = {name.removeprefix("model."): t.detach().to(F64) for name, t in tensors.items()}
        self.engram_lookup = (
            None if engram_lookup is None else torch.as_tensor(engram_lookup, dtype=torch.int64)
        )
        c = self.cfg
        self.inv_freq_base = rope_inv_freq(c.rope_dim, c.rope_theta, None)
        self.inv_freq_compress = rope_inv_freq(c.rope_dim, c.compress_rope_theta, c.rope_scaling)
        self.engram_sizes = engram_layout(c) if c.engram_layers else {}
        missing = [n for n in expected_tensor_shapes(c) if n not in self.w]
        if missing:
            raise ValueError(f"{len(missing)} tensors missing from the checkpoint, e.g. {missing[:5]}")
        for name, shape in expected_tensor_shapes(c).items():
            if tuple(self.w[name].shape) != shape:
                raise ValueError(f"{name}: shape {tuple(self.w[name].shape)}, expected {shape}")

    # -- one layer's attention -----------------------------------------------------------------

    def _main_kv(self, L: int, src_in: torch.Tensor, tr: V41Trace) -> torch.Tensor:
        """KV-source layer L: compressor(src_in) -> c_pre (E, D) after its norm, before RoPE."""
        c, w = self.cfg, self.w
        p = f"layers.{L}.attn.compressor."
        v = src_in @ w[p + "wkv.weight"].T
        pooled = v if c.ratios[L] == 1 else pool_pairs(src_in @ w[p + "wgate.weight"].T, v)
        return rms_norm(pooled, w[p + "norm.weight"], c.eps)

    def _attention(self, L: int, x: torch.Tensor, state: dict[str, Any], tr: V41Trace) -> torch.Tensor:
        c, w = self.cfg, self.w
        p = f"layers.{L}.attn."
        T = x.shape[0]
        pos = torch.arange(T)
        r = c.ratios[L]
        inv_freq = self.inv_freq_compress if r else self.inv_freq_base
        # Q: low rank, RMSNorm on q_a, no per-head norm (V4.1), RoPE on the tail of every head.
        qn = rms_norm(x @ w[p + "wq_a.weight"].T, w[p + "q_norm.weight"], c.eps)
        q = apply_rope((qn @ w[p + "wq_b.weight"].T).view(T, c.n_heads, c.head_dim), pos, inv_freq)
        # SWA K = V from the layer's own hidden.
        k_swa = apply_rope(rms_norm(x @ w[p + "wkv.weight"].T, w[p + "kv_norm.weight"], c.eps), pos, inv_freq)
        fw, fm, fi = self.kv_formats
        k_swa = _maybe_round(k_swa, fw)
        main = topk = None
        if r:
            if c.kv_map[L] == L:
                # YOCO: decoder-half KV sources compress the shared hidden h*, not their own input.
                src_in = state["h_star"] if c.n_prefill_layer <= L else x
                state["c_pre"] = self._main_kv(L, src_in, tr)
                state["main"] = _maybe_round(
                    apply_rope(state["c_pre"], torch.arange(state["c_pre"].shape[0]) * r, inv_freq), fm
                )
            main = state["main"]
            E = main.shape[0]
            if c.index_k_map[L] == L:  # index K from the KV segment's pre-RoPE entries
                kp = f"layers.{L}.attn.indexer."
                k_i = rms_norm(state["c_pre"] @ w[kp + "wk.weight"].T, w[kp + "k_norm.weight"], c.eps)
                state["index_k"] = _maybe_round(apply_rope(k_i, torch.arange(E) * r, inv_freq), fi)
            if c.index_map[L] == L:
                ip = f"layers.{L}.attn.indexer."
                q_i = (qn @ w[ip + "wq_b.weight"].T).view(T, c.index_heads, c.index_head_dim)
                q_i = _maybe_round(apply_rope(q_i, pos, inv_freq), self.query_format)  # FP4 Q (1.4)
                scores = index_scores(q_i, x @ w[ip + "weights_proj.weight"].T, state["index_k"], r)
                tr.index_scores[L] = scores
                if c.candidate_source is not None and c.candidate_source == L:
                    state["blocks"] = candidate_blocks(
                        scores, c.candidate_block_size, c.candidate_topk_blocks
                    )
                    tr.candidates[L] = state["blocks"]
                elif c.candidate_source is not None and c.candidate_source < L:
                    scores = restrict_to_blocks(scores, state["blocks"], c.candidate_block_size)
                state["topk"] = select_topk(scores, c.index_topk)
            topk = state["topk"]
            tr.main_kv[L], tr.index_k[L], tr.topk[L] = main, state["index_k"], topk
        o = sparse_attention(q, k_swa, main, topk, c.window, w[p + "attn_sink"])
        o = apply_rope(o, pos, inv_freq, inverse=True)  # undo the query-position rotation on V's tail
        # Grouped output projection: heads in o_groups groups, each to o_lora_rank, then wo_b.
        g = c.o_groups
        wo_a = w[p + "wo_a.weight"].view(g, c.o_lora_rank, -1)
        mid = torch.einsum("tgr,gdr->tgd", o.reshape(T, g, -1), wo_a).reshape(T, -1)
        return mid @ w[p + "wo_b.weight"].T

    # -- MoE and Engram -----------------------------------------------------------------------------

    def _moe(self, L: int, x: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        c, w = self.cfg, self.w
        p = f"layers.{L}.ffn."
        idx, weights = route(x, w[p + "gate.weight"], w[p + "gate.bias"], c)
        if image is not None and bool(image.any()):  # image rows: their own bias
            bias_vl = w.get(p + "gate.bias_vl", w[p + "gate.bias"])
            idx_vl, weights_vl = route(x, w[p + "gate.weight"], bias_vl, c)
            idx = torch.where(image[:, None], idx_vl, idx)
            weights = torch.where(image[:, None], weights_vl, weights)
        out = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():
            rows, slot = torch.nonzero(idx == e, as_tuple=True)
            ep = f"{p}experts.{e}."
            y = swiglu(x[rows], w[ep + "w1.weight"], w[ep + "w2.weight"], w[ep + "w3.weight"], c.swiglu_limit)
            out.index_add_(0, rows, y * weights[rows, slot, None])
        if c.n_shared:
            sp = p + "shared_experts."
            out = out + swiglu(
                x, w[sp + "w1.weight"], w[sp + "w2.weight"], w[sp + "w3.weight"], c.swiglu_limit
            )
        return out

    def _engram(
        self, L: int, R: torch.Tensor, ngram_ids: torch.Tensor, image: torch.Tensor | None = None
    ) -> torch.Tensor:
        """R (T, n, H) += g ⊙ v with a gate per stream (no short convolution in V4.1)."""
        c, w = self.cfg, self.w
        p = f"layers.{L}.engram."
        rows = engram_hash(ngram_ids, engram_multipliers(L, c), self.engram_sizes[L], c.engram_heads)
        e = w[p + "embed.weight"][rows].flatten(1)  # (T, (max-1) * heads * head_dim)
        kv = (e @ w[p + "wkv.weight"].T).view(-1, c.hc_mult + 1, c.hidden)
        k, v = kv[:, : c.hc_mult], kv[:, c.hc_mult]  # keys per stream, then one value
        a = (rms_norm(R, None, c.eps) * w[p + "q_weight"] * w[p + "k_weight"] * rms_norm(k, None, c.eps)).sum(
            -1
        )
        a = a / math.sqrt(c.hidden)
        g = torch.sigmoid(torch.sign(a) * torch.sqrt(a.abs().clamp_min(1e-6)))  # (T, n)
        if image is not None:  # image tokens are masked out
            g = torch.where(image[:, None], torch.zeros_like(g), g)
        return R + g[:, :, None] * v[:, None, :]

    # -- whole model --------------------------------------------------------------------------

    def forward(
        self,
        tokens: Sequence[int] | torch.Tensor,
        ngram_ids: torch.Tensor | None = None,
        images: Sequence[tuple[int, torch.Tensor]] = (),
    ) -> V41Trace:
        c, w = self.cfg, self.w
        ids = torch.as_tensor(tokens, dtype=torch.int64)
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"tokens must be a non-empty 1-D sequence, got shape {tuple(ids.shape)}")
        T, n = ids.numel(), c.hc_mult
        image = torch.zeros(T, dtype=torch.bool)
        for start, rows in images:
            image[start : start + rows.shape[0]] = True
        if bool((ids[~image] >= c.vocab).any()) or bool((ids[image] < c.vocab).any()):
            raise ValueError("image spans must cover exactly the token ids past the vocabulary")
        text_ids = torch.where(image, 0, ids)
        if c.engram_layers and ngram_ids is None:
            compressed = text_ids if self.engram_lookup is None else self.engram_lookup[text_ids]
            compressed = torch.where(image, c.engram_pad, compressed)
            ngram_ids = ngram_token_ids(compressed, c.engram_max_ngram, c.engram_pad)
        emb = w["embed.weight"][text_ids].clone()
        for start, rows in images:
            emb[start : start + rows.shape[0]] = rows.to(F64)
        R = emb[:, None, :].expand(T, n, c.hidden).clone()  # streams (T, n, H)
        mask = image if images else None
        tr = V41Trace(logits=torch.empty(0), final_hidden=torch.empty(0))
        state: dict[str, Any] = {}
        pre_prev = F.one_hot(torch.zeros(T, dtype=torch.int64), n).to(F64)  # shifted HC: first read stream 0
        pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (out, post, comb)
        for L in range(c.n_layers):
            for sub in ("attn", "ffn"):
                if pending is not None:
                    R = hc_post(R, *pending)
                if sub == "attn":
                    tr.streams_in[L] = R
                if sub == "attn" and L in c.engram_layers:
                    R = self._engram(L, R, ngram_ids, mask)  # type: ignore[arg-type]
                pre, post, comb = hc_mixes(
                    R,
                    w[f"layers.{L}.hc_{sub}_fn"],
                    w[f"layers.{L}.hc_{sub}_base"],
                    w[f"layers.{L}.hc_{sub}_scale"],
                    c,
                )
                # Shifted HC applies the pre-mix computed by the previous sublayer to the current streams.
                mix = pre_prev if c.hc_shifted else pre
                x = rms_norm((mix[:, :, None] * R).sum(1), w[f"layers.{L}.{sub}_norm.weight"], c.eps)
                if sub == "attn":
                    if c.n_prefill_layer == L:
                        state["h_star"] = tr.h_star = x
                    tr.attn_in[L] = x
                    out = tr.attn_out[L] = self._attention(L, x, state, tr)
                else:
                    tr.ffn_in[L] = x
                    out = tr.ffn_out[L] = self._moe(L, x, mask)
                pending, pre_prev = (out, post, comb), pre
        assert pending is not None
        R = hc_post(R, *pending)
        if c.hc_shifted:
            h = (pre_prev[:, :, None] * R).sum(1)
        else:
            flat = R.flatten(1)
            m = (flat @ w["hc_head_fn"].T) * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + c.eps)
            head_pre = torch.sigmoid(m * w["hc_head_scale"] + w["hc_head_base"]) + c.hc_eps
            h = (head_pre[:, :, None] * R).sum(1)
        tr.final_hidden = h
        head = w["embed.weight"] if c.tie_word_embeddings and "head.weight" not in w else w["head.weight"]
        tr.logits = rms_norm(h, w["norm.weight"], c.eps) @ head.T
        return tr

    def logits(
        self,
        tokens: Sequence[int] | torch.Tensor,
        ngram_ids: torch.Tensor | None = None,
        images: Sequence[tuple[int, torch.Tensor]] = (),
    ) -> torch.Tensor:
        return self.forward(tokens, ngram_ids, images).logits

    def greedy(
        self, prompt: Sequence[int], n: int, images: Sequence[tuple[int, torch.Tensor]] = ()
    ) -> list[int]:
        """n greedy tokens after prompt (images: as forward's); the whole sequence is recomputed
        each step (no cache)."""
        seq = list(prompt)
        out: list[int] = []
        for _ in range(n):
            nxt = int(self.logits(seq, images=images)[-1].argmax())
            seq.append(nxt)
            out.append(nxt)
        return out


def expected_tensor_shapes(cfg: V41Config) -> dict[str, tuple[int, ...]]:
    """Every tensor the text model reads, by DeepSeek HF name, with its shape (DS `hugging_face/names.py`,
    `v4_modules/mla_attn.py`, `moe.py`, `hc_blocks.py`, `engram_parameters.py`). Which layers carry the
    compressor / indexer / index-K tensors follows the sharing maps (only sources hold them)."""
    c = cfg
    H, D, n = c.hidden, c.head_dim, c.hc_mult
    s: dict[str, tuple[int, ...]] = {"embed.weight": (c.vocab, H), "norm.weight": (H,)}
    if not c.tie_word_embeddings:
        s["head.weight"] = (c.vocab, H)
    if not c.hc_shifted:
        s |= {"hc_head_fn": (n, n * H), "hc_head_base": (n,), "hc_head_scale": (1,)}
    for L in range(c.n_layers):
        p = f"layers.{L}."
        for sub in ("attn", "ffn"):
            s |= {
                f"{p}hc_{sub}_fn": ((2 + n) * n, n * H),
                f"{p}hc_{sub}_base": ((2 + n) * n,),
                f"{p}hc_{sub}_scale": (3,),
            }
            s[f"{p}{sub}_norm.weight"] = (H,)
        a = p + "attn."
        s |= {
            a + "wq_a.weight": (c.q_lora_rank, H),
            a + "q_norm.weight": (c.q_lora_rank,),
            a + "wq_b.weight": (c.n_heads * D, c.q_lora_rank),
            a + "wkv.weight": (D, H),
            a + "kv_norm.weight": (D,),
            a + "wo_a.weight": (c.o_groups * c.o_lora_rank, c.n_heads // c.o_groups * D),
            a + "wo_b.weight": (H, c.o_groups * c.o_lora_rank),
            a + "attn_sink": (c.n_heads,),
        }
        if c.ratios[L]:
            if c.kv_map[L] == L:
                s |= {a + "compressor.wkv.weight": (D, H), a + "compressor.norm.weight": (D,)}
                if c.ratios[L] == 2:
                    s[a + "compressor.wgate.weight"] = (D, H)
            if c.index_map[L] == L:
                s |= {
                    a + "indexer.wq_b.weight": (c.index_heads * c.index_head_dim, c.q_lora_rank),
                    a + "indexer.weights_proj.weight": (c.index_heads, H),
                }
            if c.index_k_map[L] == L:
                s |= {
                    a + "indexer.wk.weight": (c.index_head_dim, D),
                    a + "indexer.k_norm.weight": (c.index_head_dim,),
                }
        f = p + "ffn."
        s |= {f + "gate.weight": (c.n_experts, H), f + "gate.bias": (c.n_experts,)}
        for e in range(c.n_experts):
            s |= {
                f"{f}experts.{e}.w1.weight": (c.moe_inter, H),
                f"{f}experts.{e}.w3.weight": (c.moe_inter, H),
                f"{f}experts.{e}.w2.weight": (H, c.moe_inter),
            }
        if c.n_shared:
            si = c.n_shared * c.moe_inter
            s |= {
                f + "shared_experts.w1.weight": (si, H),
                f + "shared_experts.w3.weight": (si, H),
                f + "shared_experts.w2.weight": (H, si),
            }
        if L in c.engram_layers:
            rows = sum(engram_layout(c)[L])
            width = (c.engram_max_ngram - 1) * c.engram_heads * c.engram_head_dim
            s |= {
                p + "engram.q_weight": (n, H),
                p + "engram.k_weight": (n, H),
                p + "engram.embed.weight": (rows, c.engram_head_dim),
                p + "engram.wkv.weight": ((n + 1) * H, width),
            }
    return s


# --------------------------------------------------------------------------------------------
# the DFlash (DSpark) drafter (1.10, 1.11)
# --------------------------------------------------------------------------------------------


def dspark_tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The drafter's tensors (DeepSeek's names, mtp.{i}.*): per draft layer a sliding-window V4.1
    block (the layers' names, the drafter's dspark_n_routed_experts); mtp.0 also projection and
    project_norm, the last norm, markov_w1 (V, r), markov_w2 (V, r) and accept_rate.proj (1, H + r)."""
    t = config["text_config"]
    nextn = int(t.get("num_nextn_predict_layers", 0))
    if not nextn:
        return {}
    sub = {**config, "text_config": {**t, "num_hidden_layers": 1, "num_nextn_predict_layers": 0,
                                     "compress_ratios": [1], "n_routed_experts": t["dspark_n_routed_experts"],
                                     "kv_source_layer_ids": [0], "index_source_layer_ids": [0],
                                     "index_k_source_layer_ids": [0], "engram_layer_ids": []}}  # fmt: skip
    c = V41Config.from_dict(sub)
    one = {k: v for k, v in expected_tensor_shapes(c).items() if k.startswith("layers.0.")}
    one = {k: v for k, v in one.items() if ".compressor." not in k and ".indexer." not in k}
    H, V, r = c.hidden, c.vocab, int(t["dspark_markov_rank"])
    out: dict[str, tuple[int, ...]] = {}
    for i in range(nextn):
        out |= {k.replace("layers.0.", f"mtp.{i}.", 1): v for k, v in one.items()}
    n = len(t["dspark_target_layer_ids"])
    last = f"mtp.{nextn - 1}."
    out |= {"mtp.0.projection.weight": (H, n * H), "mtp.0.project_norm.weight": (H,),
            last + "norm.weight": (H,), last + "markov_w1.weight": (V, r), last + "markov_w2.weight": (V, r),
            last + "accept_rate.proj.weight": (1, H + r)}  # fmt: skip
    return out


class V41DSparkOracle:
    """The DSpark drafter of a V4.1 checkpoint in float64, whole-sequence, written from 1.11:
    trunks = the mean over the hc_mult streams entering each dspark_target_layer_ids layer (the
    target oracle's), u = RMSNorm(projection(concat)), each draft layer's context keys
    RoPE_base(RMSNorm(wkv u)) at positions 0..t. The block [x, noise x (B-1)] at t+1..t+B goes
    through the draft layers (V4.1 blocks: SWA-only, base RoPE, their own top-k MoE, shifted HC),
    every slot attending keys t-W+1..t+B (the context's and all B slots', a sink per head); after
    the collapse, logits_s = norm(h_s) @ head + markov_w2(markov_w1[prev_s]) and
    c_s = sigmoid([h_s ; markov_w1[prev_s]] . w / T). kv_cache_dtype: as V41Oracle's; the draft
    layers' keys (injected and the block's) are rounded to the window rows' format too."""

    def __init__(
        self, config: dict[str, Any], tensors: dict[str, torch.Tensor], kv_cache_dtype: str = "bf16"
    ) -> None:
        self.target = V41Oracle(config, tensors, kv_cache_dtype=kv_cache_dtype)
        self.window_format = self.target.kv_formats[0]
        self.cfg, t = self.target.cfg, config["text_config"]
        self.w = self.target.w
        self.layers = int(t["num_nextn_predict_layers"])
        self.block = int(t["dspark_block_size"])
        self.targets = [int(i) for i in t["dspark_target_layer_ids"]]
        self.noise = int(t["dspark_noise_token_id"])
        self.n_experts, self.top_k = int(t["dspark_n_routed_experts"]), int(t["dspark_num_experts_per_tok"])
        for name, shape in dspark_tensor_shapes(config).items():
            if name not in self.w or tuple(self.w[name].shape) != shape:
                raise ValueError(f"{name}: missing or not of shape {shape}")

    def _attention(self, i: int, x: torch.Tensor, ctx: torch.Tensor, t: int) -> torch.Tensor:
        """Draft layer i: x (B, H) the block's normed inputs at t+1..t+B; ctx (t+1, D) the
        injected keys -> (B, H)."""
        c, w, p = self.cfg, self.w, f"mtp.{i}.attn."
        B = x.shape[0]
        pos = torch.arange(t + 1, t + 1 + B)
        inv = self.target.inv_freq_base
        qn = rms_norm(x @ w[p + "wq_a.weight"].T, w[p + "q_norm.weight"], c.eps)
        q = apply_rope((qn @ w[p + "wq_b.weight"].T).view(B, c.n_heads, c.head_dim), pos, inv)
        k = apply_rope(rms_norm(x @ w[p + "wkv.weight"].T, w[p + "kv_norm.weight"], c.eps), pos, inv)
        k = _maybe_round(k, self.window_format)
        kv = torch.cat([ctx[max(0, t - c.window + 1) : t + 1], k])  # (S, D) the same for every slot
        logits = torch.einsum("bhd,sd->bhs", q, kv) * c.head_dim**-0.5
        sink = w[p + "attn_sink"][None, :, None].expand(B, -1, 1)
        o = torch.cat([logits, sink], dim=-1).softmax(-1)[..., :-1] @ kv  # (B, h, D)
        o = apply_rope(o, pos, inv, inverse=True)
        g = c.o_groups
        wo_a = w[p + "wo_a.weight"].view(g, c.o_lora_rank, -1)
        mid = torch.einsum("tgr,gdr->tgd", o.reshape(B, g, -1), wo_a).reshape(B, -1)
        return mid @ w[p + "wo_b.weight"].T

    def _moe(self, i: int, x: torch.Tensor) -> torch.Tensor:
        c, w, p = self.cfg, self.w, f"mtp.{i}.ffn."
        s = torch.sqrt(F.softplus(x @ w[p + "gate.weight"].T))  # (B, E)
        idx = select_topk(s + w[p + "gate.bias"], self.top_k)
        wts = s.gather(1, idx)
        wts = wts / wts.sum(-1, keepdim=True) * c.routed_scaling
        out = torch.zeros_like(x)
        for b in range(x.shape[0]):
            for j in range(self.top_k):
                ep = f"{p}experts.{int(idx[b, j])}."
                y = swiglu(x[b : b + 1], w[ep + "w1.weight"], w[ep + "w2.weight"], w[ep + "w3.weight"],
                           c.swiglu_limit)  # fmt: skip
                out[b] += wts[b, j] * y[0]
        if c.n_shared:
            sp = p + "shared_experts."
            out = out + swiglu(
                x, w[sp + "w1.weight"], w[sp + "w2.weight"], w[sp + "w3.weight"], c.swiglu_limit
            )
        return out

    def drafts(
        self, tokens: Sequence[int], k: int, temperature: float = 1.0
    ) -> tuple[list[int], list[float], list[torch.Tensor]]:
        """The context tokens[:-1] (positions 0..t), the emitted token tokens[-1] at t+1 -> (k
        greedy drafts, their confidences (prefix products), each slot's final logits (V,))."""
        c, w = self.cfg, self.w
        t = len(tokens) - 2
        tr = self.target.forward(list(tokens[:-1]))
        trunks = torch.cat([tr.streams_in[L].mean(1) for L in self.targets], dim=-1)  # (t+1, n H)
        u = rms_norm(trunks @ w["mtp.0.projection.weight"].T, w["mtp.0.project_norm.weight"], c.eps)
        ctx_pos = torch.arange(t + 1)
        ids = torch.tensor([tokens[-1]] + [self.noise] * (self.block - 1))
        R = w["embed.weight"][ids][:, None, :].expand(-1, c.hc_mult, -1).clone()  # (B, n, H)
        pre_prev = F.one_hot(torch.zeros(self.block, dtype=torch.int64), c.hc_mult).to(F64)
        pending = None
        for i in range(self.layers):
            p = f"mtp.{i}."
            a = p + "attn."
            ctx = apply_rope(rms_norm(u @ w[a + "wkv.weight"].T, w[a + "kv_norm.weight"], c.eps), ctx_pos,
                             self.target.inv_freq_base)  # fmt: skip
            ctx = _maybe_round(ctx, self.window_format)
            for sub in ("attn", "ffn"):
                if pending is not None:
                    R = hc_post(R, *pending)
                pre, post, comb = hc_mixes(
                    R, w[f"{p}hc_{sub}_fn"], w[f"{p}hc_{sub}_base"], w[f"{p}hc_{sub}_scale"], c
                )
                x = rms_norm((pre_prev[:, :, None] * R).sum(1), w[f"{p}{sub}_norm.weight"], c.eps)
                out = self._attention(i, x, ctx, t) if sub == "attn" else self._moe(i, x)
                pending, pre_prev = (out, post, comb), pre
        assert pending is not None
        R = hc_post(R, *pending)
        h = (pre_prev[:, :, None] * R).sum(1)  # (B, H) collapsed, pre-norm
        last = f"mtp.{self.layers - 1}."
        head = w["embed.weight"] if c.tie_word_embeddings and "head.weight" not in w else w["head.weight"]
        base = rms_norm(h, w[last + "norm.weight"], c.eps) @ head.T  # (B, V)
        prev, drafts, confs, logits_out, conf = int(tokens[-1]), [], [], [], 1.0
        for s_ in range(k):
            low = w[last + "markov_w1.weight"][prev]  # (r,)
            logits = base[s_] + w[last + "markov_w2.weight"] @ low
            feats = torch.cat([h[s_], low])
            conf *= float(torch.sigmoid((w[last + "accept_rate.proj.weight"][0] @ feats) / temperature))
            prev = int(logits.argmax())
            drafts.append(prev)
            confs.append(conf)
            logits_out.append(logits)
        return drafts, confs, logits_out
