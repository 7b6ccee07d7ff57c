#!/usr/bin/env bash
# Refresh the dashboard's vendored JavaScript (committed as built files, so `make demo` needs no network
# and no Node.js): xterm.js and its fit addon from the npm registry, versions pinned here.
set -euo pipefail
cd "$(dirname "$0")/.."
XTERM=@xterm/xterm@6.0.0
FIT=@xterm/addon-fit@0.11.0
dest=src/shoal/server/ui/static/vendor/xterm
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "$XTERM" "$FIT" >/dev/null && mkdir x f \
  && tar xzf xterm-xterm-*.tgz -C x && tar xzf xterm-addon-fit-*.tgz -C f)
mkdir -p "$dest"
# source maps are not shipped: drop the comments that point at them
sed '/^\/\/# sourceMappingURL=/d' "$tmp/x/package/lib/xterm.js" > "$dest/xterm.js"
sed '/^\/\/# sourceMappingURL=/d' "$tmp/f/package/lib/addon-fit.js" > "$dest/addon-fit.js"
cp "$tmp/x/package/css/xterm.css" "$dest/xterm.css"
cp "$tmp/x/package/LICENSE" "$dest/LICENSE"
echo "$XTERM $FIT" > "$dest/VERSION"
echo "vendored $XTERM and $FIT into $dest"
