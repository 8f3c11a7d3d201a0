#!/usr/bin/env bash
# One device call (about 8 minutes) for DeepSeek-V4-Flash in the format DeepSeek publishes (FP8
# linears with UE8M0 128x128 block scales, MXFP4 routed experts) on one H200:
#   1. tests: the cuda conformance cases of the GEMMs, the MoE and V4's ops, the kernel tests of
#      the new paths (tests/test_cuda_kernels.py) and the published-format parity tests
#      (tests/test_parity_v4_quant.py), in one pytest run;
#   2. end to end: bench/bench_e2e_v4.py (V4-Flash at 4 layers, random weights, 128 in / 64 out,
#      bf16 and FP8 + MXFP4 at batch 1 / 8 / 64 against each format's roofline measured in the same
#      run), then the FP8 + MXFP4 rows at batch 1 / 64 with DEEPINFER_CUDA_V4_DECODE=0 (the paths
#      before);
#   3. kernels: bench/bench_v4_decode.py (CUDA-graph replays, GB/s against the copy rate of this
#      run, V4-Flash shapes, 1 / 8 / 64 rows or tokens, the paths replaced, tile sweeps), within
#      the time left of TOTAL.
# Each part under `timeout`; logs in $OUT/logs.tgz; summary.txt, e2e_v4.md / .json, v4_decode.md / .json.
#   usage: OUT=dir bash bench/run_v4_h200.sh
#   knobs: TOTAL (s, default 480), TEST_TIMEOUT (150), E2E_TIMEOUT (200), E2E_BEFORE_TIMEOUT (90),
#          KERNEL_TIMEOUT (120)
. "$(dirname "$0")/h200_lib.sh"
TOTAL=${TOTAL:-480}
workdir "$SCRATCH/v4_results"
mkdir -p "$R/e2e"
pip_install > "$R/install.log" 2>&1
say "install rc=$? ($(torch_versions))"

# 1. tests on the GPU
part tests "${TEST_TIMEOUT:-150}" python3 -m pytest -q -rfE --tb=line -p no:cacheprovider -n 16 \
  -p deepinfer.testing.plugin --deepinfer-backend cuda --deepinfer-dtypes bfloat16 \
  --pyargs deepinfer.testing.conformance tests/test_cuda_kernels.py tests/test_parity_v4_quant.py \
  -k "linear_fp8 or fp8_gemm or grouped_gemm_fp8 or fp4 or fused_moe or experts or clamped or batched_linear or skinny or decode_moe or mxfp4 or parity_v4_quant"
grep -E "passed|failed|GREEN|RED|FAILED" "$R/tests.log" | tail -n 12 | tee -a "$R/summary.txt"

# 2. end to end (bench/bench_e2e_v4.py: bf16 and FP8 + MXFP4 against each format's roofline),
#    then the FP8 + MXFP4 rows with DEEPINFER_CUDA_V4_DECODE=0 (the paths before)
part e2e "${E2E_TIMEOUT:-200}" python3 bench/bench_e2e_v4.py --out "$R/e2e" --skip-transformers \
  --batches 1,8,64 --time-budget 150
grep -E "tok/s" "$R/e2e.log" | cut -c1-150 | tee -a "$R/summary.txt"
DEEPINFER_CUDA_V4_DECODE=0 part e2e_before "${E2E_BEFORE_TIMEOUT:-90}" python3 bench/bench_e2e_v4.py \
  --out "$R/e2e_before" --formats fp8_fp4 --skip-transformers --batches 1,64 --time-budget 60
grep -E "tok/s" "$R/e2e_before.log" | cut -c1-150 | tee -a "$R/summary.txt"
cp "$R/e2e/e2e_v4.md" "$R/e2e/e2e_v4.json" "$OUT/" 2>/dev/null

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

finish
echo "================ summary ================"
cat "$R/summary.txt"
