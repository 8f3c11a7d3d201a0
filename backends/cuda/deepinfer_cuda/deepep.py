"""DeepEP's EPBuffer (DeepEP >= 2.5) as the expert-parallel exchange (collectives.expert_exchange).

Selected explicitly: DEEPINFER_CUDA_EXPERT_EXCHANGE=deepep (deepinfer.envs). Asking for it where
`deep_ep` does not import, or has no EPBuffer (the V1 `deep_ep.Buffer` API is not supported), is
an error when the backend is created; a MoE layer it cannot serve (activations not bf16, a group
not on NCCL, experts that do not divide evenly over the ranks, more tokens than the buffer holds)
is an error at that layer, never a silent fallback to all_to_all. It has not run on a GPU:
tests/test_deepep.py runs it against a simulation of the EPBuffer calls it makes
(tests/deepep_sim.py) over gloo.

One exchange, EPBuffer's normal (non-expanded) layout:
  dispatch(x (T, Dm) bf16, topk_idx (T, K) topk_idx_t, topk_weights (T, K) float32, num_experts)
    -> recv_x (R, Dm): each token once on every rank holding one of its experts,
       recv_topk_idx (R, K): this rank's local expert ids, -1 where the expert is elsewhere,
       recv_topk_weights (R, K), handle, event;
  here the pairs (received token, local expert) run through this rank's experts, weighted and
  summed per received token in float32;
  combine(partial (R, Dm) bf16, handle) -> (T, Dm): the partial sums added over the ranks, back
  where each token lives (bf16 out, where the all_to_all path adds the pairs in float32).
In batch-invariant mode the buffer is deterministic (received rows in source order) with one
reduction in combine (allow_multiple_reduction=False), as DeepSeek's engine sets it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from deepinfer import envs

logger = logging.getLogger(__name__)
_SELECTED = f"{envs.CUDA_EXPERT_EXCHANGE.name}=deepep"


def load_deep_ep() -> Any:
    """The deep_ep module with an EPBuffer; RuntimeError saying why not."""
    try:
        import deep_ep
    except Exception as exc:
        raise RuntimeError(
            f"{_SELECTED}, but deep_ep cannot be imported "
            f"({type(exc).__name__}: {exc}); install DeepEP >= 2.5, or unset the variable for all_to_all"
        ) from exc
    if not hasattr(deep_ep, "EPBuffer"):
        version = getattr(deep_ep, "__version__", "unknown")
        raise RuntimeError(
            f"{_SELECTED} needs DeepEP >= 2.5 (deep_ep.EPBuffer); the installed "
            f"deep_ep {version} has none (its V1 deep_ep.Buffer API is not supported)"
        )
    return deep_ep


class DeepEPExchange:
    """exchange(x (T, Dm) bf16, weights (T, K), ids (T, K) global expert ids, local: range,
    experts(rows (R, Dm), local ids (R,)) -> (R, Dm)) -> (T, Dm) = sum_k weights * expert_k(x)."""

    def __init__(
        self,
        deep_ep: Any,
        group: Any,
        num_experts: int,
        hidden: int,
        top_k: int,
        max_tokens: int,
        deterministic: bool,
    ) -> None:
        self.num_experts, self.max_tokens = num_experts, max_tokens
        self.index_dtype = getattr(deep_ep, "topk_idx_t", torch.int64)
        self.buffer = deep_ep.EPBuffer(
            group, num_max_tokens_per_rank=max_tokens, hidden=hidden, num_topk=top_k,
            deterministic=deterministic, allow_multiple_reduction=not deterministic,
        )  # fmt: skip

    def __call__(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        local: range,
        experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        if x.shape[0] > self.max_tokens:  # every rank's buffer holds at most max_tokens rows
            raise ValueError(
                f"DeepEP exchange: {x.shape[0]} tokens in one MoE layer, more than its buffer's "
                f"{self.max_tokens} ({envs.CUDA_DEEPEP_TOKENS.name}); raise it to max_num_batched_tokens"
            )
        recv_x, recv_idx, recv_w, handle, _ = self.buffer.dispatch(
            x, topk_idx=ids.to(self.index_dtype), topk_weights=weights.float(), num_experts=self.num_experts
        )
        rows, slots = (recv_idx >= 0).nonzero(as_tuple=True)  # the pairs of this rank's experts
        out = experts(recv_x[rows], recv_idx[rows, slots].long())  # (P, Dm)
        partial = torch.zeros(recv_x.shape, dtype=torch.float32, device=x.device)
        partial.index_add_(0, rows, out.float() * recv_w[rows, slots].float().unsqueeze(-1))
        combined, _, _ = self.buffer.combine(partial.to(x.dtype), handle)
        result: torch.Tensor = combined
        return result


class DeepEPExchanges:
    """The exchanges of one backend, one EPBuffer per (experts, hidden, top-k) shape."""

    def __init__(self, deep_ep: Any, max_tokens: int, deterministic: bool) -> None:
        self.deep_ep, self.max_tokens, self.deterministic = deep_ep, max_tokens, deterministic
        self._made: dict[tuple[int, int, int], DeepEPExchange] = {}

    def get(self, num_experts: int, x: torch.Tensor, top_k: int) -> DeepEPExchange:
        """The exchange for a MoE layer; ValueError where DeepEP cannot serve it."""
        if x.dtype != torch.bfloat16:
            raise ValueError(
                f"the DeepEP exchange dispatches bfloat16 activations; the model runs in {x.dtype}"
            )
        if not dist.is_initialized() or dist.get_backend() != "nccl":
            raise ValueError(
                "the DeepEP exchange runs over an NCCL group (torch.distributed's default group)"
            )
        if num_experts % dist.get_world_size():
            raise ValueError(
                f"the DeepEP exchange needs the {num_experts} expert slots to divide over the "
                f"{dist.get_world_size()} ranks"
            )
        key = (num_experts, x.shape[1], top_k)
        if key not in self._made:
            logger.info(
                "expert parallelism: DeepEP EPBuffer for dispatch and combine (%d experts)", num_experts
            )
            self._made[key] = DeepEPExchange(
                self.deep_ep,
                dist.group.WORLD,
                num_experts,
                x.shape[1],
                top_k,
                self.max_tokens,
                self.deterministic,
            )
        return self._made[key]
