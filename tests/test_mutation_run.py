"""ci/mutation_run.py at a small size: two mutants on a few cases, one caught and one not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_table_names_the_catching_case_and_the_uncaught_mutant() -> None:
    select = "rms_norm_zero and float32 and plain"  # catches rms-eps, and not router-ties
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    command = ["ci/mutation_run.py", "--mutant", "rms-eps", "--mutant", "router-ties", "-k", select]
    proc = subprocess.run(
        [sys.executable, *command],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr  # router-ties is caught by no case
    rows = proc.stdout.splitlines()
    assert rows[0].split() == ["mutant", "caught", "by"], proc.stdout
    caught = [r.split() for r in rows if "test_rms_norm_zero_and_tiny_rows[float32-plain-" in r]
    assert len(caught) == 2 and caught[0][0] == "rms-eps", proc.stdout  # eps 1e-2 and 1e-6
    assert any(r.startswith("router-ties") and "NOT CAUGHT: no case failed" in r for r in rows), proc.stdout
    assert "1 of 2 mutant(s) caught by no case: router-ties" in proc.stdout
