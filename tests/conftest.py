"""Shared fixtures of deepinfer's own tests (the backend conformance suite has its own plugin,
deepinfer/testing/plugin.py, run by tests/test_reference_conformance.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from deepinfer.testing.helpers import seed_from

REPO = Path(__file__).resolve().parents[1]


# The Triton interpreter's subprocess tests (tests/test_cuda_interpret.py) take minutes each:
# they run first, longest first (CI times), so that the xdist workers, fed one test at a time
# (ci/test.sh), finish together.
LONGEST_FIRST = [
    "test_engine_async_scheduling_and_graphs_under_interpreter",
    "test_conformance_suite_under_interpreter",
    "test_engine_v4_decode_graphs_under_interpreter",
    "test_kernel_tests_under_interpreter",
    "test_engine_speculative_decoding_under_interpreter",
    "test_engine_expert_parallel_under_interpreter",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A CPU generator seeded from the test's node id: fresh per test, reproducible."""
    return torch.Generator().manual_seed(seed_from(request.node.nodeid))


def _run_deepinfer(
    *args: str, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """Run `python -m deepinfer ARGS` in a fresh interpreter; returns the completed process."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "deepinfer", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=REPO,
    )


@pytest.fixture
def run_deepinfer() -> Callable[..., subprocess.CompletedProcess[str]]:
    """`run_deepinfer("backends", env={...})` runs the command line in a fresh interpreter."""
    return _run_deepinfer
