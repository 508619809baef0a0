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
# tests/structured (~2 s to install, no dependencies).
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test,plots,ray,structured]'
exec .venv/bin/python -m pytest -q "$@"
