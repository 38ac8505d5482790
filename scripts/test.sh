#!/usr/bin/env bash
# Sets up everything the tests need (Debian packages, Python packages, models)
# and runs the whole test suite. Safe to repeat.
source "$(dirname "$0")/env.sh"
ensure_system_packages
ensure_python_packages
cd "$(sipp_root)"
cargo build --release --workspace --quiet
"$(sipp_bin)" models fetch default >/dev/null
cargo test --release --workspace --quiet "$@"
