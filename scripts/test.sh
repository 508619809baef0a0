#!/usr/bin/env bash
# Install paged-jax with its test extra into .venv (created if missing) and run the suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test,plots]'
exec .venv/bin/python -m pytest -q "$@"
