#!/usr/bin/env bash
# The one GPU check: every GPU figure the project quotes, in one call of at most 8 minutes
# (each stage capped; parity/cli/gpu_check.py holds the plan and reads the figures back).
#
#   bash scripts/gpu_checks.sh OUT          # on a machine with one CUDA GPU: OUT/gpu_check.json + .log
#   bash scripts/gpu_checks.sh --dry OUT    # anywhere (CI): every stage built and parsed, one CPU step
#   bash scripts/gpu_checks.sh OUT --only gpt2-fp32 jaxamp-tests --cap jaxamp-tests=150
#
# Needs CUDA torch, JAX with CUDA, flax, optax (what a CUDA image has) plus jmp, importable by $PY
# (default python3); this checkout is put on PYTHONPATH. JAX does not preallocate GPU memory, so
# its allocator peak is the model's.
set -uo pipefail
cd "$(dirname "$0")/.."
dry=()
if [ "${1:-}" = "--dry" ]; then
  dry=(--dry)
  shift
fi
OUT=${1:?usage: gpu_checks.sh [--dry] OUT [--only KEY...] [--cap KEY=SECONDS...]}
shift
PY=${PY:-python3}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ ${#dry[@]} -eq 0 ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
exec "$PY" -m parity.cli.gpu_check --out "$OUT" "${dry[@]}" "$@"
