#!/usr/bin/env bash
# One device call (about 6 minutes) for where DeepSeek-V4-Flash's decode step spends its time on
# one H200, in both formats (bf16; FP8 UE8M0-block linears + MXFP4 experts):
#   1. tests on the GPU: the cuda conformance cases and kernel tests of V4's ops (mHC, the
#      compressor's pooling, the MXFP4 and FP8 paths) and the published-format parity tests
#      (tests/test_parity_v4_quant.py), full tracebacks;
#   2. bench/bench_e2e_v4.py at 4 layers, 128 in / 64 out, batch 1 / 8 / 64 against each format's
#      roofline, then --profile-batches 1,64: each format's decode steps under torch.profiler
#      (kernels per step, the top kernels by exposed time, the idle gaps, traces kept);
#   3. bench/bench_v4_decode.py --only moe (and, with FP8=1, --only fp8): the MXFP4 expert
#      kernels (the FP8 skinny kernels, CUDA-core and tensor-core variants) against the copy
#      rate, tile sweeps.
# Each part under `timeout`; logs in $OUT/logs.tgz; summary.txt, e2e_v4.md / .json, traces.
#   usage: OUT=dir bash bench/run_v4_profile_h200.sh
. "$(dirname "$0")/h200_lib.sh"
workdir "$SCRATCH/v4_profile"
mkdir -p "$R/e2e"
pip_install > "$R/install.log" 2>&1
say "install rc=$? ($(torch_versions))"

part tests "${TEST_TIMEOUT:-150}" python3 -m pytest -q -rfE --tb=long -p no:cacheprovider -n 16 \
  -p deepinfer.testing.plugin --deepinfer-backend cuda --deepinfer-dtypes bfloat16 \
  --pyargs deepinfer.testing.conformance tests/test_cuda_kernels.py tests/test_parity_v4_quant.py \
  -k "hc_ or gated_pool or fp4 or mxfp4 or decode_moe or experts or linear_fp8 or skinny or parity_v4_quant"
grep -E "passed|failed|Error|FAILED" "$R/tests.log" | tail -n 12 | tee -a "$R/summary.txt"

part e2e "${E2E_TIMEOUT:-260}" python3 bench/bench_e2e_v4.py --out "$R/e2e" --skip-transformers \
  --batches 1,8,64 --time-budget 220 --profile-batches 1,64
grep -E "tok/s|GPU idle|exposed|idle .* us/step" "$R/e2e.log" | cut -c1-160 | tee -a "$R/summary.txt"
cp "$R/e2e/e2e_v4.md" "$R/e2e/e2e_v4.json" "$R"/e2e/trace_*.json.gz "$OUT/" 2>/dev/null

[ "${FP8:-0}" = 1 ] && part kernels_fp8 "${KERNEL_TIMEOUT:-90}" python3 bench/bench_v4_decode.py --out "$R/k_fp8" --only fp8
part kernels_moe "${KERNEL_TIMEOUT:-90}" python3 bench/bench_v4_decode.py --out "$R/k_moe" --only moe
for k in k_fp8 k_moe; do
  [ -f "$R/$k/v4_decode.md" ] && cat "$R/$k/v4_decode.md" >> "$R/summary.txt" && cp "$R/$k/v4_decode.md" "$OUT/$k.md"
done

finish --exclude='*.json.gz'
echo "================ summary ================"
cat "$R/summary.txt"
