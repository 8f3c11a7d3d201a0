"""Reference MoE: routers, token permutation, expert MLP. Semantics on deepinfer.backend.ops.MoeOps."""

from __future__ import annotations

import torch

from deepinfer.backend.types import RouterConfig
from deepinfer.reference import gemm
from deepinfer.reference.small import silu_and_mul


def scores_of(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    x = logits.float()
    if scoring == "softmax":
        return torch.softmax(x, dim=-1)
    if scoring == "sigmoid":
        return torch.sigmoid(x)
    if scoring == "sqrtsoftplus":
        return torch.sqrt(torch.nn.functional.softplus(x))
    raise ValueError(f"unknown router scoring {scoring!r}; expected softmax, sigmoid or sqrtsoftplus")


def _top(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest of each row of x, ties to the lower index (a stable sort by
    descending value: torch.topk's tie order is unspecified)."""
    return x.sort(dim=-1, descending=True, stable=True).indices[..., :k]


def select_experts(sel: torch.Tensor, config: RouterConfig) -> torch.Tensor:
    """Group-limited top-k over selection scores sel (T, E) -> ids (T, K) int64; equal group
    scores go to the lower group id, equal selection scores to the lower expert id."""
    t, e = sel.shape
    if config.num_groups > 1:
        groups = sel.view(t, config.num_groups, e // config.num_groups)
        if config.group_score == "top2_sum":
            group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = groups.amax(dim=-1)
        keep = _top(group_scores, config.topk_groups)
        group_mask = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)
        sel = groups.masked_fill(group_mask[..., None], float("-inf")).view(t, e)
    return _top(sel, config.top_k)


def route(
    logits: torch.Tensor,
    config: RouterConfig,
    correction_bias: torch.Tensor | None = None,
    hash_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = route_routed(logits, config, correction_bias, hash_ids)
    return append_shared(weights, ids, logits.shape[1], config)


def route_routed(
    logits: torch.Tensor,
    config: RouterConfig,
    correction_bias: torch.Tensor | None = None,
    hash_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The K routed (weights float32, ids int32) per row, before shared experts are appended."""
    scores = scores_of(logits, config.scoring)
    if hash_ids is not None:
        ids = hash_ids.long()
    else:
        sel = scores if correction_bias is None else scores + correction_bias.float()
        ids = select_experts(sel, config)
    weights = scores.gather(1, ids)
    if config.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * config.routed_scaling_factor, ids.to(torch.int32)


def append_shared(
    weights: torch.Tensor, ids: torch.Tensor, num_experts: int, config: RouterConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, K) routed pairs -> (T, K + S): the S = config.shared_experts experts after the E routed
    ones, ids E .. E + S - 1 with weight 1.0, appended to every row."""
    s = config.shared_experts
    if s < 0:
        raise ValueError(f"shared_experts must be >= 0, got {s}")
    if s == 0:
        return weights, ids
    t = ids.shape[0]
    shared = torch.arange(num_experts, num_experts + s, dtype=ids.dtype, device=ids.device).expand(t, s)
    return torch.cat([weights, weights.new_ones((t, s))], 1), torch.cat([ids, shared], 1)


def permute(
    x: torch.Tensor, ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    top_k = ids.shape[1]
    flat = ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices  # dst -> src
    src_to_dst = torch.empty_like(order)
    src_to_dst[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.bincount(flat, minlength=num_experts)
    return x[order // top_k], src_to_dst, counts


def unpermute(y_sorted: torch.Tensor, src_to_dst: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    t, k = weights.shape
    y = y_sorted[src_to_dst].view(t, k, y_sorted.shape[-1]).float()
    return (y * weights.float()[..., None]).sum(dim=1).to(y_sorted.dtype)


def experts(
    x_sorted: torch.Tensor,
    counts: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("FP8 experts need both w13_scale and w2_scale")
    if w13_scale is not None and w2_scale is not None:
        h = gemm.grouped_gemm_fp8(x_sorted, w13, w13_scale, counts, batch_invariant)
        return gemm.grouped_gemm_fp8(silu_and_mul(h), w2, w2_scale, counts, batch_invariant)
    h = gemm.grouped_gemm(x_sorted, w13, counts, batch_invariant)
    return gemm.grouped_gemm(silu_and_mul(h), w2, counts, batch_invariant)
