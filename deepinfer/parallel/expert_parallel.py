"""MoE expert parallelism: routed experts sharded over the ranks of the default
torch.distributed group, tokens sent to their experts and back with all_to_all.

Rank r of W holds experts [r * E / W, (r + 1) * E / W) (when W does not divide E, the first
E % W ranks hold one more: ExpertParallel.expert_bounds); every rank keeps the router and the
shared experts and serves its own requests (attention data parallelism). Every MoE layer is a
collective: each rank must run it the same number of times, with no tokens if it has none.

Two exchanges serve a MoE layer:
- dispatch_combine, sized on the host: each (token, expert) pair goes to the rank holding the
  expert (all_to_all with the pair counts as splits). Any step: prefill, mixed, eager decode.
- fixed_exchange, of fixed shapes: every rank has the same number of rows (a decode step padded
  to the graph bucket the ranks agreed on), each token goes once to every rank (all_gather) and
  the ranks' partial sums come back summed (reduce_scatter). Nothing is sized on the host, so a
  whole decode forward, exchanges included, is captured in one graph per bucket.
How the ranks keep in step across calls and steps, and learn of each other's failures:
deepinfer.parallel.rank_sync.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from deepinfer.backend.ops import CollectiveOps
from deepinfer.config import EplbConfig
from deepinfer.parallel.eplb import ExpertMap, initial_placement
from deepinfer.parallel.exchanges import current_log
from deepinfer.parallel.rank_sync import RankSync


@dataclass(frozen=True)
class ExpertParallel:
    rank: int
    world_size: int
    micro_batches: int = 1  # 2: two-batch overlap in every MoE layer (dispatch_combine)
    eplb: EplbConfig | None = None  # load balancing: redundant experts, rearranged (parallel.eplb)
    # the engine's status exchanges with the other ranks (its group is made at the first call)
    sync: RankSync = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sync", RankSync(self.rank, self.world_size))

    @classmethod
    def from_torch_distributed(cls, micro_batches: int = 1, eplb: EplbConfig | None = None) -> ExpertParallel:
        if not dist.is_initialized():
            raise ValueError(
                "enable_expert_parallel needs torch.distributed initialised first, one process per "
                "rank (torchrun, or torch.distributed.init_process_group)"
            )
        return cls(dist.get_rank(), dist.get_world_size(), micro_batches, eplb)

    def num_physical(self, num_experts: int) -> int:
        """Expert weight slots over all ranks: E, plus the redundant ones with EPLB (their sum
        a multiple of the ranks: each rank holds as many)."""
        if self.eplb is None:
            return num_experts
        p = num_experts + self.eplb.num_redundant_experts
        if p % self.world_size:
            raise ValueError(
                f"enable_eplb: {num_experts} routed experts + num_redundant_experts="
                f"{self.eplb.num_redundant_experts} = {p} slots do not divide over {self.world_size} ranks; "
                f"choose num_redundant_experts so that the sum is a multiple of {self.world_size}"
            )
        return p

    def held_experts(self, num_experts: int) -> list[int]:
        """The logical experts of this rank's slots when the model loads: its range of E without
        EPLB, else those of parallel.eplb.initial_placement."""
        p = self.num_physical(num_experts)
        bounds = self.expert_bounds(p)
        return initial_placement(num_experts, p)[bounds[self.rank] : bounds[self.rank + 1]]

    def expert_map(self, num_experts: int, device: torch.device | str) -> ExpertMap | None:
        """A MoE layer's logical -> physical map under EPLB (None without it)."""
        if self.eplb is None:
            return None
        return ExpertMap(num_experts, self.num_physical(num_experts), device)

    def expert_bounds(self, num_experts: int) -> list[int]:
        """(W + 1,) bounds: rank r holds experts [bounds[r], bounds[r + 1]); when W does not divide
        E the first E % W ranks hold one more."""
        if num_experts < self.world_size:
            raise ValueError(
                f"expert parallelism over {self.world_size} ranks needs at least as many routed experts; "
                f"the model has {num_experts}"
            )
        q, rem = divmod(num_experts, self.world_size)
        return [r * q + min(r, rem) for r in range(self.world_size + 1)]

    def local_experts(self, num_experts: int) -> range:
        """The routed experts this rank holds."""
        bounds = self.expert_bounds(num_experts)
        return range(bounds[self.rank], bounds[self.rank + 1])


