#!/usr/bin/env bash
# Whole GPU check of the CUDA backend in one go: install from the working tree, run the
# conformance suite for `cuda` on the GPU (heavy cases included) and the benchmarks.
# Writes under $OUT (default bench/results/local): gpu.txt, kernel_tests.log, engine_tests.log, conformance.log,
# conformance.xml, bench.log, bench_cuda.json, bench_cuda.md.
#   usage: OUT=/some/dir ci/gpu_check.sh [--skip-bench] [--skip-conformance]
#   env: CONF_TIMEOUT, BENCH_TIMEOUT, KERNEL_TIMEOUT, ENGINE_TIMEOUT (seconds), WORKERS,
#        BENCH_ARGS (e.g. --only decode)
OUT=${OUT:-bench/results/local}  # under the repository root
. "$(dirname "$0")/../bench/h200_lib.sh"
PY=${PYTHON:-python3}
CONF_TIMEOUT=${CONF_TIMEOUT:-420}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-330}
run_conf=1; run_bench=1
for a in "$@"; do
  case $a in --skip-bench) run_bench=0 ;; --skip-conformance) run_conf=0 ;; esac
done

echo "== gpu"
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

echo "== install"
t0=$SECONDS
pip_install || exit 1
echo "installed in $((SECONDS - t0)) s"
$PY - <<'PY' | tee -a "$OUT/gpu.txt"
import sys
from deepinfer.backend.registry import BackendRegistry
r = BackendRegistry.discover()
for e in r.entries():
    print(f"backend {e.info.name}: available={e.availability.available} ({e.availability.reason})")
print("auto-selected:", r.select().name)
print("triton imported by discovery:", "triton" in sys.modules)
PY

status=0
echo "== kernel tests (tests/test_cuda_kernels.py on the GPU)"
timeout "${KERNEL_TIMEOUT:-90}" $PY -m pytest tests/test_cuda_kernels.py -q -rfs -p no:cacheprovider 2>&1 \
  | tee "$OUT/kernel_tests.log" | tail -n 30
[ "${PIPESTATUS[0]}" = 0 ] || status=1

echo "== engine on the GPU: async scheduling and CUDA graphs equal the plain engine"
timeout "${ENGINE_TIMEOUT:-240}" env DEEPINFER_TEST_BACKEND=cuda $PY -m pytest tests/test_async_graphs.py -q -rfs \
  -p no:cacheprovider 2>&1 | tee "$OUT/engine_tests.log" | tail -n 30
[ "${PIPESTATUS[0]}" = 0 ] || status=1

if [ $run_conf = 1 ]; then
  echo "== conformance (cuda, heavy cases included)"
  t0=$SECONDS
  timeout "$CONF_TIMEOUT" $PY -m pytest -p deepinfer.testing.plugin --pyargs deepinfer.testing.conformance \
    --deepinfer-backend cuda --deepinfer-heavy -v -n "${WORKERS:-14}" -rfEs --tb=short --durations=15 \
    --junitxml="$OUT/conformance.xml" -p no:cacheprovider 2>&1 | tee "$OUT/conformance.log" \
    | grep -E "FAILED|ERROR|^E |passed|failed|slowest|^[0-9.]+s " | tail -n 80
  rc=${PIPESTATUS[0]}
  echo "conformance exit $rc in $((SECONDS - t0)) s"
  [ "$rc" = 0 ] || status=1
fi

if [ $run_bench = 1 ]; then
  echo "== bench"
  t0=$SECONDS
  timeout "$BENCH_TIMEOUT" $PY bench/bench_cuda.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -n 120
  rc=${PIPESTATUS[0]}
  echo "bench exit $rc in $((SECONDS - t0)) s"
  [ "$rc" = 0 ] || status=1
fi

echo "== summary"
grep -E "passed|failed|error" "$OUT/conformance.log" 2>/dev/null | tail -n 1
exit $status
