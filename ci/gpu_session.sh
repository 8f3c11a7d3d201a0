#!/usr/bin/env bash
# One device call, every part under its own time limit, each log written straight into $OUT
# (a call cut short still returns what finished) with a summary line printed after each part:
# the cuda conformance suite, the engine on real CUDA graphs, then bench/bench_e2e.py with the
# arguments given (none: skipped). Limits in seconds: CONF_TIMEOUT (250), ENGINE_TIMEOUT (120),
# BENCH_TIMEOUT (200); the device returns at most 8 files, so traces are not kept.
#   usage: OUT=dir bash ci/gpu_session.sh [bench_e2e.py arguments]
set -u -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . -e backends/cuda > "$OUT/install.log" 2>&1
echo "install rc=$?"

t0=$SECONDS
timeout "${CONF_TIMEOUT:-250}" python3 -m pytest -p deepinfer.testing.plugin --pyargs deepinfer.testing.conformance \
  --deepinfer-backend cuda --deepinfer-heavy -q -n "${WORKERS:-16}" -rfEs --tb=line -p no:cacheprovider \
  > "$OUT/conformance.log" 2>&1
echo "conformance rc=$? in $((SECONDS - t0)) s"
grep -E "FAILED|ERROR|passed|failed" "$OUT/conformance.log" | tail -n 20

t0=$SECONDS
timeout "${ENGINE_TIMEOUT:-120}" env DEEPINFER_TEST_BACKEND=cuda python3 -m pytest tests/test_async_graphs.py -q -rfs \
  -p no:cacheprovider > "$OUT/engine_tests.log" 2>&1
echo "engine tests rc=$? in $((SECONDS - t0)) s"
tail -n 5 "$OUT/engine_tests.log"

if [ $# -gt 0 ]; then
  t0=$SECONDS
  timeout "${BENCH_TIMEOUT:-200}" python3 bench/bench_e2e.py --out "$OUT" "$@" > "$OUT/bench.log" 2>&1
  echo "bench_e2e rc=$? in $((SECONDS - t0)) s"
  rm -f "$OUT"/trace_*.json.gz
  grep -E "tok/s|kernels/step|cost" "$OUT/bench.log" | cut -c1-200 | tail -n 30
fi
