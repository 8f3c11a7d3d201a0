"""Expert-parallel token dispatch / combine for MoE layers over an HCCL group.

Neither path has run on an NPU. The all_to_all path has run on the CPU simulation over gloo with
two ranks (tests/test_ascend_ep.py); the fused path has not run anywhere (the simulation models
no MC2 op). Not wired into the contract yet: the parallel layer can adopt it.

fused (MC2):  npu_moe_distribute_dispatch_v2 / npu_moe_distribute_combine_v2, when K <= 16 and
              num_experts % ep_world_size == 0. The group is named by its HCCL communicator
              (group._get_backend(torch.device("npu")).get_hccl_comm_name(rank)); assist_info and
              the receive counts are opaque and only passed from dispatch to combine.
all_to_all:   otherwise: tokens are sorted by destination rank (npu_moe_init_routing_v2 over the
              experts), the per-rank counts exchanged, rows sent with torch.distributed
              all_to_all_single, and returned the same way before the weighted combine
              (npu_moe_token_unpermute).

Experts are laid out contiguously: rank r owns experts [r * E / W, (r + 1) * E / W).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

MAX_FUSED_TOP_K = 16


@dataclass
class DispatchState:
    """What combine needs from dispatch (opaque to callers)."""

    ids: torch.Tensor  # (T, K) int32 global expert ids
    weights: torch.Tensor  # (T, K) float32
    fused: tuple[torch.Tensor, ...] | None = (
        None  # assist_info, ep_recv_counts, tp_recv_counts, expand_scales
    )
    src_to_dst: torch.Tensor | None = None  # all_to_all path: token-major row -> sorted row
    send_splits: list[int] | None = None
    recv_splits: list[int] | None = None
    recv_order: torch.Tensor | None = None  # received rows -> local-expert-sorted rows


class AscendExpertParallel:
    """Dispatch tokens to the ranks owning their experts and combine the expert outputs."""

    def __init__(self, tnpu: Any, group: Any, num_experts: int, top_k: int) -> None:
        self._tnpu = tnpu
        self._group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.world:
            raise ValueError(f"{num_experts} experts cannot be split evenly over {self.world} EP ranks")
        self.num_experts = num_experts
        self.local_experts = num_experts // self.world
        self.fused = top_k <= MAX_FUSED_TOP_K and hasattr(tnpu, "npu_moe_distribute_dispatch_v2")
        self._comm = ""
        if self.fused:
            pg: Any = group if group is not None else dist.group.WORLD
            self._comm = pg._get_backend(torch.device("npu")).get_hccl_comm_name(self.rank)

    def dispatch(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchState]:
        """x (T, Dm), ids / weights (T, K) -> (rows for this rank's experts sorted by local expert,
        counts per local expert (int64), state for combine)."""
        ids = ids.to(torch.int32)
        if self.fused:
            out = self._tnpu.npu_moe_distribute_dispatch_v2(
                x, ids, self._comm, self.world, self.rank, self.num_experts, expert_token_nums_type=1
            )
            expand_x, _, assist, counts, ep_recv, tp_recv, expand_scales = out
            state = DispatchState(ids, weights.float(), fused=(assist, ep_recv, tp_recv, expand_scales))
            return expand_x, counts.to(torch.int64), state
        return self._dispatch_all_to_all(x, ids, weights)

    def combine(self, y: torch.Tensor, state: DispatchState) -> torch.Tensor:
        """Expert outputs (rows as dispatch returned them) -> (T, Dm) weighted sum per token."""
        if state.fused is not None:
            assist, ep_recv, tp_recv, expand_scales = state.fused
            out: torch.Tensor = self._tnpu.npu_moe_distribute_combine_v2(
                y, state.ids, assist, ep_recv, state.weights, self._comm, self.world, self.rank,
                self.num_experts, tp_send_counts=tp_recv, expand_scales=expand_scales,
            )  # fmt: skip
            return out
        return self._combine_all_to_all(y, state)

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
