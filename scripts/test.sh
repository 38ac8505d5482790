#!/usr/bin/env bash
# Sets up everything the tests need (Debian packages, Python packages, models)
# and runs the whole test suite: unit, property and integration tests, the
# examples, and the documentation build. Safe to repeat.
source "$(dirname "$0")/env.sh"
ensure_system_packages
ensure_python_packages
cd "$(sipp_root)"
cargo build --release --workspace --bins --examples --quiet
"$(sipp_bin)" models fetch default minilm >/dev/null
cargo test --release --workspace --quiet "$@"
# The query example runs against the default model.
"$CARGO_TARGET_DIR/release/examples/query" "The capital of France is" | grep -q Paris
# Every fuzz target briefly, seeded from the committed corpus.
scripts/fuzz.sh "${SIPP_FUZZ_SECS:-20}"
# Rustdoc on every public item, without warnings.
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --quiet -p sipp-rs -p sipp-server
echo "all tests passed"
