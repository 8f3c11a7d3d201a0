#!/usr/bin/env bash
# One device call (about 7 minutes) for DeepSeek-V4-Flash's decode step on one H200 after its
# index work moved into one launch per compression ratio (kv_cache.compressed_entries), its rope
# tails into small.rope_tail, the compressor's bias and mask into small.compressor_pool and small
# decode grids of the compressed attention into finer splits:
#   1. tests on the GPU: the conformance cases of those ops, V4's tiny models and compressed
#      attention, the kernel tests of its splits (tests/test_cuda_kernels.py);
#   2. bench/bench_v4_attention.py: the compressed attention's tilings at batch 1 / 8 / 64;
#   3. bench/bench_e2e_v4.py at 4 layers, 128 in / 64 out, batch 1 / 8 / 64, then each format's
#      decode steps under torch.profiler at batch 1 and 64 (kernels per step, idle share, the
#      top kernels and gaps); then bf16 at batch 1 and 8 with DEEPINFER_CUDA_V4_STEP=0 and
#      DEEPINFER_MODEL_UNFUSED=compressor (the step before, side by side; also against
#      bench/results/2026-12-03_H200_v4_step_profile/after).
# Each part under `timeout`; summary.txt, v4_attention.md, e2e_v4.md / .json, traces in $OUT.
#   usage: OUT=dir bash bench/run_v4_step_h200.sh
. "$(dirname "$0")/h200_lib.sh"
workdir "$SCRATCH/v4_step"
mkdir -p "$R/e2e" "$R/attn"
pip_install > "$R/install.log" 2>&1
say "install rc=$? ($(torch_versions))"

part tests "${TEST_TIMEOUT:-80}" python3 -m pytest -q -rfE --tb=long -p no:cacheprovider \
  -p deepinfer.testing.plugin --deepinfer-backend cuda --deepinfer-dtypes bfloat16 \
  --pyargs deepinfer.testing.conformance.test_v4_ops tests/test_cuda_kernels.py \
  -k "rope_tail or compressed_entries or compressor_pool or gated_pool or tiny_v4 or compressed_attention"
grep -E "passed|failed|Error|FAILED" "$R/tests.log" | tail -n 12 | tee -a "$R/summary.txt"

part attention "${ATTN_TIMEOUT:-80}" python3 bench/bench_v4_attention.py --out "$R/attn"
[ -f "$R/attn/v4_attention.md" ] && cat "$R/attn/v4_attention.md" >> "$R/summary.txt" && cp "$R/attn/v4_attention.md" "$OUT/"

part e2e "${E2E_TIMEOUT:-230}" python3 bench/bench_e2e_v4.py --out "$R/e2e" --skip-transformers \
  --batches 1,8,64 --time-budget 150 --profile-batches 1,64
grep -E "tok/s|GPU idle|exposed|idle .* us/step" "$R/e2e.log" | cut -c1-160 | tee -a "$R/summary.txt"
cp "$R/e2e/e2e_v4.md" "$R/e2e/e2e_v4.json" "$R"/e2e/trace_*.json.gz "$OUT/" 2>/dev/null

# the same step before (bf16, batch 1 and 8): the torch compositions, two compressor GEMMs
mkdir -p "$R/e2e_old" "$OUT/old"
DEEPINFER_CUDA_V4_STEP=0 DEEPINFER_MODEL_UNFUSED=compressor part e2e_old "${OLD_TIMEOUT:-100}" \
  python3 bench/bench_e2e_v4.py --out "$R/e2e_old" --skip-transformers --formats bf16 --batches 1,8 \
  --time-budget 40 --profile-batches 1
say "before (DEEPINFER_CUDA_V4_STEP=0 DEEPINFER_MODEL_UNFUSED=compressor):"
grep -E "tok/s|GPU idle|idle .* us/step" "$R/e2e_old.log" | cut -c1-160 | tee -a "$R/summary.txt"
cp "$R/e2e_old/e2e_v4.md" "$R/e2e_old/e2e_v4.json" "$OUT/old/" 2>/dev/null

finish --exclude='*.json.gz'
echo "================ summary ================"
cat "$R/summary.txt"
