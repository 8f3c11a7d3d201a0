#!/usr/bin/env bash
# The vision tower on one H200, each part under `timeout` (about 3 minutes in all):
#   1. tests: the varlen attention kernel and the tower on the cuda backend against the float64
#      oracle (tests/test_cuda_kernels.py -k "varlen or vision_tower"), the conformance suite's
#      vision cases on cuda (bf16, fp32); none of them needs Pillow;
#   2. bench: bench/bench_vision.py, the full-size tower (width 1024, depth 32, 16 heads) with
#      random bf16 weights, images/s at 1, 8 and 32 images of 1024x1024 against the bf16 matmul
#      rate measured in the same run.
#   usage: OUT=dir bash bench/run_vision_h200.sh    (PARTS="tests bench", the default, picks)
. "$(dirname "$0")/h200_lib.sh"
PARTS=" ${PARTS:-tests bench} "
want() { [[ $PARTS == *" $1 "* ]]; }
workdir "$SCRATCH/vision"
mkdir -p "$R/bench"
pip_install > "$R/install.log" 2>&1
say "install rc=$?"

want tests && part tests "${TEST_TIMEOUT:-60}" python3 -m pytest -q -rfE --tb=short -p no:cacheprovider \
  -p deepinfer.testing.plugin --deepinfer-backend cuda --deepinfer-dtypes bfloat16,float32 \
  --pyargs deepinfer.testing.conformance.test_vision_ops tests/test_cuda_kernels.py -k "varlen or vision_tower"
grep -E "passed|failed|FAILED|Error" "$R/tests.log" | tail -n 8 | tee -a "$R/summary.txt"

want bench && part bench "${BENCH_TIMEOUT:-150}" python3 bench/bench_vision.py --out "$R/bench" --batches 1,8,32
grep -E "vision tower|matmul|images:|Error" "$R/bench.log" | cut -c1-170 | tee -a "$R/summary.txt"

cp "$R/bench/vision.json" "$OUT/" 2>/dev/null
finish
cat "$R/summary.txt"
