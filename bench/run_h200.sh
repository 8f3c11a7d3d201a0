#!/usr/bin/env bash
# One run on the device on an H200: install from the working tree, the new kernels' tests and the engine's
# graph/async equality tests on the GPU (real CUDA graphs), then bench/bench_e2e.py.
# Writes under $OUT: gpu.txt, kernel_tests.log, engine_tests.log, and bench_e2e.py's files.
#   usage: OUT=dir bash bench/run_h200.sh      env: KERNEL_TIMEOUT, ENGINE_TIMEOUT, BENCH_BUDGET (s)
set -u -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/local}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv | tee "$OUT/gpu.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . -e backends/cuda 2>&1 | tail -n 2
echo "== kernel tests (new kernels)"
timeout "${KERNEL_TIMEOUT:-30}" python3 -m pytest tests/test_cuda_kernels.py -q -x -p no:cacheprovider \
  -k "align or route or noise or mla or tile or unfused" 2>&1 | tee "$OUT/kernel_tests.log" | tail -n 5
echo "== engine tests on the GPU"
timeout "${ENGINE_TIMEOUT:-60}" env DEEPINFER_TEST_BACKEND=cuda python3 -m pytest tests/test_async_graphs.py \
  -q -x -p no:cacheprovider -k "plain or seeded or invariant or structured" 2>&1 | tee "$OUT/engine_tests.log" | tail -n 5
echo "== bench_e2e"
python3 bench/bench_e2e.py --out "$OUT" --time-budget "${BENCH_BUDGET:-160}" 2>&1 | tee "$OUT/bench.log" | tail -n 60
