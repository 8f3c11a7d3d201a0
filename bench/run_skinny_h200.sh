#!/usr/bin/env bash
# One run on the device for decode-sized linears and the router: the kernel tests of both on the GPU,
# bench/bench_router.py over router tiles (ROUTER_TILES), bench/bench_cuda.py --only skinny
# (the skinny GEMM against cuBLAS, with its tile sweep), bench/bench_spec.py --profile
# (host time per engine part, plain and speculative, SPEC_ARGS), then bench/bench_e2e.py with
# the arguments given. Each part under its own limit; logs and results in $OUT/results.tgz.
#   usage: OUT=dir bash bench/run_skinny_h200.sh [bench_e2e.py arguments]
. "$(dirname "$0")/h200_lib.sh"
R=$SCRATCH/results  # no summary.txt: say, and so part, only print
mkdir -p "$R"
pip_install > "$SCRATCH/install.log" 2>&1
echo "install rc=$?"
part kernels 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_kernels.py -k "skinny or router"
tail -n 3 "$R/kernels.log"
part router 90 python3 bench/bench_router.py --out "$R/router" --tiles "${ROUTER_TILES:-4x512,1x2048,2x1024,1x1024,2x2048}"
grep "^| v2-lite\|^| v3 " "$R/router.log" | head -n 40
part skinny 150 python3 bench/bench_cuda.py --only skinny --out "$R/skinny"
sed -n '/## Skinny/,$p' "$R/skinny.log" | head -n 60
if [ -n "${SPEC_ARGS:-}" ]; then
  # shellcheck disable=SC2086
  part spec 120 python3 bench/bench_spec.py --model model/tiny --out "$R/spec" --profile $SPEC_ARGS
  python3 - "$R/spec/profile.json" <<'PY' || true
import json, sys
for r in json.load(open(sys.argv[1])):
    walls = [round(h["wall"], 3) for h in r["host_split"]]
    print(r["config"], "wall per step ms:", walls)
    for h in sorted(r["host_split"], key=lambda h: h["wall"])[:: max(1, len(walls) - 1)]:
        print("   ", {k: round(v, 3) for k, v in h.items()})
    print("    device busy per step ms:", r.get("busy_per_step_ms"), "window:", r.get("window_per_step_ms"))
PY
fi
if [ $# -gt 0 ]; then
  part e2e "${BENCH_TIMEOUT:-300}" python3 bench/bench_e2e.py --out "$R/e2e" "$@"
  grep -E "tok/s|kernels/step|cost|busy" "$R/e2e.log" | cut -c1-200 | tail -n 30
  rm -f "$R"/e2e/trace_*.json.gz
fi
tar -C "$R" -czf "$OUT/results.tgz" .
