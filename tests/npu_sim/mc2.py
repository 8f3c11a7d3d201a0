"""npu_moe_distribute_dispatch_v2 / npu_moe_distribute_combine_v2 (MC2) over torch.distributed.

From op-plugin's torch_npu-npu_moe_distribute_{dispatch,combine}_v2.md. The HCCL group is a gloo
group here: install() gives gloo backends a get_hccl_comm_name(rank), and the ops find the group
by that name. Modelled: the non-quantised MoE-expert exchange without a TP domain, shared-expert
cards or special experts, on Atlas A2 (SoC 220-225) and A3 (250-255), with their documented
limits. Every rank moves all its rows to every other (all_gather): a double, not a fast one.

dispatch: each (token, k) copy goes to the rank holding expert_ids[token, k] (rank r holds experts
[r * E / W, (r + 1) * E / W)); expand_x (A, H) holds the received copies grouped by local expert,
then by source rank and token; rows past sum(expert_token_nums) are undefined (NaN here).
assist_info_for_combine (A * 128,) records each row's (source rank, token, k, global expert).
combine: row i of expand_x returns to its source token and out[t] = sum_k expert_scales[t, k] *
row(t, k), summed in float32, in expand_x's dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .runtime import unrecorded
from .state import STATE, SimError, check, fail

_DISPATCH = "npu_moe_distribute_dispatch_v2"
_COMBINE = "npu_moe_distribute_combine_v2"
_HALF = (torch.float16, torch.bfloat16)
_ASSIST = 128  # assist_info_for_combine: 128 int32 per row of expand_x
_GROUPS: dict[str, Any] = {}  # comm name -> gloo backend


def get_hccl_comm_name(backend: Any, rank: int) -> str:
    """Patched onto gloo's ProcessGroup backend while the simulation is installed."""
    name = f"sim_hccl_{id(backend)}"
    _GROUPS[name] = backend
    return name


def _group(op: str, name: str, world: int, rank: int) -> Any:
    check(isinstance(name, str) and 1 <= len(name) < 128, op, "group_ep: a name of length [1, 128)")
    backend = _GROUPS.get(name)
    check(backend is not None, op, "group_ep must name an HCCL communicator (get_hccl_comm_name)", name)
    for pg in dist.distributed_c10d._world.pg_map:
        if pg._get_backend(torch.device("cpu")) is backend:
            check(
                world == dist.get_world_size(pg) and rank == dist.get_rank(pg),
                op,
                "ep_world_size / ep_rank_id must be the group's size and this rank",
                f"{world}, {rank}",
            )
            return pg
    raise SimError(f"{op}: group_ep's communicator is gone (process group destroyed)")


def _a2() -> bool:
    return STATE.soc_version in range(220, 226)


