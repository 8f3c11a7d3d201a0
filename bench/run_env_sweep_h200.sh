#!/usr/bin/env bash
# One run on the device: bench/bench_e2e.py (deepinfer only, no extras) once per environment setting,
# each in its own process (every DEEPINFER_* switch is read when the backend or model is created),
# after an optional conformance subset (CONF_K). The tok/s lines of every run are printed; logs
# and e2e files in $OUT/sweep/<n>.
#   usage: OUT=dir SETTINGS="VAR=VALUE;VAR=VALUE VAR2=VALUE2;..." [CONF_K=filter] \
#          bash bench/run_env_sweep_h200.sh [bench_e2e.py arguments, default --batches 1]
# An empty setting (";;", a leading or a trailing ";") is the default environment.
. "$(dirname "$0")/h200_lib.sh"
mkdir -p "$OUT/sweep"
pip_install > "$SCRATCH/install.log" 2>&1
echo "install rc=$?"
if [ -n "${CONF_K:-}" ]; then
  timeout "${CONF_TIMEOUT:-120}" python3 -m pytest -p deepinfer.testing.plugin --pyargs deepinfer.testing.conformance \
    --deepinfer-backend cuda -q -n 8 -rfEs --tb=line -p no:cacheprovider -k "$CONF_K" > "$OUT/conformance.log" 2>&1
  echo "conformance rc=$?"
  tail -n 3 "$OUT/conformance.log"
fi
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--batches 1)
IFS=';' read -r -a settings <<< "${SETTINGS:-}"
[[ "${SETTINGS:-}" == *";" ]] && settings+=("")  # read -a drops a trailing empty setting
n=0
for setting in "${settings[@]}"; do
  dir="$OUT/sweep/$n"
  mkdir -p "$dir"
  # shellcheck disable=SC2086
  timeout "${RUN_TIMEOUT:-90}" env $setting python3 bench/bench_e2e.py --out "$dir" --skip-transformers --skip-extra \
    --time-budget 60 "${args[@]}" > "$dir/bench.log" 2>&1
  echo "[$n] ${setting:-default} rc=$?: $(grep -E 'deepinfer B=' "$dir/bench.log" | sed 's/.*deepinfer //' | tr '\n' ' ')"
  rm -f "$dir"/trace_*.json.gz
  n=$((n + 1))
done
