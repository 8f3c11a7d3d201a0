#!/usr/bin/env bash
# One run on the device for the decode-sized MoE kernels (kernels/moe.py decode_moe), each part under its own limit,
# logs in $OUT:
#   1. compiled correctness: tests/test_cuda_kernels.py's MoE tests and the conformance suite's MoE and
#      batch-invariance cases on the GPU;
#   2. bench/bench_moe_decode.py: grouped path against the decode kernels' tilings, V2-Lite / V3, bf16 / FP8,
#      T = 1..16 (last line: the DEEPINFER_CUDA_MOE_DECODE_TILES value to pin);
#   3. with arguments: bench/bench_e2e.py with them, the decode kernels off (DEEPINFER_CUDA_MOE_DECODE=0)
#      and on, for the step time before and after.
#   usage: OUT=dir [E2E_ONLY=1] bash bench/run_moe_decode_h200.sh [bench_e2e.py arguments]
. "$(dirname "$0")/h200_lib.sh"
pip_install > "$SCRATCH/install.log" 2>&1
echo "install rc=$?"
if [ -z "${E2E_ONLY:-}" ]; then
  t0=$SECONDS
  timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -rfs -p no:cacheprovider tests/test_cuda_kernels.py \
    -k "moe or unfused" > "$OUT/tests.log" 2>&1
  echo "kernel tests rc=$? in $((SECONDS - t0)) s"; tail -n 3 "$OUT/tests.log"
  t0=$SECONDS
  timeout "${CONF_TIMEOUT:-150}" python3 -m pytest -p deepinfer.testing.plugin --pyargs deepinfer.testing.conformance \
    --deepinfer-backend cuda -q -rfEs --tb=line -p no:cacheprovider -k "moe or invarian" > "$OUT/conformance.log" 2>&1
  echo "conformance (moe, batch invariance) rc=$? in $((SECONDS - t0)) s"
  grep -E "FAILED|ERROR|passed|failed" "$OUT/conformance.log" | cut -c1-250 | tail -n 12
  t0=$SECONDS
  timeout "${MOE_TIMEOUT:-200}" python3 bench/bench_moe_decode.py --out "$OUT/moe" > "$OUT/moe.log" 2>&1
  echo "moe decode sweep rc=$? in $((SECONDS - t0)) s"
  cut -c1-240 "$OUT/moe.log" | tail -n 17
fi
if [ $# -gt 0 ]; then
  for decode in 0 1; do
    t0=$SECONDS
    timeout "${BENCH_TIMEOUT:-150}" env DEEPINFER_CUDA_MOE_DECODE=$decode python3 bench/bench_e2e.py \
      --out "$OUT/e2e_decode$decode" "$@" > "$OUT/e2e_decode$decode.log" 2>&1
    echo "bench_e2e DEEPINFER_CUDA_MOE_DECODE=$decode rc=$? in $((SECONDS - t0)) s"
    grep -E "tok/s|kernels/step|ms/step|busy" "$OUT/e2e_decode$decode.log" | cut -c1-200 | tail -n 12
    rm -f "$OUT"/e2e_decode$decode/trace_*.json.gz
  done
fi
