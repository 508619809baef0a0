#!/usr/bin/env bash
# The deviceless H200 compile check (scripts/gpu_compile_check.py) under one or both CUDA
# toolchains, each in its own Python 3.12 venv with the CUDA toolchain it needs installed
# (a jax CUDA plugin pinned to the venv's jax and the NVIDIA assemblers ptxas and nvJitLink;
# about 1 GB each, no cuDNN/cuBLAS/NCCL, no GPU):
#   cuda12: .venv312 (scripts/test_newest_jax.sh's venv, the newest allowed jax) +
#           jax-cuda12-plugin, nvidia-cuda-nvcc-cu12, nvidia-nvjitlink-cu12
#   cuda13: .venv-device (scripts/device_venv.sh: the GPU machine's jax 0.11.2) +
#           jax-cuda13-plugin/pjrt, nvidia-cuda-nvcc and nvidia-nvjitlink 13.0.x and their
#           crt/nvvm/runtime dependencies pinned to 13.0.x too (CUDA 13
#           dropped the -cu13 suffix; 13.0 is the GPU machine's nvcc)
# JAX_PLATFORMS=cpu: the CUDA plugin is only used to compile, never as a client.
#   bash scripts/gpu_compile_check.sh [--toolchain cuda12|cuda13|both] [script args]
# Default: both toolchains, --grid ci. With --grid full each rewrites its report
# (docs/gpu_compile_h200.json, docs/gpu_compile_h200_cuda13.json). Prints each run's wall
# time. Skips, with a printed reason, where no python3.12 exists.
set -euo pipefail
cd "$(dirname "$0")/.."
toolchain=both
if [ "${1:-}" = "--toolchain" ]; then
  toolchain=${2:?--toolchain needs cuda12, cuda13 or both}
  shift 2
fi
case "$toolchain" in
  cuda12 | cuda13 | both) ;;
  *) echo "gpu_compile_check: --toolchain=$toolchain must be cuda12, cuda13 or both" >&2; exit 2 ;;
esac
if [ $# -eq 0 ]; then
  set -- --grid ci
fi
source scripts/python312.sh gpu_compile_check
pip_install() {
  "$1" -m pip install --quiet --no-compile --disable-pip-version-check "${@:2}"
}

run() {  # run TOOLCHAIN SCRIPT_ARGS...: installs that toolchain into its venv, runs the check
  local cuda=$1 py start=$SECONDS rc=0
  shift
  if [ "$cuda" = cuda12 ]; then
    py=.venv312/bin/python
    if [ ! -x "$py" ]; then
      "$py312" -m venv .venv312
      pip_install "$py" -e '.[test-base]'
    fi
    local jax_version
    jax_version=$("$py" -c 'import jax; print(jax.__version__)')
    pip_install "$py" "jax-cuda12-plugin==${jax_version}" nvidia-cuda-nvcc-cu12 nvidia-nvjitlink-cu12
  else
    py=$(bash scripts/device_venv.sh | tail -1)
    local jax_version
    jax_version=$("$py" -c 'import jax; print(jax.__version__)')
    pip_install "$py" "jax-cuda13-plugin==${jax_version}" "jax-cuda13-pjrt==${jax_version}" \
      'nvidia-cuda-nvcc==13.0.*' 'nvidia-nvjitlink==13.0.*' \
      'nvidia-cuda-crt==13.0.*' 'nvidia-nvvm==13.0.*' 'nvidia-cuda-runtime==13.0.*'
  fi
  JAX_PLATFORMS=cpu "$py" scripts/gpu_compile_check.py "$@" || rc=$?
  echo "gpu_compile_check: $cuda toolchain (jax $jax_version): rc=$rc, wall $((SECONDS - start)) s"
  return $rc
}

if [ "$toolchain" = both ]; then
  rc=0
  run cuda12 "$@" || rc=$?
  run cuda13 "$@" || rc=$?
  exit $rc
fi
run "$toolchain" "$@"
