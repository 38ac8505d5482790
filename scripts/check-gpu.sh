#!/usr/bin/env bash
# GPU builds and their checks (not part of CI, which builds the CPU default).
#
#   scripts/check-gpu.sh vulkan      build with --features vulkan and run the
#                                    real-model placement test on lavapipe (Mesa's
#                                    CPU Vulkan driver): 10 greedy prompts on the
#                                    Vulkan device against the CPU (near-tie rule),
#                                    llama.cpp's device log, /v1/models naming the
#                                    device, and the CPU build's texts beside the
#                                    Vulkan build's. VULKAN_TESTS=all also runs every
#                                    real-model test binary on Vulkan.
#   scripts/check-gpu.sh cuda        build with --features cuda for Hopper
#                                    (CMAKE_CUDA_ARCHITECTURES, default 90) with the
#                                    system nvcc or NVIDIA's PyPI toolkit
#                                    (scripts/cuda-toolkit.sh).
#   scripts/check-gpu.sh cuda-pack   the CUDA build's sipp binary and placement test
#                                    in $SIPP_CACHE/cuda-pack, to carry to a GPU
#                                    machine that has no Rust.
#   scripts/check-gpu.sh cuda-bench  on a GPU machine, from a cuda-pack: the
#                                    real-model tests, then sipp vs llama-server
#                                    (built there for CUDA from the reference
#                                    source) at 1, 8, 32 and 64 streams and the
#                                    shared-prefix workload, as one table.
#
# Each GPU build has its own target directory ($SIPP_CACHE/target-vulkan,
# target-cuda), so the CPU build stays incremental.
source "$(dirname "$0")/env.sh"
ROOT=$(sipp_root)
MODE="${1:-}"

PROMPTS=(
  "The capital of France is"
  "def fibonacci(n):"
  "Once upon a time, in a small village,"
  "The three primary colors are"
  "To make a cup of tea, first"
  "1, 2, 3, 4, 5,"
  "The quick brown fox"
  "Water boils at"
  "My favourite book is"
  "In 1969, the first"
)

PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true' EXIT

vulkan() {
  export VULKAN_SDK
  VULKAN_SDK=$("$ROOT/scripts/vulkan-sdk.sh" | tail -1)
  local target="$SIPP_CACHE/target-vulkan"
  local out="$SIPP_CACHE/check-gpu/vulkan"
  mkdir -p "$out"
  echo "== build (--features vulkan, $target)" >&2
  (cd "$ROOT" && CARGO_TARGET_DIR="$target" cargo build --release -p sipp-cli --features vulkan --quiet)
  # lavapipe is a CPU-type device: ggml-vulkan uses it only when named.
  export GGML_VK_VISIBLE_DEVICES="${GGML_VK_VISIBLE_DEVICES:-0}"
  local sipp="$target/release/sipp"
  local version
  version=$("$sipp" --version 2>/dev/null)
  echo "$version"
  case "$version" in *Vulkan0*) ;; *) echo "the Vulkan build sees no Vulkan device" >&2; return 1 ;; esac

  echo "== llama.cpp's own log of the load" >&2
  printf '[observability]\nllama_logs = true\n' >"$out/llama-logs.toml"
  SIPP_LOG=info "$sipp" run --config "$out/llama-logs.toml" -n 4 "Hello" >/dev/null 2>"$out/load.log"
  grep -E "using device Vulkan0|offloaded [0-9]+/[0-9]+ layers to GPU|Vulkan0 model buffer size|placement:" "$out/load.log" |
    sed 's/\x1b\[[0-9;]*m//g'
  grep -qE "offloaded ([0-9]+)/\1 layers to GPU" "$out/load.log" || { echo "not every layer went to the GPU" >&2; return 1; }

  echo "== placement_real on Vulkan (10 prompts against the CPU, near-tie rule)" >&2
  (cd "$ROOT" && CARGO_TARGET_DIR="$target" cargo test --release -p sipp-rs --features vulkan \
     --test placement_real -- --nocapture --test-threads 1)
  if [ "${VULKAN_TESTS:-}" = all ]; then
    echo "== every real-model test on Vulkan" >&2
    (cd "$ROOT" && CARGO_TARGET_DIR="$target" cargo test --release -p sipp-rs --features vulkan \
       --test real_model --test prefix_reuse --test speculative_real --test embeddings_real)
  fi

  echo "== /v1/models of sipp serve on the Vulkan build" >&2
  local port=$((18700 + RANDOM % 1000))
  OUT="$out" "$sipp" serve --port "$port" --ctx-size 2048 --parallel 2 >"$out/serve.log" 2>&1 &
  local pid=$!
  PIDS+=("$pid")
  OUT="$out" wait_health "$port" "$pid"
  local models
  models=$(curl -sf "http://127.0.0.1:$port/v1/models")
  kill "$pid"; wait "$pid" 2>/dev/null || true
  python3 - "$models" <<'PY'
