"""Expert-parallel load balancing (EPLB), as DeepSeek's engine and vLLM do it: redundant
replicas of the hottest routed experts, placed so that the busiest rank's load falls.

Symbols: E logical experts (the model's), R redundant slots (EplbConfig.num_redundant_experts),
P = E + R physical experts (weight slots), W ranks, each holding P / W consecutive slots;
L MoE layers, T tokens, K experts per token.

- Each MoE layer keeps an ExpertMap: phys2log (P,) (which logical expert each slot holds),
  log2phys (E, R + 1) and replicas (E,) (the slots of each logical expert). The router's logical
  ids become physical ones (ExpertMap.physical): a token's pair (t, k) of an expert with n
  replicas goes to replica hash(its routing weight's bits) % n, a function of the token alone, so
  which replica serves it does not depend on the rest of the batch (replicas hold the same
  weights: only the rank that computes it changes).
- Eager steps (the sized exchange, dispatch_combine) add their pairs to the layer's physical
  counts; before each step (every rank, at the same step) ExpertBalancer.step moves them into a
  ring of window_size steps, as logical counts. Graph steps are not counted: their fixed
  exchange makes every rank compute every pair (the others weighted 0), so the placement does
  not change their work.
- Every step_interval steps the rings are summed over the ranks (all_reduce), a plan is made
  from the window's load of each layer (the same on every rank: integer loads, exact fractions),
  and the weights move between ranks by all_to_all (the backend's collectives: gloo, NCCL, ...),
  in place, so graphs captured over them stay valid.
The plan (replicate, then pack): R times, one more replica to the logical expert with the highest
load per replica (this minimises the highest load per replica); then the replicas, heaviest
first, each to the rank with free slots and the least load (not already holding that expert
first, then the one holding it before, to move less); within a rank an expert keeps its slot.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch
from torch import nn

from deepinfer.backend.ops import CollectiveOps
from deepinfer.config import EplbConfig

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the plan


def initial_placement(num_experts: int, num_physical: int) -> list[int]:
    """phys2log before any load is known: slot p holds expert p % E (the replicas of experts
    0 .. R - 1 spread over the last slots)."""
    return [p % num_experts for p in range(num_physical)]


def replicate(load: Sequence[int], num_physical: int) -> list[int]:
    """(E,) loads -> (E,) replica counts summing to num_physical: each extra replica to the
    expert with the highest load per replica (ties: the lowest id)."""
    counts = [1] * len(load)
    for _ in range(num_physical - len(load)):
        e = max(range(len(load)), key=lambda e: (Fraction(load[e], counts[e]), -e))
        counts[e] += 1
    return counts


def pack(load: Sequence[int], counts: Sequence[int], world_size: int, previous: Sequence[int]) -> list[int]:
    """Replicas of loads load[e] / counts[e] onto world_size ranks of P / W slots -> phys2log (P,).
    Heaviest replica first (ties: lowest id), each to the rank with free slots that does not
    hold that expert yet, then with the least load, then that held it in `previous` (phys2log
    before), then the lowest; within a rank, experts that were there keep their slots."""
    num_physical = sum(counts)
    cap = num_physical // world_size
    old = [list(previous[r * cap : (r + 1) * cap]) for r in range(world_size)]
    replicas = sorted(
        ((Fraction(load[e], counts[e]), e) for e in range(len(load)) for _ in range(counts[e])),
        key=lambda item: (-item[0], item[1]),
    )
    held: list[list[int]] = [[] for _ in range(world_size)]
    rank_load = [Fraction(0)] * world_size
    for w, e in replicas:
        free = [r for r in range(world_size) if len(held[r]) < cap]
        r = min(free, key=lambda r: (rank_load[r], e in held[r], e not in old[r], r))
        held[r].append(e)
        rank_load[r] += w
    phys2log: list[int] = []
    for r in range(world_size):
        slots: list[int | None] = [None] * cap
        rest = list(held[r])
        for i, e in enumerate(old[r]):  # an expert that stays on this rank keeps its slot
            if e in rest:
                rest.remove(e)
                slots[i] = e
        fill = iter(rest)
        phys2log += [e if e is not None else next(fill) for e in slots]
    return phys2log


def plan(load: Sequence[int], num_physical: int, world_size: int, previous: Sequence[int]) -> list[int]:
    """The new phys2log (P,) for one layer's (E,) window load (module docstring)."""
    return pack(load, replicate(load, num_physical), world_size, previous)


