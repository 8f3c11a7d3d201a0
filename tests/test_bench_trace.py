"""bench/bench_e2e.py's trace analysis: the busy, idle and exposed (critical-path) times of a
decode step, on a synthetic chrome trace where kernels overlap as programmatic dependent launch
makes them (a kernel starts while its predecessor runs and waits inside)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def kernel(name: str, ts: float, dur: float) -> dict[str, object]:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_exposed_times_add_up_to_the_busy_time() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_e2e

    # two steps (us): gemm 0-10, norm starts early at 8 (waits) and ends at 12, a gap, attention
    # 14-20 with a nested kernel 15-16 (exposes nothing), memcpy 21-22
    step = [kernel("gemm", 0, 10), kernel("norm", 8, 4), kernel("attention", 14, 6), kernel("inner", 15, 1)]
    events = step + [dict(e, ts=float(e["ts"]) + 100) for e in step]  # type: ignore[arg-type]
    events.append({"ph": "X", "cat": "gpu_memcpy", "name": "copy", "ts": 121.0, "dur": 1.0})
    res = bench_e2e.analyse_trace({"traceEvents": events}, steps=2)
    by_name = {k["name"]: k for k in res["top_kernels"]}
    assert by_name["norm"]["ms_per_step"] == pytest.approx(4e-3)
    assert by_name["norm"]["exposed_ms_per_step"] == pytest.approx(2e-3), "overlap is gemm's"
    assert by_name["inner"]["exposed_ms_per_step"] == 0.0
    assert [k["name"] for k in res["top_kernels"]] == ["gemm", "attention", "norm", "inner"]
    kernel_busy = sum(k["exposed_ms_per_step"] for k in res["top_kernels"])
    assert kernel_busy == pytest.approx(18e-3)  # 0-12 and 14-20 per step
    assert res["busy_per_step_ms"] == pytest.approx(kernel_busy + 0.5e-3)  # the memcpy is busy too
    assert res["idle_share"] == pytest.approx(1 - 37 / 122)
    gaps = {g["between"]: g["us_per_step"] for g in res["top_gaps"]}
    assert gaps == {"attention -> gemm": 40.0, "norm -> attention": 2.0, "attention -> copy": 0.5}
