#!/usr/bin/env bash
# One device call: the whole GPU check (ci/gpu_check.sh: kernel tests, the engine
# on real CUDA graphs, the cuda conformance suite) and bench/bench_e2e.py with any arguments given,
# packed into $OUT/results.tgz (the device returns few files) beside the summaries.
#   usage: OUT=dir bash ci/gpu_session.sh [bench_e2e.py arguments]
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT}
RES=$(mktemp -d)
OUT=$RES ENGINE_TIMEOUT=${ENGINE_TIMEOUT:-200} bash ci/gpu_check.sh --skip-bench
if [ $# -gt 0 ]; then
  mkdir -p "$RES/e2e"
  python3 bench/bench_e2e.py --out "$RES/e2e" "$@" 2>&1 | tee "$RES/e2e/bench.log" | grep -v "^\[" | tail -n 5
  grep -A 40 "kernels/step" "$RES/e2e/bench.log" | head -n 150
  cp "$RES/e2e/e2e.md" "$OUT/" 2>/dev/null
fi
tar czf "$OUT/results.tgz" -C "$RES" .
