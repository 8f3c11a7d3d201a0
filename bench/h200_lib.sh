# The preamble and the parts' runner that the device scripts (bench/run_*_h200*.sh, ci/gpu_*.sh)
# share. Each script sources it first:
#   . "$(dirname "$0")/h200_lib.sh"            (from ci/: . "$(dirname "$0")/../bench/h200_lib.sh")
# and then runs in the repository root with OUT set and made. SCRATCH ($TMPDIR, else /tmp) holds
# the work folders and copied trees, so that runs with their own TMPDIR do not share them.
# tests/test_gpu_scripts.py runs every script with python3 stubbed.
set -u -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
SCRATCH=${TMPDIR:-/tmp}
SUMMARY="" PART_TOTAL=""  # set by workdir and by the script, never from the environment

# pip_install [LIMIT]: the editable install of deepinfer and its cuda backend with $PY (python3
# unless set), under `timeout LIMIT` when given; the caller redirects its output.
pip_install() {
  ${1:+timeout "$1"} "${PY:-python3}" -m pip install -q --no-deps --no-build-isolation -e . -e backends/cuda
}

# torch_versions: "TORCH TRITON GPU-NAME" (or the import's error), for the install line.
torch_versions() {
  python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())' 2>&1
}

# workdir DIR: R=DIR (made) holds the parts' logs; say appends to R/summary.txt, made empty here.
# A script that sets R itself instead keeps no summary: say only prints.
workdir() {
  R=$1
  SUMMARY=$R/summary.txt
  mkdir -p "$R"
  : > "$SUMMARY"
}

say() {
  if [ -n "${SUMMARY:-}" ]; then echo "$*" | tee -a "$SUMMARY"; else echo "$*"; fi
}

# part NAME LIMIT command...: the command under `timeout LIMIT`, its output in $R/NAME.log; says
# "NAME rc=RC in T s" and returns RC. With PART_TOTAL (seconds from the script's start) set, LIMIT
# is cut to what is left of PART_TOTAL (the line adds "(limit L s)"), and a part left under 10 s is
# skipped (said, returns 124).
part() {
  local name=$1 limit=$2 note=""
  shift 2
  if [ -n "${PART_TOTAL:-}" ]; then
    local left=$((PART_TOTAL - SECONDS))
    ((left < limit)) && limit=$left
    if ((limit < 10)); then
      say "$name skipped: ${left} s left of ${PART_TOTAL} s"
      return 124
    fi
    note=" (limit $limit s)"
  fi
  local t0=$SECONDS
  timeout "$limit" "$@" > "$R/$name.log" 2>&1
  local rc=$?
  say "$name rc=$rc in $((SECONDS - t0)) s$note"
  return $rc
}

# finish [tar options...]: says the total time, copies summary.txt into OUT and packs $R into
# OUT/logs.tgz (the device returns at most 8 files); the script prints the summary after it.
finish() {
  say "total $SECONDS s"
  cp "$R/summary.txt" "$OUT/summary.txt"
  tar -C "$R" -czf "$OUT/logs.tgz" "$@" . 2>/dev/null
}
