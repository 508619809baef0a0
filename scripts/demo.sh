#!/usr/bin/env bash
# Install paged-jax into .venv (created if missing) and run the main job.
# Extra arguments go to the main job's command line.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e .
exec .venv/bin/python scripts/generate.py "$@"
