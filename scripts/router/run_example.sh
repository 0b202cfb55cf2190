#!/usr/bin/env bash
# Data-parallel replicas behind a standard router: two `jaxinfer serve` replicas
# (the embedded default model) on 127.0.0.1:8001 and :8002, nginx
# (scripts/router/nginx.conf: least_conn, passive health checks, SSE unbuffered)
# on 127.0.0.1:8000. It waits for both replicas' /health, sends completions
# through the router (plain, streamed, beside a long stream that holds one
# replica, and after one replica is stopped), prints which replica answered each
# (nginx's X-Upstream header) and each replica's /load, then stops everything.
#
# Documentation that runs, not a test: CI does not install nginx. Needs nginx
# (Debian/Ubuntu: apt-get install -y nginx-light; NGINX=/path/to/nginx to pick one),
# curl, the .venv of scripts/setup_env.sh, and ports 8000-8002 free. Everything
# listens on 127.0.0.1 only; logs go to a temporary directory, removed at the end
# (KEEP_LOGS=1 keeps it).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
CONF="$ROOT/scripts/router/nginx.conf"
NGINX=${NGINX:-$(command -v nginx || echo /usr/sbin/nginx)}
ROUTER=http://127.0.0.1:8000
MODEL=smollm2
[ -x "$NGINX" ] || { echo "nginx not found (apt-get install -y nginx-light, or NGINX=/path/to/nginx)" >&2; exit 1; }
[ -f .venv/bin/activate ] && . .venv/bin/activate

RUN_DIR=$(mktemp -d)
chmod 755 "$RUN_DIR"  # nginx's workers (another user when started as root) use its temp folders
declare -A REPLICA_PID=()
NGINX_PID=""

cleanup() {
    [ -n "$NGINX_PID" ] && kill -QUIT "$NGINX_PID" 2>/dev/null || true
    for pid in "${REPLICA_PID[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    if [ "${KEEP_LOGS:-0}" = 1 ]; then echo "logs kept in $RUN_DIR"; else rm -rf "$RUN_DIR"; fi
}
trap cleanup EXIT

# -- start -------------------------------------------------------------------------------------------
for port in 8001 8002; do
    jaxinfer serve --host 127.0.0.1 --port "$port" --served-model-name "$MODEL" --max-model-len 512 \
        --max-num-seqs 8 --log-level warning >"$RUN_DIR/replica-$port.log" 2>&1 &
    REPLICA_PID[$port]=$!
done
"$NGINX" -t -q -p "$RUN_DIR/" -c "$CONF"
"$NGINX" -p "$RUN_DIR/" -c "$CONF" -g 'daemon off;' &
NGINX_PID=$!

wait_healthy() {  # /health answers 503 while the model loads and compiles, then 200
    local port=$1
    for _ in $(seq 900); do
        curl -sf -o /dev/null "http://127.0.0.1:$port/health" && return 0
        kill -0 "${REPLICA_PID[$port]}" 2>/dev/null || { echo "replica :$port exited:"; tail "$RUN_DIR/replica-$port.log"; exit 1; }
        sleep 1
    done
    echo "replica :$port not healthy after 900 s" >&2; exit 1
}
start=$SECONDS
wait_healthy 8001
wait_healthy 8002
echo "both replicas healthy after $((SECONDS - start)) s; router on $ROUTER"

# -- helpers -----------------------------------------------------------------------------------------
body() {  # body PROMPT MAX_TOKENS [STREAM]
    python -c 'import json, sys
print(json.dumps({"model": sys.argv[1], "prompt": sys.argv[2], "max_tokens": int(sys.argv[3]),
                  "temperature": 0, "ignore_eos": True, "stream": sys.argv[4] == "1"}))' \
        "$MODEL" "$1" "$2" "${3:-0}"
}
upstream() { grep -i '^x-upstream:' "$1" | cut -d' ' -f2- | tr -d '\r'; }
load_of() { curl -sf "http://127.0.0.1:$1/load" 2>/dev/null || echo "(down)"; }
show_loads() { echo "  /load  :8001 $(load_of 8001)  :8002 $(load_of 8002)"; }

complete() {  # complete LABEL PROMPT MAX_TOKENS: one completion through the router
    curl -sS -D "$RUN_DIR/h" -o "$RUN_DIR/b" "$ROUTER/v1/completions" -H 'Content-Type: application/json' \
        -d "$(body "$2" "$3")"
    local text
    text=$(python -c 'import json, sys; print(repr(json.load(open(sys.argv[1]))["choices"][0]["text"]))' "$RUN_DIR/b")
    printf '  %-34s <- %-32s %s\n' "$1" "$(upstream "$RUN_DIR/h")" "$text"
}

sse_summary() {  # the text and the number of data chunks of an SSE reply
    python -c 'import json, sys
chunks = [l[6:].strip() for l in open(sys.argv[1]) if l.startswith("data: ")]
text = "".join(json.loads(c)["choices"][0]["text"] for c in chunks if c != "[DONE]" and json.loads(c)["choices"])
print(f"{len(chunks)} SSE events, ends with {chunks[-1]!r}: {text[:60]!r}")' "$1"
}

# -- through the router ------------------------------------------------------------------------------
echo "1. four completions one after another (least_conn with no open connections alternates):"
for i in 1 2 3 4; do complete "completion $i" "The capital of France is" 8; done

echo "2. one streamed completion (proxy_buffering off: chunks arrive as generated):"
curl -sS -N -D "$RUN_DIR/sh" -o "$RUN_DIR/stream" "$ROUTER/v1/completions" -H 'Content-Type: application/json' \
    -d "$(body "Once upon a time" 16 1)"
printf '  %-34s <- %-32s %s\n' "streamed completion" "$(upstream "$RUN_DIR/sh")" "$(sse_summary "$RUN_DIR/stream")"

echo "3. a long stream holds one replica; least_conn sends the next requests to the other:"
curl -sS -N -D "$RUN_DIR/lh" -o "$RUN_DIR/long" "$ROUTER/v1/completions" -H 'Content-Type: application/json' \
    -d "$(body "Write a long story about the sea." 400 1)" &
long_pid=$!
for _ in $(seq 100); do grep -q '^data: ' "$RUN_DIR/long" 2>/dev/null && break; sleep 0.1; done
printf '  %-34s <- %s\n' "long stream (open)" "$(upstream "$RUN_DIR/lh")"
show_loads
complete "completion beside the stream" "Water boils at" 8
complete "another beside the stream" "The sky is" 8
wait "$long_pid"
printf '  %-34s    %s\n' "long stream (done)" "$(sse_summary "$RUN_DIR/long")"
show_loads

echo "4. what each replica has served (GET /metrics, vllm:request_success_total by finish reason):"
for port in 8001 8002; do
    echo "  :$port $(curl -sf "http://127.0.0.1:$port/metrics" | grep '^vllm:request_success_total' | grep -v ' 0.0$' | sed 's/{.*finished_reason="\([a-z]*\)".*} / \1=/' | tr '\n' ' ')"
done

echo "5. replica :8002 stops; the router passes its share to :8001 (passive health check):"
kill -TERM "${REPLICA_PID[8002]}"
wait "${REPLICA_PID[8002]}" || true
unset 'REPLICA_PID[8002]'
for i in 1 2 3; do complete "completion $i, :8002 down" "The capital of France is" 8; done
show_loads

echo "router access log (upstream per request):"
sed 's/^/  /' "$RUN_DIR/access.log"
