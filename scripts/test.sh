#!/usr/bin/env bash
# Install (into .venv) and run the whole test suite on CPU. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh test
. .venv/bin/activate
# Keep test compilations out of the user's persistent cache.
export JAXINFER_DISABLE_COMPILATION_CACHE=1
# Two workers, each taking whole files (a module's shared engine is built once): a test spends
# most of its time in XLA compilation, which runs on one thread, so one worker left a 2-core
# machine's second core idle (the suite: 19.7 -> 14.5 min on the 2-core dev VM). The files go
# out in collection order, the slow ones first (tests/conftest.py).
# pytest exits 5 when it collects no test; set -e turns that (like any failure) into a failed run.
python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not serial" "$@"
# Then, alone, the tests that time themselves on the wall clock (a second worker would skew
# their clocks). Exit 5 is "none collected" (arguments that name only other tests).
status=0
python -m pytest -q -p no:xdist -m serial "$@" || status=$?
[ "$status" -eq 0 ] || [ "$status" -eq 5 ] || exit "$status"
