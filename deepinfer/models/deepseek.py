"""DeepSeek-V2 / V2-Lite / V3 / R1, in DeepSeek's reference order: config -> MLA -> router/MoE ->
block -> model (+ the multi-token-prediction head). Written only against the backend contract.

Symbols: T tokens in the step, S rows that need logits, V vocab, Dm hidden.
Tensor names are those DeepSeek publishes (model.layers.{i}.self_attn.q_a_proj.weight, ...);
the loader maps them onto these modules.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from deepinfer.backend.ops import Backend
from deepinfer.backend.types import KVCacheSpec, PagedKVCache
from deepinfer.models.attention import MLAttention
from deepinfer.models.config import ModelConfig
from deepinfer.models.dflash import DFlashConfig, DFlashHeads
from deepinfer.models.forward_batch import ForwardBatch, KVCacheGroup
from deepinfer.models.interface import check_kv_cache_dtype
from deepinfer.models.layers import MLP, Linear, RMSNorm
from deepinfer.models.moe import MoE
from deepinfer.models.rope import cos_sin_cache
from deepinfer.parallel.expert_parallel import ExpertParallel

if TYPE_CHECKING:
    from deepinfer.models.drafter import BlockDrafter
    from deepinfer.models.weights import WeightSource


# Rope-table rows past max_position_embeddings (speculative padding drafts; see DeepseekForCausalLM)
SPECULATIVE_PADDING_POSITIONS = 32


class DecoderLayer(nn.Module):
    """Pre-norm block: h += MLA(norm(h)); h += MLP-or-MoE(norm(h)). The residual add is fused into
    the next norm (backend.small.add_rms_norm)."""

    def __init__(
        self, config: ModelConfig, backend: Backend, layer_idx: int, ep: ExpertParallel | None = None
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(backend, config.hidden_size, eps)
        self.self_attn = MLAttention(config, backend)
        self.post_attention_layernorm = RMSNorm(backend, config.hidden_size, eps)
        self.mlp: nn.Module = (
            MoE(config, backend, ep)
            if config.is_moe_layer(layer_idx)
            else MLP(backend, config.hidden_size, config.intermediate_size)
        )

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        cache: PagedKVCache,
        cos_sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: this block's input (T, Dm) minus the pending residual; returns (mlp out, residual)."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add(x, residual)
        h = self.self_attn(h, batch, cache, cos_sin)
        h, residual = self.post_attention_layernorm.add(h, residual)
        if isinstance(self.mlp, MoE):
            return self.mlp(h, batch.fixed_exchange), residual
        return self.mlp(h), residual

    def load(self, reader: WeightSource, prefix: str, dtype: torch.dtype) -> None:
        self.input_layernorm.load(reader, f"{prefix}.input_layernorm.weight", dtype)
        self.self_attn.load(reader, f"{prefix}.self_attn", dtype)
        self.post_attention_layernorm.load(reader, f"{prefix}.post_attention_layernorm.weight", dtype)
        cast(MLP | MoE, self.mlp).load(reader, f"{prefix}.mlp", dtype)


class MTPLayer(nn.Module):
    """DeepSeek-V3's multi-token-prediction module (model.layers.{num_hidden_layers + k}).

    Given the main model's final hidden state h_i of token i and the embedding of token i+1:
      h = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)]) -> a full decoder layer -> shared_head.norm
    and the shared output head turns that into logits for token i+2. Embedding and head are the
    main model's (the checkpoint's per-layer copies, embed_tokens and shared_head.head, are equal
    to them and are not loaded twice).
    """

    def __init__(
        self, config: ModelConfig, backend: Backend, layer_idx: int, ep: ExpertParallel | None = None
    ) -> None:
        super().__init__()
        dm, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(backend, dm, eps)
        self.hnorm = RMSNorm(backend, dm, eps)
        self.eh_proj = Linear(backend, 2 * dm, dm)
        self.block = DecoderLayer(config, backend, layer_idx, ep)
        self.shared_head_norm = RMSNorm(backend, dm, eps)

    def load(self, reader: WeightSource, prefix: str, dtype: torch.dtype) -> None:
        self.enorm.load(reader, f"{prefix}.enorm.weight", dtype)
        self.hnorm.load(reader, f"{prefix}.hnorm.weight", dtype)
        self.eh_proj.load(reader, f"{prefix}.eh_proj", dtype)
        self.block.load(reader, prefix, dtype)
        self.shared_head_norm.load(reader, f"{prefix}.shared_head.norm.weight", dtype)
        for copy in ("embed_tokens.weight", "shared_head.head.weight"):
            if reader.has(f"{prefix}.{copy}"):
                reader.skip(f"{prefix}.{copy}")


class DeepseekForCausalLM(nn.Module):
    """The DeepSeek decoder over the paged latent cache (one cache per layer).

    forward(batch, kv_caches) -> final hidden states (T, Dm), after the last norm;
    compute_logits(hidden rows) -> (S, V) float32. MTP layers, when the checkpoint has them,
    run through forward_mtp with their own caches (num_mtp_layers of them). The engine interface
    is deepinfer.models.interface.CausalLM.
    """

    supports_graphs = True
    supports_prefill_graphs = True
    supports_drafts_with_graphs = True
    supports_prefix_caching = True
    token_history = 0  # reads no earlier tokens than its KV cache holds

    def __init__(
        self,
        config: ModelConfig,
        backend: Backend,
        dtype: torch.dtype,
        expert_parallel: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        self.config, self.backend, self.dtype = config, backend, dtype
        self.expert_parallel = expert_parallel
        self.register_buffer("embed_tokens", torch.empty(0, device="meta"))  # (V, Dm)
        self.layers = nn.ModuleList(
            DecoderLayer(config, backend, i, expert_parallel) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(backend, config.hidden_size, config.rms_norm_eps)
        self.register_buffer("lm_head", torch.empty(0, device="meta"))  # (V, Dm)
        self.mtp = nn.ModuleList()  # filled by load_weights when the checkpoint has MTP weights
        self.drafter: BlockDrafter | None = None  # set by the loader when one is saved beside
        # the DFlash drafter (loaded when asked for): its caches follow the model's in forward's
        # kv_caches, and forward injects the context's rows into them (deepinfer.models.dflash)
        self.dflash: DFlashDrafter | None = None
        device = backend.device.device()
        # rows past max_position_embeddings serve only speculative steps' padding drafts (up to
        # k positions past max_model_len, outputs discarded), so verification graphs captured at
        # max_model_len = max_position_embeddings stay inside the table
        self.rope_positions = config.max_position_embeddings + SPECULATIVE_PADDING_POSITIONS
        table = cos_sin_cache(config.rope, config.qk_rope_head_dim, self.rope_positions, device)
        self.register_buffer("cos_sin", table, persistent=False)  # (P, R) float32

    # ------------------------------------------------------------------ engine interface

    @property
    def hidden_shape(self) -> tuple[int]:
        """One token's hidden state as forward returns it: (Dm,)."""
        return (self.config.hidden_size,)

    @property
    def num_kv_layers(self) -> int:
        """The model's layers, then the DFlash drafter's (their caches take injected rows)."""
        return self.config.num_hidden_layers + (self.dflash.num_layers if self.dflash is not None else 0)

    def dflash_caches(self, kv_caches: Sequence[PagedKVCache]) -> list[PagedKVCache]:
        """The DFlash drafter's caches among kv_caches: the last ones."""
        return list(kv_caches[self.config.num_hidden_layers :])

    @property
    def num_mtp_layers(self) -> int:
        """MTP layers loaded (0 when the checkpoint has none, e.g. transformers' saves)."""
        return len(self.mtp)

    def use_kv_cache_dtype(self, kv_cache_dtype: str) -> None:
        """ "auto" (the model dtype) or "fp8" / "fp8_e4m3": FlashMLA's FP8 latent rows, which the
        worker gives the caches' spec (engine.worker.kv_cache_format)."""
        check_kv_cache_dtype(kv_cache_dtype, ("auto", "fp8", "fp8_e4m3"), self.config.model_type)

    def kv_cache_groups(
        self, block_size: int, max_backtrack: int = 0, mtp_layers: int = 0
    ) -> list[KVCacheGroup]:
        """One full-attention group: a latent cache per layer (then one per MTP layer asked for),
        one row per token, growing with the sequence."""
        layers = self.num_kv_layers + mtp_layers
        return [KVCacheGroup("full", layers, num_mtp_caches=mtp_layers)]

    def kv_cache_spec(self, num_blocks: int, block_size: int) -> KVCacheSpec:
        """One layer's latent cache: kv_lora_rank normalised latent + qk_rope_head_dim roped key."""
        c = self.config
        return KVCacheSpec(num_blocks, block_size, c.kv_lora_rank, c.qk_rope_head_dim, self.dtype)

    def _check_positions(self, batch: ForwardBatch) -> None:
        if batch.attn.max_seq_len > self.rope_positions:
            raise ValueError(
                f"sequence length {batch.attn.max_seq_len} exceeds max_position_embeddings "
                f"({self.config.max_position_embeddings}) + {SPECULATIVE_PADDING_POSITIONS} padding positions"
            )

    def forward(self, batch: ForwardBatch, kv_caches: Sequence[PagedKVCache]) -> torch.Tensor:
        """(T, Dm) final hidden states of every token in the batch. With the DFlash drafter its
        caches follow the model's (num_kv_layers) and the step's rows are injected into them."""
        if len(kv_caches) != self.num_kv_layers:
            raise ValueError(f"expected {self.num_kv_layers} KV caches, got {len(kv_caches)}")
        n, dflash = self.config.num_hidden_layers, self.dflash
        targets = dflash.config.target_layer_ids if dflash is not None else ()
        out, trunks = self.forward_trunks(batch, kv_caches[:n], targets)
        if dflash is not None:
            dflash.inject(trunks, batch, list(kv_caches[n:]))
        return out

    def forward_trunks(
        self, batch: ForwardBatch, kv_caches: Sequence[PagedKVCache], layer_ids: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's layers over its own caches -> (final hidden states (T, Dm), the residual
        stream entering each layer of layer_ids, before its norm: (T, len(layer_ids), Dm))."""
        self._check_positions(batch)
        x = nn.functional.embedding(batch.input_ids, self.embed_tokens)  # (T, Dm)
        residual: torch.Tensor | None = None
        trunks: dict[int, torch.Tensor] = {}
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            if i in layer_ids:
                trunks[i] = x if residual is None else x + residual
            x, residual = layer(x, residual, batch, cache, self.cos_sin)
        out: torch.Tensor = self.norm(x) if residual is None else self.norm.add(x, residual)[0]
        if not layer_ids:
            return out, out.new_empty((out.shape[0], 0, out.shape[-1]))
        return out, torch.stack([trunks[i] for i in layer_ids], dim=1)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden (S, Dm) -> logits (S, V) float32; into `out` (S, V) float32 when given (the
        cast and the copy are one launch)."""
        logits = self.backend.gemm.linear(hidden, self.lm_head)
        return logits.float() if out is None else out.copy_(logits)

    def forward_mtp(
        self,
        batch: ForwardBatch,
        hidden: torch.Tensor,
        kv_caches: Sequence[PagedKVCache],
        depth: int = 0,
    ) -> torch.Tensor:
        """Draft head: batch.input_ids hold token i+1 for each row, batch.positions position i, and
        hidden (T, Dm) the main model's final hidden state of token i (forward's output). Returns
        (T, Dm) hidden states; compute_logits of them predicts token i+2. kv_caches: one per MTP
        layer (allocated with kv_cache_spec, like the main model's)."""
        if depth >= self.num_mtp_layers:
            raise ValueError(
                f"MTP depth {depth} requested but the checkpoint has {self.num_mtp_layers} MTP layers"
            )
        self._check_positions(batch)
        mtp = cast(MTPLayer, self.mtp[depth])
        e = nn.functional.embedding(batch.input_ids, self.embed_tokens)
        h = mtp.eh_proj(torch.cat([mtp.enorm(e), mtp.hnorm(hidden)], dim=-1))  # (T, 2Dm) -> (T, Dm)
        h, residual = mtp.block(h, None, batch, kv_caches[depth], self.cos_sin)
        return mtp.shared_head_norm.add(h, residual)[0]

    def compute_mtp_logits(self, hidden: torch.Tensor, depth: int = 0) -> torch.Tensor:
        """hidden (S, Dm) rows of forward_mtp's output (normed by its shared_head.norm already)
        -> logits (S, V) float32 through the shared output head."""
        return self.compute_logits(hidden)

    # ------------------------------------------------------------------ loading

    def load_weights(self, reader: WeightSource) -> None:
        """Read every tensor from `reader` (see deepinfer.models.loader)."""
        c, dtype = self.config, self.dtype
        shape = (c.vocab_size, c.hidden_size)
        self.embed_tokens = reader.get("model.embed_tokens.weight", shape, dtype)
        for i, layer in enumerate(self.layers):
            cast(DecoderLayer, layer).load(reader, f"model.layers.{i}", dtype)
        self.norm.load(reader, "model.norm.weight", dtype)
        if c.tie_word_embeddings:
            self.lm_head = self.embed_tokens
            if reader.has("lm_head.weight"):
                reader.skip("lm_head.weight")
        else:
            self.lm_head = reader.get("lm_head.weight", shape, dtype)
        # MTP layers are optional: transformers drops them when it saves a model.
        for k in range(c.num_nextn_predict_layers):
            idx = c.num_hidden_layers + k
            if not any(n.startswith(f"model.layers.{idx}.") for n in reader.location):
                break
            mtp = MTPLayer(c, self.backend, idx, self.expert_parallel)
            mtp.load(reader, f"model.layers.{idx}", dtype)
            self.mtp.append(mtp)


