"""MoE expert parallelism: routed experts sharded over the ranks of the default
torch.distributed group, tokens sent to their experts and back with all_to_all.

Rank r of W holds experts [r * E / W, (r + 1) * E / W); every rank keeps the router and the
shared experts and serves its own requests (attention data parallelism). Every MoE layer is a
collective: each rank must run it the same number of times, with no tokens if it has none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepinfer.backend.ops import CollectiveOps


@dataclass(frozen=True)
class ExpertParallel:
    rank: int
    world_size: int

    @classmethod
    def from_torch_distributed(cls) -> ExpertParallel:
        if not dist.is_initialized():
            raise ValueError(
                "enable_expert_parallel needs torch.distributed initialised first, one process per "
                "rank (torchrun, or torch.distributed.init_process_group)"
            )
        return cls(dist.get_rank(), dist.get_world_size())

    def local_experts(self, num_experts: int) -> range:
        """The routed experts this rank holds."""
        if num_experts % self.world_size:
            raise ValueError(
                f"expert parallelism over {self.world_size} ranks needs the {num_experts} routed "
                "experts to divide evenly among them"
            )
        n = num_experts // self.world_size
        return range(self.rank * n, (self.rank + 1) * n)


def dispatch_combine(
    collectives: CollectiveOps,
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    local: range,
    world_size: int,
    experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """x (T, Dm), routing weights / global expert ids (T, K) -> sum_k weights * expert_k(x), (T, Dm).

    Each (token, expert) pair goes to the rank holding the expert; there
    experts(rows (R, Dm), local ids (R,)) computes the unweighted outputs (R, Dm) of this rank's
    experts; they come back and are combined in float32 where the token lives."""
    t, k = ids.shape
    flat = ids.reshape(-1).long()  # (T*K,)
    dest = flat // len(local)  # the rank holding each pair's expert
    order = torch.argsort(dest, stable=True)  # pairs grouped by destination rank
    send = torch.bincount(dest, minlength=world_size)  # (W,) pairs for each rank
    recv = collectives.all_to_all_single(send)  # (W,) pairs from each rank
    send_sizes, recv_sizes = send.tolist(), recv.tolist()  # host sizes for the exchanges
    rows = collectives.all_to_all_single(x[order // k], recv_sizes, send_sizes)  # (R, Dm)
    local_ids = collectives.all_to_all_single(flat[order], recv_sizes, send_sizes) - local.start
    out = experts(rows, local_ids)  # (R, Dm)
    back = collectives.all_to_all_single(out, send_sizes, recv_sizes)  # (T*K, Dm) in `order`
    pairs = torch.empty_like(back)
    pairs[order] = back
    y = (pairs.view(t, k, x.shape[1]).float() * weights.float().unsqueeze(-1)).sum(dim=1)
    return y.to(x.dtype)
