#!/usr/bin/env bash
# Every GPU check in one prepared run, for a lent NVIDIA machine (see ../.library/device):
#   the gpu-marked tests (real Triton compiles of the Pallas kernels, the engine on Pallas),
#   the kernel benchmark, and the engine benchmark. Results land in $OUT (default gpu_results/).
# Each step has its own time limit so a slow one cannot eat the whole lease.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
py=${PYTHON:-python3}

$py -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 ||
  { echo "install failed"; tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
$py -c "import jax; print(jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"

echo "== gpu tests"
timeout 240 $py -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest_gpu.log"
echo "== kernel benchmark"
timeout 300 $py scripts/bench_kernels.py --output "$OUT/bench_kernels.json" 2>&1 |
  tee "$OUT/bench_kernels.log"
echo "== engine benchmark"
timeout 240 $py scripts/bench_engine.py --dtype bfloat16 --output "$OUT/bench_engine.json" 2>&1 |
  tee "$OUT/bench_engine.log"
