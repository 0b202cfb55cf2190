#!/usr/bin/env bash
# Install (into .venv) and run the main job on the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
jaxinfer generate --max-tokens 48 "The capital of France is"
jaxinfer generate --chat --max-tokens 64 "Write a haiku about the sea."
