"""Collectives with the backend's own torch.distributed backend: in two processes (where a no-op
or a wrong rank order shows), and on a one-process group (the degenerate world of one).

Two processes: deepinfer.testing.collectives spawns one process per rank; each creates the
backend with device_index = rank (a GPU backend needs two devices), joins a group over a file
store and checks every op. A rank that hangs fails the test after a bounded wait. Where the
dist backend is unavailable, or a second device cannot be created, the cases are skipped LOUDLY
(a warning, a NOT CHECKED reason and a section in the terminal summary).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from deepinfer.backend.ops import Backend
from deepinfer.testing.collectives import CollectivesUnavailable, run_collectives
from deepinfer.testing.plugin import skip_unchecked

WORLD = 2
TIMEOUT_S = 240.0  # spawning a rank imports torch (and, for some backends, a compiler) first


def require_dist_backend(backend: Backend) -> str:
    __tracebackhide__ = True
    name = backend.collectives.dist_backend
    assert isinstance(name, str) and name, "collectives.dist_backend must name a torch.distributed backend"
    if not dist.is_backend_available(name):
        skip_unchecked(
            "collectives",
            f"backend {backend.name!r} claims torch.distributed backend {name!r}, which is not "
            f"available in this process",
        )
    return name


def test_collectives_across_two_processes(
    backend: Backend, backend_name: str, backend_plugins: list[str]
) -> None:
    """all_reduce, all_gather (each claimed dtype, and bytes), reduce_scatter, all_to_all_single
    (uneven, even, empty), broadcast and barrier across two ranks, compared exactly."""
    require_dist_backend(backend)
    try:
        run_collectives(backend_name, world=WORLD, plugins=backend_plugins, timeout_s=TIMEOUT_S)
    except CollectivesUnavailable as exc:
        skip_unchecked(f"collectives over {WORLD} processes", str(exc))
    except AssertionError as exc:  # the rank's own traceback is in the message
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="module")
def group(backend: Backend) -> Iterator[None]:
    name = require_dist_backend(backend)
    if dist.is_initialized():
        skip_unchecked("collectives in one process", "a torch.distributed process group already exists")
    fd, path = tempfile.mkstemp(prefix="deepinfer-conformance-")
    os.close(fd)
    os.unlink(path)
    dist.init_process_group(name, init_method=f"file://{path}", rank=0, world_size=1)
    try:
        yield None
    finally:
        dist.destroy_process_group()
        if os.path.exists(path):
            os.unlink(path)


def test_world_of_one(backend: Backend, group: None, device: torch.device) -> None:
    c = backend.collectives
    t = torch.arange(12, dtype=torch.float32, device=device).view(4, 3)
    assert torch.equal(c.all_reduce(t.clone()).cpu(), t.cpu())
    assert torch.equal(c.all_gather(t).cpu(), t.cpu())
    raw = torch.arange(14, dtype=torch.uint8, device=device).view(2, 7)
    assert torch.equal(c.all_gather(raw).cpu(), raw.cpu())
    assert torch.equal(c.reduce_scatter(t).cpu(), t.cpu())
    assert torch.equal(c.all_to_all_single(t, [4], [4]).cpu(), t.cpu())
    assert torch.equal(c.all_to_all_single(t).cpu(), t.cpu())
    assert torch.equal(c.broadcast(t.clone(), 0).cpu(), t.cpu())
    empty = torch.empty((0, 3), device=device)
    assert c.all_to_all_single(empty, [0], [0]).shape == (0, 3)
    c.barrier()
