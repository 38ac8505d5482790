#!/usr/bin/env bash
# Runs the cargo-fuzz targets (libFuzzer) for SECONDS each, seeded from the
# committed corpus (copied, so the run does not change the repository), and
# prints executions per target. CI runs it briefly; locally run it for 600+.
#   scripts/fuzz.sh [SECONDS] [TARGET...]
# The fuzzed code is safe Rust (sipp-rs without llama.cpp, whose unsafe code
# is all in the llama.cpp runtime), so AddressSanitizer has nothing to find
# there: the default is no sanitizer, whose build takes 8.3 minutes on a
# fresh 2-core machine against 11.7 with ASan, and whose runs execute more
# inputs. FUZZ_SANITIZER=address (or leak, memory, thread) picks one.
source "$(dirname "$0")/env.sh"
SECONDS_EACH="${1:-20}"
shift || true
cd "$(sipp_root)/fuzz"
command -v cargo-fuzz >/dev/null || cargo install --quiet --locked cargo-fuzz
# cargo-fuzz needs unstable rustc flags (sanitizers); the stable toolchain
# accepts them under RUSTC_BOOTSTRAP.
export RUSTC_BOOTSTRAP=1
export CARGO_TARGET_DIR="$SIPP_CACHE/fuzz-target"
SAN=(-s "${FUZZ_SANITIZER:-none}")
cargo fuzz build -O "${SAN[@]}" >/dev/null 2>&1 || cargo fuzz build -O "${SAN[@]}"
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(request_json stop_matcher utf8_carry gguf_header chat_template tool_parsers)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
status=0
for t in "${TARGETS[@]}"; do
  mkdir -p "$WORK/$t" "$WORK/artifacts-$t"
  cp -r corpus/"$t"/. "$WORK/$t"/ 2>/dev/null || true
  if cargo fuzz run -O "${SAN[@]}" "$t" "$WORK/$t" -- -max_total_time="$SECONDS_EACH" -print_final_stats=1 \
      -artifact_prefix="$WORK/artifacts-$t/" -rss_limit_mb=2048 >"$WORK/$t.log" 2>&1; then
    execs=$(grep -m1 'stat::number_of_executed_units' "$WORK/$t.log" | awk '{print $2}')
    echo "$t: ok, $execs executions in ${SECONDS_EACH}s, corpus $(ls "$WORK/$t" | wc -l) inputs"
  else
    status=1
    echo "$t: FAILED"; tail -40 "$WORK/$t.log"
    mkdir -p artifacts/"$t"; cp "$WORK/artifacts-$t"/* artifacts/"$t"/ 2>/dev/null || true
  fi
  # Keep what the run learned when asked (locally): FUZZ_KEEP_CORPUS=1.
  if [ "${FUZZ_KEEP_CORPUS:-0}" = 1 ]; then
    cargo fuzz cmin -O "${SAN[@]}" "$t" "$WORK/$t" >/dev/null 2>&1 || true
    rm -rf corpus/"$t" && cp -r "$WORK/$t" corpus/"$t"
  fi
done
exit $status