class DFlashDrafter(DFlashHeads):
    """The DFlash drafter (deepinfer.models.dflash) with DeepSeek-V2 / V3 blocks: MLA attention,
    DeepSeek MoE, over the backend contract."""

    def __init__(
        self, target: ModelConfig, config: DFlashConfig, backend: Backend, cos_sin: torch.Tensor
    ) -> None:
        """cos_sin: the target's rope table (P, R) float32; the draft blocks use it too."""
        super().__init__(target, config, backend)
        self.cos_sin = cos_sin
        block = config.block_config(target)
        self.layers = nn.ModuleList(DecoderLayer(block, backend, 0) for _ in range(config.num_layers))
        for layer in self.blocks:
            # the block's queries read rows this layer writes in the same forward (the other
            # slots): the prefill op, not mla_decode_and_uv, whose rows must predate the forward
            layer.self_attn.decode_kernel = False

    @property
    def blocks(self) -> list[DecoderLayer]:
        return [cast("DecoderLayer", layer) for layer in self.layers]

    # ------------------------------------------------------------------ KV injection

    def inject(
        self,
        trunks: torch.Tensor,
        batch: ForwardBatch,
        caches: list[PagedKVCache],
    ) -> None:
        """trunks (T, n, Dm): the target's trunks at target_layer_ids for the step's tokens ->
        each draft layer's cache row at batch.slot_mapping (slot -1: padding, no row)."""
        if trunks.shape[0] == 0:  # an idle forward (expert parallelism: a rank without requests)
            return
        u = self.project(trunks)  # (T, n Dm) -> (T, Dm)
        for layer, cache in zip(self.blocks, caches):
            attn = layer.self_attn
            kv = attn.kv_a_proj_with_mqa(u)  # (T, C + R')
            self.backend.kv_cache.write_mla_kv(
                cache, kv, attn.kv_a_layernorm.weight, attn.kv_a_layernorm.eps, batch.positions, self.cos_sin,
                attn.interleaved, batch.slot_mapping,
            )  # fmt: skip

    def block_states(
        self, fb: ForwardBatch, embed: torch.Tensor, caches: list[PagedKVCache]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The L blocks over the block step fb -> (h pre-norm (R B, Dm), norm(h) (R B, Dm))."""
        x = nn.functional.embedding(fb.input_ids, embed)  # (R B, Dm)
        residual: torch.Tensor | None = None
        for layer, cache in zip(self.layers, caches):
            x, residual = layer(x, residual, fb, cache, self.cos_sin)
        assert residual is not None
        normed, h = self.norm.add(x, residual)
        return h, normed

    # ------------------------------------------------------------------ loading

    def load(self, reader: WeightSource, dtype: torch.dtype) -> None:
        """DeepSeek's names (module docstring): mtp.0.projection, ..., mtp.{L-1}.accept_rate."""
        self.load_heads(reader, "", dtype)
        for i, layer in enumerate(self.blocks):
            layer.load(reader, f"mtp.{i}", dtype)