import json, sys
m = json.loads(sys.argv[1])["data"][0]["meta"]
print(f"/v1/models: placement {m['placement']!r}, backend {m['backend']}, devices {m['devices']}")
assert m["backend"] == "Vulkan" and any(d.startswith("Vulkan0") for d in m["devices"]), m
assert m["offloaded_layers"] == m["total_layers"], m
PY

  # Flash attention off here: Mesa 22.3's lavapipe (Debian 12) segfaults in its
  # own worker threads running ggml-vulkan's flash-attention shader on some
  # shapes (`sipp run -c 2048 "Water boils at"`: every time; backtrace only in
  # libvulkan_lvp.so); a driver bug, not one a real GPU's driver has.
  echo "== the CPU build's greedy texts beside the Vulkan build's (informative, flash attention off)" >&2
  build_release
  local cpu same=0
  cpu=$(sipp_bin)
  for p in "${PROMPTS[@]}"; do
    local a b
    a=$("$cpu" run --temperature 0 -n 24 -c 2048 --flash-attn off "$p" 2>/dev/null)
    b=$("$sipp" run --temperature 0 -n 24 -c 2048 --flash-attn off "$p" 2>/dev/null)
    [ "$a" = "$b" ] && same=$((same + 1))
    printf '%s\n  cpu:    %q\n  vulkan: %q\n' "$p" "$a" "$b"
  done
  echo "identical texts: $same of ${#PROMPTS[@]} (the test above judges differences by the near-tie rule)"
}

# The CUDA toolchain: the system's nvcc (with its static cuBLAS), else NVIDIA's
# PyPI wheels (scripts/cuda-toolkit.sh: shared cuBLAS, a libcuda stub to link
# against). Either way the binary links cudart statically and libcuda.so.1
# from the driver at run time, and targets x86-64-v3 rather than this CPU.
cuda_env() {
  export CMAKE_CUDA_ARCHITECTURES="${CMAKE_CUDA_ARCHITECTURES:-90}"
  local rpath='-C link-arg=-Wl,-rpath,$ORIGIN:$ORIGIN/../lib'
  if command -v nvcc >/dev/null 2>&1; then
    export CUDA_PATH="${CUDA_PATH:-$(dirname "$(dirname "$(command -v nvcc)")")}"
    export RUSTFLAGS="-C target-cpu=x86-64-v3 $rpath"
  else
    export CUDA_PATH
    CUDA_PATH=$("$ROOT/scripts/cuda-toolkit.sh" | tail -1)
    export PATH="$CUDA_PATH/bin:$PATH"
    export RUSTFLAGS="-C target-cpu=x86-64-v3 -C link-arg=-L$CUDA_PATH/lib64 -C link-arg=-lcublas -C link-arg=-lcublasLt $rpath"
  fi
  export CUDA_LIBRARY_PATH="$CUDA_PATH" CUDACXX="$CUDA_PATH/bin/nvcc"
}

cuda() {
  cuda_env
  local target="$SIPP_CACHE/target-cuda"
  echo "== build (--features cuda, sm_$CMAKE_CUDA_ARCHITECTURES, CUDA_PATH=$CUDA_PATH, $target)" >&2
  (cd "$ROOT" && CARGO_TARGET_DIR="$target" nice -n 10 cargo build --release -p sipp-cli --features cuda)
  (cd "$ROOT" && CARGO_TARGET_DIR="$target" nice -n 10 cargo test --release -p sipp-rs --features cuda \
     --no-run --test placement_real)
  ls -la "$target/release/sipp"
}

