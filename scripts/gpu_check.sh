#!/usr/bin/env bash
# The GPU check of jaxinfer: one command, under 8 minutes on one H100/H200, no network.
#
#   bash scripts/gpu/stage_wheels.sh                  (once, on a machine with network: see below)
#   OUT=results/ bash scripts/gpu_check.sh            (from the project root, on the GPU machine)
#
# Wheels: the GPU image lacks gguf and llguidance. scripts/gpu/stage_wheels.sh downloads them (Python 3.12,
# x86-64 manylinux) into .gpu/whl; that folder is git-ignored, so send it with the tree (a tool that copies
# only the tracked and unignored files must be told to carry .gpu). This script installs them from there
# (WHEELS to use another folder) into a temporary directory, with no network; nothing else is installed.
#
# Parts, most important first (PARTS, default "engine e2e pallas kernels"; each under its own time limit,
# T_<part> seconds, and all under BUDGET seconds: a part starts only with 30 s left, its limit cut to what is left):
#   engine    the engine's parity tests on the GPU backend, float32 with no environment variable (HF transformers
#             logits and greedy tokens, paged attention against float64, the sampler), while the weights are written
#   e2e       an 8B-shaped bf16 checkpoint (random Llama-3.1-8B weights and config, scripts/gpu/make_weights.py)
#             served by scripts/gpu/e2e.py three times:
#             e2e_default       no option set: the config's own context (131,072 tokens), from an empty cache (cold
#                               start); decode at batch 1/16/64 (the engine's step, the device alone, the host's
#                               share), one 32k-token request, offline 256 requests; the compiled decode steps read
#                               (kernels per layer, weights copied or concatenated, bytes the attention writes)
#             e2e_default_warm  the same engine started again: the executable cache's warm start
#             e2e_4k            max_model_len 4096, the same batches and compiled-step reading; its sampler
#                               programs come from the cache the default run filled
#   pallas    the Pallas kernel tests with the kernels compiled for the GPU (tests/gpu_plugin.py)
#   kernels   scripts/bench_kernels.py: our kernels against JAX's shipped ones
#   before    (not in the default) the 4k latencies on the plain XLA backend (a scan over stacked weights)
# Results: $OUT/summary.txt (the e2e numbers first, then one line per part), and the logs and JSON beside it
# ($OUT/hlo: the compiled batch-1 decode step of each e2e run, gzipped HLO text).
#
# Rehearsal, where no GPU is at hand: REHEARSE=1 OUT=... bash scripts/gpu_check.sh runs the same parts on the CPU
# (.venv's Python; parts "engine e2e", ~4 minutes on 2 cores), with a 2-layer model of the same config at hidden 512,
# a 600-token long request, 8 offline requests and e2e.py --rehearse (the GPU backend's programs compiled for the
# CPU). Its numbers measure nothing: it shows that every part runs and that the summary reads what they wrote, so
# a GPU's minutes are not spent finding a script's bug.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:?set OUT to a results directory}
REHEARSE=${REHEARSE:-}
if [ -n "$REHEARSE" ]; then
  . .venv/bin/activate
  : "${PARTS:=engine e2e}" "${BUDGET:=1800}" "${WEIGHTS:=/tmp/l8b-rehearsal}" "${LAYERS:=2}" "${T_engine:=400}"
  : "${T_e2e:=500}" "${T_warm:=200}" "${T_4k:=400}" "${LONG:=600}" "${OFFLINE:=8}"
  export DIMS=${DIMS:-512,1024,2048}
  E2E_FLAGS=--rehearse
else
  E2E_FLAGS=
fi
LONG=${LONG:-32768}
OFFLINE=${OFFLINE:-256}
mkdir -p "$OUT/hlo"
S=$OUT/summary.txt
P=$OUT/parts.txt
: > "$P"
PARTS=${PARTS:-engine e2e pallas kernels}
BUDGET=${BUDGET:-450}
WEIGHTS=${WEIGHTS:-/tmp/l8b}
WHEELS=${WHEELS:-.gpu/whl}
export PYTHONUNBUFFERED=1 JAXINFER_CACHE_DIR=${JAXINFER_CACHE_DIR:-/tmp/jaxinfer-cache}
{ date; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } > "$OUT/env.txt" 2>&1
if [ -n "$REHEARSE" ]; then  # .venv has every package
  export PYTHONPATH=$ROOT
