#!/usr/bin/env bash
# One run on the device: the batch-invariant linear's tile candidates timed in CUDA graphs
# (bench/bench_invariant_tiles.py), then the batch-invariant engine's cost at batch 32
# (bench/bench_e2e.py) with the current tile and with the best candidate, in the same run.
#   usage: OUT=dir bash bench/run_invariant_h200.sh
. "$(dirname "$0")/h200_lib.sh"
pip_install > "$SCRATCH/install.log" 2>&1
echo "install rc=$?"
t0=$SECONDS
timeout 200 python3 bench/bench_invariant_tiles.py --out "$OUT/tiles" > "$OUT/tiles.log" 2>&1
echo "tiles rc=$? in $((SECONDS - t0)) s"
cut -c1-160 "$OUT/tiles.log" | tail -n 34
best=$(awk '/^BEST/ {print $2}' "$OUT/tiles.log")
args=(--skip-transformers --batches 32 --ablation-batches "" --profile-batch 32 --profile-steps 5 --time-budget 110)
for tile in current "$best"; do
  t0=$SECONDS
  if [ "$tile" = current ]; then
    timeout 140 python3 bench/bench_e2e.py --out "$OUT/e2e_current" "${args[@]}" > "$OUT/e2e_current.log" 2>&1
  else
    DEEPINFER_CUDA_INVARIANT_TILE=$tile timeout 140 python3 bench/bench_e2e.py --out "$OUT/e2e_best" "${args[@]}" \
      > "$OUT/e2e_best.log" 2>&1
  fi
  echo "bench_e2e tile $tile rc=$? in $((SECONDS - t0)) s"
done
grep -h -E "batch-invariant B=|invariant_b32" "$OUT"/e2e_*.log | cut -c1-200
rm -f "$OUT"/e2e_*/trace_*.json.gz "$OUT"/e2e_*/e2e.png
tar -C "$OUT" -czf "$OUT/results.tgz" tiles e2e_current e2e_best && rm -rf "$OUT/tiles" "$OUT/e2e_current" "$OUT/e2e_best"
