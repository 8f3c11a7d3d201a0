#!/usr/bin/env bash
# DeepSeek-V4.1's KV formats on one H200, one device call (under 5 minutes), each part under `timeout`:
#   1. the GPU conformance of the quantised KV ops (write_kv_rows, quantized_attention,
#      quantized_indexer_topk: the Triton kernels over FP8 / FP4 / MXFP4 rows) in bfloat16;
#   2. bench/bench_v41_kv.py: V4.1-Flash in its published format (FP8 32x32 linears, MXFP4 experts,
#      random weights) at V41_LAYERS layers (default 6), Engram dropped, KV in kv_cache_dtype auto
#      (FP8 window rings, FP4 main entries and index keys): decode tok/s at batch 1 and 64 (128 in,
#      64 out), KV bytes per token of each cache kind against the published row sizes, and the
#      fraction of the roofline (bytes a decode step moves / the copy rate measured in the run);
#   3. (PARTS with bf16, not the default: a second device call) the same at kv_cache_dtype bf16
#      (unquantised caches), for the comparison.
#   Limits: install ~20 s, tests 60 s, auto 170 s: under 5 minutes in all.
#   usage: OUT=dir bash bench/run_v41_h200.sh        (PARTS="tests auto", the default; PARTS=bf16)
. "$(dirname "$0")/h200_lib.sh"
PARTS=" ${PARTS:-tests auto} "
want() { [[ $PARTS == *" $1 "* ]]; }
workdir "$SCRATCH/v41_kv"
pip_install > "$R/install.log" 2>&1
say "install rc=$?"

want tests && part tests "${TEST_TIMEOUT:-60}" python3 -m pytest -q -rfE --tb=short -p no:cacheprovider \
  -p deepinfer.testing.plugin --deepinfer-backend cuda --deepinfer-dtypes bfloat16 \
  deepinfer/testing/conformance/test_v41_kv_ops.py
grep -E "passed|failed|FAILED" "$R/tests.log" | tail -n 6 | tee -a "$R/summary.txt"

for fmt in auto bf16; do
  want "$fmt" || continue
  part "bench_$fmt" "${BENCH_TIMEOUT:-170}" python3 bench/bench_v41_kv.py --out "$R/$fmt" \
    --layers "${V41_LAYERS:-6}" --batches 1,64 --input-len 128 --output-len 64 --kv-cache-dtype "$fmt"
  grep -vE "^INFO|^WARNING" "$R/bench_$fmt.log" | grep -E "built|KV|B/token|batch|copy|Error|error" \
    | cut -c1-200 | tail -n 16 | tee -a "$R/summary.txt"
  cp "$R/$fmt/v41_kv.json" "$OUT/v41_kv_$fmt.json" 2>/dev/null
done

finish
cat "$R/summary.txt"