elif ls "$WHEELS"/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    "$WHEELS"/*.whl >> "$OUT/env.txt" 2>&1
  export PYTHONPATH=/tmp/site:$ROOT
else
  echo "no wheels in $WHEELS: run scripts/gpu/stage_wheels.sh before (the tests needing gguf/llguidance fail)" >> "$P"
  export PYTHONPATH=$ROOT
fi
python3 -c "import jax, jaxlib, torch, transformers; print('jax', jax.__version__, jaxlib.__version__, jax.devices(), \
'torch', torch.__version__, 'transformers', transformers.__version__)" >> "$OUT/env.txt" 2>&1
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
part() {  # part NAME LIMIT COMMAND...: run within LIMIT and the budget left, log to $OUT/NAME.log, one line to $P
  local name=$1 limit=$2 t=$SECONDS; shift 2
  local left=$((BUDGET - SECONDS))
  if [ "$left" -lt 30 ]; then echo "$name skipped: ${left}s of the ${BUDGET}s budget left" >> "$P"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  timeout "$limit" env PART_LIMIT="$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t))s (limit ${limit}s): $(tail -1 "$OUT/$name.log" | cut -c1-300)" >> "$P"
}
if has e2e || has before; then
  (python3 scripts/gpu/make_weights.py "$WEIGHTS" "${LAYERS:-32}" > "$OUT/weights.log" 2>&1) &
  WEIGHTS_PID=$!
fi
# Tests share the GPU with the weights being written: no preallocation.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
if has engine; then
  # Four workers (the image has pytest-xdist), each test dealt out on its own: a test's time is mostly compiling on
  # one host core, and one worker reached 26 of these tests in 90 s on an H100.
  # shellcheck disable=SC2086
  part engine_tests "${T_engine:-70}" env JAXINFER_DISABLE_COMPILATION_CACHE=1 python3 -m pytest -q --tb=short \
    -p no:cacheprovider -n "${ENGINE_WORKERS:-4}" --dist load ${ENGINE_TESTS:-tests/models/test_hf_parity.py tests/kernels/test_paged_attention_reference.py tests/engine/test_device_sampler.py}
fi
unset XLA_PYTHON_CLIENT_PREALLOCATE
if has e2e || has before; then
  wait "$WEIGHTS_PID"; echo "weights: $(tail -1 "$OUT/weights.log")" >> "$P"
fi
if has e2e; then
  # Each run is told its limit (PART_LIMIT): it skips a part that would end past it, and writes its JSON
  # after every part, so a run cut short keeps what it measured.
  T=${T_e2e:-200}
  rm -rf "$JAXINFER_CACHE_DIR"  # a cold start: no compiled program, no autotuning result
  part e2e_default "$T" python3 scripts/gpu/e2e.py "$WEIGHTS" "$OUT/e2e_default.json" --long-context "$LONG" \
    --throughput "$OFFLINE" --hlo-dir "$OUT/hlo" $E2E_FLAGS
  part e2e_default_warm "${T_warm:-60}" python3 scripts/gpu/e2e.py "$WEIGHTS" "$OUT/e2e_default_warm.json" --start-only \
    $E2E_FLAGS
  # 4k beside it: the same decode programs but for the block tables' width; 256-token prefill chunks (the
  # prompts are 128 tokens) to compile fewer, smaller mixed programs in the time left.
  T=${T_4k:-120}
  mkdir -p "$OUT/hlo/4k"
  part e2e_4k "$T" python3 scripts/gpu/e2e.py "$WEIGHTS" "$OUT/e2e_4k.json" --max-model-len 4096 \
    --max-num-batched-tokens 256 --hlo-dir "$OUT/hlo/4k" $E2E_FLAGS
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false
if has pallas; then
  part pallas_tests "${T_pallas:-100}" env JAXINFER_DISABLE_COMPILATION_CACHE=1 python3 -m pytest -q --tb=short -p tests.gpu_plugin -p no:cacheprovider \
    tests/kernels/test_pallas_decode_attention.py tests/kernels/test_pallas_prefill_attention.py tests/kernels/test_pallas_quantized_matmul.py \
    tests/kernels/test_pallas_rms_norm.py
fi
if has kernels; then
  part bench_kernels "${T_kernels:-60}" python3 scripts/bench_kernels.py --iters 10 --json "$OUT/bench_kernels.json"
fi
unset XLA_PYTHON_CLIENT_PREALLOCATE
if has before; then
  part e2e_before "${T_before:-150}" python3 scripts/gpu/e2e.py "$WEIGHTS" "$OUT/e2e_before.json" --backend xla \
    --max-model-len 4096 --max-num-seqs 64 --max-num-batched-tokens 128 $E2E_FLAGS
fi
{ echo "jaxinfer gpu_check $(git rev-parse --short HEAD 2>/dev/null) $(date -u +%FT%TZ), ${SECONDS}s"
  python3 scripts/gpu/summary.py "$OUT" 2>&1
  cat "$P"; } > "$S"
cat "$S"
