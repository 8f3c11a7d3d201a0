#!/usr/bin/env bash
# One run on the device on one H200, each part under its own limit, logs written into $OUT as they go:
#   1. in parallel: the whole cuda conformance suite (-n 14), and the engine and kernel tests on
#      real CUDA graphs (tests/test_async_graphs.py, tests/test_cuda_kernels.py, the V4 graph,
#      FP8/FP4 and MTP tests on the cuda backend);
#   2. the DeepSeek-V4 kernels against their torch compositions (bench/bench_cuda.py --only v4);
#   3. reduced-depth DeepSeek-V4-Flash (4 of 43 layers, random weights) at batch 1 and 64, bf16
#      and the published FP8 + MXFP4 format (`deepinfer bench`);
#   4. speculative decoding on model/tiny (bench/bench_spec.py: MTP through verification
#      graphs, the block drafter) against plain decoding, with SPEC_ARGS.
# The JSON results are packed into results.tgz.  usage: OUT=dir bash bench/run_final_h200.sh
. "$(dirname "$0")/h200_lib.sh"
mkdir -p "$OUT/v4" "$OUT/spec" "$OUT/kernels"
pip_install > "$SCRATCH/install.log" 2>&1
echo "install rc=$?"
start=$SECONDS

engine() {
  timeout "${ENGINE_TIMEOUT:-230}" env DEEPINFER_TEST_BACKEND=cuda python3 -m pytest -q -rfs -p no:cacheprovider \
    -n 2 tests/test_async_graphs.py tests/test_cuda_kernels.py tests/test_cuda_gpu_kernels.py tests/test_parity_v4.py tests/test_v4_spec.py \
    > "$OUT/engine_tests.log" 2>&1
  echo "engine tests rc=$? at $((SECONDS - start)) s"
  tail -n 4 "$OUT/engine_tests.log"
}
engine &
timeout "${CONF_TIMEOUT:-230}" python3 -m pytest -p deepinfer.testing.plugin --pyargs deepinfer.testing.conformance \
  --deepinfer-backend cuda --deepinfer-heavy -q -n 12 -rfEs --tb=line -p no:cacheprovider > "$OUT/conformance.log" 2>&1
echo "conformance rc=$? at $((SECONDS - start)) s"
grep -E "FAILED|ERROR|passed|failed|GREEN" "$OUT/conformance.log" | cut -c1-250 | tail -n 25
wait

t0=$SECONDS
timeout 60 python3 bench/bench_cuda.py --only v4 --out "$OUT/kernels" > "$OUT/kernels.log" 2>&1
echo "bench_cuda v4 rc=$? in $((SECONDS - t0)) s"
cut -c1-200 "$OUT/kernels.log" | tail -n 12

for quant in none fp8; do
  for b in 1 64; do
    t0=$SECONDS
    q=(); [ "$quant" = fp8 ] && q=(--quantization fp8)
    timeout "${V4_TIMEOUT:-70}" deepinfer bench --random-config deepseek-v4-flash --num-hidden-layers 4 "${q[@]}" \
      --backend cuda --dtype bfloat16 --num-prompts "$b" --input-len 128 --output-len 64 --max-model-len 512 \
      --output-json "$OUT/v4/v4_${quant}_b$b.json" > "$OUT/v4/v4_${quant}_b$b.log" 2>&1
    echo "V4-Flash $quant batch $b rc=$? in $((SECONDS - t0)) s"
    grep -E "KV cache|hroughput|Error|graph" "$OUT/v4/v4_${quant}_b$b.log" | cut -c1-200 | tail -n 4
  done
done

t0=$SECONDS
spec_timeout=${SPEC_TIMEOUT:-200}
# shellcheck disable=SC2086
timeout "$spec_timeout" python3 bench/bench_spec.py --model "${MODEL:-model/tiny}" --out "$OUT/spec" \
  --time-budget $((spec_timeout - 30)) ${SPEC_ARGS:-} > "$OUT/spec.log" 2>&1
echo "bench_spec rc=$? in $((SECONDS - t0)) s"
grep -E '^\{|plain B=|x plain|speed' "$OUT/spec.log" | cut -c1-240 | tail -n 30

tar -C "$OUT" -czf "$OUT/results.tgz" v4 spec kernels && rm -rf "$OUT/v4" "$OUT/spec" "$OUT/kernels"
