#!/usr/bin/env bash
# Side-by-side figures of sipp and llama.cpp's own tools on the default model,
# interleaved N times (the machine is shared and noisy: best and median of N are
# reported for each). Run it alone on the machine.
#   scripts/bench-compare.sh single   # sipp run --stats decode vs llama-bench tg128
#   scripts/bench-compare.sh batched  # sipp bench lockstep x8 vs llama-batched-bench S_TG at 8
source "$(dirname "$0")/env.sh"
MODE="${1:-single}"
N="${N:-5}"
THREADS="${THREADS:-$(nproc)}"
build_release
REFBIN=$("$(dirname "$0")/reference-llama.sh")
SIPP=$(sipp_bin)
MODEL=$("$SIPP" models fetch default | sed 's/^default: //')
stats() { python3 -c 'import sys,statistics as s; v=[float(x) for x in sys.argv[2:]]; print("%-34s best %8.1f  median %8.1f  (%s)" % (sys.argv[1], max(v), s.median(v), " ".join("%.1f"%x for x in v)))' "$@"; }
a=(); b=(); u=()
for i in $(seq "$N"); do
  case "$MODE" in
    single)
      a+=("$("$SIPP" run -t "$THREADS" -n 128 --ignore-eos --temperature 0 --stats "The capital of France is" 2>&1 >/dev/null | awk '/decode tok\/s/ {print $3}')")
      b+=("$("$REFBIN/llama-bench" -m "$MODEL" -t "$THREADS" -p 0 -n 128 -r 1 -o csv 2>/dev/null | tail -1 | awk -F, '{gsub(/"/,"",$0); print $(NF-1)}')")
      ;;
    batched)
      a+=("$("$SIPP" bench -t "$THREADS" -C 8 -R 1 -n 64 --json 2>/dev/null | python3 -c 'import json,sys; d=json.load(sys.stdin); print([s for s in d["scenarios"] if s["name"].startswith("lockstep")][0]["lockstep_decode_tokens_per_s"])')")
      b+=("$("$REFBIN/llama-batched-bench" -m "$MODEL" -t "$THREADS" -tb "$THREADS" -c 4096 -b 512 -ub 512 -npp 16 -ntg 64 -npl 8 2>&1 | awk -F'|' '/^\|[ ]+16/ {gsub(/ /,"",$9); print $9}')")
      # The same with one KV stream shared by all sequences (-kvu), the layout
      # sipp uses so that sequences can share prefix cells.
      u+=("$("$REFBIN/llama-batched-bench" -m "$MODEL" -t "$THREADS" -tb "$THREADS" -c 4096 -b 512 -ub 512 -npp 16 -ntg 64 -npl 8 -kvu 2>&1 | awk -F'|' '/^\|[ ]+16/ {gsub(/ /,"",$9); print $9}')")
      ;;
    *) echo "unknown mode $MODE" >&2; exit 2 ;;
  esac
done
case "$MODE" in
  single) stats "sipp run decode tok/s" "${a[@]}"; stats "llama-bench tg128 tok/s" "${b[@]}" ;;
  batched) stats "sipp lockstep x8 decode tok/s" "${a[@]}"; stats "llama-batched-bench S_TG B=8" "${b[@]}"; stats "llama-batched-bench -kvu S_TG B=8" "${u[@]}" ;;
esac
ratio() { python3 -c 'import sys; a=[float(x) for x in sys.argv[2].split()]; b=[float(x) for x in sys.argv[3].split()]; print("ratio %s: best %.3f, median %.3f" % (sys.argv[1], max(a)/max(b), sorted(a)[len(a)//2]/sorted(b)[len(b)//2]))' "$@"; }
ratio "sipp/llama.cpp" "${a[*]}" "${b[*]}"
if [ "$MODE" = batched ]; then ratio "sipp/llama.cpp -kvu" "${a[*]}" "${u[*]}"; fi
