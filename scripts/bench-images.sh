#!/usr/bin/env bash
# Images beside a text stream: on the default model with the tiny vision
# projector (scripts/tiny_vision.py), a text-only stream runs while eight chat
# requests with new images arrive at once (scripts/bench_images.py), on sipp
# serve and on llama.cpp's llama-server with the same files, threads and
# slots. Each server runs alone while it is measured; rounds alternate. Prints
# medians: the stream's inter-token gap while the images are computed and
# after, and the image requests' latency.
#   ROUNDS=3 THREADS=2 scripts/bench-images.sh
source "$(dirname "$0")/env.sh"
ROUNDS="${ROUNDS:-3}"
THREADS="${THREADS:-2}"
build_release
REFBIN=$("$(dirname "$0")/reference-tools.sh")
SIPP=$(sipp_bin)
MODEL=$("$SIPP" models fetch default | sed 's/^default: //')
ensure_venv "$SIPP_VENV" "$(sipp_root)/scripts/requirements-test.txt"
MMPROJ="$SIPP_MODEL_DIR/smollm2-tiny-mmproj-seed1.gguf"
[ -f "$MMPROJ" ] || "$SIPP_VENV/bin/python" "$(sipp_root)/scripts/tiny_vision.py" "$MODEL" "$MMPROJ" 1
if [ ! -x "$REFBIN/llama-server" ]; then REFBIN=$("$(dirname "$0")/reference-llama.sh"); fi
OUT="${OUT:-$SIPP_CACHE/bench-images}"
mkdir -p "$OUT"
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true' EXIT

start_server() { # name port
  case "$1" in
    sipp) "$SIPP" serve --model "$MODEL" --mmproj "$MMPROJ" --port "$2" --threads "$THREADS" --parallel 9 --ctx-size 8192 >"$OUT/$1.log" 2>&1 & ;;
    llama) "$REFBIN/llama-server" -m "$MODEL" --mmproj "$MMPROJ" --port "$2" --host 127.0.0.1 -t "$THREADS" -tb "$THREADS" -np 9 -c 8192 >"$OUT/$1.log" 2>&1 & ;;
  esac
  echo $!
}

for round in $(seq "$ROUNDS"); do
  for name in sipp llama; do
    port=$((18700 + RANDOM % 1000))
    pid=$(start_server "$name" "$port")
    PIDS+=("$pid")
    wait_health "$port" "$pid"
    python3 "$(sipp_root)/scripts/bench_images.py" "http://127.0.0.1:$port" "$round" >"$OUT/$name-$round.json"
    kill "$pid"; wait "$pid" 2>/dev/null || true
  done
done

python3 - "$OUT" "$ROUNDS" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
runs = {n: [json.load(open(f"{out}/{n}-{r}.json")) for r in range(1, rounds + 1)] for n in ("sipp", "llama")}
print(f"{'8 images beside a stream (ms)':<32} {'sipp':>8} {'llama':>8} {'sipp/llama':>10}   rounds: sipp | llama")
for k in runs["sipp"][0]:
    v = {n: [r[k] for r in runs[n]] for n in runs}
    m = {n: statistics.median(v[n]) for n in runs}
    ratio = m["sipp"] / m["llama"] if m["llama"] else float("nan")
    print(f"{k:<32} {m['sipp']:>8.1f} {m['llama']:>8.1f} {ratio:>10.3f}   "
          + " | ".join(" ".join(f"{x:.1f}" for x in v[n]) for n in runs))
PY
