#!/usr/bin/env bash
# Runs the real-model test stages on a build with other kernels, which is how
# a different machine looks to greedy text: Rust code for baseline x86-64 (not
# target-cpu=native) and llama.cpp built with GGML_NATIVE=OFF GGML_AVX512=OFF,
# in a target directory of its own so the normal build stays as it is.
# Extra GGML_* variables pass through to llama.cpp's CMake, e.g.
#   GGML_AVX2=OFF GGML_FMA=OFF scripts/test-other-kernels.sh   # AVX-only kernels
source "$(dirname "$0")/env.sh"
export CARGO_TARGET_DIR="${OTHER_KERNELS_TARGET_DIR:-$SIPP_CACHE/target-other-kernels}"
# RUSTFLAGS overrides .cargo/config.toml's target-cpu=native.
export RUSTFLAGS="-C target-cpu=x86-64"
export GGML_NATIVE=OFF GGML_AVX512=OFF
# Fuzzing and rustdoc do not touch the model's kernels.
export SIPP_SKIP_STAGES="fuzz docs"
echo "other kernels: RUSTFLAGS=$RUSTFLAGS $(env | grep '^GGML_' | sort | tr '\n' ' ')target $CARGO_TARGET_DIR" >&2
exec "$(sipp_root)/scripts/test.sh" "$@"
