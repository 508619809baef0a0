#!/usr/bin/env bash
# Every GPU check in one prepared run, sized for a lent NVIDIA machine: one command of at
# most 600 s inside a 15-minute device lease (start-up included), so the steps' limits add
# up to <= 480 s. The machine has Python 3.12 with jax preinstalled and no network: no
# install is attempted beyond an offline editable install, and a source-tree fallback
# (PYTHONPATH=$PWD plus a paged_jax/models link, as pyproject's package-dir maps it).
#   1. setup: import check, GPU and jax versions
#   2. the gpu-marked tests (real Triton compiles of every kernel, engine on Pallas)
#   3. decode benchmark: batch {1,64,256} x context {2k,8k}, ours vs JAX's Pallas
#      paged_attention vs an XLA gather, fraction of 4.8 TB/s; JSON after every cell
#   4. one engine benchmark cell (paged engine, bf16, Pallas kernels)
# Results land in $OUT (default gpu_results/). `bash scripts/gpu_checks.sh --dry-run`
# prints the plan and its time budget without touching a GPU (tested on CPU).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_results}
py=${PYTHON:-python3}

# step name | time limit (s) | what it runs
STEPS=(
  "setup|40|import check, nvidia-smi, jax devices"
  "gpu_tests|170|pytest -m gpu tests"
  "bench_kernels|120|scripts/bench_kernels.py (6 decode cells x 3 implementations)"
  "bench_engine|110|scripts/bench_engine.py --systems paged, one cell"
  "fp8_decode|30|scripts/bench_fp8_decode.py: decode on bf16 vs fp8 caches"
)
BUDGET_LIMIT=480

limit_of() {
  local s
  for s in "${STEPS[@]}"; do
    IFS='|' read -r name limit _ <<<"$s"
    [ "$name" = "$1" ] && echo "$limit"
  done
}

total=0
for s in "${STEPS[@]}"; do
  IFS='|' read -r _ limit _ <<<"$s"
  total=$((total + limit))
done

if [ "${1:-}" = "--dry-run" ]; then
  echo "gpu_checks plan (results in $OUT/):"
  for s in "${STEPS[@]}"; do
    IFS='|' read -r name limit what <<<"$s"
    printf "  step %-14s <= %4d s  %s\n" "$name" "$limit" "$what"
  done
  echo "gpu_checks budget: total ${total} s <= ${BUDGET_LIMIT} s"
  $py scripts/bench_kernels.py --dry-run --time-limit $(($(limit_of bench_kernels) - 30))
  [ "$total" -le "$BUDGET_LIMIT" ] || { echo "budget exceeded"; exit 1; }
  exit 0
fi

mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s)
step() { echo "== $1 (limit $(limit_of "$1") s, $(($(date +%s) - start)) s elapsed)"; }

step setup
if ! $py -c "import paged_jax.models, pallas_kernels" 2>/dev/null; then
  if ! timeout 30 $py -m pip install -q --no-deps --no-build-isolation --no-index -e . \
    >"$OUT/install.log" 2>&1; then
    # Source-tree fallback: pyproject maps paged_jax.models to models/; a link does too.
    [ -e paged_jax/models ] || ln -s ../models paged_jax/models
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    echo "setup: editable install unavailable offline; using PYTHONPATH=$PWD"
  fi
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  timeout "$(limit_of setup)" $py -c \
    "import sys, jax, paged_jax.models; print(sys.version.split()[0], jax.__version__, jax.devices())"
} | tee "$OUT/gpu.txt"

step gpu_tests
timeout "$(limit_of gpu_tests)" $py -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 |
  tee "$OUT/pytest_gpu.log"

step bench_kernels
# Stop starting new cells 30 s before the step's limit: the JSON is complete up to there.
timeout "$(limit_of bench_kernels)" $py scripts/bench_kernels.py \
  --time-limit $(($(limit_of bench_kernels) - 30)) --output "$OUT/bench_kernels.json" 2>&1 |
  tee "$OUT/bench_kernels.log"

step bench_engine
timeout "$(limit_of bench_engine)" $py scripts/bench_engine.py --systems paged --repeats 2 --dtype bfloat16 \
  --num-requests 32 --max-num-seqs 32 --max-num-batched-tokens 128 --max-model-len 1024 \
  --output "$OUT/bench_engine.json" 2>&1 | tee "$OUT/bench_engine.log"

step fp8_decode
timeout "$(limit_of fp8_decode)" $py scripts/bench_fp8_decode.py \
  --output "$OUT/bench_fp8_decode.json" 2>&1 | tee "$OUT/bench_fp8_decode.log"

echo "== done in $(($(date +%s) - start)) s (budget ${total} s); results in $OUT/"
