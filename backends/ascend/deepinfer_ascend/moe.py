"""MoE routing, permutation and expert compute on torch_npu's MoE ops.

route       npu_moe_gating_top_k (softmax: norm_type 0, sigmoid: norm_type 1; group-limited
            top-k with group_select_mode 0 = max, 1 = top-2 sum; bias for selection only).
            The op renormalises exactly when norm_type is 1; the other two combinations take
            the unbiased scores (norm_out, out_flag=True) at the chosen experts instead.
            Not expressible with the op, and computed with the reference's torch (aten) ops on
            the NPU (a stable sort keeps the contract's tie rule): sqrtsoftplus scoring, hash
            routing, and shapes outside its limits (E <= 2048, E / groups > 2,
            k <= E / groups * topk_groups).
            Shared experts fused as extra ones (RouterConfig.shared_experts): their ids and
            unit weights are appended to the op's output (one concatenation each).
permute     npu_moe_init_routing_v2 (dropless, row_idx_type 0: expanded_row_idx[src] = dst,
            TOKEN-MAJOR src = t * K + k; expert_tokens_num_type 1: counts)
unpermute   npu_moe_token_unpermute(permuted, src_to_dst (int32), probs)
experts     npu_grouped_matmul (w13) -> npu_swiglu -> npu_grouped_matmul (w2); FP8 weights
            through the GEMM part's block-scaled path (Ascend 950 only)
"""

from __future__ import annotations

from typing import Any

import torch

from deepinfer.backend.ops import MoeOps
from deepinfer.backend.types import BackendOptions, RouterConfig
from deepinfer.reference.moe import append_shared, route_routed
from deepinfer_ascend.gemm import AscendGemm, grouped_matmul

GATING_MAX_EXPERTS = 2048
EPS = 1e-20


def gating_fits(num_experts: int, config: RouterConfig) -> bool:
    """Whether npu_moe_gating_top_k's documented shape limits admit this router."""
    groups = config.num_groups
    if config.scoring not in ("softmax", "sigmoid") or num_experts > GATING_MAX_EXPERTS:
        return False
    if num_experts % groups or num_experts // groups <= 2:
        return False
    per_group = num_experts // groups
    if -(-per_group // 32) * 32 * groups > GATING_MAX_EXPERTS:
        return False
    return 1 <= config.top_k <= per_group * config.topk_groups and 1 <= config.topk_groups <= groups


class AscendMoe(MoeOps):
    def __init__(self, options: BackendOptions, tnpu: Any, gemm: AscendGemm) -> None:
        super().__init__(options)
        self._tnpu = tnpu
        self._gemm = gemm

    def route(
        self,
        logits: torch.Tensor,
        config: RouterConfig,
        correction_bias: torch.Tensor | None = None,
        hash_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = self._route(logits, config, correction_bias, hash_ids)
        return append_shared(weights, ids, logits.shape[1], config)

    def _route(
        self,
        logits: torch.Tensor,
        config: RouterConfig,
        correction_bias: torch.Tensor | None,
        hash_ids: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The K routed pairs per row (the shared ones are appended by route)."""
        t, e = logits.shape
        if hash_ids is not None or not gating_fits(e, config) or t == 0:
            return route_routed(logits, config, correction_bias, hash_ids)  # the reference's aten ops
        sigmoid = config.scoring == "sigmoid"
        op_renorms = sigmoid  # norm_type 1 divides by the sum, norm_type 0 does not
        y, ids, norm = self._tnpu.npu_moe_gating_top_k(
            logits.float(),
            config.top_k,
            bias=None if correction_bias is None else correction_bias.float(),
            k_group=config.topk_groups if config.num_groups > 1 else 1,
            group_count=config.num_groups,
            group_select_mode=1 if config.group_score == "top2_sum" else 0,
            renorm=0,
            norm_type=1 if sigmoid else 0,
            out_flag=op_renorms != config.renormalize,
            routed_scaling_factor=config.routed_scaling_factor,
            eps=EPS,
        )
        if op_renorms == config.renormalize:
            return y.float(), ids
        w = norm.gather(1, ids.long())  # unbiased scores at the chosen experts
        if config.renormalize:
            w = w / (w.sum(dim=-1, keepdim=True) + EPS)
        return w * config.routed_scaling_factor, ids

    def permute(
        self, x: torch.Tensor, ids: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, k = ids.shape
        if t == 0:
            empty = torch.empty(0, dtype=torch.int64, device=x.device)
            return (
                x.new_empty((0, x.shape[1])),
                empty,
                torch.zeros(num_experts, dtype=torch.int64, device=x.device),
            )
        x_sorted, src_to_dst, counts, _ = self._tnpu.npu_moe_init_routing_v2(
            x,
            ids.to(torch.int32),
            active_num=t * k,
            expert_num=num_experts,
            drop_pad_mode=0,
            expert_tokens_num_type=1,
            expert_tokens_num_flag=True,
            quant_mode=-1,
            active_expert_range=[0, num_experts],
            row_idx_type=0,
        )
        return x_sorted, src_to_dst.long(), counts.long()

    def unpermute(
        self, y_sorted: torch.Tensor, src_to_dst: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        if weights.shape[0] == 0:
            return y_sorted.new_empty((0, y_sorted.shape[1]))
        out: torch.Tensor = self._tnpu.npu_moe_token_unpermute(
            y_sorted, src_to_dst.to(torch.int32), probs=weights.to(y_sorted.dtype)
        )
        return out

    def experts(
        self,
        x_sorted: torch.Tensor,
        counts: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        w13_scale: torch.Tensor | None = None,
        w2_scale: torch.Tensor | None = None,
        swiglu_limit: float | None = None,
    ) -> torch.Tensor:
        if swiglu_limit is not None or w13.dtype == torch.uint8:  # DeepSeek-V4: the contract's composition
            return super().experts(x_sorted, counts, w13, w2, w13_scale, w2_scale, swiglu_limit)
        if (w13_scale is None) != (w2_scale is None):
            raise ValueError("FP8 experts need both w13_scale and w2_scale")
        if w13_scale is not None and w2_scale is not None:
            h = self._gemm.grouped_gemm_fp8(x_sorted, w13, w13_scale, counts)
            return self._gemm.grouped_gemm_fp8(self._swiglu(h), w2, w2_scale, counts)
        h = grouped_matmul(self._tnpu, x_sorted, w13, counts)  # (M, 2I)
        return grouped_matmul(self._tnpu, self._swiglu(h), w2, counts)  # (M, Dm)

    def _swiglu(self, h: torch.Tensor) -> torch.Tensor:
        if h.shape[0] == 0:
            return h.new_empty((0, h.shape[1] // 2))
        y: torch.Tensor = self._tnpu.npu_swiglu(h, dim=-1)
        return y
