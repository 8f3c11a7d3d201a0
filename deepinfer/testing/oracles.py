"""An independent DeepSeek-V2 / V3 forward in float64, the oracle the model tests compare with.

Written from DeepSeek's published V3 reference code (inference/model.py), sharing no code with
deepinfer.models: naive MLA (the latent expanded into per-head keys and values, complex-number
rope with YaRN, full causal attention without a cache), routing token by token (softmax or
sigmoid scores, greedy / group-limited / noaux_tc top-k, routed scaling), an expert loop, and the
MTP head. It works on a state dict with DeepSeek's tensor names and the config.json dict.
A quantised KV cache is modelled by a function of the cached rows (e4m3_rows64: the FP8 latent
rows, written here in float64 from the format's definition).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _yarn_inv_freq(cfg: dict[str, Any], dim: int) -> tuple[torch.Tensor, float]:
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    base = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    freqs = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if rope.get("type", rope.get("rope_type", "default")) != "yarn":
        return freqs, 1.0
    factor, orig = float(rope["factor"]), rope["original_max_position_embeddings"]

    def corr(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr(rope.get("beta_fast", 32))), 0)
    high = min(math.ceil(corr(rope.get("beta_slow", 1))), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    smooth = 1 - ramp
    freqs = freqs / factor * (1 - smooth) + freqs * smooth

    def mscale(m: float) -> float:
        return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0

    cos_factor = mscale(rope.get("mscale", 1.0)) / mscale(rope.get("mscale_all_dim", 0.0))
    return freqs, cos_factor


def _rope64(x: torch.Tensor, positions: torch.Tensor, cfg: dict[str, Any]) -> torch.Tensor:
    """x (T, ..., R) interleaved pairs rotated as complex numbers."""
    freqs, factor = _yarn_inv_freq(cfg, x.shape[-1])
    angles = positions.double()[:, None] * freqs[None, :]  # (T, R/2)
    rot = torch.polar(torch.full_like(angles, factor), angles)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (angles.shape[1],)
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(xc * rot.view(shape)).flatten(-2)


def _softmax_scale(cfg: dict[str, Any]) -> float:
    scale: float = (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if rope.get("type", rope.get("rope_type")) == "yarn" and rope.get("mscale_all_dim"):
        m = 0.1 * rope["mscale_all_dim"] * math.log(rope["factor"]) + 1.0
        scale *= m * m
    return scale


KVRows = Callable[[torch.Tensor], torch.Tensor]  # (T, C + R) cached rows -> the rows attention reads


def _mla64(
    sd: dict[str, torch.Tensor], p: str, x: torch.Tensor, cfg: dict[str, Any], kv_rows: KVRows | None = None
) -> torch.Tensor:
    t, h = x.shape[0], cfg["num_attention_heads"]
    nope, rope_d, v_d, c = (
        cfg["qk_nope_head_dim"],
        cfg["qk_rope_head_dim"],
        cfg["v_head_dim"],
        cfg["kv_lora_rank"],
    )
    if cfg.get("q_lora_rank") is None:
        q = x @ sd[f"{p}.q_proj.weight"].T
    else:
        q = (
            _rms(x @ sd[f"{p}.q_a_proj.weight"].T, sd[f"{p}.q_a_layernorm.weight"])
            @ sd[f"{p}.q_b_proj.weight"].T
        )
    q = q.view(t, h, nope + rope_d)
    pos = torch.arange(t)
    q_pe = _rope64(q[..., nope:], pos, cfg)
    kv = x @ sd[f"{p}.kv_a_proj_with_mqa.weight"].T
    latent = _rms(kv[:, :c], sd[f"{p}.kv_a_layernorm.weight"])
    k_pe = _rope64(kv[:, None, c:], pos, cfg)  # (T, 1, R)
    if kv_rows is not None:  # what a quantised cache keeps of each token's [latent | k_pe]
        rows = kv_rows(torch.cat([latent, k_pe[:, 0]], dim=-1))
        latent, k_pe = rows[:, :c], rows[:, None, c:]
    kvb = (latent @ sd[f"{p}.kv_b_proj.weight"].T).view(t, h, nope + v_d)
    k = torch.cat([kvb[..., :nope], k_pe.expand(t, h, rope_d)], dim=-1)
    v = kvb[..., nope:]
    qf = torch.cat([q[..., :nope], q_pe], dim=-1)
    scores = torch.einsum("shd,thd->hst", qf, k) * _softmax_scale(cfg)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hst,thd->shd", scores.softmax(-1), v).reshape(t, h * v_d)
    return o @ sd[f"{p}.o_proj.weight"].T


def _mlp64(sd: dict[str, torch.Tensor], p: str, x: torch.Tensor) -> torch.Tensor:
    g, u = x @ sd[f"{p}.gate_proj.weight"].T, x @ sd[f"{p}.up_proj.weight"].T
    return (torch.nn.functional.silu(g) * u) @ sd[f"{p}.down_proj.weight"].T


def _moe64(sd: dict[str, torch.Tensor], p: str, x: torch.Tensor, cfg: dict[str, Any]) -> torch.Tensor:
    """DeepSeek-V3 noaux_tc / V2 softmax routing, token by token."""
    n_exp, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    logits = x @ sd[f"{p}.gate.weight"].T
    v3 = cfg["model_type"] == "deepseek_v3"
    scores = (
        logits.sigmoid()
        if cfg.get("scoring_func", "sigmoid" if v3 else "softmax") == "sigmoid"
        else logits.softmax(-1)
    )
    method = cfg.get("topk_method", "noaux_tc" if v3 else "greedy")
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        sel = scores[i].clone()
        if method == "noaux_tc":
            sel = sel + sd[f"{p}.gate.e_score_correction_bias"]
        groups = cfg.get("n_group") or 1
        if method != "greedy" and groups > 1:
            g = sel.view(groups, -1)
            gs = g.topk(2, -1).values.sum(-1) if method == "noaux_tc" else g.max(-1).values
            keep = gs.topk(cfg["topk_group"]).indices
            mask = torch.ones(groups, dtype=torch.bool)
            mask[keep] = False
            sel = g.masked_fill(mask[:, None], float("-inf")).view(n_exp)
        ids = sel.topk(k).indices
        w = scores[i, ids]
        if cfg.get("norm_topk_prob") and k > 1:
            w = w / w.sum()
            if v3:
                w = w * cfg.get("routed_scaling_factor", 1.0)
        else:
            w = w * cfg.get("routed_scaling_factor", 1.0)
        for wj, e in zip(w, ids.tolist()):
            out[i] += wj * _mlp64(sd, f"{p}.experts.{e}", x[i : i + 1])[0]
    if cfg.get("n_shared_experts"):
        out = out + _mlp64(sd, f"{p}.shared_experts", x)
    return out


def _layer64(
    sd: dict[str, torch.Tensor], i: int, x: torch.Tensor, cfg: dict[str, Any], kv_rows: KVRows | None = None
) -> torch.Tensor:
    p = f"model.layers.{i}"
    eps = cfg.get("rms_norm_eps", 1e-6)
    x = x + _mla64(sd, f"{p}.self_attn", _rms(x, sd[f"{p}.input_layernorm.weight"], eps), cfg, kv_rows)
    h = _rms(x, sd[f"{p}.post_attention_layernorm.weight"], eps)
    moe = cfg.get("n_routed_experts") and i >= cfg.get("first_k_dense_replace", 0)
    return x + (_moe64(sd, f"{p}.mlp", h, cfg) if moe else _mlp64(sd, f"{p}.mlp", h))


def reference_forward64(
    sd: dict[str, torch.Tensor], cfg: dict[str, Any], tokens: list[int], kv_rows: KVRows | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(final hidden (T, Dm), logits (T, V)) of one sequence, float64. kv_rows: what a quantised
    KV cache keeps of each token's [normalised latent | roped key] row (None: all of it)."""
    sd = {k: v.double() for k, v in sd.items()}
    eps = cfg.get("rms_norm_eps", 1e-6)
    x = sd["model.embed_tokens.weight"][torch.tensor(tokens)]
    for i in range(cfg["num_hidden_layers"]):
        x = _layer64(sd, i, x, cfg, kv_rows)
    h = _rms(x, sd["model.norm.weight"], eps)
    return h, h @ sd["lm_head.weight"].T


