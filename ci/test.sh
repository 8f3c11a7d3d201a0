#!/usr/bin/env bash
# Install deepinfer, its two backend packages and the test tools, then run the test suite.
#
#   bash ci/test.sh [pytest args]      (two pytest-xdist workers; PYTEST_WORKERS=N to change)
#
# Works on a fresh machine: without an active virtual environment it creates ./.venv.
# torch 2.13.0 is installed FIRST, so that pip takes the CPU build (a later unpinned
# requirement would otherwise pull a CUDA build of several GB).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${VIRTUAL_ENV:-}" ]]; then
  [[ -x .venv/bin/python ]] || python3 -m venv .venv
  # shellcheck disable=SC1091
  source .venv/bin/activate
fi

python -m pip install --quiet --upgrade setuptools wheel
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -e '.[test]' -e backends/cuda -e backends/ascend triton==3.6.0
python -c "import torch; print('torch', torch.__version__)"

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # one thread per worker: two workers on two cores, no oversubscription
set +e
# one test at a time to each worker: the longest run first (tests/conftest.py), the rest fill in
python -m pytest tests -q -n "${PYTEST_WORKERS:-2}" --maxschedchunk 1 --durations=25 "$@"
status=$?
set -e
if [[ $status -eq 5 ]]; then
  echo "ci/test.sh: pytest collected no tests" >&2
  exit 1
fi
exit $status
