#!/usr/bin/env bash
# Serving measurements: `jaxinfer bench serve` against `jaxinfer serve`
# (default model) at request rates 1, 4, 16, inf and concurrencies 1, 8, 32, then
# offline `jaxinfer bench throughput` on the same prompts (same generator, seed
# and vocabulary size) bracketed by two rate-inf serve runs on fresh servers
# (cold prefix caches, like the offline run). JSONs go to OUT_DIR.
# Usage: bash scripts/bench_serve_sweep.sh [OUT_DIR] [NUM_PROMPTS] [INPUT_LEN] [OUTPUT_LEN]
# (JAXINFER="python -m jaxinfer.cli" runs the checkout in the current directory.)
set -euo pipefail
read -r -a J <<< "${JAXINFER:-jaxinfer}"
OUT=${1:-/tmp/bench_serve}; N=${2:-32}; IN=${3:-128}; OUTLEN=${4:-32}; PORT=${PORT:-8021}
mkdir -p "$OUT"
VOCAB=49152  # SmolLM2's, so that bench serve sends the prompts bench throughput runs

start_server() {  # a fresh server logging to $OUT/$1, returned once /health answers 200
  "${J[@]}" serve --port "$PORT" --log-level warning > "$OUT/$1" 2>&1 &
  SERVER=$!
  trap 'kill -INT $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
  for _ in $(seq 1 150); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "localhost:$PORT/health")" = 200 ] && break; sleep 2
  done
}

stop_server() {
  kill -INT $SERVER; wait $SERVER || true; trap - EXIT
}
start_server server.log
common=(--port "$PORT" --num-prompts "$N" --input-len "$IN" --output-len "$OUTLEN" --vocab-size "$VOCAB")
"${J[@]}" bench serve "${common[@]}" --request-rate inf --json "$OUT/rate_inf_a.json"
# A new seed per run: the same prompts again would be served from the prefix cache.
seed=1
for rate in 1 4 16; do
  "${J[@]}" bench serve "${common[@]}" --seed $((seed++)) --request-rate "$rate" --json "$OUT/rate_$rate.json"
done
for c in 1 8 32; do
  "${J[@]}" bench serve "${common[@]}" --seed $((seed++)) --max-concurrency "$c" --json "$OUT/concurrency_$c.json"
done
stop_server
"${J[@]}" bench throughput --num-prompts "$N" --input-len "$IN" --output-len "$OUTLEN" --json "$OUT/offline.json"
start_server server2.log
"${J[@]}" bench serve "${common[@]}" --request-rate inf --json "$OUT/rate_inf_b.json"
stop_server

# Warm comparison: the first batch a fresh process runs is slower than later ones, so
# both sides also run one untimed batch (seed 100) before the measured one (seed 0).
python - "$N" "$IN" "$OUTLEN" "$VOCAB" "$OUT/offline_warm.json" <<'PY'
import json, sys
from jaxinfer import LLM
from jaxinfer.benchmark import run_throughput, synthetic_requests
n, inp, out, vocab, path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
llm = LLM(progress=False)
run_throughput(llm, synthetic_requests(vocab, n, inp, out, seed=100))
result = run_throughput(llm, synthetic_requests(vocab, n, inp, out, seed=0))
print(f"offline warm: {result['output_tokens_per_s']:.1f} output tok/s")
json.dump(result, open(path, "w"), indent=2)
PY
start_server server3.log
"${J[@]}" bench serve "${common[@]}" --seed 100 --request-rate inf > /dev/null
"${J[@]}" bench serve "${common[@]}" --request-rate inf --json "$OUT/rate_inf_warm.json"
