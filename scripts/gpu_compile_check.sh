#!/usr/bin/env bash
# The deviceless H200 compile check (scripts/gpu_compile_check.py) in the Python 3.12
# venv of scripts/test_newest_jax.sh (.venv312, created if missing), after installing
# the CUDA toolchain it needs: jax-cuda12-plugin pinned to the venv's jax, and the
# NVIDIA assemblers (ptxas, nvJitLink); about 1 GB, no cuDNN/cuBLAS/NCCL, no GPU.
# JAX_PLATFORMS=cpu: the CUDA plugin is only used to compile, never as a client.
# Skips, with a printed reason, where no python3.12 exists. Extra arguments go to the
# script (default: --grid ci, a few minutes; --grid full rewrites docs/gpu_compile_h200.json).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python312.sh gpu_compile_check
if [ ! -x .venv312/bin/python ]; then
  "$py312" -m venv .venv312
  .venv312/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test-base]'
fi
jax_version=$(.venv312/bin/python -c 'import jax; print(jax.__version__)')
.venv312/bin/python -m pip install --quiet --disable-pip-version-check \
  "jax-cuda12-plugin==${jax_version}" nvidia-cuda-nvcc-cu12 nvidia-nvjitlink-cu12
if [ $# -eq 0 ]; then
  set -- --grid ci
fi
JAX_PLATFORMS=cpu exec .venv312/bin/python scripts/gpu_compile_check.py "$@"
