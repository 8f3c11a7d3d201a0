#!/usr/bin/env bash
# A change that must not change behaviour, checked on one GPU in one device call: the tree as it
# is ("new") against an earlier commit ("old", a `git archive` tarball made beforehand:
#   git archive -o .ab/old.tgz BASE deepinfer backends bench/*.py ci
# and carried with the call). Parts, each under its own time limit, logs straight into $OUT/run (then
# $OUT/ab.tgz):
#   1. in parallel: the cuda conformance suite (CONF_K filters it; CONF=0 skips it), the engine
#      on real CUDA graphs (tests/test_async_graphs.py), and ci/gpu_tokens.py on both trees
#      (greedy and seeded tokens under every engine mode; a random V4 checkpoint written once by
#      the old tree, read by both), then the comparison of the two token files;
#   2. with bench_e2e.py arguments: bench/bench_e2e.py on the old tree, then on the new one.
# NEW_TGZ=.ab/new.tgz (made the same way) takes "new" from that tarball instead of the tree.
#   usage: OUT=dir [NEW_TGZ=...] bash ci/gpu_ab.sh [bench_e2e.py arguments]
. "$(dirname "$0")/../bench/h200_lib.sh"
RESULT=$(realpath -m "$OUT")
OUT=$RESULT/run  # every log here, then one tarball: the device returns at most 8 files
mkdir -p "$OUT"
pip_install > "$SCRATCH/install.log" 2>&1
echo "install rc=$?"
OLD=$SCRATCH/old V4=$SCRATCH/v4
rm -rf "$OLD" && mkdir -p "$OLD" && tar -C "$OLD" -xzf .ab/old.tgz && cp -r model "$OLD/"
cp ci/gpu_tokens.py "$OLD/ci/"  # the same driver for both trees (public API only)
OLD_PATH=$OLD:$OLD/backends/cuda
NEW_TREE=$PWD NEW_PATH=""
if [ -n "${NEW_TGZ:-}" ]; then
  NEW_TREE=$SCRATCH/new NEW_PATH=$SCRATCH/new:$SCRATCH/new/backends/cuda
  rm -rf "$NEW_TREE" && mkdir -p "$NEW_TREE" && tar -C "$NEW_TREE" -xzf "$NEW_TGZ" && cp -r model "$NEW_TREE/"
  cp ci/gpu_tokens.py "$NEW_TREE/ci/"
fi
start=$SECONDS

tokens() {  # name, tree, PYTHONPATH ('' for the installed tree)
  (cd "$2" && timeout "${TOKENS_TIMEOUT:-240}" env ${3:+PYTHONPATH="$3"} python3 ci/gpu_tokens.py \
    --backend cuda --out "$OUT/tokens_$1.json" --v4 "$V4") > "$OUT/tokens_$1.log" 2>&1
  echo "tokens $1 rc=$? at $((SECONDS - start)) s"
}
(cd "$OLD" && PYTHONPATH=$OLD_PATH python3 ci/gpu_tokens.py --write-v4 "$V4") > "$OUT/write_v4.log" 2>&1
tokens old "$OLD" "$OLD_PATH" &
tokens new "$NEW_TREE" "$NEW_PATH" &
timeout "${ENGINE_TIMEOUT:-200}" env DEEPINFER_TEST_BACKEND=cuda python3 -m pytest tests/test_async_graphs.py \
  -q -rfs -p no:cacheprovider > "$OUT/engine_tests.log" 2>&1 &
if [ "${CONF:-1}" = 1 ]; then
  timeout "${CONF_TIMEOUT:-250}" python3 -m pytest -p deepinfer.testing.plugin --pyargs deepinfer.testing.conformance \
    --deepinfer-backend cuda --deepinfer-heavy -q -n "${WORKERS:-12}" -rfEs --tb=line -p no:cacheprovider \
    ${CONF_K:+-k "$CONF_K"} > "$OUT/conformance.log" 2>&1
  echo "conformance rc=$? at $((SECONDS - start)) s"
  grep -E "FAILED|ERROR|passed|failed" "$OUT/conformance.log" | tail -n 12
fi
wait
echo "engine tests at $((SECONDS - start)) s"; tail -n 3 "$OUT/engine_tests.log"
tail -n 3 "$OUT/tokens_old.log" "$OUT/tokens_new.log"
python3 ci/gpu_tokens.py --compare "$OUT/tokens_old.json" "$OUT/tokens_new.json" | tee "$OUT/tokens_compare.txt"

bench() {  # name, tree, PYTHONPATH, bench_e2e.py arguments
  local name=$1 tree=$2 path=$3 t0=$SECONDS
  shift 3
  mkdir -p "$OUT/e2e_$name"
  (cd "$tree" && timeout "${BENCH_TIMEOUT:-200}" env ${path:+PYTHONPATH="$path"} python3 bench/bench_e2e.py \
    --out "$OUT/e2e_$name" "$@") > "$OUT/e2e_$name/bench.log" 2>&1
  echo "bench $name rc=$? in $((SECONDS - t0)) s"
  rm -f "$OUT/e2e_$name"/trace_*.json.gz
  grep -E "tok/s" "$OUT/e2e_$name/bench.log" | cut -c1-200 | tail -n 8
}
if [ $# -gt 0 ]; then
  bench old "$OLD" "$OLD_PATH" "$@"
  bench new "$NEW_TREE" "$NEW_PATH" "$@"
fi
tar -C "$OUT" -czf "$RESULT/ab.tgz" . && cp "$OUT/tokens_compare.txt" "$RESULT/" && rm -rf "$OUT"
