#!/usr/bin/env bash
# A minimal "Vulkan SDK" for building the llama.cpp Vulkan backend on Debian 12,
# and the system packages to build and run it on lavapipe (Mesa's CPU driver).
# Idempotent; messages go to stderr and the SDK's path is the last line on stdout:
#
#   VULKAN_SDK=$(scripts/vulkan-sdk.sh) CARGO_TARGET_DIR=~/.cache/sipp/target-vulkan \
#     cargo build --release -p sipp-cli --features vulkan
#   GGML_VK_VISIBLE_DEVICES=0 ~/.cache/sipp/target-vulkan/release/sipp run ...
#
# Why: Debian 12's libvulkan-dev (1.3.239) headers are too old for ggml-vulkan
# (no vk::LayerSettingEXT). Debian 13's libvulkan-dev (1.4.309) headers work, so
# they are unpacked into $SIPP_CACHE/vulkan-sdk/sdk/include. Its loader needs
# glibc 2.38, so sdk/lib/libvulkan.so links Debian 12's own libvulkan.so.1
# instead (ggml-vulkan loads its entry points through the dynamic dispatcher).
# glslc and SPIRV-Headers come from Debian 12 (CMake finds them in /usr).
# ggml-vulkan skips CPU devices such as lavapipe unless GGML_VK_VISIBLE_DEVICES
# names them: set GGML_VK_VISIBLE_DEVICES=0 when running.
source "$(dirname "$0")/env.sh"

VULKAN_HEADERS_VERSION="${VULKAN_HEADERS_VERSION:-1.4.309.0-1}"
VULKAN_HEADERS_SHA256="${VULKAN_HEADERS_SHA256:-8d329d465e16168afff58b1bd0dd6db46aac2cc3f56054a481b25a04e90b345a}"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
VULKAN_DIR="$SIPP_CACHE/vulkan-sdk"
SDK="$VULKAN_DIR/sdk"
SYSTEM_LOADER=/usr/lib/x86_64-linux-gnu/libvulkan.so.1

# Debian 12 packages: the shader compiler, SPIR-V headers, the loader, lavapipe,
# and vulkaninfo (to check which devices the loader sees).
ensure_vulkan_packages() {
  ensure_apt_packages glslc spirv-headers libvulkan1 mesa-vulkan-drivers vulkan-tools
}

# fetch_headers_deb DEST: Debian 13's libvulkan-dev .deb from the pool; if that
# version has left the pool (a point release replaced it), apt downloads the
# current trixie one, with a private sources list that leaves the system's alone.
fetch_headers_deb() {
  local dest=$1
  local url="$DEBIAN_MIRROR/pool/main/v/vulkan-loader/libvulkan-dev_${VULKAN_HEADERS_VERSION}_amd64.deb"
  echo "fetching $url" >&2
  if curl -sfL -o "$dest.part" "$url"; then
    if [ "$(sha256sum "$dest.part" | cut -d' ' -f1)" != "$VULKAN_HEADERS_SHA256" ]; then
      echo "checksum mismatch for $url" >&2; rm -f "$dest.part"; return 1
    fi
    mv "$dest.part" "$dest"
    return 0
  fi
  rm -f "$dest.part"
  echo "not in the pool any more; asking apt for trixie's libvulkan-dev" >&2
  local apt="$VULKAN_DIR/apt"
  mkdir -p "$apt/lists/partial" "$apt/archives/partial"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $DEBIAN_MIRROR trixie main" \
    > "$apt/sources.list"
  local opts=(-o "Dir::Etc::SourceList=$apt/sources.list" -o "Dir::Etc::SourceParts=-"
              -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt" -o "Debug::NoLocking=1")
  apt-get "${opts[@]}" update -qq >&2
  (cd "$apt/archives" && rm -f libvulkan-dev_*.deb &&
     apt-get "${opts[@]}" download libvulkan-dev/trixie >&2)
  mv "$apt"/archives/libvulkan-dev_*.deb "$dest"
}

ensure_sdk() {
  if [ -f "$SDK/include/vulkan/vulkan.hpp" ] && [ -e "$SDK/lib/libvulkan.so" ]; then
    return 0
  fi
  mkdir -p "$VULKAN_DIR"
  local deb="$VULKAN_DIR/libvulkan-dev_trixie_amd64.deb"
  [ -f "$deb" ] || fetch_headers_deb "$deb"
  local stage="$VULKAN_DIR/stage.$$"
  rm -rf "$stage" "$SDK"
  dpkg-deb -x "$deb" "$stage"
  mkdir -p "$SDK/lib"
  mv "$stage/usr/include" "$SDK/include"
  rm -rf "$stage"
  ln -sf "$SYSTEM_LOADER" "$SDK/lib/libvulkan.so"
  echo "Vulkan headers 1.4.$(awk '/^#define VK_HEADER_VERSION /{print $3}' "$SDK/include/vulkan/vulkan_core.h") in $SDK" >&2
}

ensure_vulkan_packages
ensure_sdk
echo "$SDK"
