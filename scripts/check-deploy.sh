#!/usr/bin/env bash
# Validates deploy/ offline: the Kubernetes manifests (Kubernetes' own schemas,
# strict; the Gateway API's published schemas; field checks of InferencePool
# v1 and the endpoint picker's config for the Gateway API Inference Extension
# v1.3.1; how the objects fit together), the Dockerfiles (hadolint and what the
# images must be), then breaks the manifests on purpose and requires every
# break to be caught. No Docker engine and no cluster are used.
#
# Installs what it needs, once, outside the repository:
#   $SIPP_CACHE/venv-deploy      scripts/requirements-deploy.txt (kubernetes-validate,
#                                jsonschema, PyYAML, hadolint, Node.js)
#   $SIPP_CACHE/npm-deploy       deploy/validate/package-lock.json
#                                (@kubernetes-models/gateway-api)
# Ends with one line "N passed, M failed"; exits 1 when anything failed.
#
# Usage: scripts/check-deploy.sh [--kube-version 1.33.0]
source "$(dirname "$0")/env.sh"
ROOT="$(sipp_root)"

VENV="$SIPP_CACHE/venv-deploy"
ensure_venv "$VENV" "$ROOT/scripts/requirements-deploy.txt"
export PATH="$VENV/bin:$PATH"

# npm packages: reinstalled only when the lock file changes.
NPM_DIR="$SIPP_CACHE/npm-deploy"
LOCK="$ROOT/deploy/validate/package-lock.json"
want=$(cat "$ROOT/deploy/validate/package.json" "$LOCK" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$NPM_DIR/.lock.sha256" 2>/dev/null)" != "$want" ]; then
  rm -rf "$NPM_DIR"
  mkdir -p "$NPM_DIR"
  cp "$ROOT/deploy/validate/package.json" "$LOCK" "$NPM_DIR/"
  (cd "$NPM_DIR" && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
  echo "$want" > "$NPM_DIR/.lock.sha256"
fi

exec "$VENV/bin/python" "$ROOT/deploy/validate/validate_manifests.py" \
  --repo "$ROOT" \
  --node "$VENV/bin/node" \
  --node-modules "$NPM_DIR/node_modules" \
  --hadolint "$VENV/bin/hadolint" \
  "$@"
