"""Expert-parallel dispatch / combine (deepinfer_ascend.ep), both paths, on two ranks.

Two processes over gloo, each with the torch_npu simulation: tokens are dispatched to the rank
owning their experts, run through the backend's experts there, combined back, and compared with
the reference MoE on the full weights. The fused MC2 path (npu_moe_distribute_dispatch_v2 /
combine_v2, simulated in tests/npu_sim/mc2.py) runs through collectives.expert_exchange and
dispatch_combine on a simulated A3.
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


# --------------------------------------------------------------------------- MC2 (simulated)

MC2_E, MC2_K, MC2_DM, MC2_I = 8, 3, 1024, 8  # A3: H in [1024, 7168]


def _expert_fn(w13: torch.Tensor, w2: torch.Tensor, first: int, fail: bool = False) -> Any:
    """experts(rows (R, Dm), local ids (R,)) -> (R, Dm): SwiGLU MLPs in float64, expert first + id."""

    def experts(rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        if fail:
            raise RuntimeError("experts failed")
        out = torch.zeros(rows.shape, dtype=torch.float64)
        for e in sorted(set(local_ids.tolist())):
            sel = local_ids == e
            gate, up = (rows[sel].double() @ w13[first + e].T).chunk(2, dim=-1)
            out[sel] = (torch.nn.functional.silu(gate) * up) @ w2[first + e].T
        return out.to(rows.dtype)

    return experts


def _reference(
    x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, experts: Any, keep: range
) -> torch.Tensor:
    """One process holding every expert: sum_k w * expert_k(x) over the experts in `keep`."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for k in range(ids.shape[1]):
        y = experts(x, ids[:, k].long()).double()
        mask = torch.tensor([int(i) in keep for i in ids[:, k]], dtype=torch.float64)
        out += y * (w[:, k].double() * mask).unsqueeze(-1)
    return out


