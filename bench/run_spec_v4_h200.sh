#!/usr/bin/env bash
# One run on the device, each part under its own time limit and its log written straight into $OUT:
# speculative decoding against plain decoding on model/tiny (bench/bench_spec.py, profiled at
# batch 1), the decode throughput of a reduced-depth DeepSeek-V4-Flash of random bf16 weights at
# batch 1 and 64 (`deepinfer bench`), and the batch-invariant linear's tile candidates
# (bench/bench_invariant_tiles.py). The JSON results are packed into results.tgz at the end.
# Limits in seconds: SPEC_TIMEOUT (280; bench_spec's own --time-budget is 60 s less),
# V4_TIMEOUT (110 per batch), TILES_TIMEOUT (150). Extra bench_spec arguments: SPEC_ARGS.
#   usage: OUT=dir bash bench/run_spec_v4_h200.sh
set -u -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT}
mkdir -p "$OUT/spec" "$OUT/v4" "$OUT/tiles"
python3 -m pip install -q --no-deps --no-build-isolation -e . -e backends/cuda > /tmp/install.log 2>&1
echo "install rc=$?"

t0=$SECONDS
spec_timeout=${SPEC_TIMEOUT:-280}
# shellcheck disable=SC2086
timeout "$spec_timeout" python3 bench/bench_spec.py --model "${MODEL:-model/tiny}" --out "$OUT/spec" \
  --time-budget $((spec_timeout - 60)) ${SPEC_ARGS:-} > "$OUT/spec.log" 2>&1
echo "bench_spec rc=$? in $((SECONDS - t0)) s"
grep -E '^\{|plain B=' "$OUT/spec.log" | cut -c1-240

for b in 1 64; do
  t0=$SECONDS
  timeout "${V4_TIMEOUT:-110}" deepinfer bench --random-config deepseek-v4-flash --num-hidden-layers 4 \
    --backend cuda --dtype bfloat16 --num-prompts "$b" --input-len 128 --output-len 64 --max-model-len 512 \
    --output-json "$OUT/v4/v4_b$b.json" >> "$OUT/v4.log" 2>&1
  echo "V4-Flash batch $b rc=$? in $((SECONDS - t0)) s"
  grep -E "KV cache|Throughput|Error" "$OUT/v4.log" | cut -c1-220 | tail -n 5
done

t0=$SECONDS
timeout "${TILES_TIMEOUT:-150}" python3 bench/bench_invariant_tiles.py --out "$OUT/tiles" > "$OUT/tiles.log" 2>&1
echo "invariant tiles rc=$? in $((SECONDS - t0)) s"
cat "$OUT/tiles.log" | cut -c1-200 | tail -n 40

tar -C "$OUT" -czf "$OUT/results.tgz" spec v4 tiles && rm -rf "$OUT/spec" "$OUT/v4" "$OUT/tiles"
