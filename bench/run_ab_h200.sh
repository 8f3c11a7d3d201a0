#!/usr/bin/env bash
# Two trees in one run on the device: bench/bench_e2e.py on the tree with PATCH reverted ("old") and on
# the tree as it is ("new"), one process each, old first, with the same arguments. Before them,
# in parallel: the engine on real CUDA graphs (tests/test_async_graphs.py) and the conformance
# suite under CONF_K (a pytest -k filter; unset: skipped). The old tree is a copy in $TMPDIR/old,
# imported ahead of the installed (new) packages through PYTHONPATH; each bench log names the
# deepinfer it imported. Everything lands in $OUT (old/, new/, the test logs) and, with the
# traces, in $OUT/ab.tgz (the device returns at most 8 files).
#   usage: OUT=dir bash bench/run_ab_h200.sh PATCH [bench_e2e.py arguments]
. "$(dirname "$0")/h200_lib.sh"
OUT=$(realpath -m "$OUT")
PATCH=$(realpath "${1:?PATCH}")
shift
mkdir -p "$OUT/old" "$OUT/new"
pip_install > "$SCRATCH/install.log" 2>&1
echo "install rc=$?"
OLD=$SCRATCH/old
rm -rf "$OLD" && mkdir -p "$OLD" && cp -r deepinfer backends bench model "$OLD/"
(cd "$OLD" && patch -s -R -p1 < "$PATCH") && echo "old tree: $PATCH reverted"

start=$SECONDS
timeout "${ENGINE_TIMEOUT:-150}" env DEEPINFER_TEST_BACKEND=cuda python3 -m pytest tests/test_async_graphs.py \
  -q -rfs -p no:cacheprovider > "$OUT/engine_tests.log" 2>&1 &
if [ -n "${CONF_K:-}" ]; then
  timeout "${CONF_TIMEOUT:-150}" python3 -m pytest -p deepinfer.testing.plugin --pyargs deepinfer.testing.conformance \
    --deepinfer-backend cuda --deepinfer-heavy -q -n 8 -rfEs --tb=line -p no:cacheprovider -k "$CONF_K" \
    > "$OUT/conformance.log" 2>&1
  echo "conformance rc=$? at $((SECONDS - start)) s"; tail -n 2 "$OUT/conformance.log"
fi
wait
echo "engine tests at $((SECONDS - start)) s"; tail -n 2 "$OUT/engine_tests.log"

run() {  # name, tree, PYTHONPATH ('' for the installed tree), bench_e2e.py arguments
  local name=$1 tree=$2 path=$3 t0=$SECONDS
  shift 3
  (
    cd "$tree" || exit 1
    env ${path:+PYTHONPATH="$path"} python3 -c \
      "import deepinfer, deepinfer_cuda; print('imports', deepinfer.__file__, deepinfer_cuda.__file__)"
    timeout "${BENCH_TIMEOUT:-200}" env ${path:+PYTHONPATH="$path"} python3 bench/bench_e2e.py --out "$OUT/$name" "$@"
  ) > "$OUT/$name/bench.log" 2>&1
  echo "bench $name rc=$? in $((SECONDS - t0)) s"
  grep -E "imports|tok/s|kernels/step" "$OUT/$name/bench.log" | cut -c1-220 | tail -n 14
}
run old "$OLD" "$OLD:$OLD/backends/cuda" "$@"
run new "$PWD" "" "$@"
tar -C "$OUT" -czf "$OUT/ab.tgz" old new
rm -rf "$OUT/old" "$OUT/new"
