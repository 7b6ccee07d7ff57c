#!/usr/bin/env bash
# Optional (issue 17): install the full trainer frameworks on CPU torch in .venv-trainers and run one tiny
# run per framework that can run on a CPU here: TRL's real GRPOTrainer (tests/trainers), and OpenRLHF's agent
# executor with real torch rewards. verl and OpenRLHF cannot be installed whole here (vLLM/SGLang and
# flash-attn need CUDA); `make test` runs their own modules by path.
set -euo pipefail
cd "$(dirname "$0")/.."
V=.venv-trainers
base=$(.venv/bin/python -c 'import sys; print(sys._base_executable)')
# torch's CPU build: this site keeps the file on disk (pip's find-links); never a CUDA build from an index
links=()
[ -d /opt/wheels ] && links=(--find-links /opt/wheels)
if [ ! -f "$V/.shoal-installed" ] || [ pyproject.toml -nt "$V/.shoal-installed" ]; then
  echo "==> $V: torch (CPU), trl==1.16.0, shoal"
  .venv/bin/uv venv -q --allow-existing -p "$base" "$V"
  .venv/bin/uv pip install -q -p "$V/bin/python" "${links[@]}" "torch==2.13.0+cpu" "trl==1.16.0" -e '.[dev,rl-test]'
  touch "$V/.shoal-installed"
fi
export TRL_EXPERIMENTAL_SILENCE=1
exec "$V/bin/python" -m pytest tests/trainers tests/integration/test_integration_openrlhf.py -q "$@"
