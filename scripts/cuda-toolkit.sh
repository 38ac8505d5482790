#!/usr/bin/env bash
# A CUDA toolkit for `cargo build -p sipp-cli --features cuda` on a machine
# without one (no nvcc, no NVIDIA driver), assembled from NVIDIA's PyPI wheels.
# Prints the toolkit's root, a CUDA_PATH-style tree, as its last stdout line;
# messages go to stderr. Idempotent: reinstalls only when the pins change.
#
#   CUDA=$(scripts/cuda-toolkit.sh)
#   nice -n 19 env CUDA_PATH="$CUDA" CUDA_LIBRARY_PATH="$CUDA" \
#     CUDACXX="$CUDA/bin/nvcc" PATH="$CUDA/bin:$PATH" CMAKE_CUDA_ARCHITECTURES=90 \
#     RUSTFLAGS="-C target-cpu=x86-64-v3 -C link-arg=-L$CUDA/lib64 \
#       -C link-arg=-lcublas -C link-arg=-lcublasLt -C link-arg=-Wl,-rpath,\$ORIGIN:\$ORIGIN/../lib" \
#     CARGO_TARGET_DIR="$SIPP_CACHE/target-cuda" \
#     cargo build --release -p sipp-cli --features cuda
#
# CUDA_LIBRARY_PATH, not CUDA_PATH, is what llama-cpp-sys-2's link search
# (find_cuda_helper) reads on Linux. RUSTFLAGS replaces .cargo/config.toml's
# target-cpu=native, which would tie the binary to this build machine's CPU.
# With CMAKE_CUDA_ARCHITECTURES=90 (sm_90 code plus compute_90 PTX) a cold
# build took 41 minutes on a 2-core machine, 33 of them for ggml-cuda's 144
# .cu files.
#
# Only CUDA 13 has nvcc on PyPI (the -cu12 nvcc wheel holds ptxas, nvvm and
# headers, no nvcc/cicc/cudafe++). The pins are one release, CUDA 13.0 Update 2
# (the `cuda-toolkit==13.0.2` metapackage's), the oldest 13.x with a recent
# cuBLAS: a CUDA 13 binary needs an NVIDIA driver of the R580 branch or newer.
#
# What the wheels lack, and what this does instead:
# - libcublas_static.a / libcublasLt_static.a: cuBLAS ships only as shared
#   libraries on PyPI. llama-cpp-sys-2 asks for them statically on Linux
#   (cudart_static, cublas_static, cublasLt_static, culibos), so lib64/stubs
#   holds empty archives of those names, and the build links libcublas.so.13 and
#   libcublasLt.so.13 itself (the -lcublas -lcublasLt link args above).
#   cudart and culibos are the wheels' real static archives. At run time the
#   binary needs libcublas.so.13 and libcublasLt.so.13 on the library path
#   (`pip install nvidia-cublas==13.1.0.3`: nvidia/cu13/lib; or a CUDA 13
#   runtime image), plus the driver's libcuda.so.1.
# - lib64/stubs/libcuda.so: generated here, an empty function for every driver
#   API entry point cuda.h declares, soname libcuda.so.1, only for linking.
#
# nvcc finds its tools and headers relative to where it is called from (its
# nvcc.profile's TOP is the folder above the nvcc it was run as, symlinks not
# resolved), so the tree below is a real folder of symlinks into the wheels.
source "$(dirname "$0")/env.sh"

CUDA_TOOLKIT_DIR="$SIPP_CACHE/cuda-toolkit"
CUDA_ROOT="$CUDA_TOOLKIT_DIR/cuda"
SITE="$CUDA_TOOLKIT_DIR/site"
WHEELS="$CUDA_TOOLKIT_DIR/wheels"

PINS=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-cuda-crt==13.0.88
  nvidia-nvvm==13.0.88
  nvidia-cuda-runtime==13.0.96
  nvidia-cuda-cccl==13.0.85
  nvidia-cuda-culibos==13.0.85
  nvidia-cublas==13.1.0.3
)

log() { echo "cuda-toolkit: $*" >&2; }

install_wheels() {
  local stamp="$SITE/.pins"
  if [ "$(cat "$stamp" 2>/dev/null)" = "${PINS[*]}" ] && [ -x "$SITE/nvidia/cu13/bin/nvcc" ]; then
    return
  fi
  mkdir -p "$WHEELS"
  log "downloading ${PINS[*]} (about 530 MB, cached in $WHEELS)"
  python3 -m pip download --quiet --disable-pip-version-check --no-deps \
    --dest "$WHEELS" "${PINS[@]}" >&2
  # All the wheels install into one nvidia/cu13 tree, so in one pip call.
  rm -rf "$SITE" "$CUDA_ROOT"
  log "installing into $SITE"
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --no-index \
    --find-links "$WHEELS" --target "$SITE" "${PINS[@]}" >&2
  echo "${PINS[*]}" > "$stamp"
}

# A link-time libcuda.so: every cu* function cuda.h declares (after its
# macros map names such as cuMemAlloc to the exported cuMemAlloc_v2).
make_libcuda_stub() {
  local out=$1 inc=$2 tmp
  tmp=$(mktemp -d)
  echo '#include <cuda.h>' | gcc -E -P -I"$inc" -x c - |
    grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' | sed 's/[[:space:]]*($//' | sort -u |
    sed 's/.*/int &(void) { return 999; }/' > "$tmp/libcuda_stub.c"
  gcc -shared -fPIC -o "$tmp/libcuda.so" -Wl,-soname,libcuda.so.1 "$tmp/libcuda_stub.c"
  mv "$tmp/libcuda.so" "$out"
  rm -rf "$tmp"
}

assemble_tree() {
  local cu13="$SITE/nvidia/cu13"
  if [ -f "$CUDA_ROOT/.complete" ]; then
    return
  fi
  log "assembling $CUDA_ROOT"
  rm -rf "$CUDA_ROOT"
  mkdir -p "$CUDA_ROOT/bin" "$CUDA_ROOT/lib64/stubs"
  local f
  for f in "$cu13"/bin/*; do ln -s "$f" "$CUDA_ROOT/bin/"; done
  ln -s "$cu13/include" "$CUDA_ROOT/include"
  ln -s "$cu13/nvvm" "$CUDA_ROOT/nvvm"
  for f in "$cu13"/lib/*; do ln -s "$f" "$CUDA_ROOT/lib64/"; done
  # The unversioned names linkers and CMake's FindCUDAToolkit look for.
  local so
  for so in "$cu13"/lib/lib*.so.*; do
    so=$(basename "$so")
    ln -sf "$so" "$CUDA_ROOT/lib64/${so%%.so.*}.so"
  done
  ln -s lib64 "$CUDA_ROOT/lib"
  make_libcuda_stub "$CUDA_ROOT/lib64/stubs/libcuda.so" "$cu13/include"
  # Empty stand-ins for the static cuBLAS archives no wheel ships (see above).
  ar rc "$CUDA_ROOT/lib64/stubs/libcublas_static.a"
  ar rc "$CUDA_ROOT/lib64/stubs/libcublasLt_static.a"
  touch "$CUDA_ROOT/.complete"
}

install_wheels
assemble_tree
"$CUDA_ROOT/bin/nvcc" --version | tail -n 2 >&2
echo "$CUDA_ROOT"