def _mc2_worker(rank: int, port: int, results: Any) -> None:
    sys.path.insert(0, str(ROOT))
    from deepinfer_ascend.ep import Mc2Exchange

    from deepinfer.backend.registry import BackendRegistry
    from deepinfer.parallel.expert_parallel import dispatch_combine
    from tests.npu_sim import install

    install(soc_version=250)  # Atlas A3: MC2 from two ranks on
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    out: dict[str, Any] = {"rank": rank}
    try:
        collectives = BackendRegistry.discover().create("ascend").collectives
        gen = torch.Generator().manual_seed(0)
        w13 = torch.randn(MC2_E, 2 * MC2_I, MC2_DM, generator=gen, dtype=torch.float64) / MC2_DM**0.5
        w2 = torch.randn(MC2_E, MC2_DM, MC2_I, generator=gen, dtype=torch.float64) / MC2_I**0.5
        every = _expert_fn(w13, w2, 0)
        bounds = [0, MC2_E // 2, MC2_E]
        mine = range(bounds[rank], bounds[rank + 1])

        def problem(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(seed * 10 + rank)
            x = torch.randn(t, MC2_DM, generator=g).to(torch.bfloat16)
            ids = torch.stack(
                [torch.randperm(MC2_E, generator=g)[:MC2_K] for _ in range(t)] or [torch.empty(0, MC2_K)]
            )
            ids = ids.reshape(t, MC2_K)
            return x, torch.rand(t, MC2_K, generator=g), ids.to(torch.int32)

        def err(y: torch.Tensor, want: torch.Tensor) -> float:
            return (
                float((y.double() - want).abs().max() / want.abs().max().clamp_min(1e-6))
                if y.numel()
                else 0.0
            )

        fused = collectives.expert_exchange(MC2_E, torch.empty(1, MC2_DM, dtype=torch.bfloat16), MC2_K)
        out["fused"] = isinstance(fused, Mc2Exchange)
        # 1. one MC2 call per exchange, ranks with different T (7, 5)
        x, w, ids = problem(7 - 2 * rank, 1)
        y = dispatch_combine(collectives, x, w, ids, bounds, rank, _expert_fn(w13, w2, mine.start))
        out["err"] = err(y, _reference(x, w, ids, every, range(MC2_E)))
        # 2. several MC2 calls (at most 3 tokens per rank each), rank 1 with no tokens at all
        assert isinstance(fused, Mc2Exchange)
        fused.max_tokens = 3
        x, w, ids = problem(8 * (1 - rank), 2)
        y = dispatch_combine(collectives, x, w, ids, bounds, rank, _expert_fn(w13, w2, mine.start))
        out["err_calls"] = err(y, _reference(x, w, ids, every, range(MC2_E)))
        out["shape_calls"] = tuple(y.shape)
        fused.max_tokens = 512
        # 3. rank 1's experts raise: rank 0 gets zeros for them, rank 1 the error, both stay in step
        x, w, ids = problem(6, 3)
        try:
            y = dispatch_combine(
                collectives, x, w, ids, bounds, rank, _expert_fn(w13, w2, mine.start, rank == 1)
            )
            out["err_failed"] = err(y, _reference(x, w, ids, every, range(0, MC2_E // 2)))
        except RuntimeError as exc:
            out["raised"] = str(exc)
        x, w, ids = problem(4, 4)
        y = dispatch_combine(collectives, x, w, ids, bounds, rank, _expert_fn(w13, w2, mine.start))
        out["err_after"] = err(y, _reference(x, w, ids, every, range(MC2_E)))
        # 4. fallback: K > 16, uneven experts or float32 activations -> None, all_to_all serves
        x16 = torch.empty(1, MC2_DM, dtype=torch.bfloat16)
        out["none"] = [
            collectives.expert_exchange(40, x16, 17) is None,
            collectives.expert_exchange(9, x16, MC2_K) is None,
            collectives.expert_exchange(MC2_E, x16.float(), MC2_K) is None,
        ]
        e40 = 40
        w13b = torch.randn(e40, 2 * MC2_I, MC2_DM, generator=gen, dtype=torch.float64) / MC2_DM**0.5
        w2b = torch.randn(e40, MC2_DM, MC2_I, generator=gen, dtype=torch.float64) / MC2_I**0.5
        g = torch.Generator().manual_seed(50 + rank)
        x = torch.randn(5, MC2_DM, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(e40, generator=g)[:17] for _ in range(5)]).to(torch.int32)
        w = torch.rand(5, 17, generator=g)
        half = [0, e40 // 2, e40]
        y = dispatch_combine(collectives, x, w, ids, half, rank, _expert_fn(w13b, w2b, half[rank]))
        out["err_fallback"] = err(y, _reference(x, w, ids, _expert_fn(w13b, w2b, 0), range(e40)))
    finally:
        results.put(out)
        dist.destroy_process_group()


def test_mc2_exchange_through_dispatch_combine_two_ranks() -> None:
    """The MC2 exchange (collectives.expert_exchange on SoC A3) against one process holding every
    expert: different T per rank, several calls and a rank with no tokens, a rank whose experts
    raise, and the fallbacks where MC2 does not apply."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.spawn(_mc2_worker, args=(_free_port(), results), nprocs=WORLD)  # type: ignore[attr-defined,no-untyped-call]
    r0, r1 = sorted((results.get(timeout=600) for _ in range(WORLD)), key=lambda r: r["rank"])
    tol = 2e-2  # bf16 activations and outputs
    for r in (r0, r1):
        assert r["fused"], r
        assert r["err"] < tol and r["err_calls"] < tol and r["err_after"] < tol, r
        assert r["none"] == [True, True, True] and r["err_fallback"] < tol, r
    assert r0["shape_calls"] == (8, MC2_DM) and r1["shape_calls"] == (0, MC2_DM)
    assert r0["err_failed"] < tol and "raised" not in r0, r0  # rank 1's experts gave zeros
    assert r1["raised"] == "experts failed", r1
