#!/usr/bin/env bash
# The device's software on this machine: creates (or reuses) .venv-device, a Python 3.12 venv
# with the versions the lent GPU machine holds (jax/jaxlib 0.11.2, pytest with pytest-timeout
# and pytest-xdist, hypothesis, transformers, flax) and the project installed editable with
# --no-deps; no torch (no CPU build for Python 3.12 lies on these machines, the index's is
# multi-GB). Its last line of output is the venv's python. scripts/gpu_compile_check.sh adds
# the CUDA 13 compile toolchain to the same venv, so every CPU run in it sets
# JAX_PLATFORMS=cpu. Where no python3.12 exists it prints "device_venv: SKIPPED: ..." and
# exits 0 with no path (scripts/python312.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DEVICE_VENV:-$PWD/.venv-device}
JAX_VERSION=0.11.2
PACKAGES=(
  "jax==$JAX_VERSION" "jaxlib==$JAX_VERSION" pytest pytest-timeout pytest-xdist hypothesis
  transformers flax
)
py=$VENV/bin/python

# Reused when it already holds the pinned jax, the test tools and this checkout's project.
ready() {
  [ -x "$py" ] && JAX_PLATFORMS=cpu "$py" - "$PWD" "$JAX_VERSION" 2>/dev/null <<'EOF'
import importlib.metadata as md, pathlib, sys
root, want = sys.argv[1:]
assert md.version("jax") == md.version("jaxlib") == want
for name in ("pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "transformers", "flax"):
    md.version(name)
import paged_jax
assert pathlib.Path(paged_jax.__file__).resolve().is_relative_to(pathlib.Path(root).resolve())
EOF
}

if ! ready; then
  if [ ! -x "$py" ]; then
    source scripts/python312.sh device_venv
    echo "device_venv: creating $VENV with $py312" >&2
    "$py312" -m venv "$VENV"
  fi
  "$py" -m pip install --quiet --no-compile --disable-pip-version-check "${PACKAGES[@]}" >&2
  "$py" -m pip install --quiet --no-compile --disable-pip-version-check --no-deps -e . >&2
  ready || { echo "device_venv: $VENV is incomplete after installing" >&2; exit 1; }
fi
echo "$py"
