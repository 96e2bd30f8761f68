#!/usr/bin/env bash
# The GPU checks the issues ask for, on one CUDA machine, from the repository root.
#
#   bash scripts/gpu_checks.sh parity   OUT   # matmul TFLOP/s, the parity matrix (one process per cell), fp8 cells
#   bash scripts/gpu_checks.sh bench    OUT   # loss_scaled / autocast / parity benchmarks, DDP N=1, GPU tests
#
# Needs CUDA torch, GPU JAX, flax, optax, jmp (and torchao for fp8) importable by $PY (default
# python3). Each cell of the matrix runs in its own process: JAX's `peak_bytes_in_use` is a
# process-lifetime peak with no reset, so one process per cell is what makes it a per-cell figure.
# Every command is bounded by `timeout`; a failing command is reported and the next one runs.
set -uo pipefail
cd "$(dirname "$0")/.."
phase=${1:?usage: gpu_checks.sh parity|bench OUT}
OUT=${2:?usage: gpu_checks.sh parity|bench OUT}
PY=${PY:-python3}
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

step() {  # step SECONDS LOGNAME CMD...: bounded, logged, never fatal
  local limit=$1 log=$2
  shift 2
  echo "== $* (limit ${limit}s)"
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$log.log" 2>&1
  local rc=$?
  echo "   rc=$rc in $((SECONDS - start)) s; last lines:"
  tail -n 4 "$OUT/$log.log" | sed 's/^/   | /'
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import jax, torch; print('jax', jax.__version__, jax.devices(), '| torch', torch.__version__, torch.cuda.get_device_name())"

case "$phase" in
parity)
  step 120 matmul "$PY" -m parity matmul --device gpu --sizes 1024 2048 4096 8192 --out "$OUT/matmul" --quiet
  for model in mlp cnn transformer resnet; do
    for precision in fp32 bf16-mixed fp16-mixed; do
      step 90 "run_${model}_${precision}" "$PY" -m parity run --model "$model" --precision "$precision" \
        --device gpu --steps 100 --out "$OUT/matrix" --no-progress
    done
  done
  for model in mlp transformer; do
    for precision in fp8-tensorwise fp8-rowwise fp8-rowwise-gw-hp; do
      step 90 "run_${model}_${precision}" "$PY" -m parity run --model "$model" --precision "$precision" \
        --device gpu --steps 60 --out "$OUT/matrix" --no-progress
    done
  done
  step 120 compare "$PY" -m parity compare "$OUT/matrix"
  ;;
bench)
  step 200 bench_loss_scaled "$PY" benchmarks/bench_loss_scaled.py --out "$OUT/loss_scaled.json"
  step 120 bench_autocast "$PY" benchmarks/bench_autocast.py --device gpu --out "$OUT/autocast.json"
  step 200 bench_parity "$PY" benchmarks/bench_parity.py --device gpu --out "$OUT/parity_gpu.json"
  step 150 ddp1 "$PY" -m parity run --model mlp --precision bf16-mixed --devices 1 --strategy ddp \
    --device gpu --steps 8 --batch-size 8 --no-eval --out "$OUT/ddp1"
  step 200 gpu_tests "$PY" -m pytest -q -p no:cacheprovider -o addopts="" tests/jaxamp/test_doctests.py \
    tests/jaxamp/test_autocast_overrides.py tests/jaxamp/test_policy.py tests/jaxamp/test_reduce_dtype.py
  ;;
*)
  echo "unknown phase '$phase': parity or bench" >&2
  exit 2
  ;;
esac
