#!/usr/bin/env bash
# Sets up everything (Debian packages, build, default model) and runs one
# generation on the default model. Safe to repeat.
#   scripts/run.sh ["prompt"]
source "$(dirname "$0")/env.sh"
ensure_system_packages
build_release
"$(sipp_bin)" models fetch default >/dev/null
exec "$(sipp_bin)" run --model default --max-tokens 64 --stats "${1:-The capital of France is}"
