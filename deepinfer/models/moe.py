"""DeepSeek routers and the MoE layer (routed experts + shared experts).

Symbols: T tokens, E routed experts, K experts per token, I moe_intermediate_size, Dm hidden.

Routers (DeepSeek's MoEGate), all through backend.moe.select_experts (router_logits + route):
  V2 greedy               softmax scores, plain top-K.
  V2 group_limited_greedy softmax, keep the topk_group groups with the best MAX score, then top-K.
  V3 noaux_tc             sigmoid; e_score_correction_bias is added for SELECTION only; groups
                          ranked by the SUM of their top-2 biased scores; weights are the unbiased
                          scores.
Weights: V3 divides by their sum when norm_topk_prob (and K > 1), then ALWAYS multiplies by
routed_scaling_factor. V2 does one or the other: normalise when norm_topk_prob (and K > 1),
otherwise multiply by routed_scaling_factor (DeepSeek-V2's published code).

Shared experts fusion (S = n_shared_experts): the shared MLP of intermediate S * I is S more
experts of intermediate I after the routed ones (SwiGLU over a concatenated intermediate is the
sum of the chunks' outputs), which the router appends to every token with weight 1
(RouterConfig.shared_experts): one grouped GEMM pair computes routed and shared experts, and the
shared MLP's two GEMMs, its silu_and_mul and the final add are gone. In batch-invariant mode too
(the grouped GEMM and the combine reduce each row alone, in a fixed order). Not under expert
parallelism (the shared experts stay on every rank), nor for FP8 weights unless I is a whole
number of 128-row scale blocks;
DEEPINFER_MODEL_UNFUSED=shared_experts switches it off (layers.fusion_enabled).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from deepinfer.backend.fp8 import FP8_BLOCK, num_blocks
from deepinfer.backend.ops import Backend
from deepinfer.backend.types import RouterConfig
from deepinfer.models.config import ModelConfig
from deepinfer.models.layers import MLP, fuse_gate_up, fusion_enabled, padded_intermediate
from deepinfer.parallel.expert_parallel import ExpertParallel, dispatch_combine, fixed_exchange

if TYPE_CHECKING:
    from deepinfer.models.weights import WeightSource


# (w13 (2I', Dm), w13 scale or None, w2 (Dm, I'), w2 scale or None): one expert's fused weights
ExpertWeights = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]


def router_config(config: ModelConfig) -> RouterConfig:
    """The contract's RouterConfig for a model's gate (see the module docstring)."""
    normalise = config.norm_topk_prob and config.num_experts_per_tok > 1
    if config.topk_method == "greedy":
        groups, topk_groups = 1, 1
    else:
        groups, topk_groups = config.n_group, config.topk_group
    if config.model_type == "deepseek_v2" and normalise:
        scaling = 1.0
    else:
        scaling = config.routed_scaling_factor
    return RouterConfig(
        scoring="sigmoid" if config.scoring_func == "sigmoid" else "softmax",
        top_k=config.num_experts_per_tok,
        num_groups=groups,
        topk_groups=topk_groups,
        group_score="top2_sum" if config.topk_method == "noaux_tc" else "max",
        renormalize=normalise,
        routed_scaling_factor=scaling,
    )


class MoE(nn.Module):
    """Routed experts (fused w13 (E, 2I, Dm) = [gate; up], w2 (E, Dm, I)) plus shared experts,
    held as S more experts of w13 / w2 where they fuse (module docstring), else as an MLP.

    With expert parallelism (deepinfer.parallel.expert_parallel) the layer holds only its
    rank's E / W experts and every rank must call forward (possibly with no tokens) the same
    number of times."""

    def __init__(self, config: ModelConfig, backend: Backend, ep: ExpertParallel | None = None) -> None:
        super().__init__()
        self.backend = backend
        self.num_experts, self.hidden, self.inter = (
            config.n_routed_experts,
            config.hidden_size,
            config.moe_intermediate_size,
        )
        self.ep = ep
        # the expert slots each rank holds (all of them without expert parallelism): with EPLB
        # E + R physical ones whose logical experts self.eplb maps (deepinfer.parallel.eplb)
        e = self.num_experts
        self.bounds = ep.expert_bounds(ep.num_physical(e)) if ep is not None else [0, e]
        rank = ep.rank if ep is not None else 0
        self.local = range(self.bounds[rank], self.bounds[rank + 1])
        self.held = ep.held_experts(e) if ep is not None else list(range(e))  # slot -> logical expert
        self.eplb = ep.expert_map(e, backend.device.device()) if ep is not None else None
        self.router = router_config(config)
        self.uses_bias = config.topk_method == "noaux_tc"
        meta = torch.empty(0, device="meta")
        self.register_buffer("gate_weight", meta)  # (E, Dm) float32: routing is computed in float32
        self.register_buffer("e_score_correction_bias", None)  # (E,) float32 for noaux_tc
        # E' = E routed experts (this rank's), + S with the shared experts fused
        self.register_buffer("w13", meta)  # (E', 2I, Dm)
        self.register_buffer("w2", meta)  # (E', Dm, I)
        self.register_buffer("w13_scale", None)  # FP8: (E', 2 ceil(I/128), ceil(Dm/128))
        self.register_buffer("w2_scale", None)  # FP8: (E', ceil(Dm/128), ceil(I/128))
        self.num_shared = config.n_shared_experts
        shared = self.num_shared * self.inter
        self.shared_experts: MLP | None = MLP(backend, config.hidden_size, shared) if shared else None
        # shared experts as experts E .. E + S - 1 of w13 / w2 (module docstring); final at load
        self.fuse_shared = shared > 0 and ep is None

    def forward(self, x: torch.Tensor, fixed_exchange: bool = False) -> torch.Tensor:
        """x (T, Dm) -> (T, Dm). fixed_exchange (expert parallelism): every rank runs this layer
        with the same T (a graph step: ForwardBatch.fixed_exchange)."""
        # (T, K), or (T, K + S) with the shared experts fused
        weights, ids = self.backend.moe.select_experts(
            x, self.gate_weight, self.router, self.e_score_correction_bias
        )
        if self.ep is None:
            y = self.backend.moe.fused_moe(x, weights, ids, self.w13, self.w2, self.w13_scale, self.w2_scale)
            return y if self.shared_experts is None else y + self.shared_experts(x)
        if self.eplb is not None:  # logical -> physical experts, counted in eager steps
            ids = self.eplb.physical(weights, ids, record=not fixed_exchange)
        if fixed_exchange:
            return self._fixed_exchange(x, weights, ids)
        return self._expert_parallel(x, weights, ids)

    def _fixed_exchange(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Routed experts over the ranks by the fixed-shape exchange of a graph step
        (deepinfer.parallel.expert_parallel.fixed_exchange): x (T, Dm), weights / ids (T, K)."""
        assert self.ep is not None

        def local_moe(rows: torch.Tensor, local_w: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
            return self.backend.moe.fused_moe(
                rows, local_w, local_ids, self.w13, self.w2, self.w13_scale, self.w2_scale
            )

        y = fixed_exchange(self.backend.collectives, x, weights, ids, self.bounds, self.ep.rank, local_moe)
        return y if self.shared_experts is None else y + self.shared_experts(x)

    def _expert_parallel(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Routed experts over the ranks (deepinfer.parallel): x (T, Dm), weights / ids (T, K).
        With two micro-batches the shared experts compute while the combines are in flight."""
        assert self.ep is not None
        shared: list[torch.Tensor] = []

        def shared_experts() -> None:
            if self.shared_experts is not None:
                shared.append(self.shared_experts(x))

        def local_experts(rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
            ones = torch.ones((rows.shape[0], 1), dtype=torch.float32, device=rows.device)
            return self.backend.moe.fused_moe(
                rows, ones, local_ids.view(-1, 1), self.w13, self.w2, self.w13_scale, self.w2_scale
            )

        two = self.ep.micro_batches == 2
        y = dispatch_combine(
            self.backend.collectives, x, weights, ids, self.bounds, self.ep.rank, local_experts,
            self.ep.micro_batches, shared_experts if two else None,
        )  # fmt: skip
        if not two:
            shared_experts()
        return y + shared[0] if shared else y

    def expert_tensors(self) -> list[torch.Tensor]:
        """The routed experts' tensors, (slots, ...) each (EPLB moves their rows)."""
        return [t for t in (self.w13, self.w2, self.w13_scale, self.w2_scale) if t is not None]

    def load(self, reader: WeightSource, prefix: str, dtype: torch.dtype) -> None:
        e, dm, inter = self.num_experts, self.hidden, self.inter
        self.gate_weight = reader.get(f"{prefix}.gate.weight", (e, dm), torch.float32)
        if self.uses_bias:
            self.e_score_correction_bias = reader.get(
                f"{prefix}.gate.e_score_correction_bias", (e,), torch.float32
            )
        transformers_layout = reader.has(f"{prefix}.experts.gate_up_proj")
        shared: list[ExpertWeights] = []
        if self.shared_experts is not None:
            routed_fp8 = not transformers_layout and reader.has(
                f"{prefix}.experts.{self.held[0]}.gate_proj.weight_scale_inv"
            )
            shared_fp8 = reader.has(f"{prefix}.shared_experts.gate_proj.weight_scale_inv")
            self.fuse_shared &= fusion_enabled("shared_experts", reader.unfused)
            self.fuse_shared &= routed_fp8 == shared_fp8 and (not shared_fp8 or inter % FP8_BLOCK == 0)
            if self.fuse_shared:
                shared = self._shared_as_experts(reader, f"{prefix}.shared_experts", dtype)
                self.shared_experts = None
                self.router = dataclasses.replace(self.router, shared_experts=self.num_shared)
            else:
                self.shared_experts.load(reader, f"{prefix}.shared_experts", dtype)
        if transformers_layout:  # transformers' fused in-memory layout
            w13 = reader.get(f"{prefix}.experts.gate_up_proj", (e, 2 * inter, dm), dtype)
            w2 = reader.get(f"{prefix}.experts.down_proj", (e, dm, inter), dtype)
            mine = torch.tensor(self.held, dtype=torch.int64, device=w13.device)
            self.w13, self.w2 = (w13, w2) if self.ep is None else (w13[mine], w2[mine])
            if shared:
                self.w13 = torch.cat([self.w13, torch.stack([w[0] for w in shared])])
                self.w2 = torch.cat([self.w2, torch.stack([w[2] for w in shared])])
            return
        self._load_per_expert(reader, f"{prefix}.experts", dtype, shared)

    def _shared_as_experts(
        self, reader: WeightSource, prefix: str, dtype: torch.dtype
    ) -> list[ExpertWeights]:
        """The shared MLP (S * I wide) as S experts of intermediate I: chunk s is rows
        [s * I, (s + 1) * I) of gate_proj and up_proj and those columns of down_proj, with their
        scale blocks (FP8 is fused only when I is a multiple of 128)."""
        n, dm, inter = self.num_shared, self.hidden, self.inter
        gate, gate_s = reader.linear(f"{prefix}.gate_proj", (n * inter, dm), dtype)
        up, up_s = reader.linear(f"{prefix}.up_proj", (n * inter, dm), dtype)
        down, down_s = reader.linear(f"{prefix}.down_proj", (dm, n * inter), dtype)
        out = []
        for s in range(n):
            rows = slice(s * inter, (s + 1) * inter)
            blocks = slice(s * inter // FP8_BLOCK, (s + 1) * inter // FP8_BLOCK)
            out.append(
                fuse_gate_up(
                    (gate[rows], None if gate_s is None else gate_s[blocks]),
                    (up[rows], None if up_s is None else up_s[blocks]),
                    (down[:, rows], None if down_s is None else down_s[:, blocks]),
                )
            )
        return out

    def _load_per_expert(
        self, reader: WeightSource, prefix: str, dtype: torch.dtype, shared: list[ExpertWeights]
    ) -> None:
        """DeepSeek's published layout: experts.{e}.{gate,up,down}_proj.weight (+ weight_scale_inv).
        Only this rank's experts are read; the others are marked as known. `shared`: the shared
        experts' chunks, held after the routed experts (indices e .. e + S - 1)."""
        e, dm, inter = len(self.held), self.hidden, self.inter
        for i in sorted(set(range(self.num_experts)) - set(self.held)):
            for name in ("gate_proj", "up_proj", "down_proj"):
                for suffix in ("weight", "weight_scale_inv"):
                    if reader.has(f"{prefix}.{i}.{name}.{suffix}"):
                        reader.skip(f"{prefix}.{i}.{name}.{suffix}")
        fp8 = reader.has(f"{prefix}.0.gate_proj.weight_scale_inv")
        inter_p = padded_intermediate(inter, fp8)
        w_dtype = reader.fp8_dtype if fp8 else dtype
        device = reader.device
        n = e + len(shared)
        w13 = torch.empty((n, 2 * inter_p, dm), dtype=w_dtype, device=device)
        w2 = torch.empty((n, dm, inter_p), dtype=w_dtype, device=device)
        s13 = s2 = None
        if fp8:
            s13 = torch.empty((n, 2 * num_blocks(inter), num_blocks(dm)), dtype=torch.float32, device=device)
            s2 = torch.empty((n, num_blocks(dm), num_blocks(inter)), dtype=torch.float32, device=device)
        for i in range(n):
            if i < e:
                gate = reader.linear(f"{prefix}.{self.held[i]}.gate_proj", (inter, dm), dtype)
                up = reader.linear(f"{prefix}.{self.held[i]}.up_proj", (inter, dm), dtype)
                down = reader.linear(f"{prefix}.{self.held[i]}.down_proj", (dm, inter), dtype)
                a, sa, b, sb = fuse_gate_up(gate, up, down)
            else:
                a, sa, b, sb = shared[i - e]
            if (sa is None) == fp8:
                raise ValueError(f"{prefix}: experts mix FP8 and floating-point weights (expert {i})")
            w13[i].copy_(a)
            w2[i].copy_(b)
            if s13 is not None and s2 is not None and sa is not None and sb is not None:
                s13[i].copy_(sa)
                s2[i].copy_(sb)
        self.w13, self.w2, self.w13_scale, self.w2_scale = w13, w2, s13, s2
