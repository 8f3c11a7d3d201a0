#!/usr/bin/env bash
# One run on the device, every part under its own time limit, each log written straight into $OUT
# (a run cut short still returns what finished) with a summary line printed after each part.
# In parallel (one GPU of 141 GB and 16 cores hold them all): the cuda conformance suite, the
# engine on real CUDA graphs (tests/test_async_graphs.py), and with TRAIN_TINY=1 the training of
# model/tiny and its block drafter into $OUT/tiny (the weights, and small.tgz with the rest).
# Then bench/bench_e2e.py with the arguments given (none: skipped).
# Limits in seconds: CONF_TIMEOUT (250), ENGINE_TIMEOUT (120), TRAIN_MINUTES (3),
# BENCH_TIMEOUT (200); the device returns at most 8 files, so traces are not kept.
# CONF_K: a pytest -k filter for the conformance suite. ENGINE_K: the engine tests and the kernel
# tests (tests/test_cuda_kernels.py) under that -k filter, on 4 workers.
#   usage: OUT=dir [TRAIN_TINY=1] bash ci/gpu_suite.sh [bench_e2e.py arguments]
. "$(dirname "$0")/../bench/h200_lib.sh"
pip_install > "$SCRATCH/install.log" 2>&1
echo "install rc=$?"
start=$SECONDS

train() {
  local dir=$SCRATCH/tiny
  mkdir -p "$OUT/tiny" "$dir"
  timeout $(( ${TRAIN_MINUTES:-3} * 60 + 90 )) python3 train/train_tiny.py --out "$dir" \
    --minutes "${TRAIN_MINUTES:-3}" --max-epochs "${TRAIN_EPOCHS:-6}" --device cuda > "$dir/train.log" 2>&1
  echo "train_tiny rc=$? at $((SECONDS - start)) s"
  timeout 150 python3 train/train_drafter.py --model "$dir" --out "$dir" --minutes 1.1 --device cuda \
    > "$dir/drafter.log" 2>&1
  echo "train_drafter rc=$? at $((SECONDS - start)) s"
  cp "$dir"/*.safetensors "$OUT/tiny/"
  tar -C "$dir" -czf "$OUT/tiny/small.tgz" --exclude='*.safetensors' .
  tail -n 3 "$dir/train.log" "$dir/drafter.log"
}

engine() {
  local tests=(tests/test_async_graphs.py)
  [ -n "${ENGINE_K:-}" ] && tests+=(tests/test_cuda_kernels.py -n 4 -k "$ENGINE_K")
  timeout "${ENGINE_TIMEOUT:-120}" env DEEPINFER_TEST_BACKEND=cuda python3 -m pytest "${tests[@]}" \
    -q -rfs -p no:cacheprovider > "$OUT/engine_tests.log" 2>&1
  echo "engine tests rc=$? at $((SECONDS - start)) s"
  tail -n 3 "$OUT/engine_tests.log"
}

[ "${TRAIN_TINY:-0}" = 1 ] && { train & }
engine &
timeout "${CONF_TIMEOUT:-250}" python3 -m pytest -p deepinfer.testing.plugin --pyargs deepinfer.testing.conformance \
  --deepinfer-backend cuda --deepinfer-heavy -q -n "${WORKERS:-14}" -rfEs --tb=line -p no:cacheprovider \
  ${CONF_K:+-k "$CONF_K"} > "$OUT/conformance.log" 2>&1
echo "conformance rc=$? at $((SECONDS - start)) s"
grep -E "FAILED|ERROR|passed|failed" "$OUT/conformance.log" | tail -n 20
wait

if [ $# -gt 0 ]; then
  t0=$SECONDS
  timeout "${BENCH_TIMEOUT:-200}" python3 bench/bench_e2e.py --out "$OUT" "$@" > "$OUT/bench.log" 2>&1
  echo "bench_e2e rc=$? in $((SECONDS - t0)) s"
  rm -f "$OUT"/trace_*.json.gz
  grep -E "tok/s|kernels/step|cost" "$OUT/bench.log" | cut -c1-200 | tail -n 30
fi
