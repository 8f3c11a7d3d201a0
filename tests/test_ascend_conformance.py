"""The backend conformance suite, run for `ascend` on the torch_npu simulation (a subprocess:
the simulation must never be visible to other tests in this process).

Atlas A2 (SoC 220): the whole suite. Ascend 950 (SoC 260): the FP8 tests, which A2 skips.
Also the engine on ascend: speculative decoding against plain decoding (tests/test_speculative.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_suite(soc: int, *extra: str) -> subprocess.CompletedProcess[str]:
    if not any(ep.name == "ascend" for ep in entry_points(group="deepinfer.backends")):
        pytest.fail("deepinfer-ascend is not installed: pip install -e backends/ascend", pytrace=False)
    env = {**os.environ, "DEEPINFER_NPU_SIM_SOC": str(soc), "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "tests.npu_sim.plugin",
        "-p", "deepinfer.testing.plugin", "--pyargs", "deepinfer.testing.conformance",
        "--deepinfer-backend", "ascend", *extra,
    ]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=2400)


def assert_passed(proc: subprocess.CompletedProcess[str], soc: int) -> None:
    out = proc.stdout + proc.stderr
    assert f"torch_npu simulation installed (CPU device, SoC {soc})" in out, out[-3000:]
    assert proc.returncode == 0, f"conformance failed for ascend (SoC {soc}):\n{out[-6000:]}"
    assert " passed" in out and " failed" not in out


def test_conformance_atlas_a2() -> None:
    assert_passed(run_suite(220), 220)


def test_conformance_ascend_950_fp8() -> None:
    proc = run_suite(260, "-k", "fp8")
    assert_passed(proc, 260)
    assert "deselected" in proc.stdout  # only the FP8 cases ran here


def test_engine_speculative_decoding_on_the_simulation() -> None:
    env = {**os.environ, "DEEPINFER_NPU_SIM_SOC": "220", "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.npu_sim.plugin",
        str(ROOT / "tests" / "test_speculative.py"), "-k", "ascend_backend",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=2400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "1 passed" in proc.stdout, out[-4000:]