def reference_mtp64(
    sd: dict[str, torch.Tensor], cfg: dict[str, Any], hidden: torch.Tensor, next_tokens: list[int]
) -> torch.Tensor:
    """MTP logits (T, V) float64: row i from the main model's hidden h_i and the token t_{i+1}."""
    sd = {k: v.double() for k, v in sd.items()}
    eps = cfg.get("rms_norm_eps", 1e-6)
    idx = cfg["num_hidden_layers"]
    p = f"model.layers.{idx}"
    e = sd["model.embed_tokens.weight"][torch.tensor(next_tokens)]
    cat = torch.cat(
        [_rms(e, sd[f"{p}.enorm.weight"], eps), _rms(hidden.double(), sd[f"{p}.hnorm.weight"], eps)], -1
    )
    x = _layer64(sd, idx, cat @ sd[f"{p}.eh_proj.weight"].T, cfg)
    return _rms(x, sd[f"{p}.shared_head.norm.weight"], eps) @ sd["lm_head.weight"].T


def e4m3_round64(y: torch.Tensor) -> torch.Tensor:
    """Round float64 values (|y| <= 448) to the nearest e4m3 value, ties to even: 3 mantissa bits,
    normal exponents from -6, subnormal step 2^-9."""
    a = y.abs()
    step = torch.exp2(torch.floor(torch.log2(a.clamp(min=2.0**-6))) - 3)
    return torch.sign(y) * torch.round(a / step) * step  # torch.round: half to even


def e4m3_rows64(latent_dim: int, tile: int) -> KVRows:
    """kv_rows of the FP8 latent cache (deepinfer.backend.kv_formats_mla's definition): the latent
    per tile of `tile` values at scale 2^ceil(log2(amax / 448)), the rope part in bfloat16."""

    def rows(x: torch.Tensor) -> torch.Tensor:
        c = latent_dim
        tiles = x[:, :c].reshape(x.shape[0], c // tile, tile)
        amax = tiles.abs().amax(-1, keepdim=True).clamp(min=1e-10)
        scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
        latent = (e4m3_round64(tiles / scale) * scale).reshape(x.shape[0], c)
        return torch.cat([latent, x[:, c:].to(torch.bfloat16).double()], dim=-1)

    return rows
