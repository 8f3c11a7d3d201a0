"""CI for the CUDA backend without a GPU: its Triton kernels run in the Triton interpreter on the
CPU (TRITON_INTERPRET=1), in subprocesses so that no other test sees that variable.

1. the backend conformance suite for `cuda` (small shapes; heavy cases stay off; bfloat16 only:
   the interpreter computes every product in float32 whatever the dtype, so float32 and float16
   add little here beyond other tiles, and both run in the GPU's conformance run,
   ci/gpu_check.sh),
2. tests/test_cuda_kernels.py, the direct kernel tests (split-KV combine, exact FP8 rounding, ...),
3. the engine on cuda: speculative decoding against plain decoding (tests/test_speculative.py,
   tests/test_drafter.py, tests/test_dflash_engine.py: verification graphs),
   expert parallelism over two processes against one (tests/test_expert_parallel.py, bf16
   expert weights: the FP8 experts' kernels are in the conformance suite), async
   scheduling and (emulated) decode graphs against the plain engine (tests/test_async_graphs.py),
   and DeepSeek-V4 decode graphs against eager steps (tests/test_v4_cache_groups.py),
   DeepSeek-V4.1 with Engram layers (and their prefetch) and with candidate blocks against its float64 oracle
   (tests/test_parity_v41.py), and in its published KV formats against the oracle rounding its KV
   (tests/test_parity_v41_kv.py).
Each subprocess gets a generous limit (SUBPROCESS_TIMEOUT): the interpreter is slow, and on a busy
machine several times slower; the limit only catches a hang.
What the interpreter cannot show (speed, CUDA graphs, streams) is listed in docs/cuda.md.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer import envs

REPO = Path(__file__).resolve().parents[1]
SUBPROCESS_TIMEOUT = envs.read().test_subprocess_timeout

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or importlib.util.find_spec("deepinfer_cuda") is None,
    reason="needs triton and the deepinfer-cuda package (pip install -e backends/cuda)",
)


def _run(args: list[str], timeout: float = SUBPROCESS_TIMEOUT) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop(envs.BACKEND.name, None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


def test_conformance_suite_under_interpreter() -> None:
    workers = ["-n", "2"] if importlib.util.find_spec("xdist") is not None else []
    res = _run(
        ["-p", "deepinfer.testing.plugin", "--pyargs", "deepinfer.testing.conformance",
         "--deepinfer-backend", "cuda", "--deepinfer-dtypes", "bfloat16", *workers]
    )  # fmt: skip
    tail = (res.stdout + res.stderr)[-4000:]
    assert res.returncode == 0, f"conformance suite failed for cuda under TRITON_INTERPRET=1:\n{tail}"
    assert " passed" in res.stdout and "failed" not in res.stdout, tail


def test_kernel_tests_under_interpreter() -> None:
    res = _run([str(REPO / "tests" / "test_cuda_kernels.py")])
    tail = (res.stdout + res.stderr)[-4000:]
    assert res.returncode == 0, f"kernel tests failed under TRITON_INTERPRET=1:\n{tail}"
    assert " passed" in res.stdout and "skipped" not in res.stdout, tail


def test_engine_speculative_decoding_under_interpreter() -> None:
    tests = [
        str(REPO / "tests" / f) for f in ("test_speculative.py", "test_drafter.py", "test_dflash_engine.py")
    ]
    res = _run([*tests, "-k", "cuda_backend"])
    tail = (res.stdout + res.stderr)[-4000:]
    assert res.returncode == 0, f"speculative decoding on cuda failed under TRITON_INTERPRET=1:\n{tail}"
    assert "3 passed" in res.stdout, tail  # MTP, the block drafter, DFlash (verification graphs)


def test_engine_expert_parallel_under_interpreter() -> None:
    res = _run([str(REPO / "tests" / "test_expert_parallel.py"), "-k", "cuda and bf16"])
    tail = (res.stdout + res.stderr)[-4000:]
    assert res.returncode == 0, f"expert parallelism on cuda failed under TRITON_INTERPRET=1:\n{tail}"
    assert "1 passed" in res.stdout, tail


def test_engine_async_scheduling_and_graphs_under_interpreter() -> None:
    selected = "equal_the_plain_engine and plain-cuda or seeded or invariant"
    res = _run([str(REPO / "tests" / "test_async_graphs.py"), "-k", selected])
    tail = (res.stdout + res.stderr)[-4000:]
    assert res.returncode == 0, f"async scheduling / graphs on cuda failed under TRITON_INTERPRET=1:\n{tail}"
    assert "3 passed" in res.stdout, tail


def test_engine_v4_decode_graphs_under_interpreter() -> None:
    res = _run([str(REPO / "tests" / "test_v4_cache_groups.py"), "-k", "graphs"])
    tail = (res.stdout + res.stderr)[-4000:]
    assert res.returncode == 0, f"DeepSeek-V4 graphs on cuda failed under TRITON_INTERPRET=1:\n{tail}"
    assert "1 passed" in res.stdout, tail


def test_engine_v41_engram_under_interpreter() -> None:
    res = _run([str(REPO / "tests" / "test_parity_v41.py"), "-k", "cuda_backend"])
    tail = (res.stdout + res.stderr)[-4000:]
    assert res.returncode == 0, f"DeepSeek-V4.1 on cuda failed under TRITON_INTERPRET=1:\n{tail}"
    assert "4 passed" in res.stdout, tail  # Engram (two cases), its prefetch, candidate blocks


def test_engine_v41_kv_formats_under_interpreter() -> None:
    res = _run([str(REPO / "tests" / "test_parity_v41_kv.py"), "-k", "cuda_backend"])
    tail = (res.stdout + res.stderr)[-4000:]
    assert res.returncode == 0, f"DeepSeek-V4.1's KV formats on cuda failed under TRITON_INTERPRET=1:\n{tail}"
    assert "1 passed" in res.stdout, tail
