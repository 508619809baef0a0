#!/usr/bin/env bash
# Install paged-jax with its test extra into .venv (created if missing) and run the suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# ray: the data-parallel tests (tests/data_parallel; ~40 s to install, ~2 min to run on
# 2 cores); they skip with a reason where it is absent. structured: llguidance for
# tests/structured (~2 s to install, no dependencies). eval: lm-eval for tests/lm_eval
# (its hf-backend parity tests; they skip with a reason where it is absent).
# --no-compile: pip would byte-compile every installed module (torch, transformers,
# ray, lm-eval's dependencies), most of which no test imports; Python compiles what is
# imported, once (measured into a fresh venv: 212 -> 129 CPU s for this install).
.venv/bin/python -m pip install --quiet --no-compile --disable-pip-version-check -e '.[test,plots,ray,structured,eval]'
# Two pytest workers (pytest-xdist), one module each at a time (--dist loadscope keeps a
# module's fixtures, such as the multi-device subprocess run, on one worker): most tests
# are single-threaded XLA compiles, so on 2 cores this halves the wall time.
# $PAGED_JAX_TEST_WORKERS sets the count (0 = in the runner's own process).
# The workers share one persistent XLA compilation cache (tests/conftest.py: under
# ~/.cache/paged_jax/test-xla-cache/, one folder per Python/jax/jaxlib/backend;
# PAGED_JAX_TEST_XLA_CACHE=0 turns it off). --durations=20: the slowest tests, each run
# (docs/ci.md), by wall time and by CPU seconds (steadier on a loaded machine).
# Without arguments, on jaxlib < 0.11, the main pass compiles with XLA's legacy CPU
# emitters (PAGED_JAX_TEST_CPU_EMITTERS=legacy: faster to compile, tests/conftest.py);
# the tests marked xla_default_cpu_codegen (the batch-invariant mode's bits) skip there,
# saying why, and a second pass runs them alone under XLA's own emitters. With arguments:
# one pass, as given, under XLA's own emitters unless PAGED_JAX_TEST_CPU_EMITTERS says.
export PAGED_JAX_TEST_CPU_DURATIONS="${PAGED_JAX_TEST_CPU_DURATIONS:-20}"
pytest_run() {
  .venv/bin/python -m pytest -q -n "${PAGED_JAX_TEST_WORKERS:-2}" --dist loadscope \
    --durations=20 "$@"
}
if [ $# -gt 0 ]; then
  pytest_run "$@"
  exit
fi
# The second pass (a few modules, one worker; the Ray replicas mostly wait) runs beside
# the first, its output printed after it; either failing fails the run.
rc=0
second_log=$(mktemp)
PAGED_JAX_TEST_CPU_EMITTERS=default PAGED_JAX_TEST_WORKERS=1 \
  pytest_run -m xla_default_cpu_codegen >"$second_log" 2>&1 &
second_pid=$!
PAGED_JAX_TEST_CPU_EMITTERS="${PAGED_JAX_TEST_CPU_EMITTERS:-legacy}" pytest_run || rc=$?
wait "$second_pid" || rc=$?
echo "=== second pass (beside the first): the xla_default_cpu_codegen tests under XLA's own CPU emitters"
cat "$second_log"
rm -f "$second_log"
exit "$rc"
