"""Expert-parallel token dispatch / combine for MoE layers over an HCCL group.

Nothing here has run on an NPU. Both paths have run on the CPU simulation of torch_npu over gloo
with two ranks (tests/test_ascend_ep.py); the simulation models the MC2 ops from op-plugin's
documentation, not from a measured NPU.

fused (MC2):  npu_moe_distribute_dispatch_v2 / npu_moe_distribute_combine_v2 where the SoC's
              documented limits allow it (Mc2Limits: K <= 16, E % W == 0, W, H, E and tokens per
              call in range, bf16 / fp16). Served to the parallel layer as
              collectives.expert_exchange (Mc2Exchange). The group is named by its HCCL
              communicator (group._get_backend(device).get_hccl_comm_name(rank));
              assist_info_for_combine, ep_recv_counts, tp_recv_counts and expand_scales are opaque
              and only passed from dispatch to combine.
all_to_all:   otherwise: tokens are sorted by destination rank (npu_moe_init_routing_v2 over the
              experts), the per-rank counts exchanged, rows sent with torch.distributed
              all_to_all_single, and returned the same way before the weighted combine
              (npu_moe_token_unpermute).

Experts are laid out contiguously: rank r owns experts [r * E / W, (r + 1) * E / W).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from deepinfer_ascend import npu

MAX_FUSED_TOP_K = 16


@dataclass(frozen=True)
class Mc2Limits:
    """What dispatch_v2 and combine_v2 both accept on one SoC family (op-plugin's
    torch_npu-npu_moe_distribute_{dispatch,combine}_v2.md; the stricter op where they differ)."""

    world_sizes: range | tuple[int, ...]  # ep_world_size
    hidden: range  # H
    hidden_multiple: int
    max_tokens: int  # BS: tokens one rank sends in one call, 0 < BS
    max_experts: int  # moe_expert_num
    max_local_experts: int  # moe_expert_num / ep_world_size
    expert_scales: bool  # A2: dispatch carries the routing weights, combine needs expand_scales

    def allow(self, world: int, num_experts: int, hidden: int, top_k: int) -> bool:
        return (
            world in self.world_sizes
            and hidden in self.hidden
            and hidden % self.hidden_multiple == 0
            and 0 < top_k <= min(MAX_FUSED_TOP_K, num_experts)
            and num_experts <= self.max_experts
            and num_experts % world == 0
            and num_experts // world <= self.max_local_experts
        )


A2_LIMITS = Mc2Limits((16, 32, 64), range(32, 7169), 32, 256, 512, 24, expert_scales=True)
A3_LIMITS = Mc2Limits(range(2, 385), range(1024, 7169), 1, 512, 512, 512, expert_scales=False)


def mc2_limits(soc: int) -> Mc2Limits | None:
    """The MC2 limits of a SoC, or None where the ops are not documented (e.g. the Ascend 950)."""
    if soc in npu.SOC_A2:
        return A2_LIMITS
    if soc in npu.SOC_A3:
        return A3_LIMITS
    return None


def hccl_comm_name(group: Any, rank: int) -> str:
    """The HCCL communicator name of a process group, as the MC2 ops take it."""
    pg: Any = group if group is not None else dist.group.WORLD
    return str(pg._get_backend(torch.device(npu.device_type())).get_hccl_comm_name(rank))


@dataclass
class DispatchState:
    """What combine needs from dispatch (opaque to callers)."""

    ids: torch.Tensor  # (T, K) int32 global expert ids
    weights: torch.Tensor  # (T, K) float32
    # MC2: assist_info_for_combine (A*128,), ep_recv_counts, tp_recv_counts, expand_scales, global_bs
    fused: tuple[Any, ...] | None = None
    src_to_dst: torch.Tensor | None = None  # all_to_all path: token-major row -> sorted row
    send_splits: list[int] | None = None
    recv_splits: list[int] | None = None
    recv_order: torch.Tensor | None = None  # received rows -> local-expert-sorted rows


class AscendExpertParallel:
    """Dispatch tokens to the ranks owning their experts and combine the expert outputs: through
    MC2 when `mc2` (the SoC's limits, already checked to allow this layer) is given, else all_to_all."""

    def __init__(
        self, tnpu: Any, group: Any, num_experts: int, top_k: int, mc2: Mc2Limits | None = None
    ) -> None:
        self._tnpu = tnpu
        self._group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.world:
            raise ValueError(f"{num_experts} experts cannot be split evenly over {self.world} EP ranks")
        self.num_experts = num_experts
        self.local_experts = num_experts // self.world
        self.mc2 = mc2
        self.fused = mc2 is not None
        self._comm = hccl_comm_name(group, self.rank) if self.fused else ""

    def dispatch(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, global_bs: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchState]:
        """x (T, Dm), ids / weights (T, K) -> (rows for this rank's experts sorted by local expert,
        counts per local expert (int64), state for combine).

        MC2: the rows are expand_x (A, Dm), A = global_bs * min(E_local, K) (global_bs 0: T * W,
        every rank passing the same T); only the first counts.sum() rows hold tokens. global_bs is
        W * the largest T of any rank when the ranks' T differ; every rank passes the same."""
        ids = ids.to(torch.int32)
        weights = weights.float()
        if self.mc2 is None:
            return self._dispatch_all_to_all(x, ids, weights)
        out = self._tnpu.npu_moe_distribute_dispatch_v2(
            x=x, expert_ids=ids, group_ep=self._comm, ep_world_size=self.world, ep_rank_id=self.rank,
            moe_expert_num=self.num_experts, global_bs=global_bs, expert_token_nums_type=1,
            expert_scales=weights if self.mc2.expert_scales else None,
        )  # fmt: skip
        # expand_x, dynamic_scales (quant_mode 2 only), assist_info_for_combine, expert_token_nums,
        # ep_recv_counts, tp_recv_counts, expand_scales
        expand_x, _, assist, counts, ep_recv, tp_recv, expand_scales = out
        state = DispatchState(ids, weights, fused=(assist, ep_recv, tp_recv, expand_scales, global_bs))
        return expand_x, counts.to(torch.int64), state

    def combine(self, y: torch.Tensor, state: DispatchState) -> torch.Tensor:
        """Expert outputs (rows as dispatch returned them) -> (T, Dm) weighted sum per token."""
        if state.fused is None:
            return self._combine_all_to_all(y, state)
        assert self.mc2 is not None
        assist, ep_recv, tp_recv, expand_scales, global_bs = state.fused
        # A2: expand_scales is required and there is no TP domain; A3: the reverse
        extra = {"expand_scales": expand_scales} if self.mc2.expert_scales else {"tp_send_counts": tp_recv}
        out: torch.Tensor = self._tnpu.npu_moe_distribute_combine_v2(
            expand_x=y, expert_ids=state.ids, assist_info_for_combine=assist, ep_send_counts=ep_recv,
            expert_scales=state.weights, group_ep=self._comm, ep_world_size=self.world,
            ep_rank_id=self.rank, moe_expert_num=self.num_experts, global_bs=global_bs, **extra,
        )  # fmt: skip
        return out

    # ------------------------------------------------------------------ all_to_all path

    def _dispatch_all_to_all(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchState]:
        t, k = ids.shape
        # Sort token copies by global expert: that is also by destination rank.
        x_sorted, src_to_dst, counts, _ = self._tnpu.npu_moe_init_routing_v2(
            x, ids, active_num=t * k, expert_num=self.num_experts, expert_tokens_num_type=1,
            expert_tokens_num_flag=True, active_expert_range=[0, self.num_experts], row_idx_type=0,
        )  # fmt: skip
        per_rank = counts.view(self.world, self.local_experts)  # (W, E_local)
        recv = torch.empty_like(per_rank)
        dist.all_to_all_single(recv, per_rank.contiguous(), group=self._group)  # counts from every rank
        send_splits = per_rank.sum(dim=1).tolist()
        recv_splits = recv.sum(dim=1).tolist()
        rows = x.new_empty((sum(recv_splits), x.shape[1]))
        dist.all_to_all_single(rows, x_sorted, recv_splits, send_splits, group=self._group)
        # Received rows are grouped by source rank, then by local expert: regroup by local expert.
        expert_of_row = torch.repeat_interleave(
            torch.arange(self.local_experts, device=x.device).repeat(self.world), recv.reshape(-1)
        )
        recv_order = torch.sort(expert_of_row, stable=True).indices
        state = DispatchState(ids, weights.float(), None, src_to_dst, send_splits, recv_splits, recv_order)
        return rows.index_select(0, recv_order), recv.sum(dim=0), state

    def _combine_all_to_all(self, y: torch.Tensor, state: DispatchState) -> torch.Tensor:
        assert state.recv_order is not None and state.src_to_dst is not None
        assert state.send_splits is not None and state.recv_splits is not None
        back = torch.empty_like(y)
        back[state.recv_order] = y  # undo the local-expert regrouping
        home = y.new_empty((sum(state.send_splits), y.shape[1]))
        dist.all_to_all_single(home, back, state.send_splits, state.recv_splits, group=self._group)
        out: torch.Tensor = self._tnpu.npu_moe_token_unpermute(
            home, state.src_to_dst.to(torch.int32), probs=state.weights.to(home.dtype)
        )
        return out


class Mc2Exchange:
    """collectives.expert_exchange over MC2: exchange(x (T, Dm), weights (T, K), ids (T, K) global
    expert ids, local: range, experts(rows (R, Dm), local ids (R,)) -> (R, Dm)) -> (T, Dm) =
    sum_k weights * expert_k(x), the weighted sum done by combine_v2 where the token lives.

    The ranks' T differ and MC2 takes at most max_tokens per rank per call: the ranks agree on
    the largest T (one all_reduce), then every rank makes the same number of dispatch/combine
    calls with global_bs = W * the rows per call. A rank with no rows left in a call sends one
    padding token (zeros, experts 0..K-1, weight 0): MC2 takes no empty batch. If experts()
    raises, zeros go back to the other ranks, the remaining calls still run, and the error is
    raised after."""

    def __init__(self, ep: AscendExpertParallel) -> None:
        assert ep.mc2 is not None
        self.ep = ep
        self.max_tokens = ep.mc2.max_tokens

    def __call__(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        local: range,
        experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        t, k = ids.shape
        assert local.start == self.ep.rank * self.ep.local_experts and len(local) == self.ep.local_experts
        longest = torch.tensor([t], dtype=torch.int64, device=x.device)
        dist.all_reduce(longest, dist.ReduceOp.MAX, group=self.ep._group)
        calls = max(1, -(-int(longest) // self.max_tokens))
        per_call = max(1, -(-int(longest) // calls))  # rows per rank per call, <= max_tokens
        out = x.new_empty((t, x.shape[1]))
        failure: BaseException | None = None
        for c in range(calls):
            rows = slice(min(c * per_call, t), min((c + 1) * per_call, t))
            xs, ws, ids_s = x[rows], weights[rows], ids[rows]
            if xs.shape[0] == 0:  # padding token
                xs = x.new_zeros((1, x.shape[1]))
                ws = weights.new_zeros((1, k))
                ids_s = torch.arange(k, dtype=torch.int32, device=x.device).unsqueeze(0)
            expand_x, counts, state = self.ep.dispatch(xs, ids_s, ws, global_bs=per_call * self.ep.world)
            n = int(counts.sum())  # rows past n in expand_x hold nothing: combine ignores them
            y = torch.zeros_like(expand_x)
            if failure is None:
                local_ids = torch.repeat_interleave(torch.arange(len(local), device=x.device), counts)
                try:
                    y[:n] = experts(expand_x[:n], local_ids).to(y.dtype)
                except BaseException as exc:  # the other ranks wait in combine: zeros go back
                    failure = exc
                    y.zero_()
            done = self.ep.combine(y, state)
            out[rows] = done[: rows.stop - rows.start]
        if failure is not None:
            raise failure
        return out


def mc2_exchange(tnpu: Any, soc: int, num_experts: int, x: torch.Tensor, top_k: int) -> Mc2Exchange | None:
    """The MC2 exchange for this layer over the default group, or None where MC2
    does not apply (no torch_npu ops, SoC limits: see Mc2Limits, activations not bf16 / fp16)."""
    limits = mc2_limits(soc)
    if limits is None or not dist.is_initialized() or x.dtype not in (torch.bfloat16, torch.float16):
        return None
    if not all(
        hasattr(tnpu, op) for op in ("npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine_v2")
    ):
        return None
    if not limits.allow(dist.get_world_size(), num_experts, x.shape[1], top_k):
        return None
    return Mc2Exchange(AscendExpertParallel(tnpu, None, num_experts, top_k, limits))
