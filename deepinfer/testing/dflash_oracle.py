"""An independent forward of the DFlash (DSpark) drafter: plain PyTorch, dense, no cache, sharing
no code with deepinfer.models (reference/deepseek-v4.1.md 1.10-1.11; the target's layers are
deepinfer.testing.oracles', the V3 float64 oracle).

It computes in the dtype of the trunks it is given, on their device (float64 in the tests;
train/train_dflash.py trains with a form batched over windows that reuses its parts and is
checked against dflash_block in tests/test_dflash_engine.py):
  naive MLA (the latent expanded into per-head keys and values), the context's keys and values
  from u = project_norm(projection(trunks)) at positions 0..L-1, each block's from its own slots
  at anchor+1 .. anchor+B; block n's slots see context positions <= anchor_n and every slot of
  block n (a mask over [context | all blocks]); the MoE with every expert computed and the
  unrouted ones weighted 0; the Markov correction and the confidence head.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from deepinfer.testing.oracles import _layer64, _rms, _softmax_scale, _yarn_inv_freq

LORA_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: DeepSeek's RMSNorm default eps


def target_trunks64(
    sd: dict[str, torch.Tensor], cfg: dict[str, Any], tokens: list[int], layer_ids: list[int]
) -> torch.Tensor:
    """The target's residual stream entering each layer of layer_ids, (T, n, Dm) float64."""
    sd = {k: v.double() for k, v in sd.items()}
    x = sd["model.embed_tokens.weight"][torch.tensor(tokens)]
    out = {}
    for i in range(cfg["num_hidden_layers"]):
        out[i] = x
        x = _layer64(sd, i, x, cfg)
    return torch.stack([out[i] for i in layer_ids], dim=1)


def _rope(x: torch.Tensor, positions: torch.Tensor, cfg: dict[str, Any]) -> torch.Tensor:
    """x (M, ..., R): interleaved pairs (x0, x1) rotated by position * freq, in x's dtype."""
    freqs, factor = _yarn_inv_freq(cfg, x.shape[-1])
    ang = positions.double()[:, None] * freqs.to(positions.device)[None, :]  # (M, R/2)
    cos, sin = (ang.cos() * factor).to(x.dtype), (ang.sin() * factor).to(x.dtype)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)


def _moe(
    w: dict[str, torch.Tensor], p: str, x: torch.Tensor, cfg: dict[str, Any], dcfg: dict[str, Any]
) -> torch.Tensor:
    e, k = dcfg["n_routed_experts"], dcfg["num_experts_per_tok"]
    logits = x @ w[f"{p}.gate.weight"].T  # (M, E)
    sigmoid = cfg.get("scoring_func", "sigmoid") == "sigmoid"
    scores = logits.sigmoid() if sigmoid else logits.softmax(-1)
    sel = scores
    if cfg.get("topk_method") == "noaux_tc":
        sel = scores + w[f"{p}.gate.e_score_correction_bias"]
    ids = sel.topk(k, dim=-1).indices  # (M, K)
    wts = scores.gather(1, ids)
    if cfg.get("norm_topk_prob") and k > 1:
        wts = wts / wts.sum(-1, keepdim=True)
        if cfg["model_type"] == "deepseek_v3":
            wts = wts * cfg.get("routed_scaling_factor", 1.0)
    else:
        wts = wts * cfg.get("routed_scaling_factor", 1.0)
    dense = torch.zeros_like(scores).scatter(1, ids, wts)  # (M, E): 0 for experts not chosen
    stack = [
        torch.stack([w[f"{p}.experts.{j}.{n}.weight"] for j in range(e)])
        for n in ("gate_proj", "up_proj", "down_proj")
    ]
    g = torch.einsum("md,eid->mei", x, stack[0])
    u = torch.einsum("md,eid->mei", x, stack[1])
    y = torch.einsum("mei,edi->med", F.silu(g) * u, stack[2])  # (M, E, Dm)
    out = torch.einsum("me,med->md", dense, y)
    if dcfg.get("n_shared_experts", 0):
        s = f"{p}.shared_experts"
        out = (
            out
            + (F.silu(x @ w[f"{s}.gate_proj.weight"].T) * (x @ w[f"{s}.up_proj.weight"].T))
            @ w[f"{s}.down_proj.weight"].T
        )
    return out


