#!/usr/bin/env bash
# The chat page's two third-party scripts, taken unmodified from their npm
# packages: marked (markdown to HTML) and DOMPurify (sanitizes that HTML).
# `scripts/web-vendor.sh` writes them into crates/sipp-server/web/vendor/;
# `scripts/web-vendor.sh --check` verifies the committed copies are
# byte-for-byte the packages' files. Needs npm (Debian's `npm`).
set -euo pipefail
cd "$(dirname "$0")/.."
MARKED=18.3.0
DOMPURIFY=3.5.0
dest=crates/sipp-server/web/vendor
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
command -v npm >/dev/null || { echo "npm is required (apt-get install npm)" >&2; exit 1; }
(cd "$tmp" && npm pack --silent "marked@$MARKED" "dompurify@$DOMPURIFY" >/dev/null)
mkdir -p "$tmp/marked" "$tmp/dompurify"
tar xzf "$tmp/marked-$MARKED.tgz" -C "$tmp/marked"
tar xzf "$tmp/dompurify-$DOMPURIFY.tgz" -C "$tmp/dompurify"
declare -A files=(
  [marked.umd.js]="$tmp/marked/package/lib/marked.umd.js"
  [purify.min.js]="$tmp/dompurify/package/dist/purify.min.js"
)
status=0
for name in "${!files[@]}"; do
  if [ "${1:-}" = "--check" ]; then
    if cmp -s "${files[$name]}" "$dest/$name"; then
      echo "$name: identical to its npm package"
    else
      echo "$name: DIFFERS from its npm package" >&2
      status=1
    fi
  else
    cp "${files[$name]}" "$dest/$name"
    echo "wrote $dest/$name"
  fi
done
exit $status
