#!/usr/bin/env bash
# Before/after figures of two sipp binaries on the default model, side by side
# in one run: N interleaved rounds (the order alternates each round), every
# round printed, then medians and the after/before ratio. Run it alone.
#   scripts/bench-ab.sh BEFORE_BIN [AFTER_BIN]
# Workloads: single (sipp run decode tok/s, 128 tokens), batched (sipp bench
# lockstep x8 decode tok/s) and shared-prefix (sipp bench shared-prefix with
# the cache on: tok/s and TTFT p50).
source "$(dirname "$0")/env.sh"
BEFORE="${1:?usage: bench-ab.sh BEFORE_BIN [AFTER_BIN]}"
if [ -n "${2:-}" ]; then AFTER="$2"; else build_release; AFTER=$(sipp_bin); fi
N="${N:-9}"
THREADS="${THREADS:-$(nproc)}"
MODEL=$("$AFTER" models fetch default | sed 's/^default: //')
single() { "$1" run -m "$MODEL" -t "$THREADS" -n 128 --ignore-eos --temperature 0 --stats "The capital of France is" 2>&1 >/dev/null | awk '/decode tok\/s/ {print $3}'; }
batched() { "$1" bench -m "$MODEL" -t "$THREADS" -C 8 -R 1 -n 64 --json 2>/dev/null | python3 -c 'import json,sys; d=json.load(sys.stdin); print([s for s in d["scenarios"] if s["name"].startswith("lockstep")][0]["lockstep_decode_tokens_per_s"])'; }
shared() { "$1" bench -m "$MODEL" -t "$THREADS" --workload shared-prefix -C 8 -R 1 -n 32 --no-baseline --json 2>/dev/null | python3 -c 'import json,sys; d=json.load(sys.stdin); s=[s for s in d["scenarios"] if "cache on" in s["name"]][0]; print("%.2f %.1f" % (s["tokens_per_s"], s["ttft_p50_ms"]))'; }
declare -A fig
for i in $(seq "$N"); do
  if [ $((i % 2)) -eq 1 ]; then order="before after"; else order="after before"; fi
  for which in $order; do
    bin=$BEFORE; [ "$which" = after ] && bin=$AFTER
    s=$(single "$bin"); b=$(batched "$bin"); read -r p t <<<"$(shared "$bin")"
    fig[$which.single]+="$s "; fig[$which.batched]+="$b "; fig[$which.shared]+="$p "; fig[$which.ttft]+="$t "
    printf 'round %d %-6s single %7s tok/s  batched %7s tok/s  shared-prefix %7s tok/s ttft_p50 %7s ms\n' "$i" "$which" "$s" "$b" "$p" "$t"
  done
done
for w in single batched shared ttft; do
  python3 - "$w" "${fig[before.$w]}" "${fig[after.$w]}" <<'PY'
import statistics as st, sys
w, a, b = sys.argv[1], [float(x) for x in sys.argv[2].split()], [float(x) for x in sys.argv[3].split()]
unit = "ms (lower is better)" if w == "ttft" else "tok/s"
print("%-8s before median %8.2f  after median %8.2f  after/before %.3f  %s" % (w, st.median(a), st.median(b), st.median(b) / st.median(a), unit))
PY
done
