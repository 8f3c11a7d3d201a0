"""Collectives on a one-process group with the backend's own torch.distributed backend.

Multi-process behaviour of the default implementations is tested in deepinfer's own tests
(tests/test_collectives.py); here every op must run on the backend's device and return the
right shapes and values for world size 1.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from deepinfer.backend.ops import Backend


@pytest.fixture(scope="module")
def group(backend: Backend) -> Iterator[None]:
    name = backend.collectives.dist_backend
    assert isinstance(name, str) and name
    if dist.is_initialized():
        pytest.skip("a torch.distributed process group already exists in this process")
    if not dist.is_backend_available(name):
        pytest.skip(f"torch.distributed backend {name!r} is not available in this process")
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
    assert torch.equal(c.reduce_scatter(t).cpu(), t.cpu())
    assert torch.equal(c.all_to_all_single(t, [4], [4]).cpu(), t.cpu())
    assert torch.equal(c.all_to_all_single(t).cpu(), t.cpu())
    assert torch.equal(c.broadcast(t.clone(), 0).cpu(), t.cpu())
    empty = torch.empty((0, 3), device=device)
    assert c.all_to_all_single(empty, [0], [0]).shape == (0, 3)
    c.barrier()
