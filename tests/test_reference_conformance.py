"""The shipped conformance suite passes for the reference backend, run as users run it."""

from __future__ import annotations

import subprocess
from collections.abc import Callable


def test_reference_passes_conformance(run_deepinfer: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    out = run_deepinfer("conformance", "--backend", "reference", "-q", "-rs", "-W", "ignore::FutureWarning")
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    summary = out.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary
    # the reference claims every dtype, FP8 and batch invariance: none of those tests may skip
    skips = [line for line in out.stdout.splitlines() if line.startswith("SKIPPED")]
    assert not [line for line in skips if "does not claim" in line], "\n".join(skips)
