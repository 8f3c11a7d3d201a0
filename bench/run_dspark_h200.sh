#!/usr/bin/env bash
# The DFlash (DSpark) drafter on one H200: model/tiny with its shipped drafter (model/tiny/dflash/)
# against plain decoding, MTP and the old block drafter, batch 1, 8, 32, 128, 256, each without and
# with confidence scheduling (measured step times), plain decoding timed beside every row
# (bench/bench_spec.py). Each part under its own time limit, all of it under 7 minutes:
#   dflash  DFlash k = 5 (DFLASH_K: other k)                           (DFLASH_TIMEOUT, 170 s)
#   others  the block drafter k = 5 and MTP k = 1, same batches         (OTHERS_TIMEOUT, 150 s)
#   v41     a reduced-depth DeepSeek-V4.1-Flash (4 layers, random FP8 / MXFP4 weights) with its
#           3 random DSpark draft layers as the DFlash drafter: a verified step (k = 5, every
#           draft verified) against a plain step at batch 1, 8, 32, both in graphs
#           (bench/bench_spec_step.py --method dflash)                  (V41_TIMEOUT, 90 s)
# Results: $OUT/dflash/spec.{json,md,svg}, $OUT/others/spec.{json,md,svg},
# $OUT/v41/spec_step.{json,md}, logs beside; the tables are printed at the end. A part cut short by its limit keeps the rows it finished (bench_spec
# writes after every configuration; --time-budget skips, and lists, what would not fit).
#   usage: OUT=dir bash bench/run_dspark_h200.sh        (PARTS="dflash" for one part)
. "$(dirname "$0")/h200_lib.sh"
PARTS=" ${PARTS:-dflash others v41} "
BATCHES=${BATCHES:-1 8 32 128 256}
mkdir -p "$OUT/dflash" "$OUT/others" "$OUT/v41"
t_all=$SECONDS
pip_install 60 > "$OUT/install.log" 2>&1
echo "install rc=$?"
common=(--model model/tiny --backend cuda --repeats 2 --min-seconds 0.5 --new-tokens 128 --prompt-len 64)

if [[ $PARTS == *" dflash "* ]]; then
  t0=$SECONDS
  limit=${DFLASH_TIMEOUT:-170}
  # shellcheck disable=SC2086
  timeout "$limit" python3 bench/bench_spec.py "${common[@]}" --out "$OUT/dflash" --batches $BATCHES \
    --dflash-k ${DFLASH_K:-5} --block-k --mtp-k --time-budget $((limit - 30)) > "$OUT/dflash.log" 2>&1
  echo "dflash rc=$? in $((SECONDS - t0)) s"
fi

if [[ $PARTS == *" others "* ]]; then
  t0=$SECONDS
  limit=${OTHERS_TIMEOUT:-150}
  # shellcheck disable=SC2086
  timeout "$limit" python3 bench/bench_spec.py "${common[@]}" --out "$OUT/others" --batches $BATCHES \
    --dflash-k --block-k 5 --mtp-k 1 --time-budget $((limit - 30)) > "$OUT/others.log" 2>&1
  echo "others rc=$? in $((SECONDS - t0)) s"
fi

if [[ $PARTS == *" v41 "* ]]; then
  t0=$SECONDS
  limit=${V41_TIMEOUT:-90}
  timeout "$limit" python3 bench/bench_spec_step.py --out "$OUT/v41" --method dflash \
    --random-config deepseek-v4.1-flash --num-hidden-layers 4 --fp8 --k 5 --batches 1 8 32 \
    --prompt-len 64 --new-tokens 32 --short-tokens 8 --repeats 2 > "$OUT/v41.log" 2>&1
  echo "v41 rc=$? in $((SECONDS - t0)) s"
fi

for part in dflash others; do
  echo "== $part"
  cat "$OUT/$part/spec.md" 2>/dev/null || grep -E 'Error|error' "$OUT/$part.log" | tail -n 5
done
echo "== v41"
cat "$OUT/v41/spec_step.md" 2>/dev/null || grep -E 'Error|error' "$OUT/v41.log" | tail -n 5
echo "total $((SECONDS - t_all)) s"
