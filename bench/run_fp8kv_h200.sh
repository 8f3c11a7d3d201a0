#!/usr/bin/env bash
# One device call (under 8 minutes) for the FP8 latent cache (kv_cache_dtype="fp8") on one H200,
# each part under `timeout`:
#   1. tests (parts "kernels" and "conformance"): the FP8-cache kernel tests (tests/test_cuda_kernels.py
#      -k fp8_...: the quantising store, decode / prefill over FP8 rows in several splits, the float16
#      read across magnitudes, the backend path), and the conformance
#      suite's FP8-cache cases on cuda, heavy ones included
#      (deepinfer/testing/conformance/test_fp8_kv_cache.py), every dtype; part "conformance_half":
#      the same cases with the float16 read (DEEPINFER_CUDA_FP8_HALF_READ=1);
#   2. bench: bench/bench_cuda.py --only decode_fp8: decode over the FP8 cache against the bf16
#      cache it was quantised from, 16 and 128 heads (batch x keys: 1 x 32768, 8 x 4096,
#      128 x 32768; 32 x 4096, 128 x 32768), GB/s against the copy rate measured in the same run,
#      every row's error over its first requests (the defaults' and the float16 read's), and the
#      variants of bench_cuda.fp8_variants: the float16 read (attention.FP8_HALF_READ) with TMA, with
#      4 programs an SM, each read at the tiles of FP8_WIDE_SWEEP (128 heads) / FP8_NARROW_SWEEP
#      (16 heads) (SWEEP=0: the defaults and the float16 read only).
#   usage: OUT=dir bash bench/run_fp8kv_h200.sh    (PARTS="tests bench", the default, picks;
#          "tests" is "kernels conformance")
. "$(dirname "$0")/h200_lib.sh"
PARTS=" ${PARTS:-tests bench} "
PARTS=${PARTS/ tests / kernels conformance }
want() { [[ $PARTS == *" $1 "* ]]; }
workdir "$(mktemp -d "$SCRATCH/fp8kv.XXXXXX")"
mkdir -p "$R/bench"
pip_install 90 > "$R/install.log" 2>&1
say "install rc=$?"

if want kernels; then
  part kernels "${KERNEL_TIMEOUT:-150}" python3 -m pytest -q -rfE --tb=short -p no:cacheprovider \
    tests/test_cuda_kernels.py -k "fp8_rows or fp8_decode or fp8_prefill or fp8_cache or fp8_store or fp8_float16"
  grep -E "passed|failed|FAILED|Error" "$R/kernels.log" | tail -n 8 | tee -a "$R/summary.txt"
fi
conformance() {  # conformance NAME [VAR=VALUE...]: the FP8-cache cases, heavy ones included
  local name=$1; shift
  part "$name" "${CONF_TIMEOUT:-150}" env "$@" python3 -m pytest -q -rfE --tb=short -p no:cacheprovider \
    -n 8 -p deepinfer.testing.plugin --deepinfer-backend cuda --deepinfer-heavy \
    deepinfer/testing/conformance/test_fp8_kv_cache.py
  grep -E "passed|failed|FAILED|Error|GREEN" "$R/$name.log" | tail -n 12 | tee -a "$R/summary.txt"
}
if want conformance; then
  conformance conformance
fi

if want bench; then
  sweep=(); [[ ${SWEEP:-1} == 0 ]] && sweep=(--no-fp8-sweep)
  part bench "${BENCH_TIMEOUT:-120}" python3 bench/bench_cuda.py --only decode_fp8 ${sweep[@]+"${sweep[@]}"} --out "$R/bench"
  grep -E "^copy|decode fp8|FAILED" "$R/bench.log" | tee -a "$R/summary.txt"
fi
if want conformance_half; then
  conformance conformance_half DEEPINFER_CUDA_FP8_HALF_READ=1
fi

cp "$R/bench/bench_cuda.md" "$R/bench/bench_cuda.json" "$OUT/" 2>/dev/null
finish
cat "$R/summary.txt"
