#!/usr/bin/env bash
# One device call (under 10 minutes) for the V4 family on one H200, each part under `timeout`:
#   1. the GPU tests of V4's mHC kernels (conformance + tests/test_cuda_kernels.py -k hc_);
#   2. bench/bench_e2e_v4.py: V4-Flash at 4 layers, both formats, batch 1 / 8 / 64 against each
#      format's roofline, the decode step profiled at batch 1;
#   3. bench/run_spec_v4_h200.sh (PARTS=step): the MTP verified step against a plain step, in graphs;
#   4. DeepSeek-V4.1-Flash in its published format (FP8 32x32 linears, MXFP4 experts), random weights,
#      reduced to V41_LAYERS layers (default 6: window, C1 and C2 layers of both YOCO halves), its
#      Engram layers dropped (the shipped tables, about 100 GB a layer, do not fit one GPU):
#      `deepinfer bench` at batch 1 and 64, 128 in / 64 out.
#   usage: OUT=dir bash bench/run_v4_family_h200.sh    (PARTS="tests e2e spec v41", the default, picks)
. "$(dirname "$0")/h200_lib.sh"
PARTS=" ${PARTS:-tests e2e spec v41} "
want() { [[ $PARTS == *" $1 "* ]]; }
workdir "$SCRATCH/v4_family"
mkdir -p "$R/e2e" "$R/spec" "$R/v41"
pip_install > "$R/install.log" 2>&1
say "install rc=$?"

want tests && part tests "${TEST_TIMEOUT:-90}" python3 -m pytest -q -rfE --tb=short -p no:cacheprovider -n 8 \
  -p deepinfer.testing.plugin --deepinfer-backend cuda --deepinfer-dtypes bfloat16 \
  --pyargs deepinfer.testing.conformance tests/test_cuda_kernels.py -k "hc_ or gated_pool"
grep -E "passed|failed|FAILED" "$R/tests.log" | tail -n 6 | tee -a "$R/summary.txt"

want e2e && part e2e "${E2E_TIMEOUT:-150}" python3 bench/bench_e2e_v4.py --out "$R/e2e" --skip-transformers \
  --batches 1,8,64 --time-budget 120 --profile-batches 1
grep -E "tok/s|GPU idle" "$R/e2e.log" | cut -c1-170 | tee -a "$R/summary.txt"
cp "$R/e2e/e2e_v4.md" "$R/e2e/e2e_v4.json" "$OUT/" 2>/dev/null

want spec && OUT="$R/spec" STEP_TIMEOUT=${STEP_TIMEOUT:-200} part spec $(( ${STEP_TIMEOUT:-200} + 20 )) bash bench/run_spec_v4_h200.sh
tail -n 25 "$R/spec.log" | tee -a "$R/summary.txt"
cp "$R/spec/results.tgz" "$OUT/spec_results.tgz" 2>/dev/null

python3 - "$R/v41/config" "${V41_LAYERS:-6}" <<'PY'
import json, sys
from pathlib import Path
raw = json.loads(Path("model/deepseek-v4.1-flash/config.json").read_text())
raw["text_config"]["engram_layer_ids"] = []
Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
(Path(sys.argv[1]) / "config.json").write_text(json.dumps(raw, indent=1))
PY
for b in 1 64; do
  want v41 || break
  part "v41_b$b" "${V41_TIMEOUT:-110}" deepinfer bench --random-config "$R/v41/config" \
    --num-hidden-layers "${V41_LAYERS:-6}" --quantization fp8 --backend cuda --num-prompts "$b" \
    --input-len 128 --output-len 64 --max-model-len 512 --output-json "$R/v41/v41_b$b.json"
  grep -E "KV|Throughput|tok/s|Error|error" "$R/v41_b$b.log" | cut -c1-220 | tail -n 8 | tee -a "$R/summary.txt"
done
cp "$R"/v41/*.json "$OUT/" 2>/dev/null

finish --exclude='*.json.gz' --exclude='results.tgz'
cat "$R/summary.txt"
