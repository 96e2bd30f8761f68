#!/usr/bin/env bash
# Sets up a fresh machine: a virtual environment in .venv with the project and every extra,
# torch pinned by constraints.txt (CPU build where one is available). Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[parity,dev,test]"
echo "environment ready: $(pwd)/.venv"
