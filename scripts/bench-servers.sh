#!/usr/bin/env bash
# sipp serve and llama-server side by side, over HTTP, on the default model with
# the same threads and slots, measured by the same client (`sipp bench --url`).
# Each server runs alone while it is measured; rounds alternate between them.
#   ROUNDS=3 THREADS=2 SLOTS=8 scripts/bench-servers.sh
source "$(dirname "$0")/env.sh"
ROUNDS="${ROUNDS:-3}"
THREADS="${THREADS:-2}"
SLOTS="${SLOTS:-8}"
CTX="${CTX:-16384}"
build_release
REFBIN=$("$(dirname "$0")/reference-llama.sh")
SIPP=$(sipp_bin)
MODEL=$("$SIPP" models fetch default | sed 's/^default: //')
OUT="${OUT:-$SIPP_CACHE/bench-servers}"
mkdir -p "$OUT"

PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true' EXIT

start_server() { # name port
  case "$1" in
    sipp) "$SIPP" serve --model "$MODEL" --port "$2" --threads "$THREADS" --parallel "$SLOTS" --ctx-size "$CTX" >"$OUT/$1.log" 2>&1 & ;;
    llama) "$REFBIN/llama-server" -m "$MODEL" --port "$2" --host 127.0.0.1 -t "$THREADS" -tb "$THREADS" -np "$SLOTS" -c "$CTX" >"$OUT/$1.log" 2>&1 & ;;
  esac
  echo $!
}

run_bench() { # name port round
  local base="http://127.0.0.1:$2"
  "$SIPP" bench --url "$base" --workload generate -C "$SLOTS" -R 2 -n 64 --json >"$OUT/$1-generate-$3.json"
  "$SIPP" bench --url "$base" --workload shared-prefix -C 16 -n 16 --no-baseline --json >"$OUT/$1-shared-$3.json"
}

for round in $(seq "$ROUNDS"); do
  for name in sipp llama; do
    port=$((18700 + RANDOM % 1000))
    if [ "$name" = llama ]; then port=$((port + 1)); fi
    pid=$(start_server "$name" "$port")
    PIDS+=("$pid")
    wait_health "$port" "$pid"
    run_bench "$name" "$port" "$round"
    kill "$pid"; wait "$pid" 2>/dev/null || true
  done
done

python3 - "$OUT" "$ROUNDS" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def load(name, kind, r): return json.load(open(f"{out}/{name}-{kind}-{r}.json"))
def scen(d, prefix): return next(s for s in d["scenarios"] if s["name"].startswith(prefix))
rows = {}
for name in ("sipp", "llama"):
    g = [load(name, "generate", r) for r in range(1, rounds + 1)]
    s = [load(name, "shared", r) for r in range(1, rounds + 1)]
    rows[name] = {
        "single-stream decode tok/s": [scen(x, "single")["request_decode_tokens_per_s"] for x in g],
        "8 concurrent x 64 tok/s": [scen(x, "concurrent")["tokens_per_s"] for x in g],
        "shared-prefix x16 TTFT p50 ms": [scen(x, "shared-prefix cache on")["ttft_p50_ms"] for x in s],
    }
print(f"{'figure':<32} {'sipp (median)':>14} {'llama-server':>14} {'ratio':>8}   rounds: sipp | llama")
for k in rows["sipp"]:
    a, b = statistics.median(rows["sipp"][k]), statistics.median(rows["llama"][k])
    fmt = lambda v: " ".join(f"{x:.1f}" for x in v)
    print(f"{k:<32} {a:>14.1f} {b:>14.1f} {a / b:>8.3f}   {fmt(rows['sipp'][k])} | {fmt(rows['llama'][k])}")
PY