def dispatch_combine(
    collectives: CollectiveOps,
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    bounds: Sequence[int],
    rank: int,
    experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    micro_batches: int = 1,
    meanwhile: Callable[[], object] | None = None,
) -> torch.Tensor:
    """x (T, Dm), routing weights / global expert ids (T, K) -> sum_k weights * expert_k(x), (T, Dm).

    Each (token, expert) pair goes to the rank holding the expert (rank r holds experts
    [bounds[r], bounds[r + 1])); there experts(rows (R, Dm), local ids (R,)) computes the
    unweighted outputs (R, Dm) of this rank's experts; they come back and are combined in float32
    where the token lives.

    micro_batches=2 (two-batch overlap): the tokens are split in two halves whose exchanges are
    started without waiting, so that the dispatch of the second half runs while the first half's
    experts compute, and the combine of the first while the second's compute. Every rank must
    pass the same micro_batches. The sums are those of micro_batches=1. meanwhile(), if given,
    runs once the last combine started, before waiting for it (compute that overlaps it).

    Once the first collective ran, all of them run: if experts() raises, zeros go back to the
    other ranks (who wait for them) and the error is raised after (deepinfer.parallel.exchanges)."""
    t, k = ids.shape
    world_size = len(bounds) - 1
    local = range(bounds[rank], bounds[rank + 1])
    # the backend's fused exchange, if it has one for these experts (it checks that they divide
    # evenly: one it was asked for explicitly raises where they do not)
    fused = collectives.expert_exchange(bounds[-1], x, k) if micro_batches == 1 else None
    if fused is not None:
        return _fused_exchange(fused, collectives, x, weights, ids, bounds, rank, experts, meanwhile)
    flat = ids.reshape(-1).long()  # (T*K,)
    starts = torch.tensor(bounds[1:-1], dtype=torch.int64, device=flat.device)  # (W-1,)
    dest = torch.bucketize(flat, starts, right=True)  # the rank holding each pair's expert
    # micro-batch m: the pairs of tokens [cut[m], cut[m + 1]); pairs grouped by destination rank
    cut = [t * m // micro_batches for m in range(micro_batches + 1)]
    orders = [
        torch.argsort(dest[cut[m] * k : cut[m + 1] * k], stable=True) + cut[m] * k
        for m in range(micro_batches)
    ]
    send = torch.stack(
        [
            torch.bincount(dest[cut[m] * k : cut[m + 1] * k], minlength=world_size)
            for m in range(micro_batches)
        ],
        dim=1,
    )  # (W, M) pairs for each rank, per micro-batch
    log = current_log()
    if log is not None:
        log.started()
    recv = collectives.all_to_all_single(send)  # (W, M) pairs from each rank
    send_sizes, recv_sizes = send.t().tolist(), recv.t().tolist()  # (M, W) host sizes
    a2a = collectives.all_to_all_single_async
    dispatched = []  # per micro-batch: rows (R, Dm), their global expert ids (R,), and their waits
    for m, order in enumerate(orders):
        rows, wait_rows = a2a(x[order // k], recv_sizes[m], send_sizes[m])
        got_ids, wait_ids = a2a(flat[order], recv_sizes[m], send_sizes[m])
        dispatched.append((rows, got_ids, wait_rows, wait_ids))
    failure: BaseException | None = None
    combined = []  # per micro-batch: (outputs back (T_m*K, Dm) in its order, wait)
    for m, (rows, got_ids, wait_rows, wait_ids) in enumerate(dispatched):
        wait_rows()
        wait_ids()
        out = None
        if failure is None:
            try:
                out = experts(rows, got_ids - local.start)  # (R, Dm)
            except BaseException as exc:  # the other ranks wait for these rows: zeros go back, then raise
                failure = exc
        if out is None:
            out = rows.new_zeros(rows.shape)
        combined.append(a2a(out, send_sizes[m], recv_sizes[m]))
    if meanwhile is not None and failure is None:  # e.g. the shared experts, while the combines run
        try:
            meanwhile()
        except BaseException as exc:
            failure = exc
    for _, wait in combined:
        wait()
    if log is not None:
        shape = (x.shape[1], k, x.dtype, combined[0][0].dtype, bounds, rank, x.device, micro_batches)
        log.finished(partial(_empty_exchange, collectives, *shape))
    if failure is not None:
        raise failure
    pairs = torch.empty((t * k, x.shape[1]), dtype=combined[0][0].dtype, device=x.device)
    for order, (back, _) in zip(orders, combined):
        pairs[order] = back
    y = (pairs.view(t, k, x.shape[1]).float() * weights.float().unsqueeze(-1)).sum(dim=1)
    return y.to(x.dtype)


def routed_experts(
    collectives: CollectiveOps,
    ep: ExpertParallel,
    bounds: Sequence[int],
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    fixed: bool,
    local_moe: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    meanwhile: Callable[[], object] | None = None,
) -> torch.Tensor:
    """x (T, Dm), routing weights / global expert ids (T, K) -> sum_k weights * expert_k(x), (T, Dm)
    over the ranks: fixed_exchange in a graph step (`fixed`: ForwardBatch.fixed_exchange), else
    dispatch_combine. local_moe(rows (R, Dm), weights (R, K'), local ids (R, K')) -> (R, Dm), the
    weighted sum of this rank's experts (a fused MoE over the rank's weights). meanwhile() (e.g.
    the shared experts) runs once: with two micro-batches while the last combine is in flight,
    else after the exchange."""
    overlap = not fixed and ep.micro_batches == 2
    if fixed:
        y = fixed_exchange(collectives, x, weights, ids, bounds, ep.rank, local_moe)
    else:

        def pairs(rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:  # one row per pair
            ones = torch.ones((rows.shape[0], 1), dtype=torch.float32, device=rows.device)
            return local_moe(rows, ones, local_ids.view(-1, 1))

        y = dispatch_combine(
            collectives, x, weights, ids, bounds, ep.rank, pairs, ep.micro_batches,
            meanwhile if overlap else None,
        )  # fmt: skip
    if meanwhile is not None and not overlap:
        meanwhile()
    return y


def _fused_exchange(
    fused: Callable[..., torch.Tensor],
    collectives: CollectiveOps,
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    bounds: Sequence[int],
    rank: int,
    experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    meanwhile: Callable[[], object] | None,
) -> torch.Tensor:
    """dispatch_combine through the backend's fused exchange (collectives.expert_exchange), with
    the same promise: if experts() raises, zeros go back and the error is raised after."""
    failures: list[BaseException] = []

    def guarded(rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        try:
            return experts(rows, local_ids)
        except BaseException as exc:
            failures.append(exc)
            return rows.new_zeros(rows.shape)

    log = current_log()
    if log is not None:
        log.started()
    y = fused(x, weights, ids, range(bounds[rank], bounds[rank + 1]), guarded)
    if log is not None:
        shape = (x.shape[1], ids.shape[1], x.dtype, x.dtype, bounds, rank, x.device, 1)
        log.finished(partial(_empty_exchange, collectives, *shape))
    if meanwhile is not None and not failures:
        meanwhile()
    if failures:
        raise failures[0]
    return y


def fixed_exchange(
    collectives: CollectiveOps,
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    bounds: Sequence[int],
    rank: int,
    experts: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """x (T, Dm), routing weights / global expert ids (T, K) -> sum_k weights * expert_k(x), (T, Dm),
    where every rank passes the same T (a graph bucket, padding rows included): no size is read
    on the host, so the exchange can be captured in a graph.

    1. all_gather of one packed row per token, [weights (K,) float32 | ids (K,) int32 | x (Dm,)]
       as bytes: the tokens of every rank, (W*T, ...) in rank order. Each token travels once to
       each rank: T rows a peer (one row per (token, expert) pair would be K times more).
    2. experts(rows (W*T, Dm), weights (W*T, K), local ids (W*T, K)) -> (W*T, Dm), the weighted
       sum over the pairs whose expert this rank holds: the other pairs get weight 0 and some
       expert of this rank as their id (they add nothing; a fused MoE still computes them).
    3. reduce_scatter: each token's partial sums added over the ranks (in x's dtype, each rank's
       partial rounded to it first), (T, Dm) back where the token lives.

    As dispatch_combine: once the all_gather ran, the reduce_scatter runs too; if experts() raises,
    zeros go to the other ranks and the error is raised after (deepinfer.parallel.exchanges)."""
    t, k = ids.shape
    local = range(bounds[rank], bounds[rank + 1])
    packed = _pack(x, weights, ids)  # (T, B) uint8
    log = current_log()
    if log is not None:
        log.started()
    rows = collectives.all_gather(packed)  # (W*T, B)
    failure: BaseException | None = None
    try:
        got_w, got_ids, got_x = _unpack(rows, k, x.shape[1], x.dtype)
        mine = (got_ids >= local.start) & (got_ids < local.stop)
        local_w = torch.where(mine, got_w, 0.0)
        local_ids = torch.where(mine, got_ids - local.start, got_ids % len(local))
        partial_sums = experts(got_x, local_w, local_ids)  # (W*T, Dm)
    except BaseException as exc:  # the other ranks wait in the reduce_scatter: zeros go back, then raise
        failure = exc
        partial_sums = x.new_zeros((rows.shape[0], x.shape[1]))
    y = collectives.reduce_scatter(partial_sums.to(x.dtype))  # (T, Dm)
    if log is not None:
        shape = (t, k, x.shape[1], x.dtype, bounds, rank, x.device)
        log.finished(partial(_empty_fixed_exchange, collectives, *shape))
    if failure is not None:
        raise failure
    return y


def _pack(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(T, Dm), (T, K), (T, K) -> (T, B) uint8 rows [weights float32 | ids int32 | x | padding to
    4 bytes], B = 8K + Dm * itemsize rounded up to 4, so that every part unpacks as a view."""
    t = x.shape[0]
    parts = [
        weights.float().contiguous().view(torch.uint8),
        ids.to(torch.int32).contiguous().view(torch.uint8),
        x.contiguous().view(torch.uint8),
    ]
    pad = -(x.shape[1] * x.element_size()) % 4
    if pad:
        parts.append(torch.zeros((t, pad), dtype=torch.uint8, device=x.device))
    return torch.cat(parts, dim=1)


def _unpack(
    rows: torch.Tensor, k: int, hidden: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_pack's (N, B) rows -> weights (N, K) float32, ids (N, K) int32, x (N, Dm) contiguous."""
    x_bytes = hidden * torch.empty((), dtype=dtype).element_size()
    weights = rows[:, : 4 * k].view(torch.float32)
    ids = rows[:, 4 * k : 8 * k].view(torch.int32)
    x = rows[:, 8 * k : 8 * k + x_bytes].view(dtype).contiguous()  # fused_moe's x is contiguous
    return weights, ids, x


def _empty_fixed_exchange(
    collectives: CollectiveOps,
    t: int,
    k: int,
    hidden: int,
    dtype: torch.dtype,
    bounds: Sequence[int],
    rank: int,
    device: torch.device,
) -> None:
    """One fixed_exchange of T padding rows whose experts return zeros (deepinfer.parallel.exchanges)."""
    x = torch.zeros((t, hidden), dtype=dtype, device=device)
    ids = torch.zeros((t, k), dtype=torch.int32, device=device)

    def zeros(rows: torch.Tensor, weights: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(rows)

    fixed_exchange(collectives, x, ids.float(), ids, bounds, rank, zeros)


def _empty_exchange(
    collectives: CollectiveOps,
    hidden: int,
    k: int,
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    bounds: Sequence[int],
    rank: int,
    device: torch.device,
    micro_batches: int,
) -> None:
    """One exchange with no tokens of this rank, whose experts return zeros: what a rank whose
    forward failed still owes the others (deepinfer.parallel.exchanges). It keeps the layer's K:
    the backend's choice of exchange may depend on it."""
    x = torch.empty((0, hidden), dtype=dtype, device=device)
    ids = torch.empty((0, k), dtype=torch.int64, device=device)

    def zeros(rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros((rows.shape[0], hidden), dtype=out_dtype, device=device)

    dispatch_combine(collectives, x, ids.float(), ids, bounds, rank, zeros, micro_batches)
