#!/usr/bin/env bash
# A MooseFS dev cluster (master + 2 chunkservers, each in its own network namespace), FUSE-mounted on
# this host:  scripts/moosefs.sh up|down|status [--name NAME] [--chunkservers N]
# Same as `shoal store dev-moosefs …`; then: export SHOAL_STORE=/var/lib/shoal-moosefs/dev/mnt/store
set -euo pipefail
cd "$(dirname "$0")/.."
cmd=${1:-status}
shift || true
exec .venv/bin/shoal store dev-moosefs "$cmd" "$@"
