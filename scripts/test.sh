#!/usr/bin/env bash
# Install (into .venv) and run the whole test suite on CPU. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh test
. .venv/bin/activate
# Keep test compilations out of the user's persistent cache.
export JAXINFER_DISABLE_COMPILATION_CACHE=1
# pytest exits 5 when it collects no test; set -e turns that (like any failure) into a failed run.
python -m pytest -q "$@"
