#!/usr/bin/env bash
# One run on the device for decode speed: the decode-sized MoE tilings (bench/bench_moe_decode.py), the bitwise check of
# the batch-invariant linear across tiles of one K order (bench/bench_invariant_tiles.py --bits)
# and its tiles timed against cuBLAS,
# and bench/bench_e2e.py with the arguments given. Each part under its own limit, logs in $OUT.
#   usage: OUT=dir bash bench/run_decode_h200.sh [bench_e2e.py arguments]
. "$(dirname "$0")/h200_lib.sh"
pip_install > "$SCRATCH/install.log" 2>&1
echo "install rc=$?"
t0=$SECONDS
timeout "${MOE_TIMEOUT:-200}" python3 bench/bench_moe_decode.py --out "$OUT/moe" > "$OUT/moe.log" 2>&1
echo "moe sweep rc=$? in $((SECONDS - t0)) s"
cut -c1-220 "$OUT/moe.log" | tail -n 18
t0=$SECONDS
timeout 90 python3 bench/bench_invariant_tiles.py --bits --out "$OUT/moe" > "$OUT/bits.log" 2>&1
echo "tile bits rc=$? in $((SECONDS - t0)) s"
grep -c "equal to 16x32x128: True" "$OUT/bits.log"; grep "False" "$OUT/bits.log" | cut -c1-160
t0=$SECONDS
timeout "${TILES_TIMEOUT:-150}" python3 bench/bench_invariant_tiles.py --out "$OUT/moe" > "$OUT/tiles.log" 2>&1
echo "invariant tiles rc=$? in $((SECONDS - t0)) s"
grep -E "^best|^BEST|cuBLAS" "$OUT/tiles.log" | cut -c1-160
if [ $# -gt 0 ]; then
  t0=$SECONDS
  timeout "${BENCH_TIMEOUT:-240}" python3 bench/bench_e2e.py --out "$OUT/e2e" "$@" \
    > "$OUT/e2e.log" 2>&1
  echo "bench_e2e rc=$? in $((SECONDS - t0)) s"
  grep -E "tok/s|kernels/step|cost|busy" "$OUT/e2e.log" | cut -c1-200 | tail -n 30
  rm -f "$OUT"/e2e/trace_*.json.gz
fi
tar -C "$OUT" -czf "$OUT/results.tgz" moe e2e 2>/dev/null; rm -rf "$OUT/moe" "$OUT/e2e"
