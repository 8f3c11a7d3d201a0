#!/usr/bin/env bash
# One run on the device, each part under its own time limit and its log written straight into $OUT.
# PARTS (default "step", which fits one device call of 300 s) picks among:
#   step   the MTP verified step against a plain step of a reduced-depth DeepSeek-V4-Flash of
#          random bf16 weights (4 layers + its MTP layer), both in graphs, batch 1 to 64, k = 1..3
#          (bench/bench_spec_step.py): the goal "with a head that always agrees, a k-draft verified
#          step costs at most 1.3x a plain step"; writes step/spec_step.{json,md} and prints the table
#   spec   speculative decoding against plain decoding on model/tiny (bench/bench_spec.py)
#   v4     the decode throughput of the same reduced V4-Flash at batch 1 and 64 (`deepinfer bench`)
#   tiles  the batch-invariant linear's tile candidates (bench/bench_invariant_tiles.py)
# Limits in seconds: STEP_TIMEOUT (250; bench_spec_step's own --time-budget is 70 s less: later k
# are skipped and listed), SPEC_TIMEOUT (280), V4_TIMEOUT (110 per batch), TILES_TIMEOUT (150).
# Extra arguments: STEP_ARGS (bench_spec_step), SPEC_ARGS (bench_spec). The JSON results are
# packed into results.tgz at the end.
#   usage: OUT=dir bash bench/run_spec_v4_h200.sh            (PARTS="step spec v4 tiles" for all)
. "$(dirname "$0")/h200_lib.sh"
PARTS=" ${PARTS:-step} "
mkdir -p "$OUT/step" "$OUT/spec" "$OUT/v4" "$OUT/tiles"
pip_install > "$SCRATCH/install.log" 2>&1
echo "install rc=$?"

if [[ $PARTS == *" step "* ]]; then
  t0=$SECONDS
  step_timeout=${STEP_TIMEOUT:-250}
  # shellcheck disable=SC2086
  timeout "$step_timeout" python3 bench/bench_spec_step.py --out "$OUT/step" --backend cuda \
    --random-config deepseek-v4-flash --num-hidden-layers 4 --dtype bfloat16 --repeats 2 \
    --time-budget $((step_timeout - 70)) ${STEP_ARGS:-} > "$OUT/step.log" 2>&1
  echo "bench_spec_step rc=$? in $((SECONDS - t0)) s"
  grep -E 'plain B=|built in|Error|error' "$OUT/step.log" | cut -c1-240
  cat "$OUT/step/spec_step.md" 2>/dev/null || tail -n 30 "$OUT/step.log"
fi

if [[ $PARTS == *" spec "* ]]; then
  t0=$SECONDS
  spec_timeout=${SPEC_TIMEOUT:-280}
  # shellcheck disable=SC2086
  timeout "$spec_timeout" python3 bench/bench_spec.py --model "${MODEL:-model/tiny}" --out "$OUT/spec" \
    --time-budget $((spec_timeout - 60)) ${SPEC_ARGS:-} > "$OUT/spec.log" 2>&1
  echo "bench_spec rc=$? in $((SECONDS - t0)) s"
  grep -E '^\{|plain B=' "$OUT/spec.log" | cut -c1-240
fi

if [[ $PARTS == *" v4 "* ]]; then
  for b in 1 64; do
    t0=$SECONDS
    timeout "${V4_TIMEOUT:-110}" deepinfer bench --random-config deepseek-v4-flash --num-hidden-layers 4 \
      --backend cuda --dtype bfloat16 --num-prompts "$b" --input-len 128 --output-len 64 --max-model-len 512 \
      --output-json "$OUT/v4/v4_b$b.json" >> "$OUT/v4.log" 2>&1
    echo "V4-Flash batch $b rc=$? in $((SECONDS - t0)) s"
    grep -E "KV cache|Throughput|Error" "$OUT/v4.log" | cut -c1-220 | tail -n 5
  done
fi

if [[ $PARTS == *" tiles "* ]]; then
  t0=$SECONDS
  timeout "${TILES_TIMEOUT:-150}" python3 bench/bench_invariant_tiles.py --out "$OUT/tiles" > "$OUT/tiles.log" 2>&1
  echo "invariant tiles rc=$? in $((SECONDS - t0)) s"
  cut -c1-200 "$OUT/tiles.log" | tail -n 40
fi

tar -C "$OUT" -czf "$OUT/results.tgz" step spec v4 tiles && rm -rf "$OUT/step" "$OUT/spec" "$OUT/v4" "$OUT/tiles"
