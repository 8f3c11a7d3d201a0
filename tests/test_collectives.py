"""The contract's default collectives (CollectiveOps) across processes: the reference backend over
gloo on the CPU (two and three ranks), the cuda backend over NCCL where two GPUs are visible.

Every case has a deadline (deepinfer.testing.collectives.run_collectives): a rank that hangs in
a collective is killed and the test fails saying so, instead of hanging CI.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer.backend import Availability, Backend, BackendInfo, BackendOptions, hookimpl
from deepinfer.reference.backend import ReferenceCollectives, create_reference_backend
from deepinfer.testing.collectives import CollectivesUnavailable, run_collectives

DEADLINE_S = 120.0  # spawning a rank imports torch; the checks themselves take a second


@pytest.mark.parametrize("world", [2, 3])
def test_default_collectives_over_gloo(world: int) -> None:
    run_collectives("reference", world=world, timeout_s=DEADLINE_S)


@pytest.mark.skipif(
    importlib.util.find_spec("deepinfer_cuda") is None or torch.cuda.device_count() < 2,
    reason="needs deepinfer-cuda and 2 visible GPUs",
)
def test_cuda_collectives_over_nccl() -> None:
    run_collectives("cuda", world=2, timeout_s=DEADLINE_S)


# ---------------------------------------------------------------- the deadline and failures


class HangingCollectives(ReferenceCollectives):
    """Rank 1 never joins the all_reduce: rank 0 waits for it forever."""

    def all_reduce(self, t: torch.Tensor, group: Any = None) -> torch.Tensor:
        if torch.distributed.get_rank() == 1:
            time.sleep(3600)
        return super().all_reduce(t, group)


class OffByOneGather(ReferenceCollectives):
    """all_gather in the wrong rank order."""

    def all_gather(self, t: torch.Tensor, group: Any = None) -> torch.Tensor:
        out = super().all_gather(t, group)
        return torch.cat(out.chunk(torch.distributed.get_world_size(group))[::-1])


def _broken(name: str, collectives: type[ReferenceCollectives]) -> BackendInfo:
    def create(options: BackendOptions) -> Backend:
        ref = create_reference_backend(options)
        return dataclasses.replace(ref, name=name, collectives=collectives(options, torch.device("cpu")))

    return BackendInfo(name, "0", 0, False, lambda: Availability(True), create)


def _one_device(options: BackendOptions) -> Backend:
    """A backend with one device: device_index 1 cannot be created (a GPU box with one GPU)."""
    if options.device_index != 0:
        raise ValueError(f"device_index {options.device_index} out of range: 1 device")
    return dataclasses.replace(create_reference_backend(options), name="one-device")


class _Plugin:
    @hookimpl
    def deepinfer_backends(self) -> list[BackendInfo]:
        return [
            _broken("hanging", HangingCollectives),
            _broken("gather-order", OffByOneGather),
            BackendInfo("one-device", "0", 0, False, lambda: Availability(True), _one_device),
        ]


BROKEN = _Plugin()
PLUGIN = f"{Path(__file__).stem}:BROKEN"  # importable in the spawned ranks (sys.path is passed on)


def test_a_hung_collective_fails_within_the_deadline() -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank\(s\) \[0, 1\] did not finish within 15 s"):
        run_collectives("hanging", plugins=[PLUGIN], timeout_s=15.0)
    assert time.monotonic() - start < 15.0 + 30.0  # the deadline plus killing and joining


def test_a_wrong_result_names_the_rank_and_the_op() -> None:
    with pytest.raises(AssertionError, match=r"(?s)rank \d failed.*all_gather \(torch.float32\) is wrong"):
        run_collectives("gather-order", plugins=[PLUGIN], timeout_s=DEADLINE_S)


def test_a_second_device_that_cannot_be_created_is_unavailable_not_passed() -> None:
    with pytest.raises(
        CollectivesUnavailable, match="rank 1: cannot create backend 'one-device' with device_index=1"
    ):
        run_collectives("one-device", plugins=[PLUGIN], timeout_s=DEADLINE_S)


def test_the_suite_reports_unrun_collectives_loudly() -> None:
    """The conformance suite skips the two-process case for that backend with a warning and a
    NOT CHECKED section in the terminal summary, even without -rs."""
    path = [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]  # this module, for the plugin
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}
    cmd = [
        sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "deepinfer.testing.plugin",
        "--pyargs", "deepinfer.testing.conformance", "--deepinfer-backend", "one-device",
        "--deepinfer-plugin", PLUGIN, "-k", "collectives", "-q", "-W", "ignore::FutureWarning",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600).stdout
    assert "1 passed, 1 skipped" in out, out[-3000:]
    assert "ConformanceGapWarning: NOT CHECKED: collectives over 2 processes" in out, out[-3000:]
    section = out[out.index("deepinfer conformance: 1 case(s) NOT CHECKED for 'one-device'") :]
    assert "test_collectives_across_two_processes" in section and "device_index=1" in section, section