def rank_loads(load: Sequence[int], phys2log: Sequence[int], world_size: int) -> list[Fraction]:
    """Each rank's load under phys2log, each expert's load split evenly over its replicas."""
    counts = [0] * len(load)
    for e in phys2log:
        counts[e] += 1
    cap = len(phys2log) // world_size
    return [
        sum((Fraction(load[e], counts[e]) for e in phys2log[r * cap : (r + 1) * cap]), Fraction(0))
        for r in range(world_size)
    ]


# --------------------------------------------------------------------------- one layer


class ExpertMap(nn.Module):
    """One MoE layer's logical -> physical map and its counts (module docstring). Its tensors
    are updated in place: graphs captured over them stay valid."""

    phys2log: torch.Tensor  # (P,) the logical expert of each slot
    log2phys: torch.Tensor  # (E, R + 1) the slots of each expert, the first repeated to fill
    replicas: torch.Tensor  # (E,) how many slots each expert has
    counts: torch.Tensor  # (P,) pairs per slot in this step
    total: torch.Tensor  # (P,) pairs per slot since the last rearrangement

    def __init__(self, num_experts: int, num_physical: int, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.num_experts, self.num_physical = num_experts, num_physical
        width = num_physical - num_experts + 1  # the most replicas one expert can have
        self.register_buffer("phys2log", torch.zeros(num_physical, dtype=torch.int64, device=device))
        self.register_buffer("log2phys", torch.zeros((num_experts, width), dtype=torch.int64, device=device))
        self.register_buffer("replicas", torch.ones(num_experts, dtype=torch.int64, device=device))
        self.register_buffer("counts", torch.zeros(num_physical, dtype=torch.int64, device=device))
        self.register_buffer("total", torch.zeros(num_physical, dtype=torch.int64, device=device))
        self.placement = initial_placement(num_experts, num_physical)
        self.set_placement(self.placement)

    def set_placement(self, phys2log: Sequence[int]) -> None:
        table: list[list[int]] = [[] for _ in range(self.num_experts)]
        for p, e in enumerate(phys2log):
            table[e].append(p)
        if any(not slots for slots in table):
            raise AssertionError("a logical expert without a replica")
        width = self.log2phys.shape[1]
        rows = [slots + [slots[0]] * (width - len(slots)) for slots in table]
        self.placement = list(phys2log)
        self.phys2log.copy_(torch.tensor(self.placement, dtype=torch.int64))
        self.log2phys.copy_(torch.tensor(rows, dtype=torch.int64))
        self.replicas.copy_(torch.tensor([len(s) for s in table], dtype=torch.int64))

    def physical(self, weights: torch.Tensor, ids: torch.Tensor, record: bool) -> torch.Tensor:
        """Logical ids (T, K) -> physical ids (T, K) int64: replica hash(weight bits) % replicas.
        record: add the pairs to this step's counts (eager steps; module docstring)."""
        ids = ids.long()
        bits = weights.float().contiguous().view(torch.int32).long() & 0x7FFFFFFF
        mixed = (bits * 0x9E3779B1) >> 16  # < 2^47: the low mantissa bits spread over the rest
        replica = mixed % self.replicas[ids]
        phys = self.log2phys[ids, replica]
        if record:
            flat = phys.reshape(-1)
            self.counts.index_add_(0, flat, torch.ones_like(flat))
        return phys


def move_experts(
    collectives: CollectiveOps,
    tensors: Sequence[torch.Tensor],
    old: Sequence[int],
    new: Sequence[int],
    rank: int,
    world_size: int,
) -> int:
    """Rewrite this rank's expert tensors (each (P / W, ...), slot-major) from placement `old`
    to `new` (phys2log, the same on every rank): a slot whose expert changes copies it from this
    rank if it holds it, else from the lowest rank that does, by one all_to_all per tensor (as
    bytes). A collective when any slot changes (every rank knows: the same plans). -> slots this
    rank received from other ranks."""
    cap = len(new) // world_size
    holders: dict[int, list[int]] = {}
    for p, e in enumerate(old):
        holders.setdefault(e, []).append(p)
    # (src rank, src local slot, dst rank, dst local slot) for every slot that changes
    moves = []
    for p, e in enumerate(new):
        if old[p] == e:
            continue
        dst = p // cap
        near = [q for q in holders[e] if q // cap == dst]
        q = near[0] if near else holders[e][0]
        moves.append((q // cap, q % cap, dst, p % cap))
    if not moves:
        return 0
    local = [(s, d) for src, s, dst, d in moves if src == dst == rank]
    # what goes to (comes from) each other rank; a rank's moves to itself are the local copies
    sends = [[s for src, s, dst, _ in moves if src == rank != dst == r] for r in range(world_size)]
    recvs = [[d for src, _, dst, d in moves if dst == rank != src == r] for r in range(world_size)]
    send_rows = [s for x in sends for s in x]
    recv_rows = [d for x in recvs for d in x]
    for t in tensors:
        raw = t.view(torch.uint8).reshape(t.shape[0], -1)  # (P / W, bytes of one expert)
        index = torch.tensor(send_rows, dtype=torch.int64, device=t.device)
        got = collectives.all_to_all_single(
            raw[index], [len(x) for x in recvs], [len(x) for x in sends]
        )  # (received, bytes)
        if local:  # read every source before writing any destination
            sources = torch.tensor([s for s, _ in local], dtype=torch.int64, device=t.device)
            targets = torch.tensor([d for _, d in local], dtype=torch.int64, device=t.device)
            raw[targets] = raw[sources].clone()
        if recv_rows:
            raw[torch.tensor(recv_rows, dtype=torch.int64, device=t.device)] = got
    return len(recv_rows)


# --------------------------------------------------------------------------- the model


@dataclass
class BalancedLayer:
    """A MoE layer under EPLB: its map and its expert tensors (each (P / W, ...): w13, w2 and
    their scales where it has them)."""

    map: ExpertMap
    tensors: Callable[[], list[torch.Tensor]]


class ExpertBalancer:
    """The model's EPLB state: the window of logical counts of every layer and the step count.
    step() runs before each step on every rank (the same steps: after the status exchange)."""

    def __init__(
        self,
        layers: list[BalancedLayer],
        config: EplbConfig,
        rank: int,
        world_size: int,
        device: torch.device,
    ) -> None:
        self.layers, self.config, self.rank, self.world_size = layers, config, rank, world_size
        e = layers[0].map.num_experts if layers else 0
        # (window_size, L, E) logical pairs per step of the window, a ring
        self.window = torch.zeros((config.window_size, len(layers), e), dtype=torch.int64, device=device)
        self.steps = 0
        self.rearrangements = 0
        self.moved = 0  # slots received from other ranks, over every rearrangement
        self.shares: list[float] = []  # the busiest rank's share before each rearrangement

    @classmethod
    def of_model(cls, model: object, config: EplbConfig, rank: int, world_size: int) -> ExpertBalancer:
        """The balancer of every MoE layer of `model` (an nn.Module) that has an ExpertMap (its
        `eplb` attribute) and expert_tensors()."""
        modules = model.modules() if isinstance(model, nn.Module) else []
        layers = [
            BalancedLayer(m.eplb, m.expert_tensors)  # type: ignore[arg-type]
            for m in modules
            if isinstance(getattr(m, "eplb", None), ExpertMap)
        ]
        device = layers[0].map.phys2log.device if layers else torch.device("cpu")
        return cls(layers, config, rank, world_size, device)

    def step(self, collectives: CollectiveOps) -> None:
        """Before a step: the last step's counts into the window; every step_interval steps,
        rearrange (a collective of every rank)."""
        slot = self.steps % self.config.window_size
        self.steps += 1
        for i, layer in enumerate(self.layers):
            m = layer.map
            self.window[slot, i].zero_().index_add_(0, m.phys2log, m.counts)
            m.total += m.counts
            m.counts.zero_()
        if self.layers and self.steps % self.config.step_interval == 0:
            self.rearrange(collectives)

    def busiest_share(self, collectives: CollectiveOps) -> float:
        """Over every layer, the busiest rank's pairs over all pairs since the last
        rearrangement (1 / W is even), sum_l max_r load_lr / sum_l sum_r load_lr. A collective."""
        if not self.layers:
            return 0.0
        total = torch.stack([layer.map.total for layer in self.layers])  # (L, P)
        total = collectives.all_reduce(total.clone())
        per_rank = total.view(len(self.layers), self.world_size, -1).sum(dim=2)  # (L, W)
        all_pairs = int(per_rank.sum())
        return float(per_rank.max(dim=1).values.sum()) / all_pairs if all_pairs else 0.0

    def rearrange(self, collectives: CollectiveOps) -> None:
        """Plan every layer from the window's load summed over the ranks, then move the weights."""
        share = self.busiest_share(collectives)
        self.shares.append(share)
        load = collectives.all_reduce(self.window.sum(dim=0)).tolist()  # (L, E)
        for i, layer in enumerate(self.layers):
            m = layer.map
            new = plan(load[i], m.num_physical, self.world_size, m.placement)
            if new != m.placement:
                self.moved += move_experts(
                    collectives, layer.tensors(), m.placement, new, self.rank, self.world_size
                )
                m.set_placement(new)
            m.total.zero_()
        self.rearrangements += 1
        if self.config.log_balancedness:
            logger.info("EPLB: busiest rank's share %.3f before rearrangement %d", share, self.rearrangements)
