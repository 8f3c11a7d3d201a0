"""The contract's default collectives (CollectiveOps) over two processes: the reference backend
over gloo on the CPU, and the cuda backend over NCCL where two GPUs are visible."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from deepinfer.backend.registry import BackendRegistry
from deepinfer.backend.types import BackendOptions

WORLD = 2


def _worker(rank: int, store_path: str, name: str, dist_backend: str) -> None:
    warnings.simplefilter("ignore", FutureWarning)  # torch 2.13 renames the *_tensor collectives
    backend = BackendRegistry.discover().create(name, BackendOptions(device_index=rank))
    c = backend.collectives
    assert c.dist_backend == dist_backend
    dev = backend.device.device()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    torch.set_default_device(dev)  # every tensor below is made on the backend's device
    dist.init_process_group(c.dist_backend, init_method=f"file://{store_path}", rank=rank, world_size=WORLD)
    try:
        # all_reduce: sum, in place
        t = torch.arange(6, dtype=torch.float32).view(2, 3) * (rank + 1)
        out = c.all_reduce(t)
        assert out is t and torch.equal(t, torch.arange(6, dtype=torch.float32).view(2, 3) * 3)

        # all_gather: rank-ordered concatenation along dim 0
        mine = torch.full((2, 3), float(rank)) + torch.arange(3)
        gathered = c.all_gather(mine)
        assert torch.equal(
            gathered, torch.cat([torch.full((2, 3), float(r)) + torch.arange(3) for r in range(WORLD)])
        )

        # reduce_scatter: this rank's slice of the sum
        full = torch.arange(8, dtype=torch.float32).view(4, 2) + 10 * rank
        part = c.reduce_scatter(full)
        total = torch.stack(
            [torch.arange(8, dtype=torch.float32).view(4, 2) + 10 * r for r in range(WORLD)]
        ).sum(0)
        assert torch.equal(part, total[2 * rank : 2 * rank + 2])

        # all_to_all_single with uneven splits (and an empty one): send[r][d] rows from r to d
        send = [[1, 3], [2, 0]]
        rows = sum(send[rank])
        x = torch.stack([torch.tensor([float(rank), float(i)]) for i in range(rows)]).view(rows, 2)
        y = c.all_to_all_single(x, [send[r][rank] for r in range(WORLD)], send[rank])
        start = {r: sum(send[r][:rank]) for r in range(WORLD)}  # where my rows start in r's buffer
        expected = [
            torch.tensor([float(r), float(start[r] + i)]) for r in range(WORLD) for i in range(send[r][rank])
        ]
        assert torch.equal(y, torch.stack(expected)), (rank, y)

        # even split (None) and a rank with nothing to send
        even = c.all_to_all_single(torch.full((4, 1), float(rank)))
        assert torch.equal(even, torch.tensor([[0.0], [0.0], [1.0], [1.0]]))
        empty = c.all_to_all_single(torch.empty((0, 5)), [0, 0], [0, 0])
        assert empty.shape == (0, 5)

        # broadcast from rank 1, in place
        b = torch.full((3,), float(rank))
        assert c.broadcast(b, src=1) is b and torch.equal(b, torch.ones(3))

        c.barrier()
    finally:
        dist.destroy_process_group()


def test_default_collectives_over_gloo(tmp_path: Path) -> None:
    args = (str(tmp_path / "store"), "reference", "gloo")
    spawn(_worker, args=args, nprocs=WORLD, join=True)  # type: ignore[no-untyped-call]


@pytest.mark.skipif(
    importlib.util.find_spec("deepinfer_cuda") is None or torch.cuda.device_count() < WORLD,
    reason=f"needs deepinfer-cuda and {WORLD} visible GPUs",
)
def test_cuda_collectives_over_nccl(tmp_path: Path) -> None:
    args = (str(tmp_path / "store"), "cuda", "nccl")
    spawn(_worker, args=args, nprocs=WORLD, join=True)  # type: ignore[no-untyped-call]
