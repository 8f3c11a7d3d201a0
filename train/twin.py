"""A training twin of deepinfer's DeepSeek-V3 model (deepinfer/models/deepseek.py), differentiable
and batched: (B, S) token windows instead of a paged cache. Every parameter carries the tensor
name DeepSeek publishes, so `checkpoint_tensors` is the checkpoint deepinfer's loader reads.

Symbols: B batch, S sequence, H heads, C kv_lora_rank, R qk_rope_head_dim, N qk_nope_head_dim,
Vh v_head_dim, E routed experts, K experts per token, I moe_intermediate_size, Dm hidden, V vocab.

Same math as the engine, in training form:
  MLA      naive (latent expanded into per-head keys / values), full causal attention;
  rope     interleaved pairs (2j, 2j+1) rotated by position * theta^(-2j/R) (rope_interleave);
  router   V3 noaux_tc: sigmoid scores, e_score_correction_bias added for SELECTION only, groups
           ranked by the sum of their top-2 biased scores, top-K inside the kept groups, weights =
           unbiased scores / their sum * routed_scaling_factor;
  experts  computed densely for every expert and weighted by the (mostly zero) routing weights:
           the same sum as sparse dispatch, with static shapes;
  MTP      h = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)]) -> a decoder layer -> shared_head.norm
           -> the main lm_head, where h_i is the main model's output after its final norm.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the RMSNorm default, as in DeepSeek's code


@dataclass(frozen=True)
class TwinConfig:
    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 768
    moe_intermediate_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    q_lora_rank: int = 96
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    n_routed_experts: int = 16
    n_shared_experts: int = 1
    num_experts_per_tok: int = 4
    n_group: int = 4
    topk_group: int = 2
    routed_scaling_factor: float = 2.5
    first_k_dense_replace: int = 1
    num_nextn_predict_layers: int = 1
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    bos_token_id: int = 0
    eos_token_id: int = 1

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def hf_config(self, dtype: str) -> dict[str, Any]:
        """config.json in transformers' DeepseekV3Config field names."""
        d = asdict(self)
        theta = d.pop("rope_theta")
        return {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            **d,
            "qk_head_dim": self.qk_head_dim,
            "head_dim": self.qk_rope_head_dim,
            "num_key_value_heads": self.num_attention_heads,
            "norm_topk_prob": True,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "moe_layer_freq": 1,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "rope_interleave": True,
            "rope_parameters": {"rope_theta": theta, "rope_type": "default"},
            "tie_word_embeddings": False,
            "initializer_range": 0.02,
            "use_cache": True,
            "dtype": dtype,
        }


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """In float32, cast back (as the engine's and transformers' RMSNorm)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * y).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def linear(d_in: int, d_out: int) -> nn.Linear:
    return nn.Linear(d_in, d_out, bias=False)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., S, R) with pairs (2j, 2j+1); cos, sin (S, R/2) float32."""
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)


