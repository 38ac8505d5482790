#!/usr/bin/env bash
# LoRA throughput: 8 concurrent streams on the default model with two tiny
# rank-4 adapters (scripts/tiny_lora.py) loaded, all on one adapter set against
# three sets mixed (none, A, B), on sipp serve (mixed sets one batch per set in
# each step, the default, and `mixed_adapters = "rotate"`, one set per step) and
# on llama.cpp's llama-server with the same files, threads and slots. Each
# server runs alone while it is measured; rounds alternate between them.
# Prints tokens/s medians and ratios.
#   ROUNDS=3 THREADS=2 SLOTS=8 TOKENS=64 scripts/bench-lora.sh
source "$(dirname "$0")/env.sh"
ROUNDS="${ROUNDS:-3}"
THREADS="${THREADS:-2}"
SLOTS="${SLOTS:-8}"
TOKENS="${TOKENS:-64}"
build_release
REFBIN=$("$(dirname "$0")/reference-llama.sh")
SIPP=$(sipp_bin)
MODEL=$("$SIPP" models fetch default | sed 's/^default: //')
ensure_venv "$SIPP_VENV" "$(sipp_root)/scripts/requirements-test.txt"
A="$SIPP_MODEL_DIR/smollm2-tiny-lora-seed1.gguf"
B="$SIPP_MODEL_DIR/smollm2-tiny-lora-seed2.gguf"
[ -f "$A" ] || "$SIPP_VENV/bin/python" "$(sipp_root)/scripts/tiny_lora.py" "$MODEL" "$A" 1
[ -f "$B" ] || "$SIPP_VENV/bin/python" "$(sipp_root)/scripts/tiny_lora.py" "$MODEL" "$B" 2
OUT="${OUT:-$SIPP_CACHE/bench-lora}"
mkdir -p "$OUT"
cat >"$OUT/rotate.toml" <<TOML
[[models]]
id = "default"
model = "$MODEL"
[models.runtime.scheduler]
mixed_adapters = "rotate"
[[models.runtime.lora]]
path = "$A"
[[models.runtime.lora]]
path = "$B"
TOML

PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true' EXIT

start_server() { # name port
  case "$1" in
    sipp) "$SIPP" serve --model "$MODEL" --port "$2" --threads "$THREADS" --parallel "$SLOTS" --ctx-size 8192 --lora "$A,$B" >"$OUT/$1.log" 2>&1 & ;;
    sipp-rotate) "$SIPP" serve --config "$OUT/rotate.toml" --port "$2" --threads "$THREADS" --parallel "$SLOTS" --ctx-size 8192 >"$OUT/$1.log" 2>&1 & ;;
    llama) "$REFBIN/llama-server" -m "$MODEL" --port "$2" --host 127.0.0.1 -t "$THREADS" -tb "$THREADS" -np "$SLOTS" -c 8192 --lora "$A,$B" >"$OUT/$1.log" 2>&1 & ;;
  esac
  echo $!
}

for round in $(seq "$ROUNDS"); do
  for name in sipp sipp-rotate llama; do
    port=$((18700 + RANDOM % 1000))
    pid=$(start_server "$name" "$port")
    PIDS+=("$pid")
    wait_health "$port" "$pid"
    python3 "$(sipp_root)/scripts/bench_lora.py" "http://127.0.0.1:$port" "$SLOTS" "$TOKENS" >"$OUT/$name-$round.json"
    kill "$pid"; wait "$pid" 2>/dev/null || true
  done
done

python3 - "$OUT" "$ROUNDS" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
names = ("sipp", "sipp-rotate", "llama")
runs = {n: [json.load(open(f"{out}/{n}-{r}.json")) for r in range(1, rounds + 1)] for n in names}
fmt = lambda v: " ".join(f"{x:.1f}" for x in v)
print(f"{'8 streams, tokens/s':<20} {'sipp':>8} {'rotate':>8} {'llama':>8} {'sipp/llama':>10}   rounds: sipp | rotate | llama")
for k in runs["sipp"][0]:
    v = {n: [r[k] for r in runs[n]] for n in names}
    m = {n: statistics.median(v[n]) for n in names}
    print(f"{k:<20} {m['sipp']:>8.1f} {m['sipp-rotate']:>8.1f} {m['llama']:>8.1f} {m['sipp'] / m['llama']:>10.3f}   "
          + " | ".join(fmt(v[n]) for n in names))
for n in names:
    m = lambda k: statistics.median(r[k] for r in runs[n])
    print(f"{n}: three mixed sets / one set = {m('three sets mixed') / m('one set (A)'):.3f}")
PY
