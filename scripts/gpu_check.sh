#!/usr/bin/env bash
# The GPU check of jaxinfer: one command, under 8 minutes on one H100/H200, no network.
#
#   OUT=results/ bash scripts/gpu_check.sh          (from the project root)
#
# Parts (PARTS, default all; each under its own time limit, T_<part> seconds):
#   engine    the engine's parity tests on the GPU backend, float32 with no environment variable
#             (HF transformers logits and greedy tokens, paged attention against float64, the sampler)
#   pallas    the Pallas kernel tests with the kernels compiled for the GPU (tests/gpu_plugin.py)
#   kernels   scripts/bench_kernels.py: our kernels against JAX's shipped ones
#   e2e       an 8B-shaped bf16 checkpoint (random Llama-3.1-8B weights, scripts/gpu/make_weights.py):
#             cold start, decode latency at batch 1/16/64, offline throughput, then a warm start
#             (scripts/gpu/e2e.py)
#   before    the same latencies on the plain XLA backend (a scan over stacked weights: the GPU path
#             before the backend seam), for a before/after in one run
# Results: $OUT/summary.txt, and the logs and JSON beside it.
# Packages the GPU image lacks (gguf, llguidance) are installed from WHEELS (default .gpu/whl: wheels staged
# there beforehand, since the GPU machine has no network) into a temporary directory; nothing else is installed.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:?set OUT to a results directory}
mkdir -p "$OUT"
S=$OUT/summary.txt
PARTS=${PARTS:-engine pallas kernels e2e before}
WEIGHTS=${WEIGHTS:-/tmp/l8b}
export PYTHONUNBUFFERED=1 JAXINFER_CACHE_DIR=${JAXINFER_CACHE_DIR:-/tmp/jaxinfer-cache}
{ date; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } > "$OUT/env.txt" 2>&1
if ls "${WHEELS:-.gpu/whl}"/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    "${WHEELS:-.gpu/whl}"/*.whl >> "$OUT/env.txt" 2>&1
  export PYTHONPATH=/tmp/site:$ROOT
else
  export PYTHONPATH=$ROOT
fi
python3 -c "import jax, jaxlib, torch, transformers; print('jax', jax.__version__, jaxlib.__version__, jax.devices(), \
'torch', torch.__version__, 'transformers', transformers.__version__)" >> "$OUT/env.txt" 2>&1
echo "jaxinfer gpu_check $(git rev-parse --short HEAD 2>/dev/null) $(date -u +%FT%TZ)" > "$S"
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
part() {  # part NAME LIMIT COMMAND...: run with a time limit, log to $OUT/NAME.log, one summary line
  local name=$1 limit=$2; shift 2
  local t=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t))s: $(tail -1 "$OUT/$name.log")" >> "$S"
}
if has e2e || has before; then
  (python3 scripts/gpu/make_weights.py "$WEIGHTS" "${LAYERS:-32}" > "$OUT/weights.log" 2>&1) &
  WEIGHTS_PID=$!
fi
# Tests and kernel benches share the GPU with the weights being written: no preallocation.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
if has engine; then
  # shellcheck disable=SC2086
  part engine_tests "${T_engine:-150}" env JAXINFER_DISABLE_COMPILATION_CACHE=1 python3 -m pytest -q --tb=short \
    -p no:cacheprovider ${ENGINE_TESTS:-tests/models/test_hf_parity.py tests/kernels/test_paged_attention_reference.py tests/engine/test_device_sampler.py}
fi
if has pallas; then
  part pallas_tests "${T_pallas:-120}" env JAXINFER_DISABLE_COMPILATION_CACHE=1 python3 -m pytest -q --tb=short -p tests.gpu_plugin -p no:cacheprovider \
    tests/kernels/test_pallas_decode_attention.py tests/kernels/test_pallas_prefill_attention.py tests/kernels/test_pallas_quantized_matmul.py
fi
if has kernels; then
  part bench_kernels "${T_kernels:-60}" python3 scripts/bench_kernels.py --iters 10 --json "$OUT/bench_kernels.json"
fi
unset XLA_PYTHON_CLIENT_PREALLOCATE
if has e2e || has before; then
  wait "$WEIGHTS_PID"; echo "weights: $(tail -1 "$OUT/weights.log")" >> "$S"
fi
if has e2e; then
  rm -rf "$JAXINFER_CACHE_DIR"  # a cold start: no compiled program, no autotuning result
  part e2e_cold "${T_e2e:-240}" python3 scripts/gpu/e2e.py "$WEIGHTS" "$OUT/e2e_cold.json" --throughput
  part e2e_warm "${T_warm:-60}" python3 scripts/gpu/e2e.py "$WEIGHTS" "$OUT/e2e_warm.json" --start-only
fi
if has before; then
  part e2e_before "${T_before:-150}" python3 scripts/gpu/e2e.py "$WEIGHTS" "$OUT/e2e_before.json" --backend xla \
    --max-num-seqs 64 --max-num-batched-tokens 128
fi
python3 scripts/gpu/summary.py "$OUT" >> "$S" 2>&1
cat "$S"
