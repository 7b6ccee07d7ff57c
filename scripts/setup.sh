#!/usr/bin/env bash
# Install everything shoal needs on Debian 12 (as root): system packages, a Python venv, the agent.
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  # build the in-sandbox agent and Python packages with C parts
  gcc make libc6-dev python3 python3-venv python3-dev
  # container sandboxes
  crun runc iproute2 nftables kmod util-linux
  # gVisor, the stronger runtime option (runtime="gvisor"; Debian 12 packages a 2022 build)
  runsc
  # image store; the node's layer reader (chunkd/: SHA-256 from libcrypto, zstd chunk objects, FUSE)
  erofs-utils mmdebstrap skopeo zstd e2fsprogs btrfs-progs libssl-dev libzstd-dev
  # a loopback registry for the image-import tests (never started as a service)
  docker-registry
  # a real distributed filesystem for the shared-store tests (`shoal store dev-moosefs`; no service started)
  moosefs-master moosefs-chunkserver moosefs-client
  # microVM / VM backends (guest kernel comes from Debian's package, never from elsewhere)
  qemu-system-x86 qemu-utils busybox-static cpio linux-image-amd64
  # the dashboard's browser tests (headless, driven by Playwright or Selenium; no browser is downloaded)
  chromium chromium-driver
)

if [ "$(id -u)" != 0 ]; then
  echo "setup.sh: run as root (sandboxes need mounts, cgroups and namespaces)" >&2
  exit 1
fi

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "==> apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "setup.sh: $PYTHON is older than 3.11" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv with $PYTHON"
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.shoal-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "==> pip install -e .[dev,ray]"
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e '.[dev,ray]'
  touch "$stamp"
fi

# the real RL frameworks the integration tests run against (issue 17), installed with uv: pip's resolver
# takes minutes on harbor's dependency tree, uv seconds
stamp=.venv/.shoal-rl-test
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "==> uv pip install -e .[rl-test]"
  .venv/bin/uv pip install -q -p .venv/bin/python -e '.[rl-test]'
  touch "$stamp"
fi
# Harbor needs Python >= 3.12: a second venv where such an interpreter exists (pyenv has them here)
harbor_py=""
for c in python3.13 python3.12 $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python 2>/dev/null | sort -rV); do
  if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
    harbor_py=$(command -v "$c")
    break
  fi
done
stamp=.venv-harbor/.shoal-installed
if [ -z "$harbor_py" ]; then
  echo "==> no Python >= 3.12 here: the Harbor tests will be skipped (they need one for harbor itself)"
elif [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "==> .venv-harbor with $harbor_py: uv pip install -e .[harbor]"
  .venv/bin/uv venv -q --allow-existing -p "$harbor_py" .venv-harbor
  .venv/bin/uv pip install -q -p .venv-harbor/bin/python -e '.[harbor]'
  touch "$stamp"
fi
# the unmodified verl, OpenRLHF and TRL modules the tests load by path (importing those packages needs
# torch, which `make test` does not install): their wheels from PyPI, unpacked, never installed
for spec in verl==0.9.1 openrlhf==0.11.2 trl==1.16.0; do
  name=${spec%%==*}
  dest=build/frameworks/$name
  if [ ! -f "$dest/.shoal-$spec" ]; then
    echo "==> $spec's wheel into $dest (read by the tests, not installed)"
    tmp=$(mktemp -d)
    .venv/bin/pip download -q --no-deps -d "$tmp" "$spec"
    rm -rf "$dest" && mkdir -p "$dest"
    .venv/bin/python -m zipfile -e "$tmp"/*.whl "$dest"
    rm -rf "$tmp"
    touch "$dest/.shoal-$spec"
  fi
done

echo "==> building the in-sandbox agent"
make -s -C agent
echo "==> building the layer reader (shoal-chunkd)"
make -s -C chunkd

# crun refuses hybrid-cgroup hosts unless the hugetlb v1 hierarchy is mounted; runc works either way
.venv/bin/shoal doctor --fix >/dev/null || true
echo "==> setup done"