def _kv(
    w: dict[str, torch.Tensor], p: str, x: torch.Tensor, pos: torch.Tensor, cfg: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head keys (M, H, N + R) and values (M, H, Vh) of rows x (M, Dm) at positions pos."""
    h, nope, c = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["kv_lora_rank"]
    kv = x @ w[f"{p}.kv_a_proj_with_mqa.weight"].T
    latent = _rms(kv[:, :c], w[f"{p}.kv_a_layernorm.weight"], LORA_EPS)
    k_pe = _rope(kv[:, None, c:], pos, cfg)  # (M, 1, R)
    kvb = (latent @ w[f"{p}.kv_b_proj.weight"].T).view(x.shape[0], h, -1)
    k = torch.cat([kvb[..., :nope], k_pe.expand(-1, h, -1)], dim=-1)
    return k, kvb[..., nope:]


def _query(
    w: dict[str, torch.Tensor], p: str, hn: torch.Tensor, pos: torch.Tensor, cfg: dict[str, Any]
) -> torch.Tensor:
    """Per-head queries (M, H, N + R) of normalised rows hn (M, Dm) at positions pos."""
    heads, nope, rope_d = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    if cfg.get("q_lora_rank") is None:
        q = hn @ w[f"{p}.q_proj.weight"].T
    else:
        q = (
            _rms(hn @ w[f"{p}.q_a_proj.weight"].T, w[f"{p}.q_a_layernorm.weight"], LORA_EPS)
            @ w[f"{p}.q_b_proj.weight"].T
        )
    q = q.view(-1, heads, nope + rope_d)
    return torch.cat([q[..., :nope], _rope(q[..., nope:], pos, cfg)], dim=-1)


def _context(w: dict[str, torch.Tensor], trunks: torch.Tensor, eps: float) -> torch.Tensor:
    """The injected context rows u = project_norm(projection(trunks)): trunks (L, n, Dm) of one
    sequence or (W, L, n, Dm) of W windows -> (L, Dm) or (W L, Dm)."""
    flat = trunks.flatten(-2).flatten(0, -2)  # (L, n Dm) or (W L, n Dm)
    return _rms(flat @ w["mtp.0.projection.weight"].T, w["mtp.0.project_norm.weight"], eps)


def _slots(
    embed: torch.Tensor, anchors: torch.Tensor, tokens: torch.Tensor, dcfg: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """anchors, tokens (N,) or (W, N) -> (pos (N B,) or (W N B,): the slots' positions anchor+1
    .. anchor+B; x (N B, Dm) or (W N B, Dm): their embeddings, the block's token at slot 0 and
    noise after it)."""
    b, dev = dcfg["block_size"], anchors.device
    pos = (anchors[..., None] + 1 + torch.arange(b, device=dev)).reshape(-1)
    noise = torch.full((*tokens.shape, b - 1), dcfg["noise_token_id"], device=dev)
    return pos, embed[torch.cat([tokens[..., None], noise], -1).reshape(-1)]


def _ffn(
    w: dict[str, torch.Tensor], p: str, x: torch.Tensor, cfg: dict[str, Any], dcfg: dict[str, Any]
) -> torch.Tensor:
    """Layer p's MoE sublayer with its residual: x (M, Dm) -> (M, Dm)."""
    eps = cfg.get("rms_norm_eps", 1e-6)
    return x + _moe(w, f"{p}.mlp", _rms(x, w[f"{p}.post_attention_layernorm.weight"], eps), cfg, dcfg)


def _head(
    w: dict[str, torch.Tensor],
    cfg: dict[str, Any],
    dcfg: dict[str, Any],
    lm_head: torch.Tensor,
    x: torch.Tensor,
    prev: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The last layer's rows x (M B, Dm), prev (M B,) the token before each slot's prediction ->
    (logits (M B, V) with the Markov correction, z / T (M, B): the confidence head's logits over
    each slot's temperature, c = their sigmoid)."""
    b, last = dcfg["block_size"], f"mtp.{dcfg['num_layers'] - 1}"
    low = w[f"{last}.markov_w1.weight"][prev]  # (M B, r)
    eps = cfg.get("rms_norm_eps", 1e-6)
    logits = _rms(x, w[f"{last}.norm.weight"], eps) @ lm_head.T + low @ w[f"{last}.markov_w2.weight"].T
    temps = dcfg.get("confidence_temperature", [1.0])
    temps = list(temps) * b if len(temps) == 1 else list(temps)
    z = (torch.cat([x, low.to(x.dtype)], dim=-1) @ w[f"{last}.accept_rate.proj.weight"].T).view(-1, b)
    return logits, z / torch.tensor(temps, device=x.device, dtype=z.dtype)


def dflash_block(
    w: dict[str, torch.Tensor],
    cfg: dict[str, Any],
    dcfg: dict[str, Any],
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    trunks: torch.Tensor,
    anchors: torch.Tensor,
    tokens: torch.Tensor,
    prev: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of one sequence. w: the drafter's tensors (DeepSeek's mtp.* names); cfg: the
    target's config.json dict; dcfg: the drafter's (dflash/config.json); trunks (L, n, Dm) the
    target's at every position of the sequence; anchors (N,) t of each block (its slots at
    t+1 .. t+B); tokens (N,) the token at t+1; prev (N, B) the token before each slot's
    prediction (prev[:, 0] = tokens). -> (logits (N, B, V), c (N, B): each slot's sigmoid, not
    the prefix product), in trunks' dtype."""
    dt = trunks.dtype
    w = {k: v.to(dt) for k, v in w.items()}
    embed, lm_head = embed.to(dt), lm_head.to(dt)
    b, layers = dcfg["block_size"], dcfg["num_layers"]
    eps = cfg.get("rms_norm_eps", 1e-6)
    n, ctx = anchors.shape[0], trunks.shape[0]

    u = _context(w, trunks, eps)  # (L, Dm)
    pos, x = _slots(embed, anchors, tokens, dcfg)  # (N B,), (N B, Dm)
    ctx_pos = torch.arange(ctx)
    # visibility: [context (L) | every block's slots (N B)] for each slot
    blk = torch.arange(n).repeat_interleave(b)  # (N B,) the block of each slot
    see_ctx = ctx_pos[None, :] <= anchors[blk][:, None]  # (N B, L)
    see_blk = blk[:, None] == blk[None, :]  # (N B, N B)
    visible = torch.cat([see_ctx, see_blk], dim=1)
    scale = _softmax_scale(cfg)
    for i in range(layers):
        p = f"mtp.{i}"
        a = f"{p}.self_attn"
        hn = _rms(x, w[f"{p}.input_layernorm.weight"], eps)
        q = _query(w, a, hn, pos, cfg)
        k_ctx, v_ctx = _kv(w, a, u, ctx_pos, cfg)
        k_blk, v_blk = _kv(w, a, hn, pos, cfg)
        k, v = torch.cat([k_ctx, k_blk]), torch.cat([v_ctx, v_blk])
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        scores = scores.masked_fill(~visible[None], float("-inf"))
        o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(x.shape[0], -1)
        x = _ffn(w, p, x + o @ w[f"{a}.o_proj.weight"].T, cfg, dcfg)
    logits, z = _head(w, cfg, dcfg, lm_head, x, prev.reshape(-1))
    return logits.view(n, b, -1), torch.sigmoid(z)


def dflash_draft64(
    w: dict[str, torch.Tensor],
    cfg: dict[str, Any],
    dcfg: dict[str, Any],
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    trunks: torch.Tensor,
    anchor: int,
    token: int,
    k: int,
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Greedy drafts of one block, float64: slot s's prev is draft s-1, found by rerunning the
    block with the prefix known so far (no shortcut through the model's sequential loop) ->
    (k drafts, logits (k, V), confidences (k,): prefix products)."""
    trunks = trunks.double()
    b = dcfg["block_size"]
    drafts: list[int] = []
    rows, cs = [], []
    for s in range(k):
        prev = torch.tensor([[token, *drafts] + [0] * (b - 1 - len(drafts))])
        logits, c = dflash_block(
            w, cfg, dcfg, embed, lm_head, trunks, torch.tensor([anchor]), torch.tensor([token]), prev
        )
        rows.append(logits[0, s])
        cs.append(c[0, s])
        drafts.append(int(logits[0, s].argmax()))
    return drafts, torch.stack(rows), torch.cumprod(torch.stack(cs), 0)
