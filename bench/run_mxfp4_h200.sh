#!/usr/bin/env bash
# One device call (under 10 minutes) for the MXFP4 grouped GEMM on Triton's microscaled product,
# on one H200, each part under `timeout`:
#   1. the GPU tests of the MXFP4 and MoE kernels (tests/test_cuda_kernels.py and tests/test_cuda_gpu_kernels.py -k "fp4 or moe") and
#      the conformance suite's MoE and GEMM cases on cuda, bf16;
#   2. bench/bench_v4_decode.py --only prefill: the grouped GEMM over 64 to 4096 tokens' copies
#      (dispatch, nibble pairs, tile sweeps);
#   3. bench/bench_e2e_v4.py, V4-Flash at 4 layers: both formats as built (the nibble-pair kernel),
#      then fp8_fp4 with DEEPINFER_CUDA_MX_FP4=0 (nibble pairs only), batch 1 / 8 / 64, its step profiled at 64;
#   4. bench/bench_v4_decode.py --only moe: the expert layer at 1 to 256 tokens.
#   usage: OUT=dir bash bench/run_mxfp4_h200.sh    (PARTS="tests kernels e2e", the default, picks)
. "$(dirname "$0")/h200_lib.sh"
PARTS=" ${PARTS:-tests kernels e2e} "
want() { [[ $PARTS == *" $1 "* ]]; }
workdir "$SCRATCH/mxfp4"
mkdir -p "$R/kernels" "$R/e2e" "$R/e2e_mx"
pip_install > "$R/install.log" 2>&1
say "install rc=$?"

want tests && part tests "${TEST_TIMEOUT:-90}" python3 -m pytest -q -rfE --tb=short -p no:cacheprovider -n 8 \
  -p deepinfer.testing.plugin --deepinfer-backend cuda --deepinfer-dtypes bfloat16 \
  --pyargs deepinfer.testing.conformance tests/test_cuda_kernels.py tests/test_cuda_gpu_kernels.py -k "fp4 or moe or grouped"
grep -E "passed|failed|FAILED|Error" "$R/tests.log" | tail -n 8 | tee -a "$R/summary.txt"

want kernels && part prefill "${PREFILL_TIMEOUT:-90}" python3 bench/bench_v4_decode.py --only prefill --out "$R/kernels/prefill"
grep -E "default|: mx|old|failed" "$R/prefill.log" | cut -c1-150 | tee -a "$R/summary.txt"
grep -E "mx " "$R/prefill.log" | cut -c1-150 >> "$R/summary.txt"

if want e2e; then
  part e2e "${E2E_TIMEOUT:-150}" python3 bench/bench_e2e_v4.py --out "$R/e2e" --skip-transformers \
    --batches 1,8,64 --time-budget 100
  grep -E "tok/s" "$R/e2e.log" | cut -c1-170 | tee -a "$R/summary.txt"
  DEEPINFER_CUDA_MX_FP4=0 part e2e_mx "${E2E_MX_TIMEOUT:-110}" python3 bench/bench_e2e_v4.py \
    --out "$R/e2e_mx" --skip-transformers --formats fp8_fp4 --batches 1,8,64 --time-budget 60 --profile-batches 64
  grep -E "tok/s|GPU idle" "$R/e2e_mx.log" | cut -c1-170 | tee -a "$R/summary.txt"
fi

want kernels && part moe "${MOE_TIMEOUT:-120}" python3 bench/bench_v4_decode.py --only moe --out "$R/kernels/moe"
grep -E "moe T=[0-9]+ (new|grouped|grouped mx|old|bf16):|failed" "$R/moe.log" | cut -c1-150 | tee -a "$R/summary.txt"

finish
cat "$R/summary.txt"
