#!/usr/bin/env bash
# One device call (about 8 minutes) for DeepSeek-V4-Flash in the format DeepSeek publishes (FP8
# linears with UE8M0 128x128 block scales, MXFP4 routed experts) on one H200:
#   1. tests: the cuda conformance cases of the GEMMs, the MoE and V4's ops, the kernel tests of
#      the new paths (tests/test_cuda_kernels.py) and the published-format parity tests
#      (tests/test_parity_v4_quant.py), in one pytest run;
#   2. kernels: bench/bench_v4_decode.py (CUDA-graph replays, GB/s against the copy rate of this
#      run, V4-Flash shapes, 1 / 8 / 64 rows or tokens, the paths replaced, tile sweeps);
#   3. end to end: `deepinfer bench --random-config deepseek-v4-flash --num-hidden-layers 4`, 128 in,
#      64 out, FP8 + MXFP4 and bf16, batch 1 and 64, with the new paths and with
#      DEEPINFER_CUDA_V4_DECODE=0 (the paths before), each run skipped when the time left
#      (TOTAL) would not cover its limit. Order: tests, the four FP8 rows, the kernels (within
#      the time left), then bf16 new (batch 1, 64) and bf16 before.
# Each part under `timeout`; logs in $OUT/logs.tgz; summary.txt, v4_decode.md / .json, e2e.json.
#   usage: OUT=dir bash bench/run_v4_h200.sh
#   knobs: TOTAL (s, default 480), TEST_TIMEOUT (100), KERNEL_TIMEOUT (120), E2E_TIMEOUT (70 each)
set -u -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT}
R=/tmp/v4_results
TOTAL=${TOTAL:-480}
mkdir -p "$OUT" "$R/e2e"
: > "$R/summary.txt"
say() { echo "$*" | tee -a "$R/summary.txt"; }
python3 -m pip install -q --no-deps --no-build-isolation -e . -e backends/cuda > "$R/install.log" 2>&1
say "install rc=$? ($(python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())' 2>&1))"
part() {  # part NAME LIMIT command...: run, log to $R/NAME.log, report rc and time
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$R/$name.log" 2>&1
  local rc=$?
  say "$name rc=$rc in $((SECONDS - t0)) s"
  return $rc
}

# 1. tests on the GPU
part tests "${TEST_TIMEOUT:-100}" python3 -m pytest -q -p no:cacheprovider -n 16 \
  -p deepinfer.testing.plugin --deepinfer-backend cuda --deepinfer-dtypes bfloat16 \
  --pyargs deepinfer.testing.conformance tests/test_cuda_kernels.py tests/test_parity_v4_quant.py \
  -k "linear_fp8 or fp8_gemm or grouped_gemm_fp8 or fp4 or fused_moe or experts or clamped or batched_linear or skinny or decode_moe or mxfp4 or parity_v4_quant"
grep -E "passed|failed|GREEN|RED|FAILED" "$R/tests.log" | tail -n 12 | tee -a "$R/summary.txt"

# 2. end to end, before (DEEPINFER_CUDA_V4_DECODE=0) and after: the FP8 + MXFP4 rows first
E2E_LIMIT=${E2E_TIMEOUT:-70}
e2e() {  # e2e FORMAT BATCH SWITCH
  local fmt=$1 b=$2 sw=$3 name="e2e_${1}_b${2}_v4decode${3}"
  if [ $((TOTAL - SECONDS)) -lt "$E2E_LIMIT" ]; then
    say "$name skipped: $((TOTAL - SECONDS)) s left"
    return
  fi
  local q=()
  [ "$fmt" = fp8 ] && q=(--quantization fp8)
  DEEPINFER_CUDA_V4_DECODE=$sw part "$name" "$E2E_LIMIT" python3 -m deepinfer.cli bench \
    --random-config deepseek-v4-flash --num-hidden-layers 4 --backend cuda --dtype bfloat16 "${q[@]}" \
    --num-prompts "$b" --max-num-seqs "$b" --input-len 128 --output-len 64 --max-model-len 512 --output-json "$R/e2e/$name.json"
  grep -iE "tok/s|throughput" "$R/$name.log" | tail -n 2 | sed "s/^/    /" | tee -a "$R/summary.txt"
}
for run in "fp8 1 1" "fp8 1 0" "fp8 64 1" "fp8 64 0"; do
  # shellcheck disable=SC2086
  e2e $run
done

# 3. the decode kernels against the copy rate and the paths they replace (within the time left)
KLIMIT=$(( TOTAL - SECONDS - 10 < ${KERNEL_TIMEOUT:-120} ? TOTAL - SECONDS - 10 : ${KERNEL_TIMEOUT:-120} ))
[ "$KLIMIT" -lt 30 ] && KLIMIT=30
part kernels "$KLIMIT" python3 bench/bench_v4_decode.py --out "$R/kernels"
if [ -f "$R/kernels/v4_decode.md" ]; then
  cat "$R/kernels/v4_decode.md" >> "$R/summary.txt"
  cp "$R/kernels/v4_decode.md" "$R/kernels/v4_decode.json" "$OUT/"
else
  tail -n 20 "$R/kernels.log" | tee -a "$R/summary.txt"
fi

for run in "bf16 1 1" "bf16 64 1" "bf16 1 0" "bf16 64 0"; do
  # shellcheck disable=SC2086
  e2e $run
done

python3 - "$R/e2e" > "$R/e2e_table.txt" 2>&1 <<'PY' || true
import json, pathlib, sys
runs = {}
for p in sorted(pathlib.Path(sys.argv[1]).glob("e2e_*.json")):
    fmt, b, sw = p.stem.split("_")[1:]  # e2e_FMT_bB_v4decodeS
    runs[(fmt, int(b[1:]), sw[-1])] = json.loads(p.read_text())["output_tokens_per_s"]
rows = []
print("| format | batch | out tok/s new | out tok/s before (DEEPINFER_CUDA_V4_DECODE=0) | new / before |")
print("| --- | --- | --- | --- | --- |")
for fmt in ("fp8", "bf16"):
    for b in (1, 64):
        new, old = runs.get((fmt, b, "1")), runs.get((fmt, b, "0"))
        ratio = f"{new / old:.2f}x" if new and old else "-"
        cell = [f"{v:.1f}" if v else "-" for v in (new, old)]
        print(f"| {fmt} | {b} | {cell[0]} | {cell[1]} | {ratio} |")
        rows.append({"format": fmt, "batch": b, "new_out_tok_s": new, "before_out_tok_s": old})
for b in (1, 64):
    f8, bf = runs.get(("fp8", b, "1")), runs.get(("bf16", b, "1"))
    if f8 and bf:
        print(f"batch {b}: FP8 + MXFP4 / bf16 = {f8 / bf:.2f}x")
(pathlib.Path(sys.argv[1]).parent / "e2e.json").write_text(json.dumps(rows, indent=1))
PY
cat "$R/e2e_table.txt" >> "$R/summary.txt"
cp "$R/e2e.json" "$OUT/" 2>/dev/null || true

say "total $SECONDS s"
cp "$R/summary.txt" "$OUT/summary.txt"
tar -C "$R" -czf "$OUT/logs.tgz" . 2>/dev/null
echo "================ summary ================"
cat "$R/summary.txt"