# What travels to a GPU machine without Rust: the stripped sipp binary and the
# placement test, xz-compressed (each is ~46 MB; the device code for sm_90 is
# most of it).
cuda_pack() {
  local target="$SIPP_CACHE/target-cuda" pack="$SIPP_CACHE/cuda-pack"
  rm -rf "$pack" && mkdir -p "$pack"
  cp "$target/release/sipp" "$pack/sipp"
  local bin
  bin=$(ls -t "$target"/release/deps/placement_real-* | grep -v '\.d$' | head -1)
  cp "$bin" "$pack/placement_real"
  strip "$pack/sipp" "$pack/placement_real"
  xz -T0 -6 "$pack/sipp" "$pack/placement_real"
  du -sh "$pack"/* >&2
  echo "$pack"
}

# On the GPU machine: PACK (the cuda-pack folder), MODEL (the default model's
# GGUF) and REFSRC (llama.cpp's reference source) travel with the repository.
cuda_bench() {
  local pack="${PACK:-$SIPP_CACHE/cuda-pack}" model="${MODEL:?MODEL=path to the default GGUF}"
  local out="${OUT:-/tmp/check-gpu-cuda}" src="${REFSRC:?REFSRC=llama.cpp reference source}"
  mkdir -p "$out"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  export SIPP_MODEL_DIR="$(dirname "$model")"
  for f in sipp placement_real; do
    [ -x "$out/$f" ] || xz -dc "$pack/$f.xz" >"$out/$f" && chmod +x "$out/$f"
  done
  echo "== placement_real on CUDA (10 prompts against the CPU, near-tie rule)" >&2
  (cd "$ROOT/crates/sipp" && timeout 300 "$out/placement_real" --nocapture --test-threads 1) \
    >"$out/placement_real.log" 2>&1 || { tail -40 "$out/placement_real.log"; return 1; }
  grep -E "placement:|diverged at near-ties|test result" "$out/placement_real.log"
  echo "== llama-server for CUDA from the reference source" >&2
  cmake -S "$src" -B "$out/llama-build" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release >"$out/cmake.log" 2>&1
  cmake --build "$out/llama-build" --target llama-server -j "$(nproc)" >>"$out/cmake.log" 2>&1
  local sipp="$out/sipp" server="$out/llama-build/bin/llama-server" port=18800
  bench_server() { # name cmd...
    local name=$1; shift
    "$@" >"$out/$name.log" 2>&1 &
    local pid=$!
    PIDS+=("$pid")
    OUT="$out" wait_health "$port" "$pid"
    for c in 1 8 32 64; do
      "$sipp" bench --url "http://127.0.0.1:$port" --workload generate -C "$c" -R 2 -n 128 --json \
        >"$out/$name-gen-$c.json"
    done
    "$sipp" bench --url "http://127.0.0.1:$port" --workload shared-prefix -C 16 -n 16 --no-baseline --json \
      >"$out/$name-shared.json"
    [ "$name" = sipp ] && curl -sf "http://127.0.0.1:$port/metrics" >"$out/sipp-metrics.txt"
    kill "$pid"; wait "$pid" 2>/dev/null || true
    port=$((port + 1))
  }
  bench_server sipp "$sipp" serve --model "$model" --port "$port" --parallel 64 --ctx-size 65536
  bench_server llama "$server" -m "$model" --port "$port" --host 127.0.0.1 -ngl 99 -np 64 -c 65536
  python3 - "$out" <<'PY'
import json, re, sys
out = sys.argv[1]
def scen(d, prefix): return next(s for s in d["scenarios"] if s["name"].startswith(prefix))
print(f"{'figure':<34} {'sipp':>10} {'llama-server':>13} {'ratio':>7}")
for c in (1, 8, 32, 64):
    for key, label in (("tokens_per_s", "aggregate tok/s"), ("ttft_p50_ms", "TTFT p50 ms")):
        a = scen(json.load(open(f"{out}/sipp-gen-{c}.json")), "concurrent" if c > 1 else "single")[key]
        b = scen(json.load(open(f"{out}/llama-gen-{c}.json")), "concurrent" if c > 1 else "single")[key]
        print(f"{f'{c} streams {label}':<34} {a:>10.1f} {b:>13.1f} {a / b:>7.3f}")
a = scen(json.load(open(f"{out}/sipp-shared.json")), "shared-prefix cache on")["ttft_p50_ms"]
b = scen(json.load(open(f"{out}/llama-shared.json")), "shared-prefix cache on")["ttft_p50_ms"]
print(f"{'shared-prefix x16 TTFT p50 ms':<34} {a:>10.1f} {b:>13.1f} {a / b:>7.3f}")
m = open(f"{out}/sipp-metrics.txt").read()
def total(name):
    return sum(float(l.rsplit(" ", 1)[1]) for l in m.splitlines() if l.startswith(name))
steps = total("sipp_engine_steps_total")
outside = total("sipp_engine_step_seconds_total") - total("sipp_engine_batch_seconds_total")
if steps:
    print(f"engine time outside llama_decode per step: {1000 * outside / steps:.3f} ms over {steps:.0f} steps")
PY
}

case "$MODE" in
  vulkan) vulkan ;;
  cuda) cuda ;;
  cuda-pack) cuda_pack ;;
  cuda-bench) cuda_bench ;;
  *) echo "usage: $0 vulkan|cuda|cuda-pack|cuda-bench" >&2; exit 2 ;;
esac
