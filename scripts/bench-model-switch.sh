#!/usr/bin/env bash
# What switching models costs under `models_max = 1`: two on-demand targets
# (the default model under two ids), requests alternating between them (each
# one loads its model and unloads the other), against the same requests all
# to one target (loaded once). Prints the median and max latency of each.
#
#   scripts/bench-model-switch.sh [REQUESTS]   (default 10 per phase)
source "$(dirname "$0")/env.sh"
set -euo pipefail
N=${1:-10}
SIPP=$(sipp_bin)
"$SIPP" models fetch default >/dev/null
DIR=$(mktemp -d)
trap 'kill $PID 2>/dev/null; rm -rf "$DIR"' EXIT
for id in first second; do
  printf '[[models]]\nid = "%s"\nmodel = "default"\nload = "on_demand"\n\n' "$id" >>"$DIR/sipp.toml"
done
PORT=18437
"$SIPP" serve --config "$DIR/sipp.toml" --models-max 1 --port $PORT >"$DIR/serve.log" 2>&1 &
PID=$!
for _ in $(seq 120); do curl -sf -o /dev/null "http://127.0.0.1:$PORT/health" && break; sleep 0.5; done
python3 - "$PORT" "$N" <<'PY'
import json, statistics, sys, time, urllib.request
port, n = sys.argv[1], int(sys.argv[2])
def ask(model):
    body = json.dumps({"model": model, "prompt": "The sea is", "max_tokens": 8, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"content-type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req) as r:
        assert r.status == 200
        r.read()
    return time.perf_counter() - t
ask("first")
steady = [ask("first") for _ in range(n)]
switching = [ask(["second", "first"][i % 2]) for i in range(n)]
for name, xs in (("same model", steady), ("alternating (load + unload each)", switching)):
    print(f"{name:34s} median {statistics.median(xs)*1000:7.1f} ms  max {max(xs)*1000:7.1f} ms  (n={len(xs)})")
print(f"switch cost: {statistics.median(switching)/statistics.median(steady):.1f}x the median latency")
PY
curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^sipp_model_(loads|unloads)_total' || true
