#!/usr/bin/env bash
# One run on the device: bench/bench_e2e_v4.py at full reduced depth (DeepSeek-V4-Flash shapes, 4
# layers, bf16 and the published fp8_fp4 format against transformers and the roofline; batches
# 1..256), every part under `timeout`, logs straight into $OUT (a run cut short still returns what
# finished: the bench rewrites its files after every row), a summary printed at the end.
# Beside it, on the CPU, the --smoke run (tiny V4, reference backend, the transformers of this
# machine), packed into smoke.tgz: it tells a code path that fails here from one that fails at size.
# Files back (at most 8): e2e_v4.json, e2e_v4.md, e2e_v4.png, bench_v4.log, smoke.tgz.
# Limits in seconds: BENCH_TIMEOUT (420, the hard stop), BENCH_BUDGET (300: the bench starts no row
# past it and times fewer repeats where a row would overrun it), SMOKE_TIMEOUT (150). Extra
# bench_e2e_v4.py arguments: the script's own (e.g. --batches 1,64 --hf-max-batch 8).
# About 6 minutes on an H200; peak memory about 107 GiB (while deepinfer's bf16 model is built).
#   usage: OUT=dir bash bench/run_v4_e2e_h200.sh [bench_e2e_v4.py arguments]
. "$(dirname "$0")/h200_lib.sh"
mkdir -p "$OUT/smoke"
pip_install > "$SCRATCH/install.log" 2>&1
rc=$?
echo "install rc=$rc"
[ "$rc" = 0 ] || tail -n 20 "$SCRATCH/install.log"
start=$SECONDS

(
  timeout "${SMOKE_TIMEOUT:-150}" env CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=4 \
    python3 bench/bench_e2e_v4.py --smoke --out "$OUT/smoke" > "$OUT/smoke/smoke.log" 2>&1
  echo "smoke (CPU) rc=$? at $((SECONDS - start)) s"
) &

timeout "${BENCH_TIMEOUT:-420}" python3 bench/bench_e2e_v4.py --out "$OUT" \
  --time-budget "${BENCH_BUDGET:-300}" "$@" > "$OUT/bench_v4.log" 2>&1
echo "bench_e2e_v4 rc=$? at $((SECONDS - start)) s"
wait

tar -C "$OUT" -czf "$OUT/smoke.tgz" smoke && rm -rf "$OUT/smoke"
echo "== smoke rows (CPU, tiny V4): format batch deepinfer_tok_s greedy_tokens_equal"
tar -xzOf "$OUT/smoke.tgz" smoke/e2e_v4.json 2>/dev/null | python3 -c '
import json, sys
doc = json.load(sys.stdin)
for r in doc["rows"]:
    print(r["format"], r["batch"], round(r.get("deepinfer_tok_s", 0), 1), r.get("greedy_tokens_equal", ""))
print("errors:", doc["errors"])' || echo "no smoke JSON"
echo "== log lines"
grep -E "tok/s|FAILED|skipped|Error|memory" "$OUT/bench_v4.log" | cut -c1-220 | tail -n 40
echo "== table"
sed -n '/^| format/,/^$/p' "$OUT/e2e_v4.md" 2>/dev/null
python3 -c '
import json, sys
doc = json.load(open(sys.argv[1]))
m = doc["memory"]
print("memory: peak", round(m.get("h200_memory_needed_gib", 0), 1), "GiB; bf16 weights",
      round(m.get("bf16_weight_bytes", 0) / 2**30, 2), "GiB; fp8_fp4 weights",
      round(m.get("fp8_fp4_weight_bytes", 0) / 2**30, 2), "GiB")
print("copy", round(doc["ceilings"]["copy"]["gbs"]), "GB/s; matmul", round(doc["ceilings"]["matmul"]["tflops"], 1),
      "TFLOP/s; errors:", doc["errors"], "; sections:", {k: round(v) for k, v in doc["sections_s"].items()})
' "$OUT/e2e_v4.json" 2>/dev/null || echo "no e2e_v4.json"
ls -la "$OUT"
