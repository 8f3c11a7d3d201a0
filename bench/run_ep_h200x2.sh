#!/usr/bin/env bash
# Expert parallelism on two H200s (issue 42), every part under `timeout`, results into $OUT:
#   1. tokens.json  bench_ep.py --part tokens: greedy tokens of two expert-parallel ranks over
#                   NCCL against one process (V2-Lite shape; V4-Flash shape at 4 layers, FP8 + MXFP4)
#   2. dp.json      bench_dp.py --batches 256,512 --skip-big: V2-Lite shape, bf16, two GPUs against
#                   one in the same run
#   3. eplb.json    bench_ep.py --part eplb: skewed routing, EPLB off and on (throughput, the
#                   busiest rank's share)
#   4. faults.json  bench_ep.py --part faults: a rank raising, killed, stalled, an unequal number of
#                   calls, with the seconds until every rank ended the call
# NCCL_NVLS_ENABLE=0 (no NVLink multicast). Limits in seconds: T_TOKENS 120, T_DP 220, T_EPLB 80,
# T_FAULTS 110 (530 s: under 9 minutes with the install). V2-Lite at 8 layers for tokens and EPLB,
# whole for the throughput; faults on the tiny config with distributed_timeout_s 10.
# CPU (tiny sizes, reference backend over gloo, every part, no GPU):  CPU=1 OUT=dir bash bench/run_ep_h200x2.sh
#   usage: OUT=dir bash bench/run_ep_h200x2.sh
. "$(dirname "$0")/h200_lib.sh"
export NCCL_NVLS_ENABLE=0
PY=${PYTHON:-python3}
start=$SECONDS
if [ "${CPU:-0}" = 1 ]; then
  EP=(--cpu) DP=(--toy --skip-big --batches 4,8)
  : "${T_TOKENS:=300}" "${T_DP:=300}" "${T_EPLB:=300}" "${T_FAULTS:=300}"  # two shared CPU cores
else
  pip_install > "$OUT/install.log" 2>&1  # with $PY
  echo "install rc=$?"
  EP=(--v2-layers 8 --eplb-layers 8) DP=(--batches 256,512 --skip-big --input-len 256 --output-len 128)
fi
part() {  # name limit command...
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? at $((SECONDS - start)) s"
}
part tokens "${T_TOKENS:-120}" $PY bench/bench_ep.py --part tokens --out "$OUT/tokens.json" "${EP[@]}"
part dp "${T_DP:-220}" $PY bench/bench_dp.py --out "$OUT/dp.json" "${DP[@]}"
part eplb "${T_EPLB:-80}" $PY bench/bench_ep.py --part eplb --out "$OUT/eplb.json" "${EP[@]}"
part faults "${T_FAULTS:-110}" $PY bench/bench_ep.py --part faults --out "$OUT/faults.json" "${EP[@]}"
echo "== summary"
$PY - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def load(name):
    try:
        return json.loads((out / f"{name}.json").read_text())
    except Exception as exc:
        print(f"{name}: no results ({exc})")
        return None
if (doc := load("tokens")) is not None:
    for model, row in doc["tokens"].items():
        if not isinstance(row, dict):  # part_s
            continue
        print(f"tokens {model}: equal {row.get('requests_equal')}/{row.get('requests')}", row.get("error", ""))
if (doc := load("dp")) is not None:
    for row in doc.get("batches", []):
        print(f"batch {row['batch']}: one {row['one']['output_tokens_per_s']:.1f} two "
              f"{row['two']['output_tokens_per_s']:.1f} out tok/s ({row['output_speedup']:.2f}x)")
if (doc := load("eplb")) is not None:
    e = doc["eplb"]
    for k in ("off", "on"):
        print(f"eplb {k}:", {n: v for n, v in e["runs"][k].items()})
    print("busiest share initial / balanced:", e.get("busiest_share_initial_placement"),
          e.get("busiest_share_balanced"), "; throughput on/off:", e.get("throughput_on_over_off"))
if (doc := load("faults")) is not None:
    for case, row in doc["faults"]["cases"].items():
        print(f"fault {case}: ended after {row.get('ended_after_s', float('nan')):.2f} s "
              f"(bound {doc['faults']['bound_s']:g} s) within={row.get('within_bound')}:", row.get("error"))
PYEOF
ls -la "$OUT"
