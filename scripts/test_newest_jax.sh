#!/usr/bin/env bash
# The torch-free tests (kernels, Triton cross-lowering, worker, engine on SumModel,
# models without transformers) again under Python 3.12 and the newest jax the package
# allows, in .venv312 (created if missing). Only a Python 3.11 CPU torch lies on these
# machines and any other torch pulls a multi-GB CUDA build, so this venv gets the
# package with its `test-base` extra only; tests that need torch/transformers skip
# with a reason (pytest.importorskip in tests/conftest.py).
# Skips, with a printed reason, where no python3.12 exists. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python312.sh test_newest_jax
if [ ! -x .venv312/bin/python ]; then
  "$py312" -m venv .venv312
fi
# --upgrade-strategy eager: the newest jax/jaxlib/flax inside pyproject's bounds.
.venv312/bin/python -m pip install --quiet --no-compile --disable-pip-version-check \
  --upgrade --upgrade-strategy eager -e '.[test-base]'
.venv312/bin/python -c 'import sys, jax, flax; print(f"test_newest_jax: Python {sys.version.split()[0]}, jax {jax.__version__}, flax {flax.__version__}")'
# CPU only: this venv may also hold the CUDA plugin of scripts/gpu_compile_check.sh, which
# without a GPU would print a cuDNN traceback at jax's first use and then fall back anyway.
export JAX_PLATFORMS=cpu
# What can differ across jax versions: the Pallas kernels (interpret mode, the Triton and
# Mosaic lowerings), the models' forward, sharding and random init, the worker's jitted
# step, sampler and executable cache, the engine's step programs and one engine end to end
# (the decode-path tests). Not run here (docs/ci.md): files that never call jax (the
# roofline's byte counts, the tuned-config table, the package surface, the warp table, the
# worker's host-side batch packing, config.json and checkpoint-file checks), the fp8 cell
# script's smoke (test_fp8_kv.py runs its kernels), and the tests the default-Python suite
# runs alone: tests/core (host only), the engine's scheduling tests on SumModel (host logic
# around the jitted step the worker tests cover) and the API tests (tests/llm, mostly
# torch-based). Also left to the default-Python suite, for CI's budget: three files whose
# jax use the files kept here exercise on this jax too (the pure-JAX references, which
# every kernel test here compares against; the sampling-noise statistics, whose sampler
# test_sampling.py runs; the non-finite flag, whose step test_step_programs.py builds).
# CI runs this beside the main test stage with PAGED_JAX_TEST_WORKERS=1.
# The shared XLA compilation cache of tests/conftest.py keeps this venv's entries in their
# own folder (its name carries the Python, jax and jaxlib versions).
export PAGED_JAX_TEST_CPU_DURATIONS="${PAGED_JAX_TEST_CPU_DURATIONS:-20}"
exec .venv312/bin/python -m pytest -q -p no:cacheprovider \
  -n "${PAGED_JAX_TEST_WORKERS:-2}" --dist loadscope --durations=20 \
  tests/pallas_kernels tests/worker tests/models \
  tests/engine/test_step_programs.py tests/engine/test_decode_path_and_validate.py \
  --ignore=tests/pallas_kernels/test_roofline.py --ignore=tests/pallas_kernels/test_tuning.py \
  --ignore=tests/pallas_kernels/test_package.py --ignore=tests/pallas_kernels/test_num_warps.py \
  --ignore=tests/pallas_kernels/test_fp8_scripts.py --ignore=tests/pallas_kernels/test_reference.py \
  --ignore=tests/worker/test_sampling_noise.py --ignore=tests/worker/test_nonfinite.py \
  --ignore=tests/worker/test_block_table.py --ignore=tests/worker/test_decode_only_steps.py \
  --ignore=tests/worker/test_input_batch.py --ignore=tests/worker/test_input_batch_schedule.py \
  --ignore=tests/worker/test_prepare_fast_path.py \
  --ignore=tests/models/test_config_strict.py --ignore=tests/models/test_load_errors.py \
  --ignore=tests/models/test_load_hardening.py --ignore=tests/models/test_loading.py "$@"
