#!/usr/bin/env bash
# Stage the wheels scripts/gpu_check.sh installs on a GPU machine that has no network: the packages its
# image lacks (gguf, llguidance), for Python 3.12 on x86-64 Linux, into .gpu/whl (git-ignored).
# Run it on a machine with network before the tree goes to the GPU machine; a second run downloads nothing.
#
#   bash scripts/gpu/stage_wheels.sh          (WHEELS=dir to stage elsewhere, PYTHON=python to run pip with)
#
# The requirements are pyproject.toml's own (so the staged versions satisfy the project); --no-deps, as the
# image has their dependencies (numpy, pyyaml, tqdm).
set -eu
cd "$(dirname "$0")/../.."
WHEELS=${WHEELS:-.gpu/whl}
mkdir -p "$WHEELS"
for package in gguf llguidance; do
  requirement=$(grep -o "\"$package[<>=!~ ][^\"]*\"" pyproject.toml | head -1 | tr -d '"')
  requirement=${requirement:-$package}
  "${PYTHON:-python3}" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any --dest "$WHEELS" "$requirement"
done
ls -1 "$WHEELS"
