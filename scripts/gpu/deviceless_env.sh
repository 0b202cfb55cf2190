#!/usr/bin/env bash
# A Python that compiles for CUDA on a machine with no GPU (scripts/gpu/deviceless.py): the project's .venv
# (its jaxinfer, jax and dependencies) plus the CUDA 13 jax plugin of the same jax version and the NVIDIA
# libraries it loads (compiler, cuBLAS, cuDNN: ~4.4 GB), in .gpu/deviceless (git-ignored). Needs the package
# index once; a second run installs nothing.
#
#   bash scripts/gpu/deviceless_env.sh && .gpu/deviceless/bin/python scripts/gpu/deviceless.py
set -eu
cd "$(dirname "$0")/../.."
DIR=.gpu/deviceless
VERSION=$(.venv/bin/python -c "import jax; print(jax.__version__)")
[ -x "$DIR/bin/python" ] || .venv/bin/python -m venv "$DIR"
# The project's .venv on the path after this one's own packages: pip finds its jax and jaxlib there and
# installs only the plugin and the libraries.
SITE=$("$DIR/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > "$SITE/project_venv.pth"
"$DIR/bin/python" -m pip install --quiet --disable-pip-version-check "jax==$VERSION" "jaxlib==$VERSION" \
  "jax-cuda13-plugin[with-cuda]==$VERSION"
