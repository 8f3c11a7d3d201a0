"""Collectives across real processes: a backend's CollectiveOps checked over a group of `world`
ranks, one spawned process per rank, with the backend's own torch.distributed backend.

A world of one cannot tell a collective from a no-op (every op is the identity there), so the
conformance suite and deepinfer's own tests run `run_collectives` with two processes. Each rank
creates the backend through the registry with BackendOptions(device_index=rank), joins a group
over a file store (no network port), runs `check_collectives` and writes its outcome to a file.
The parent waits a bounded time: a rank that hangs (a collective some rank never joined, a
deadlock) is killed and reported as a failure, never waited on forever.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import tempfile
import time
import traceback
import warnings
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from deepinfer.backend.ops import Backend
from deepinfer.backend.types import BackendOptions
from deepinfer.testing.helpers import registry_with

# Values every float dtype holds exactly (small integers), so every check is an exact equality.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class CollectivesUnavailable(RuntimeError):
    """The multi-process check could not run here (a rank could not create its backend, e.g.
    fewer devices than ranks). Not a pass: the caller must report it loudly."""


def check_collectives(backend: Backend, rank: int, world: int) -> None:
    """Every op of backend.collectives on the default group, with rank-dependent inputs whose
    result a no-op, a wrong rank order or a wrong split cannot produce. Raises AssertionError."""
    c = backend.collectives
    dev = backend.device.device()
    dtypes = [dt for dt in _DTYPES if dt in backend.capabilities.dtypes] or [torch.float32]

    def full(shape: tuple[int, ...], value: float, dt: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full(shape, value, dtype=dt, device=dev)

    def ar(shape: tuple[int, ...], dt: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.arange(math.prod(shape), dtype=dt, device=dev).view(shape)

    def same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
        assert actual.device.type == dev.type, f"rank {rank}: {what} returned a tensor on {actual.device}"
        assert actual.dtype == expected.dtype and tuple(actual.shape) == tuple(expected.shape), (
            f"rank {rank}: {what} gave {actual.dtype} {tuple(actual.shape)}, "
            f"expected {expected.dtype} {tuple(expected.shape)}"
        )
        if not torch.equal(actual.cpu(), expected.cpu()):
            raise AssertionError(
                f"rank {rank} of {world}: {what} is wrong\n got      {actual.cpu().tolist()}\n"
                f" expected {expected.cpu().tolist()}"
            )

    ranks_sum = world * (world + 1) / 2  # sum over r of (r + 1)
    for dt in dtypes:
        # all_reduce: sum over ranks, in place, returning the sum
        t = ar((2, 3), dt) * (rank + 1)
        out = c.all_reduce(t)
        same(out, ar((2, 3), dt) * ranks_sum, f"all_reduce ({dt})")
        same(t, ar((2, 3), dt) * ranks_sum, f"all_reduce ({dt}), the input after the call (in place)")

        # all_gather: rank-ordered concatenation along dim 0
        def block(r: int, dt: torch.dtype = dt) -> torch.Tensor:
            return full((2, 3), float(r), dt) + torch.arange(3, dtype=dt, device=dev)

        expected = torch.cat([block(r) for r in range(world)])
        same(c.all_gather(block(rank)), expected, f"all_gather ({dt})")

    # all_gather of bytes: the fixed-shape MoE exchange (expert_parallel.fixed_exchange) sends
    # each token's weights, expert ids and activations packed as uint8 rows
    def byte_rows(r: int) -> torch.Tensor:  # an odd row width: no multiple of a wider dtype
        return torch.arange(2 * 7, dtype=torch.uint8, device=dev).view(2, 7) + (50 * r) % 240

    same(c.all_gather(byte_rows(rank)), torch.cat([byte_rows(r) for r in range(world)]), "all_gather (uint8)")

    # reduce_scatter: this rank's slice of the sum
    whole = ar((2 * world, 2)) + 10 * rank
    total = torch.stack([ar((2 * world, 2)) + 10 * r for r in range(world)]).sum(0)
    same(c.reduce_scatter(whole), total[2 * rank : 2 * rank + 2], "reduce_scatter")

    # all_to_all_single, uneven splits with an empty one: rank r sends send[r][d] rows to rank d;
    # each row says where it came from (source rank, its index in the source's buffer)
    send = [[(r + d) % 3 + (r == d) for d in range(world)] for r in range(world)]
    send[0][world - 1] = 0
    rows = sum(send[rank])
    x = torch.tensor([[float(rank), float(i)] for i in range(rows)], dtype=torch.float32).view(rows, 2)
    y = c.all_to_all_single(x.to(dev), [send[r][rank] for r in range(world)], send[rank])
    expected_rows = [
        [float(r), float(sum(send[r][:rank]) + i)] for r in range(world) for i in range(send[r][rank])
    ]
    same(y, torch.tensor(expected_rows, dtype=torch.float32).view(-1, 2), "all_to_all_single (uneven)")
    # even split (None)
    same(
        c.all_to_all_single(full((2 * world, 1), float(rank))),
        torch.arange(world, dtype=torch.float32, device=dev).repeat_interleave(2).view(-1, 1),
        "all_to_all_single (even split)",
    )
    empty = c.all_to_all_single(torch.empty((0, 5), device=dev), [0] * world, [0] * world)
    assert tuple(empty.shape) == (0, 5), f"rank {rank}: all_to_all_single of nothing gave {empty.shape}"

    # all_to_all_single_async: two exchanges in flight at once, waited for in reverse order
    first, wait_first = c.all_to_all_single_async(
        x.to(dev), [send[r][rank] for r in range(world)], send[rank]
    )
    second, wait_second = c.all_to_all_single_async(full((2 * world, 1), float(rank)))
    wait_second()
    wait_first()
    same(
        first,
        torch.tensor(expected_rows, dtype=torch.float32).view(-1, 2),
        "all_to_all_single_async (uneven)",
    )
    same(
        second,
        torch.arange(world, dtype=torch.float32, device=dev).repeat_interleave(2).view(-1, 1),
        "all_to_all_single_async (even split, started second)",
    )

    # broadcast from the last rank, in place
    b = full((3,), float(rank))
    out = c.broadcast(b, src=world - 1)
    same(out, full((3,), float(world - 1)), "broadcast (src = last rank)")
    same(b, full((3,), float(world - 1)), "broadcast (src = last rank), the input after the call (in place)")
    c.barrier()


def _write(result_dir: str, rank: int, status: str, detail: str = "") -> None:
    path = Path(result_dir) / f"rank{rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps({"status": status, "detail": detail}))
    os.replace(path.with_suffix(".tmp"), path)


def _read(result_dir: str, rank: int) -> dict[str, str] | None:
    path = Path(result_dir) / f"rank{rank}.json"
    if not path.exists():
        return None
    result: dict[str, str] = json.loads(path.read_text())
    return result


def _set_device(device: torch.device) -> None:
    if device.type == "cpu":
        return
    module: Any = torch.get_device_module(device)
    if hasattr(module, "set_device"):
        module.set_device(device)


def _rank_main(
    rank: int, world: int, backend_name: str, plugins: list[str], work_dir: str, timeout_s: float
) -> None:
    """One rank: create the backend, join the group, check, write the outcome."""
    warnings.simplefilter("ignore", FutureWarning)  # torch renames the *_tensor collectives
    try:
        backend = registry_with(plugins).create(backend_name, BackendOptions(device_index=rank))
        _set_device(backend.device.device())
    except Exception as exc:
        _write(work_dir, rank, "unavailable", f"rank {rank}: cannot create backend {backend_name!r} "
               f"with device_index={rank}: {type(exc).__name__}: {exc}")  # fmt: skip
        return
    try:
        dist.init_process_group(
            backend.collectives.dist_backend,
            init_method=f"file://{Path(work_dir) / 'store'}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s + 60),  # the parent's deadline decides first
        )
        try:
            check_collectives(backend, rank, world)
        finally:
            dist.destroy_process_group()
    except BaseException:
        _write(work_dir, rank, "failed", traceback.format_exc())
        return
    _write(work_dir, rank, "ok")


def run_collectives(
    backend_name: str,
    *,
    world: int = 2,
    plugins: Sequence[str] = (),
    timeout_s: float = 180.0,
    grace_s: float = 15.0,
) -> None:
    """Spawn `world` processes that each create `backend_name` (device_index = rank) and run
    check_collectives together. Returns when every rank passed.

    Raises AssertionError when a rank failed (its traceback in the message) or did not finish
    within `timeout_s` (a hang: the stuck ranks are killed); CollectivesUnavailable when a rank
    could not create its backend. After the first rank fails, the others get `grace_s` to
    finish (they may be waiting in a collective the failed rank never joins)."""
    ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold a device
    with tempfile.TemporaryDirectory(prefix="deepinfer-collectives-") as work_dir:
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(r, world, backend_name, list(plugins), work_dir, timeout_s),
                name=f"deepinfer-collectives-rank{r}",
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        start = time.monotonic()
        deadline = start + timeout_s
        try:
            while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
                results = [_read(work_dir, r) for r in range(world)]
                status = {res["status"] for res in results if res is not None}
                if "unavailable" in status:  # the others wait for it in init_process_group
                    break
                if "failed" in status:
                    deadline = min(deadline, time.monotonic() + grace_s)
                time.sleep(0.05)
            hung = [r for r, p in enumerate(procs) if p.is_alive()]
        finally:  # also on KeyboardInterrupt: never leave a rank behind
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(10)
        results = [_read(work_dir, r) for r in range(world)]

    unavailable = [res["detail"] for res in results if res is not None and res["status"] == "unavailable"]
    if unavailable:
        raise CollectivesUnavailable("; ".join(unavailable))
    failed = [
        (r, res["detail"]) for r, res in enumerate(results) if res is not None and res["status"] == "failed"
    ]
    if failed:
        rank, detail = failed[0]
        others = f" (ranks {hung} still running, killed)" if hung else ""
        raise AssertionError(f"collectives over {world} processes: rank {rank} failed{others}:\n{detail}")
    if hung:
        raise AssertionError(
            f"collectives over {world} processes: rank(s) {hung} did not finish within {timeout_s:.0f} s "
            f"and were killed: a collective hung (a rank waiting for a peer that never joined it?)"
        )
    for r, (p, res) in enumerate(zip(procs, results)):
        if res is None:
            raise AssertionError(
                f"collectives over {world} processes: rank {r} exited with code {p.exitcode} "
                f"without reporting (crashed?)"
            )