def _limits(op: str, world: int, rank: int, experts: int, hidden: int, bs: int, k: int) -> None:
    """Checks shared by both ops (the stricter op's where they differ)."""
    a2, a3 = _a2(), STATE.soc_version in range(250, 256)
    check(a2 or a3, op, "supported on Atlas A2 / A3 only", f"SoC {STATE.soc_version}")
    if a2:
        check(world in (16, 32, 64), op, "A2: ep_world_size 16, 32 or 64", str(world))
        check(
            0 < hidden <= 7168 and hidden % 32 == 0, op, "A2: H in (0, 7168], a multiple of 32", str(hidden)
        )
        check(0 < bs <= 256, op, "A2: 0 < BS <= 256", str(bs))
    else:
        check(2 <= world <= 384, op, "A3: ep_world_size in [2, 384]", str(world))
        check(1024 <= hidden <= 7168, op, "A3: H in [1024, 7168]", str(hidden))
        check(0 < bs <= 512, op, "A3: 0 < BS <= 512", str(bs))
    check(0 <= rank < world, op, "ep_rank_id in [0, ep_world_size)")
    check(
        1 <= experts <= 512 and experts % world == 0, op, "moe_expert_num in [1, 512], % ep_world_size == 0"
    )
    check(not a2 or experts // world <= 24, op, "A2: moe_expert_num / ep_world_size <= 24")
    check(0 < k <= min(16, experts), op, "0 < K <= 16 and K <= moe_expert_num", str(k))


def _ids(op: str, ids: torch.Tensor, bs: int, experts: int) -> None:
    check(ids.dim() == 2 and ids.shape[0] == bs, op, "expert_ids: (BS, K)", str(tuple(ids.shape)))
    check(ids.dtype == torch.int32, op, "expert_ids dtype must be int32", str(ids.dtype))
    check(int(ids.min()) >= 0 and int(ids.max()) < experts, op, "expert_ids values in [0, moe_expert_num)")
    distinct = ids.long().sort(dim=1).values.diff(dim=1)
    check(bool((distinct != 0).all()), op, "the K values in one row of expert_ids must differ")


def _unmodelled(op: str, **kw: tuple[Any, Any]) -> None:
    """Each keyword: (value, the default that means "not used")."""
    for name, (value, default) in kw.items():
        if (value is not None) if default is None else (value != default):
            fail(op, f"{name} is not modelled by the simulation")


def _gather_rows(pg: Any, t: torch.Tensor, rows: int) -> list[torch.Tensor]:
    """Every rank's t (n_r, ...) padded to `rows` -> list over ranks (bf16 / fp16 travel as bytes)."""
    pad = t.new_zeros((rows - t.shape[0], *t.shape[1:]))
    send = torch.cat([t, pad])
    wire = send.view(torch.uint8) if send.dtype in _HALF else send
    got = [torch.empty_like(wire) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(got, wire.contiguous(), group=pg)
    return [g.view(send.dtype) for g in got]


def npu_moe_distribute_dispatch_v2(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    group_ep: str,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    *,
    scales: Any = None,
    x_active_mask: Any = None,
    expert_scales: torch.Tensor | None = None,
    elastic_info: Any = None,
    group_tp: str = "",
    tp_world_size: int = 0,
    tp_rank_id: int = 0,
    expert_shard_type: int = 0,
    shared_expert_num: int = 1,
    shared_expert_rank_num: int = 0,
    quant_mode: int = 0,
    global_bs: int = 0,
    expert_token_nums_type: int = 1,
    comm_alg: str = "",
    zero_expert_num: int = 0,
    copy_expert_num: int = 0,
    const_expert_num: int = 0,
) -> tuple[Any, ...]:
    op = _DISPATCH
    with unrecorded():
        _unmodelled(
            op, scales=(scales, None), x_active_mask=(x_active_mask, None), elastic_info=(elastic_info, None),
            group_tp=(group_tp, ""), shared_expert_rank_num=(shared_expert_rank_num, 0),
            quant_mode=(quant_mode, 0),
            zero_expert_num=(zero_expert_num, 0), copy_expert_num=(copy_expert_num, 0),
            const_expert_num=(const_expert_num, 0),
        )  # fmt: skip
        check(tp_world_size in (0, 1), op, "a TP domain (tp_world_size 2) is not modelled by the simulation")
        check(
            x.dim() == 2 and x.dtype in _HALF,
            op,
            "x: (BS, H) bfloat16 / float16",
            f"{x.dtype} {tuple(x.shape)}",
        )
        bs, hidden = x.shape
        _limits(op, ep_world_size, ep_rank_id, moe_expert_num, hidden, bs, expert_ids.shape[-1])
        _ids(op, expert_ids, bs, moe_expert_num)
        check(expert_token_nums_type in (0, 1), op, "expert_token_nums_type 0 (cumsum) or 1 (count)")
        if expert_scales is not None:
            check(_a2(), op, "A3: expert_scales is not supported (pass None)")
            check(
                expert_scales.shape == expert_ids.shape and expert_scales.dtype == torch.float32,
                op,
                "expert_scales: (BS, K) float32",
            )
        pg = _group(op, group_ep, ep_world_size, ep_rank_id)
        sizes = _gather_rows(pg, torch.tensor([bs, global_bs]), 2)
        check(all(int(s[1]) == global_bs for s in sizes), op, "global_bs must be the same on every rank")
        most = max(int(s[0]) for s in sizes)
        if global_bs == 0:
            check(all(int(s[0]) == bs for s in sizes), op, "global_bs 0 needs the same BS on every rank")
        else:
            check(
                global_bs >= most * ep_world_size, op, "global_bs >= max BS * ep_world_size", str(global_bs)
            )
        gbs = global_bs or bs * ep_world_size
        k = expert_ids.shape[1]
        local = moe_expert_num // ep_world_size
        a = gbs * min(local, k)  # rows of expand_x: the most this rank can receive
        weights = expert_scales if expert_scales is not None else torch.zeros(expert_ids.shape)
        xs = _gather_rows(pg, x, most)
        idss = _gather_rows(pg, expert_ids, most)
        ws = _gather_rows(pg, weights.float(), most)
    # received copies: (local expert, source rank, token, k), sorted in that order
    first = ep_rank_id * local
    recv = []
    for src, (n, ids_r) in enumerate(zip((int(s[0]) for s in sizes), idss)):
        tok, slot = ((ids_r[:n] >= first) & (ids_r[:n] < first + local)).nonzero(as_tuple=True)
        for t_, k_ in zip(tok.tolist(), slot.tolist()):
            recv.append((int(ids_r[t_, k_]) - first, src, t_, k_))
    recv.sort()
    expand_x = torch.full((a, hidden), float("nan"), dtype=x.dtype)
    assist = torch.full((a * _ASSIST,), -1, dtype=torch.int32)
    info = assist.view(a, _ASSIST)
    expand_scales = torch.zeros(a, dtype=torch.float32)
    for i, (e, src, t_, k_) in enumerate(recv):
        expand_x[i] = xs[src][t_]
        info[i, :4] = torch.tensor([src, t_, k_, first + e], dtype=torch.int32)
        expand_scales[i] = ws[src][t_, k_]
    counts = torch.zeros((local, ep_world_size), dtype=torch.int64)  # (local expert, source rank)
    for e, src, _, _ in recv:
        counts[e, src] += 1
    nums = counts.sum(dim=1)
    expert_token_nums = nums if expert_token_nums_type == 1 else nums.cumsum(0)
    if _a2():
        server_num = max(ep_world_size // 8, 1)
        ep_recv_counts = torch.zeros(moe_expert_num + 2 * gbs * k * server_num, dtype=torch.int32)
        ep_recv_counts[: local * ep_world_size] = counts.reshape(-1).cumsum(0).to(torch.int32)
        tp_recv_counts, out_scales = None, expand_scales
    else:
        ep_recv_counts = counts.reshape(-1).cumsum(0).to(torch.int32)  # (W * local,)
        tp_recv_counts, out_scales = torch.zeros(1, dtype=torch.int32), None
    dynamic_scales = None  # quant_mode 0
    return expand_x, dynamic_scales, assist, expert_token_nums, ep_recv_counts, tp_recv_counts, out_scales


def npu_moe_distribute_combine_v2(
    expand_x: torch.Tensor,
    expert_ids: torch.Tensor,
    assist_info_for_combine: torch.Tensor,
    ep_send_counts: torch.Tensor,
    expert_scales: torch.Tensor,
    group_ep: str,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    *,
    tp_send_counts: torch.Tensor | None = None,
    x_active_mask: Any = None,
    expand_scales: torch.Tensor | None = None,
    shared_expert_x: Any = None,
    group_tp: str = "",
    tp_world_size: int = 0,
    tp_rank_id: int = 0,
    expert_shard_type: int = 0,
    shared_expert_num: int = 1,
    shared_expert_rank_num: int = 0,
    global_bs: int = 0,
    comm_quant_mode: int = 0,
) -> torch.Tensor:
    op = _COMBINE
    with unrecorded():
        _unmodelled(
            op, x_active_mask=(x_active_mask, None), shared_expert_x=(shared_expert_x, None),
            group_tp=(group_tp, ""), shared_expert_rank_num=(shared_expert_rank_num, 0),
            comm_quant_mode=(comm_quant_mode, 0),
        )  # fmt: skip
        check(tp_world_size in (0, 1), op, "a TP domain (tp_world_size 2) is not modelled by the simulation")
        check(
            expand_x.dim() == 2 and expand_x.dtype in _HALF,
            op,
            "expand_x: (A, H) bfloat16 / float16",
            f"{expand_x.dtype} {tuple(expand_x.shape)}",
        )
        a, hidden = expand_x.shape
        bs = expert_ids.shape[0] if expert_ids.dim() == 2 else -1
        _limits(op, ep_world_size, ep_rank_id, moe_expert_num, hidden, bs, expert_ids.shape[-1])
        _ids(op, expert_ids, bs, moe_expert_num)
        check(
            assist_info_for_combine.dtype == torch.int32 and assist_info_for_combine.shape == (a * _ASSIST,),
            op,
            "assist_info_for_combine: (A * 128,) int32, as dispatch returned it (A = expand_x's rows)",
        )
        check(
            ep_send_counts.dim() == 1 and ep_send_counts.dtype == torch.int32, op, "ep_send_counts: 1-D int32"
        )
        check(
            expert_scales.shape == expert_ids.shape and expert_scales.dtype == torch.float32,
            op,
            "expert_scales: (BS, K) float32",
        )
        if _a2():
            check(
                expand_scales is not None
                and expand_scales.shape == (a,)
                and expand_scales.dtype == torch.float32,
                op,
                "A2: expand_scales (A,) float32 is required",
            )
            check(tp_send_counts is None, op, "A2: no TP domain, tp_send_counts must be None")
        else:
            check(expand_scales is None, op, "A3: expand_scales is not supported (pass None)")
        pg = _group(op, group_ep, ep_world_size, ep_rank_id)
        sizes = _gather_rows(pg, torch.tensor([a, global_bs]), 2)
        check(all(int(s[1]) == global_bs for s in sizes), op, "global_bs must be the same on every rank")
        check(all(int(s[0]) == a for s in sizes), op, "expand_x: the same A on every rank (from dispatch)")
        rows = _gather_rows(pg, expand_x, a)
        infos = _gather_rows(pg, assist_info_for_combine.view(a, _ASSIST)[:, :4].contiguous(), a)
    # every (token, k) of this rank gets exactly one row back, from the rank that holds its expert
    k = expert_ids.shape[1]
    got = torch.full((bs, k, hidden), float("nan"), dtype=torch.float32)
    seen = torch.zeros((bs, k), dtype=torch.bool)
    for rows_r, info_r in zip(rows, infos):
        for i in (info_r[:, 0] == ep_rank_id).nonzero().flatten().tolist():
            _, t_, k_, e = info_r[i].tolist()
            check(
                t_ < bs and int(expert_ids[t_, k_]) == e and not bool(seen[t_, k_]),
                op,
                "expert_ids and assist_info_for_combine must be those of the matching dispatch",
            )
            got[t_, k_] = rows_r[i].float()
            seen[t_, k_] = True
    check(
        bool(seen.all()), op, "expert_ids and assist_info_for_combine must be those of the matching dispatch"
    )
    return (got * expert_scales.unsqueeze(-1)).sum(dim=1).to(expand_x.dtype)
