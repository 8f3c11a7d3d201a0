"""Multi-head latent attention (MLA) in the absorbed form, over the paged latent cache.

Symbols: T tokens, H heads, C kv_lora_rank (latent), R qk_rope_head_dim, N qk_nope_head_dim,
Vh v_head_dim, Dm hidden.

Naive MLA expands each cached latent c (C) into per-head keys k = [W_UK c | k_pe] and values
v = W_UV c. The absorbed form never expands the cache: q_nope . (W_UK c) = (W_UK^T q_nope) . c,
so each head's query becomes [W_UK^T q_nope | q_pe] (C + R) against the shared cache row
[c | k_pe], and the attention output over c (C wide: V is the cache row's first C values) is
mapped to the head's value space by W_UV afterwards. Prefill, chunked prefill and decode all use
this form, so every step reads the same cache and needs no per-head K/V.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from deepinfer.backend.ops import Backend
from deepinfer.backend.types import PagedKVCache
from deepinfer.models.config import ModelConfig
from deepinfer.models.forward_batch import ForwardBatch
from deepinfer.models.layers import Linear, RMSNorm, concat_linears, fusion_enabled

if TYPE_CHECKING:
    from deepinfer.models.weights import WeightSource

# DeepSeek builds q_a_layernorm and kv_a_layernorm with the RMSNorm default eps, not rms_norm_eps.
LORA_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    """DeepSeek MLA, with (V2, V3) or without (V2-Lite) the low-rank query projection.

    decode_kernel: decode-only steps take attention.mla_decode_and_uv (its rows before each
    query must predate the forward); False for a block whose queries read rows the same layer
    writes in the step (the DFlash drafter's bidirectional block): attention.prefill, then W_UV."""

    decode_kernel = True

    def __init__(self, config: ModelConfig, backend: Backend) -> None:
        super().__init__()
        self.backend = backend
        c = config
        self.num_heads, self.kv_lora_rank = c.num_attention_heads, c.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.q_lora_rank = c.q_lora_rank
        self.softmax_scale = c.softmax_scale
        self.interleaved = c.rope_interleave
        q_out = c.num_attention_heads * c.qk_head_dim
        if c.q_lora_rank is None:
            self.q_proj = Linear(backend, c.hidden_size, q_out)
        else:
            self.q_a_proj = Linear(backend, c.hidden_size, c.q_lora_rank)
            self.q_a_layernorm = RMSNorm(backend, c.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = Linear(backend, c.q_lora_rank, q_out)
        self.kv_a_proj_with_mqa = Linear(backend, c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim)
        # q_proj (or q_a_proj) and kv_a_proj_with_mqa concatenated at load (both read x): one GEMM;
        # None where FP8 scale blocks do not allow it (concat_linears) or DEEPINFER_MODEL_UNFUSED
        self.qkv_a_proj: Linear | None = None
        self.kv_a_layernorm = RMSNorm(backend, c.kv_lora_rank, LORA_NORM_EPS)
        self.o_proj = Linear(backend, c.num_attention_heads * c.v_head_dim, c.hidden_size)
        # kv_b_proj (H * (N + Vh), C) split per head, kept in the model dtype (FP8 is dequantised).
        self.register_buffer("w_uk", torch.empty(0, device="meta"))  # (H, C, N): W_UK^T per head
        self.register_buffer("w_uv", torch.empty(0, device="meta"))  # (H, Vh, C)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cache: PagedKVCache,
        cos_sin: torch.Tensor,
    ) -> torch.Tensor:
        """x (T, Dm) -> (T, Dm). Writes this step's latent rows to `cache` before attending."""
        t = x.shape[0]
        q_a = self.q_proj if self.q_lora_rank is None else self.q_a_proj
        if self.qkv_a_proj is not None:  # (T, Nq + C + R) -> views (T, Nq), (T, C + R)
            q, kv = self.qkv_a_proj(x).split([q_a.out_features, self.kv_a_proj_with_mqa.out_features], -1)
        else:
            q, kv = q_a(x), self.kv_a_proj_with_mqa(x)
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(t, self.num_heads, self.nope_dim + self.rope_dim)  # rows may be strided
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)  # (T, H, N), (T, H, R)

        # The cache row [kv_a_layernorm(latent) | rope(k_pe)] from kv (T, C + R), and the query
        # [q_nope @ W_UK^T per head | rope(q_pe)] (T, H, C + R) against [latent | k_pe], in one op
        q_full = self.backend.attention.mla_query_and_cache(
            q_nope, q_pe, self.w_uk, kv, cache, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps,
            batch.positions, cos_sin, self.interleaved, batch.slot_mapping,
        )  # fmt: skip
        attention = self.backend.attention
        if batch.attn.is_decode_only and self.decode_kernel:  # attention and W_UV in one op: (T, H, Vh)
            o = attention.mla_decode_and_uv(
                q_full, cache, batch.attn, self.w_uv, scale=self.softmax_scale, v_dim=self.kv_lora_rank
            )
        else:
            o_latent = attention.prefill(
                q_full, cache, batch.attn, scale=self.softmax_scale, v_dim=self.kv_lora_rank
            )
            o = self.backend.gemm.batched_linear(o_latent.transpose(0, 1), self.w_uv).transpose(0, 1)
        out: torch.Tensor = self.o_proj(o.reshape(t, self.num_heads * self.v_dim))
        return out

    def load(self, reader: WeightSource, prefix: str, dtype: torch.dtype) -> None:
        if self.q_lora_rank is None:
            self.q_proj.load(reader, f"{prefix}.q_proj", dtype)
        else:
            self.q_a_proj.load(reader, f"{prefix}.q_a_proj", dtype)
            self.q_a_layernorm.load(reader, f"{prefix}.q_a_layernorm.weight", dtype)
            self.q_b_proj.load(reader, f"{prefix}.q_b_proj", dtype)
        self.kv_a_proj_with_mqa.load(reader, f"{prefix}.kv_a_proj_with_mqa", dtype)
        if fusion_enabled("qkv_a", reader.unfused):
            q_a = self.q_proj if self.q_lora_rank is None else self.q_a_proj
            self.qkv_a_proj = concat_linears(self.backend, [q_a, self.kv_a_proj_with_mqa])
        self.kv_a_layernorm.load(reader, f"{prefix}.kv_a_layernorm.weight", dtype)
        self.o_proj.load(reader, f"{prefix}.o_proj", dtype)
        shape = (self.num_heads * (self.nope_dim + self.v_dim), self.kv_lora_rank)
        w_kv_b = reader.dense(f"{prefix}.kv_b_proj", shape, dtype)
        w_kv_b = w_kv_b.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        self.w_uk = w_kv_b[:, : self.nope_dim].transpose(1, 2).contiguous()
        self.w_uv = w_kv_b[:, self.nope_dim :].contiguous()
