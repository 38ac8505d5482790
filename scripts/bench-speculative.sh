#!/usr/bin/env bash
# Speculative decoding, sipp against llama-server, over HTTP with the same
# client (`sipp bench --url --workload grounded`), on the default model with
# the same threads and slots. sipp serve runs once and is measured with
# speculation off and n-gram per request; llama-server runs once per n-gram
# type of its `--spec-type` (and once without), since it chooses at launch.
# Each server runs alone while it is measured. Prints every figure, each
# run's greedy agreement with the same server's speculation-off texts, and
# sipp's grounded single-stream n-gram figure over the best llama-server one.
# Single streams: median decode tok/s per request; C streams: tokens per
# second while all C clients were busy (each sends REQUESTS requests in turn).
#   THREADS=2 SLOTS=8 REQUESTS=4 TOKENS=256 scripts/bench-speculative.sh
source "$(dirname "$0")/env.sh"
THREADS="${THREADS:-2}"
SLOTS="${SLOTS:-8}"
CTX="${CTX:-16384}"
REQUESTS="${REQUESTS:-4}"
TOKENS="${TOKENS:-256}"
LLAMA_TYPES="${LLAMA_TYPES:-none ngram-simple ngram-map-k ngram-map-k4v ngram-mod ngram-cache}"
build_release
REFBIN=$("$(dirname "$0")/reference-llama.sh")
SIPP=$(sipp_bin)
MODEL=$("$SIPP" models fetch default | sed 's/^default: //')
OUT="${OUT:-$SIPP_CACHE/bench-speculative}"
mkdir -p "$OUT"

PID=""
trap '[ -n "$PID" ] && kill "$PID" 2>/dev/null || true' EXIT

bench() { # port modes out
  "$SIPP" bench --url "http://127.0.0.1:$1" --workload grounded -C "$SLOTS" -R "$REQUESTS" \
    -n "$TOKENS" --speculative-modes "$2" --json >"$3"
}

port=$((18700 + RANDOM % 1000))
"$SIPP" serve --model "$MODEL" --port "$port" --threads "$THREADS" --parallel "$SLOTS" \
  --ctx-size "$CTX" >"$OUT/sipp.log" 2>&1 &
PID=$!
wait_health "$port" "$PID"
bench "$port" off,ngram "$OUT/sipp.json"
kill "$PID"; wait "$PID" 2>/dev/null || true

for t in $LLAMA_TYPES; do
  port=$((port + 1))
  spec=()
  [ "$t" != none ] && spec=(--spec-type "$t")
  "$REFBIN/llama-server" -m "$MODEL" --port "$port" --host 127.0.0.1 -t "$THREADS" -tb "$THREADS" \
    -np "$SLOTS" -c "$CTX" "${spec[@]}" >"$OUT/llama-$t.log" 2>&1 &
  PID=$!
  wait_health "$port" "$PID"
  bench "$port" server "$OUT/llama-$t.json"
  kill "$PID"; wait "$PID" 2>/dev/null || true
done

python3 - "$OUT" $LLAMA_TYPES <<'PY'
import json, sys
out, types = sys.argv[1], sys.argv[2:]
def load(n): return json.load(open(f"{out}/{n}.json"))
def scen(d, name): return next(s for s in d["scenarios"] if s["name"] == name)
def agreement(a, b):
    # Mean share of each text that agrees with the reference before diverging.
    shares = []
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        shares.append(n / max(len(x), len(y), 1))
    return sum(shares) / max(len(shares), 1)
rows = []
sipp = load("sipp")
C = sipp["clients"]
for mode in ("off", "ngram"):
    rows.append((f"sipp {mode}", sipp, mode, sipp["extra"]["texts grounded x1 off"]))
ref = load("llama-none")["extra"]["texts grounded x1 server"] if "none" in types else None
for t in types:
    d = load(f"llama-{t}")
    rows.append((f"llama-server {t}", d, "server", ref))
print(f"{'run':<28} {'grounded x1':>12} {'grounded x%d' % C:>12} {'generate x1':>12} {'generate x%d' % C:>12} {'accepted':>9} {'agreement':>10}")
best_llama = 0.0
sipp_ngram = 0.0
for name, d, mode, reference in rows:
    g1 = scen(d, f"grounded x1 {mode}")
    gc = scen(d, f"grounded x{C} {mode}")
    f1 = scen(d, f"generate x1 {mode}")
    fc = scen(d, f"generate x{C} {mode}")
    acc = g1.get("draft_acceptance")
    texts = d["extra"][f"texts grounded x1 {mode}"]
    agree = agreement(reference, texts) if reference else float("nan")
    print(f"{name:<28} {g1['request_decode_tokens_per_s']:>12.1f} {gc['busy_tokens_per_s']:>12.1f} "
          f"{f1['request_decode_tokens_per_s']:>12.1f} {fc['busy_tokens_per_s']:>12.1f} "
          f"{'-' if acc is None else f'{acc*100:.1f}%':>9} {agree:>10.3f}")
    if name.startswith("llama-server"):
        best_llama = max(best_llama, g1["request_decode_tokens_per_s"])
    if name == "sipp ngram":
        sipp_ngram = g1["request_decode_tokens_per_s"]
print(f"sipp ngram grounded single-stream over the best llama-server setting: {sipp_ngram / max(best_llama, 1e-9):.3f}")
PY
