#!/usr/bin/env bash
# The torch-free install, from scratch: a virtual environment in .venv-check with the project's
# `check` extra (the parity extra without torch/torchao), `dev` and `test` (transformers' Flax
# models), pinned by constraints.txt; then, in it, the golden-file tests (`python -m parity check`
# and `bisect` of the committed goldens, damaged files) and the example CI project's own tests, as
# a CI job without torch runs them. Tests that need torch (exports) skip there. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-check
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[check,dev,test]"
# the environment is what it claims: no torch, torchao or torchvision; transformers' Flax models import
"$VENV/bin/python" - <<'PY'
import importlib.util
present = [name for name in ("torch", "torchao", "torchvision") if importlib.util.find_spec(name)]
assert not present, f"the torch-free environment has {present}"
from transformers import FlaxGPT2LMHeadModel  # noqa: F401
print("torch-free environment ready: no torch, transformers' Flax models import")
PY
rc=0
"$VENV/bin/python" -m pytest -p no:cacheprovider -n 2 -q \
  tests/parity/test_parity_golden.py tests/parity/test_parity_golden_inputs.py \
  tests/parity/test_parity_golden_replay.py || rc=$?
# the example project as its own CI job runs it: its own pytest session (no tests/conftest.py)
"$VENV/bin/python" -m pytest -p no:cacheprovider -q examples/parity_ci || rc=$?
exit "$rc"
