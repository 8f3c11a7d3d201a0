#!/usr/bin/env bash
# DeepSeek-V4.1's ops on the cuda backend, one H200, one device call under 5 minutes (every part
# under `timeout`, each limit cut to what is left of TOTAL_S):
#   1. tests: the cuda conformance cases and kernel tests of every V4.1 op in one pytest run
#      (-n 16, bfloat16 and float32): the quantised KV rows (write_kv_rows with the fused
#      quantise + store of kernels/kv_v41.py, read_kv_rows), quantized_attention, the FP4 indexer
#      (MXFP4 keys and queries: quantized_indexer_topk, indexer_candidate_blocks,
#      indexer_topk_in_blocks), V4's indexer / compressed attention / gated pool that V4.1's bf16
#      caches and C2 layers run, Engram (lookup over float and FP8 rows, gate) and the (shifted)
#      hyper-connections (hc_pre / hc_post / hc_mixes / hc_collapse);
#   2. parity: tests/test_parity_v41_kv.py's cuda mode (the whole model on the cuda backend in
#      the published formats against the float64 rounding oracle's greedy tokens);
#   3. bench: bench/bench_v41_kv.py as bench/run_v41_h200.sh runs it: V4.1-Flash at V41_LAYERS
#      (6) layers in its published format (FP8 32x32 linears, MXFP4 experts, random weights,
#      Engram dropped), kv_cache_dtype auto, decode tok/s at batch 1 and 64 (128 in, 64 out), KV
#      bytes per token against the published row sizes, fraction of the roofline.
# Prints and writes $OUT/summary.txt (each part's rc and time, pass counts, the bench lines);
# logs in $OUT/logs.tgz, the bench's JSON as $OUT/v41_kv_auto.json.
#   usage: OUT=dir bash bench/run_v41q_h200.sh
#   knobs: TOTAL_S (290), TEST_TIMEOUT (150), PARITY_TIMEOUT (90), BENCH_TIMEOUT (170), V41_LAYERS
. "$(dirname "$0")/h200_lib.sh"
PART_TOTAL=${TOTAL_S:-290}
workdir "$SCRATCH/v41q"
pip_install 60 > "$R/install.log" 2>&1
say "install rc=$? ($(torch_versions))"

# 1. the V4.1 ops' conformance cases and kernel tests
K="kv_rows or quantized or candidate or in_blocks or indexer or compressed_attention or gated_pool"
K="$K or engram or hc_ or v41_row_stores or index_queries"
part tests "${TEST_TIMEOUT:-150}" python3 -m pytest -q -rfE --tb=line -p no:cacheprovider -n 16 \
  -p deepinfer.testing.plugin --deepinfer-backend cuda --deepinfer-dtypes bfloat16,float32 \
  --pyargs deepinfer.testing.conformance.test_v41_kv_ops deepinfer.testing.conformance.test_v4_ops \
  deepinfer.testing.conformance.test_engram tests/test_cuda_kernels.py -k "$K"
grep -E "passed|failed|GREEN|RED|FAILED|error" "$R/tests.log" | tail -n 12 | cut -c1-240 | tee -a "$R/summary.txt"

# 2. the whole model on cuda in the published formats against the rounding oracle
part parity "${PARITY_TIMEOUT:-90}" python3 -m pytest -q -rfE --tb=short -p no:cacheprovider \
  tests/test_parity_v41_kv.py -k cuda_backend
grep -E "passed|failed|skipped|FAILED|Error" "$R/parity.log" | tail -n 6 | cut -c1-240 | tee -a "$R/summary.txt"

# 3. V4.1-Flash, 6 layers, published formats (bench/run_v41_h200.sh's auto part)
part bench_auto "${BENCH_TIMEOUT:-170}" python3 bench/bench_v41_kv.py --out "$R/auto" \
  --layers "${V41_LAYERS:-6}" --batches 1,64 --input-len 128 --output-len 64 --kv-cache-dtype auto
grep -vE "^INFO|^WARNING" "$R/bench_auto.log" | grep -E "built|KV|B/token|batch|copy|Error|error" \
  | cut -c1-200 | tail -n 16 | tee -a "$R/summary.txt"
cp "$R/auto/v41_kv.json" "$OUT/v41_kv_auto.json" 2>/dev/null

finish
cat "$R/summary.txt"
