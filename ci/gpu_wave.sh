#!/usr/bin/env bash
# Several device checks in one call, one after another, each under its own `timeout`:
#   OUT=dir bash ci/gpu_wave.sh "NAME|LIMIT_S|COMMAND" ...
# COMMAND runs in the repository root with OUT=$OUT/NAME; its output goes to $OUT/NAME/log.txt and
# the last lines to $OUT/summary.txt with its exit status and time.
#   e.g. OUT=dir bash ci/gpu_wave.sh "v41|300|bash bench/run_v41_h200.sh" "mx|150|PARTS=e2e bash bench/run_mxfp4_h200.sh"
. "$(dirname "$0")/../bench/h200_lib.sh"
workdir "$OUT"
pip_install > "$OUT/install.log" 2>&1
say "install rc=$?"
for item in "$@"; do
  IFS='|' read -r name limit command <<< "$item"
  mkdir -p "$OUT/$name"
  t0=$SECONDS
  OUT="$OUT/$name" timeout "$limit" bash -c "$command" > "$OUT/$name/log.txt" 2>&1
  rc=$?
  { echo "== $name rc=$rc in $((SECONDS - t0)) s"; tail -n "${TAIL:-25}" "$OUT/$name/log.txt"; } | tee -a "$OUT/summary.txt"
done