class MLA(nn.Module):
    def __init__(self, c: TwinConfig) -> None:
        super().__init__()
        self.c = c
        h = c.num_attention_heads
        self.q_a_proj = linear(c.hidden_size, c.q_lora_rank)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, LORA_NORM_EPS)
        self.q_b_proj = linear(c.q_lora_rank, h * c.qk_head_dim)
        self.kv_a_proj_with_mqa = linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = linear(c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim))
        self.o_proj = linear(h * c.v_head_dim, c.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (B, S, Dm) -> (B, S, Dm), causal."""
        c, (b, s, _) = self.c, x.shape
        h, n, r, vh = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, s, h, n + r).transpose(1, 2)
        q_nope, q_pe = q.split([n, r], dim=-1)  # (B, H, S, N), (B, H, S, R)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, r], dim=-1)  # (B, S, C), (B, S, R)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, s, h, n + vh).transpose(1, 2)
        k_nope, v = kv.split([n, vh], dim=-1)  # (B, H, S, N), (B, H, S, Vh)
        q_pe = rope_interleaved(q_pe, cos, sin)
        k_pe = rope_interleaved(k_pe, cos, sin)[:, None].expand(b, h, s, r)  # shared by every head
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe], dim=-1)
        # Pad V to the query width so every SDPA kernel accepts it; the padded outputs are dropped.
        v_pad = F.pad(v, (0, n + r - vh)) if vh < n + r else v
        o = F.scaled_dot_product_attention(q, k, v_pad, is_causal=True, scale=c.qk_head_dim**-0.5)
        o = o[..., :vh].transpose(1, 2).reshape(b, s, h * vh)
        out: torch.Tensor = self.o_proj(o)
        return out


class MLP(nn.Module):
    def __init__(self, dim: int, inter: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (
            linear(dim, inter),
            linear(dim, inter),
            linear(inter, dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class MoE(nn.Module):
    """Routed experts stacked as (E, I, Dm) / (E, Dm, I) parameters (saved per expert) + shared expert.
    `tokens_per_expert` (E,) counts the tokens routed to each expert by the last forward (the load
    the bias update balances)."""

    e_score_correction_bias: torch.Tensor
    tokens_per_expert: torch.Tensor

    def __init__(self, c: TwinConfig) -> None:
        super().__init__()
        self.c = c
        e, dm, i = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
        self.gate_weight = nn.Parameter(torch.empty(e, dm))
        self.register_buffer("e_score_correction_bias", torch.zeros(e))
        self.gate_proj = nn.Parameter(torch.empty(e, i, dm))
        self.up_proj = nn.Parameter(torch.empty(e, i, dm))
        self.down_proj = nn.Parameter(torch.empty(e, dm, i))
        self.shared_experts = MLP(dm, i * c.n_shared_experts)
        self.register_buffer("tokens_per_expert", torch.zeros(e), persistent=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, Dm) -> (weights (T, K) float32, ids (T, K))."""
        c, t = self.c, x.shape[0]
        with torch.autocast(x.device.type, enabled=False):  # routing in float32, as the engine does
            scores = torch.sigmoid(F.linear(x.float(), self.gate_weight.float()))  # (T, E)
        sel = scores + self.e_score_correction_bias  # the bias steers selection only
        groups = sel.view(t, c.n_group, -1)
        group_scores = groups.topk(2, dim=-1).values.sum(-1)  # (T, G)
        keep = group_scores.topk(c.topk_group, dim=-1).indices
        dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter(1, keep, False)
        sel = groups.masked_fill(dropped[..., None], float("-inf")).view(t, -1)
        ids = sel.topk(c.num_experts_per_tok, dim=-1).indices
        w = scores.gather(1, ids)
        return (w / w.sum(-1, keepdim=True) * c.routed_scaling_factor).float(), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, x = x.shape, x.reshape(-1, x.shape[-1])  # (T, Dm)
        w, ids = self.route(x)
        dense_w = torch.zeros(x.shape[0], self.c.n_routed_experts, device=x.device).scatter(1, ids, w)
        with torch.no_grad():
            # index_add_ rather than bincount: no host sync
            ones = torch.ones(ids.numel(), device=x.device)
            self.tokens_per_expert.zero_().index_add_(0, ids.flatten(), ones)
        g = torch.einsum("td,eid->tei", x, self.gate_proj)
        u = torch.einsum("td,eid->tei", x, self.up_proj)
        hid = F.silu(g) * u * dense_w.to(g.dtype)[..., None]  # (T, E, I), zero for unselected experts
        y = torch.einsum("tei,edi->td", hid, self.down_proj)
        out: torch.Tensor = y + self.shared_experts(x)
        return out.view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, c: TwinConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = MLA(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp: nn.Module = (
            MoE(c) if layer_idx >= c.first_k_dense_replace else MLP(c.hidden_size, c.intermediate_size)
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class MTPLayer(DecoderLayer):
    def __init__(self, c: TwinConfig, layer_idx: int) -> None:
        super().__init__(c, layer_idx)
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.eh_proj = linear(2 * c.hidden_size, c.hidden_size)
        self.shared_head_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Twin(nn.Module):
    """forward(ids (B, S)) -> final hidden (B, S, Dm) after model.norm; logits = lm_head(hidden);
    mtp(hidden (B, S, Dm), next_ids (B, S)) -> MTP hidden whose logits predict the token after next."""

    inv_freq: torch.Tensor

    def __init__(self, c: TwinConfig) -> None:
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = linear(c.hidden_size, c.vocab_size)
        self.mtp = nn.ModuleList(
            MTPLayer(c, c.num_hidden_layers + k) for k in range(c.num_nextn_predict_layers)
        )
        half = c.qk_rope_head_dim // 2
        inv_freq = 1.0 / c.rope_theta ** (torch.arange(half, dtype=torch.float64) * 2 / c.qk_rope_head_dim)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def moe_layers(self) -> list[MoE]:
        return [m.mlp for m in [*self.layers, *self.mtp] if isinstance(m.mlp, MoE)]

    def init_weights(self, generator: torch.Generator, std: float = 0.02) -> None:
        """N(0, std) matrices, output projections scaled down by sqrt(2 * depth), unit norms, zero bias."""
        out_std = std / (2 * (self.c.num_hidden_layers + len(self.mtp))) ** 0.5
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 1:
                    p.fill_(1.0)
                    continue
                s = out_std if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")) else std
                p.copy_(torch.randn(p.shape, generator=generator) * s)

    def rope(self, s: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.outer(torch.arange(s, device=device, dtype=torch.float32), self.inv_freq)
        return freqs.cos(), freqs.sin()  # (S, R/2) each

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope(ids.shape[1], ids.device)
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        out: torch.Tensor = self.norm(x)
        return out

    def mtp_forward(self, hidden: torch.Tensor, next_ids: torch.Tensor, depth: int = 0) -> torch.Tensor:
        m = self.mtp[depth]
        assert isinstance(m, MTPLayer)
        cos, sin = self.rope(next_ids.shape[1], next_ids.device)
        e = m.enorm(self.embed_tokens(next_ids))
        h = m.eh_proj(torch.cat([e, m.hnorm(hidden)], dim=-1))
        out: torch.Tensor = m.shared_head_norm(m(h, cos, sin))
        return out

    @torch.no_grad()
    def update_router_bias(self, speed: float) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing: bias += u * sign(mean load - load)."""
        for moe in self.moe_layers():
            moe.e_score_correction_bias += speed * torch.sign(
                moe.tokens_per_expert.mean() - moe.tokens_per_expert
            )


def checkpoint_tensors(model: Twin) -> dict[str, torch.Tensor]:
    """The state dict under DeepSeek's published names (float32, on the CPU, contiguous).

    Experts are split per expert (mlp.experts.{e}.{gate,up,down}_proj.weight); the router is
    mlp.gate.weight + mlp.gate.e_score_correction_bias; MTP layer k is model.layers.{L + k} with
    enorm, hnorm, eh_proj and shared_head.norm. The MTP layer's copies of the embedding and the
    head (embed_tokens, shared_head.head in V3's release) equal the main ones and are left out;
    deepinfer's loader uses the main ones either way."""
    out: dict[str, torch.Tensor] = {}
    n = model.c.num_hidden_layers
    for name, t in model.state_dict().items():
        t = t.detach().float().cpu()
        if name.startswith("mtp."):
            k, rest = name[len("mtp.") :].split(".", 1)
            name = f"layers.{n + int(k)}.{rest.replace('shared_head_norm', 'shared_head.norm')}"
        if name.startswith("layers.") or name.startswith(("embed_tokens", "norm.")):
            name = f"model.{name}"
        name = name.replace("mlp.gate_weight", "mlp.gate.weight")
        name = name.replace("mlp.e_score_correction_bias", "mlp.gate.e_score_correction_bias")
        stacked = name.rsplit(".", 1)
        if ".mlp." in name and stacked[1] in ("gate_proj", "up_proj", "down_proj"):
            for e in range(t.shape[0]):
                out[f"{stacked[0]}.experts.{e}.{stacked[1]}.weight"] = t[e].contiguous()
            continue
        out[name] = t.contiguous()
    return out
