#!/usr/bin/env bash
# The device checks of the cuda paths written without a GPU (every one is interpreter-checked and
# lowered for SM90 in CI, none yet run on silicon), in two device calls of under 10 minutes each,
# one after the other while the machine is warm:
#   OUT=dir bash ci/gpu_pending.sh 1   # conformance of the new ops, DFlash trained on the GPU and
#                                      # bench_spec with it, the MXFP4 decode variants, the FP8 cache
#   OUT=dir bash ci/gpu_pending.sh 2   # V4-Flash end to end, new step against the old (same run),
#                                      # the compressed-attention tilings, the Engram prefetch
# What each part answers:
#   conf    the cuda conformance cases and kernel tests of V4's step ops (compressed_entries,
#           rope_tail, compressor_pool), V4.1's FP4 index queries and fused row stores, the Engram
#           prefetch, the FP8 cache's float16 read and the MXFP4 decode variants; exactness on the
#           GPU decides which variants may become defaults
#   dtrain  train/train_dflash.py on the GPU (about 100 s); its drafter replaces model/tiny/dflash
#           for the next part only if its held-out mean accepted length beats the shipped 1.70
#   spec    bench/bench_spec.py, DFlash k = 5 scheduled and not, the block drafter and MTP, plain
#           decoding timed beside each (issue 36's rows; the measured policy's drafted-step share)
#   fp4     bench/bench_v4_decode.py --fp4-variants: PAIR / GROUP / MMA / ASM / SCALED at 1, 8,
#           64 tokens against the copy rate (DEEPINFER_CUDA_FP4_DECODE)
#   fp8     bench/bench_cuda.py --only decode_fp8: the bf16 cache, the FP8 cache's default read and
#           its float16 read (DEEPINFER_CUDA_FP8_HALF_READ) side by side
#   e2e     bench/bench_e2e_v4.py, 4 layers: the tree as built, then DEEPINFER_CUDA_V4_STEP=0 with
#           DEEPINFER_MODEL_UNFUSED=compressor (the step before its launch fusions) and
#           DEEPINFER_CUDA_FP4_DECODE=SCALED, each at batch 1 and 64 with a profile at batch 1
#   attn    bench/bench_v4_attention.py: V4's compressed attention tilings (DEEPINFER_CUDA_V4_SMALL_GRID)
#   engram  bench/bench_engram_prefetch.py: a captured step with the Engram rows fetched inline and
#           prefetched on a side stream (DEEPINFER_ENGRAM_PREFETCH), outputs compared bit for bit
# The device returns at most 8 files: the logs go to one tarball, $OUT/results.tgz, beside
# summary.txt (ci/gpu_wave.sh's summary).
. "$(dirname "$0")/../bench/h200_lib.sh"
RESULT=$(realpath -m "$OUT")
W=$SCRATCH/pending
mkdir -p "$RESULT" "$W"
E2E="python3 bench/bench_e2e_v4.py --skip-transformers --batches 1,64 --profile-batches 1"
K="v41 or engram or rope_tail or compressed_entries or compressor_pool or gated_pool or tiny_v4"
K="$K or compressed_attention or candidate or in_blocks or quantized or kv_rows or index_queries"
K="$K or row_store or fp8_kv or fp8_float16 or fp8_rows or fp8_decode or fp4 or decode_moe"
case "${1:?part 1 or 2}" in
  1)
    OUT=$W bash ci/gpu_wave.sh \
      "conf|100|python3 -m pytest -q -rfE --tb=line -p no:cacheprovider -n 16 -p deepinfer.testing.plugin \
--deepinfer-backend cuda --deepinfer-dtypes bfloat16 --pyargs deepinfer.testing.conformance \
tests/test_cuda_kernels.py tests/test_cuda_gpu_kernels.py -k '$K'" \
      "dtrain|130|S=\$(date +%s); python3 train/train_dflash.py --model model/tiny --out \$OUT --device cuda \
--minutes 5 --until \$((S + 100))" \
      "spec|125|python3 ci/gpu_pending_adopt.py \$OUT/../dtrain/dflash model/tiny/dflash 1.70; \
python3 bench/bench_spec.py --model model/tiny --backend cuda --repeats 2 --min-seconds 0.5 --new-tokens 128 \
--prompt-len 64 --batches 1 32 128 --scheduling both --time-budget 105 --out \$OUT --dflash-k 5 --block-k --mtp-k" \
      "fp4|80|python3 bench/bench_v4_decode.py --only moe --fp4-variants --out \$OUT" \
      "fp8|85|OUT=\$OUT PARTS=bench BENCH_TIMEOUT=78 bash bench/run_fp8kv_h200.sh"
    ;;
  2)
    OUT=$W bash ci/gpu_wave.sh \
      "e2e|200|$E2E --out \$OUT/new --time-budget 60 && DEEPINFER_CUDA_V4_STEP=0 \
DEEPINFER_MODEL_UNFUSED=compressor $E2E --out \$OUT/old --time-budget 60 && \
DEEPINFER_CUDA_FP4_DECODE=SCALED $E2E --formats fp8_fp4 --out \$OUT/scaled --time-budget 40" \
      "attn|70|python3 bench/bench_v4_attention.py --out \$OUT" \
      "engram|25|python3 bench/bench_engram_prefetch.py --tokens 1,64 --rows 200003"
    ;;
  *)
    echo "usage: OUT=dir bash ci/gpu_pending.sh 1|2" >&2
    exit 2
    ;;
esac
cp "$W/summary.txt" "$RESULT/summary.txt"
tar -C "$W" -czf "$RESULT/results.tgz" --exclude='*.json.gz' .
