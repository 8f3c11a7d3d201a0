"""MoE expert parallelism: routed experts sharded over the ranks of the default
torch.distributed group, tokens sent to their experts and back with all_to_all.

Rank r of W holds experts [r * E / W, (r + 1) * E / W); every rank keeps the router and the
shared experts and serves its own requests (attention data parallelism). Every MoE layer is a
collective: each rank must run it the same number of times, with no tokens if it has none.
How the ranks keep in step across calls and steps, and learn of each other's failures:
deepinfer.parallel.rank_sync.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from deepinfer.backend.ops import CollectiveOps
from deepinfer.parallel.exchanges import current_log
from deepinfer.parallel.rank_sync import RankSync


@dataclass(frozen=True)
class ExpertParallel:
    rank: int
    world_size: int
    # the engine's status exchanges with the other ranks (its group is made at the first call)
    sync: RankSync = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sync", RankSync(self.rank, self.world_size))

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
    experts; they come back and are combined in float32 where the token lives.

    Once the first collective ran, all of them run: if experts() raises, zeros go back to the
    other ranks (who wait for them) and the error is raised after (deepinfer.parallel.exchanges)."""
    t, k = ids.shape
    flat = ids.reshape(-1).long()  # (T*K,)
    dest = flat // len(local)  # the rank holding each pair's expert
    order = torch.argsort(dest, stable=True)  # pairs grouped by destination rank
    send = torch.bincount(dest, minlength=world_size)  # (W,) pairs for each rank
    log = current_log()
    if log is not None:
        log.started()
    recv = collectives.all_to_all_single(send)  # (W,) pairs from each rank
    send_sizes, recv_sizes = send.tolist(), recv.tolist()  # host sizes for the exchanges
    rows = collectives.all_to_all_single(x[order // k], recv_sizes, send_sizes)  # (R, Dm)
    local_ids = collectives.all_to_all_single(flat[order], recv_sizes, send_sizes) - local.start
    failure: BaseException | None = None
    try:
        out = experts(rows, local_ids)  # (R, Dm)
    except BaseException as exc:  # the other ranks wait for these rows: zeros go back, then raise
        out, failure = rows.new_zeros(rows.shape), exc
    back = collectives.all_to_all_single(out, send_sizes, recv_sizes)  # (T*K, Dm) in `order`
    if log is not None:
        shape = (x.shape[1], x.dtype, out.dtype, local, world_size, x.device)
        log.finished(partial(_empty_exchange, collectives, *shape))
    if failure is not None:
        raise failure
    pairs = torch.empty_like(back)
    pairs[order] = back
    y = (pairs.view(t, k, x.shape[1]).float() * weights.float().unsqueeze(-1)).sum(dim=1)
    return y.to(x.dtype)


def _empty_exchange(
    collectives: CollectiveOps,
    hidden: int,
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    local: range,
    world_size: int,
    device: torch.device,
) -> None:
    """One exchange with no tokens of this rank, whose experts return zeros: what a rank whose
    forward failed still owes the others (deepinfer.parallel.exchanges)."""
    x = torch.empty((0, hidden), dtype=dtype, device=device)
    ids = torch.empty((0, 1), dtype=torch.int64, device=device)

    def zeros(rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros((rows.shape[0], hidden), dtype=out_dtype, device=device)

    dispatch_combine(collectives, x, ids.float(), ids, local, world_size, zeros)
