"""A simulation of DeepEP 2.5's EPBuffer, exactly the calls deepinfer_cuda.deepep makes, over any
torch.distributed group (gloo on the CPU): `EPBuffer(group, num_max_tokens_per_rank=, hidden=,
num_topk=, deterministic=, allow_multiple_reduction=)`, `dispatch(x, topk_idx=, topk_weights=,
num_experts=)` and `combine(x, handle)`, with DeepEP's argument rules (bf16 activations,
topk_idx_t ids, float32 weights, at most num_max_tokens_per_rank tokens, experts that divide
evenly) and its results in the normal (non-expanded) layout:

  dispatch -> recv_x (R, Dm): every token of every rank with at least one expert on this rank,
              recv_topk_idx (R, K): local expert ids, -1 for experts elsewhere,
              recv_topk_weights (R, K), handle, event;
  combine(x (R, Dm), handle) -> (T, Dm) bf16: each token's rows summed over the ranks, None, event.

Received rows come in source order when deterministic, else in a scrambled order (DeepEP gives
no order then), so a caller that relies on the order fails. Built with all_gather / all_reduce.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

__version__ = "2.5.0"
topk_idx_t = torch.int64
calls: dict[str, int] = {"dispatch": 0, "combine": 0}


def _gather(t: torch.Tensor, group: Any) -> torch.Tensor:
    """(n, m) per rank -> (W * n, m), as bytes (gloo gathers neither bf16 nor int16)."""
    raw = t.contiguous().view(torch.uint8)
    out = [torch.empty_like(raw) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, raw, group=group)
    return torch.cat(out).view(t.dtype)


class EPBuffer:
    def __init__(
        self,
        group: Any,
        num_bytes: int | None = None,
        num_max_tokens_per_rank: int = 0,
        hidden: int = 0,
        num_topk: int = 0,
        deterministic: bool = False,
        allow_multiple_reduction: bool = True,
        explicitly_destroy: bool = False,
    ) -> None:
        assert num_max_tokens_per_rank > 0 and hidden > 0 and num_topk > 0
        self.group, self.capacity, self.hidden, self.num_topk = (
            group,
            num_max_tokens_per_rank,
            hidden,
            num_topk,
        )
        self.deterministic = deterministic
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any, None]:
        t, k = topk_idx.shape
        assert x.dtype == torch.bfloat16 and x.shape == (t, self.hidden), (x.dtype, x.shape)
        assert topk_idx.dtype == topk_idx_t and topk_weights.dtype == torch.float32 and k == self.num_topk
        assert t <= self.capacity and num_experts % self.world == 0
        calls["dispatch"] += 1
        cap, local = self.capacity, num_experts // self.world
        pad = cap - t
        all_x = _gather(torch.cat([x, x.new_zeros((pad, x.shape[1]))]), self.group)
        all_ids = _gather(torch.cat([topk_idx, topk_idx.new_full((pad, k), -1)]), self.group)
        all_w = _gather(torch.cat([topk_weights, topk_weights.new_zeros((pad, k))]), self.group)
        lo = self.rank * local
        mine = (all_ids >= lo) & (all_ids < lo + local)  # (W * cap, K)
        source = mine.any(dim=1).nonzero().view(-1)  # global row index of each received token
        if not self.deterministic:
            source = source.flip(0)  # any order: not the source order
        recv_ids = torch.where(mine, all_ids - lo, -1)[source]
        handle = SimpleNamespace(source=source, num_tokens=t, buffer=self)
        return all_x[source], recv_ids, all_w[source], handle, None

    def combine(self, x: torch.Tensor, handle: Any) -> tuple[torch.Tensor, None, None]:
        assert handle.buffer is self and x.dtype == torch.bfloat16 and x.shape[0] == handle.source.shape[0]
        calls["combine"] += 1
        sums = torch.zeros((self.world * self.capacity, x.shape[1]), dtype=torch.float32)
        sums[handle.source] = x.float()
        dist.all_reduce(sums, group=self.group)
        start = self.rank * self.capacity
        return sums[start : start + handle.num_tokens].to(torch.bfloat16), None, None
