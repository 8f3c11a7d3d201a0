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
