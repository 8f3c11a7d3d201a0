"""Expert-parallel dispatch / combine (deepinfer_ascend.ep), all_to_all path, on two ranks.

Two processes over gloo, each with the torch_npu simulation: tokens are dispatched to the rank
owning their experts, run through the backend's experts there, combined back, and compared with
the reference MoE on the full weights. The fused MC2 path (npu_moe_distribute_dispatch_v2 /
combine_v2) is not simulated and stays un-run.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
WORLD, T, K, E, DM, I = 2, 7, 3, 8, 16, 12


def _worker(rank: int, port: int, results: Any) -> None:
    sys.path.insert(0, str(ROOT))
    from deepinfer_ascend.ep import AscendExpertParallel

    from deepinfer.backend.registry import BackendRegistry
    from deepinfer.reference import moe as ref_moe
    from tests.npu_sim import install

    tnpu = install(soc_version=220)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        backend = BackendRegistry.discover().create("ascend")
        gen = torch.Generator().manual_seed(0)  # the same full problem on every rank
        x_all = torch.randn(WORLD * T, DM, generator=gen)
        ids_all = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(WORLD * T)]).to(
            torch.int32
        )
        w_all = torch.rand(WORLD * T, K, generator=gen)
        w13 = torch.randn(E, 2 * I, DM, generator=gen) / DM**0.5
        w2 = torch.randn(E, DM, I, generator=gen) / I**0.5
        mine = slice(rank * T, (rank + 1) * T)
        x, ids, weights = x_all[mine], ids_all[mine], w_all[mine]

        ep = AscendExpertParallel(tnpu, None, E, K)
        assert not ep.fused  # the simulation has no MC2 ops
        rows, counts, state = ep.dispatch(x, ids, weights)
        local = slice(rank * ep.local_experts, (rank + 1) * ep.local_experts)
        y = backend.moe.experts(rows, counts, w13[local], w2[local])
        out = ep.combine(y, state)

        xs, s2d, cnt = ref_moe.permute(x.double(), ids, E)
        expected = ref_moe.unpermute(
            ref_moe.experts(xs, cnt, w13.double(), w2.double()), s2d, weights.double()
        )
        err = float((out.double() - expected).abs().max())
        results.put((rank, err, int(counts.sum()), tuple(out.shape)))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_all_to_all_dispatch_combine_two_ranks() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.spawn(_worker, args=(_free_port(), results), nprocs=WORLD)  # type: ignore[attr-defined,no-untyped-call]
    got = sorted(results.get(timeout=600) for _ in range(WORLD))
    assert [r for r, *_ in got] == list(range(WORLD))
    assert sum(n for _, _, n, _ in got) == WORLD * T * K  # every token copy reached one expert
    for rank, err, _, shape in got:
        assert shape == (T, DM)
        assert err < 1e-4, f"rank {rank}: max error {err:.3e} against the reference MoE"
