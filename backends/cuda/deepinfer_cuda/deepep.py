"""DeepEP's normal kernels as the expert-parallel exchange (collectives.expert_exchange).

Written against DeepEP's documented V1 `deep_ep.Buffer` API (docs/legacy.md of
deepseek-ai/DeepEP: get_dispatch_layout, dispatch, combine); used when `deep_ep` imports, the
group is NCCL, activations are bf16 and the routed experts divide evenly over the ranks (DeepEP
gives each rank E / W experts). It has not run here: no machine this backend was measured on had
DeepEP installed (docs/data_parallel.md).

One exchange: dispatch sends each token once to every rank holding one of its experts; there the
pairs (received token, local expert) run through this rank's experts, weighted and summed per
received token in float32; combine sums those partial outputs over the ranks, back where each
token lives (in bf16: DeepEP's combine dtype).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from deepinfer_cuda.vendor import _module

logger = logging.getLogger(__name__)


class DeepEPExchange:
    """exchange(x (T, Dm) bf16, weights (T, K), ids (T, K) global expert ids, local: range,
    experts(rows (R, Dm), local ids (R,)) -> (R, Dm)) -> (T, Dm) = sum_k weights * expert_k(x)."""

    def __init__(self, deep_ep: Any, num_experts: int, hidden_bytes: int) -> None:
        group = dist.group.WORLD
        size = dist.get_world_size()
        nvl, rdma = 0, 0
        for config in (deep_ep.Buffer.get_dispatch_config(size), deep_ep.Buffer.get_combine_config(size)):
            nvl = max(config.get_nvl_buffer_size_hint(hidden_bytes, size), nvl)
            rdma = max(config.get_rdma_buffer_size_hint(hidden_bytes, size), rdma)
        self.buffer = deep_ep.Buffer(group, nvl, rdma)
        self.num_experts = num_experts

    def __call__(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        local: range,
        experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        topk_idx = ids.to(torch.int64)
        per_rank, per_rdma_rank, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(
            topk_idx, self.num_experts
        )
        recv_x, recv_idx, recv_w, _, handle, _ = self.buffer.dispatch(
            x, topk_idx=topk_idx, topk_weights=weights.float(), num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
        )  # fmt: skip
        # recv_idx (R, K): this rank's local expert ids, -1 where the expert is on another rank
        rows, slots = (recv_idx >= 0).nonzero(as_tuple=True)
        out = experts(recv_x[rows], recv_idx[rows, slots])  # (P, Dm)
        partial = torch.zeros(recv_x.shape, dtype=torch.float32, device=x.device)
        partial.index_add_(0, rows, out.float() * recv_w[rows, slots].float().unsqueeze(-1))
        combined, _, _ = self.buffer.combine(partial.to(x.dtype), handle)
        result: torch.Tensor = combined
        return result


@functools.cache
def _exchange(num_experts: int, hidden_bytes: int) -> DeepEPExchange | None:
    deep_ep = _module("deep_ep")
    if deep_ep is None:
        return None
    logger.info(
        "expert parallelism: DeepEP normal kernels for dispatch and combine (%d experts)", num_experts
    )
    return DeepEPExchange(deep_ep, num_experts, hidden_bytes)


def deepep_exchange(num_experts: int, x: torch.Tensor) -> DeepEPExchange | None:
    """The DeepEP exchange for num_experts routed experts and activations like x, or None when
    DeepEP does not apply (not installed, not bf16 on CUDA over NCCL, experts not divisible)."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and dist.is_initialized()):
        return None
    if dist.get_backend() != "nccl" or num_experts % dist.get_world_size():
        return None
    return _exchange(num_experts, x.shape[1] * 2)
