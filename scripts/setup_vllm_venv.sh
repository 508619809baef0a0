#!/usr/bin/env bash
# Builds a side venv (outside the repo) in which vLLM 0.33.0's own V1 KVCacheManager
# imports, for scripts/bench_vllm_manager.py. vLLM is not a dependency of paged-jax.
#
#   bash scripts/setup_vllm_venv.sh [VENV_DIR]      # default /work/venv-vllm
#   VENV_DIR/bin/python scripts/bench_vllm_manager.py
#
# - vllm is installed with --no-deps: its metadata pins torch 2.14.0 and CUDA kernel
#   packages (multi-GB). torch is the 2.13.0 CPU build that lies on these machines'
#   disk (a Python 3.11 wheel, hence Python 3.11); never install an unpinned torch.
# - The other packages are the ones `import vllm.v1.core.kv_cache_manager` and
#   `vllm.v1.request` need, at the versions this was tested with (some are newer than
#   vLLM's own pins; none of them is on the block manager's code path). Nothing is
#   stubbed. pip prints dependency-conflict warnings for vllm's unmet pins; they are
#   expected.
set -euo pipefail

VENV=${1:-/work/venv-vllm}
PY=${PYTHON:-python3}

if ! "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    echo "setup_vllm_venv.sh: $PY is not Python 3.11 (the CPU torch wheel here is cp311);" \
        "set PYTHON=/path/to/python3.11" >&2
    exit 1
fi

# pip's notes about index folders without a package, and vllm's unmet pins, are noise.
quiet() {
    { grep -v -e "WARNING: Location" -e "requires .*, which is not installed" \
        -e "which is incompatible" -e "dependency resolver does not currently" || true; }
}

"$PY" -m venv "$VENV"
PIP=("$VENV/bin/pip" install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip 2>&1 | quiet
"${PIP[@]}" --no-deps vllm==0.33.0 2>&1 | quiet
"${PIP[@]}" torch==2.13.0 \
    aiohttp==3.14.5 cachetools==8.0.2 cbor2==6.3.0 cloudpickle==3.1.3 fastapi==0.165.0 \
    llguidance==1.9.1 msgspec==0.23.0 numpy==2.4.6 openai==3.57.0 openai-harmony==0.0.8 \
    packaging==26.4 partial-json-parser==0.2.1.1.post7 pillow==13.0.0 \
    prometheus_client==0.26.0 psutil==7.2.2 py-cpuinfo==9.0.0 pybase64==1.5.1 \
    pydantic==2.14.4 pyzmq==27.3.0 regex==2026.11.19 requests==2.34.2 \
    transformers==5.24.0 urllib3==2.8.0 uvloop==0.23.0 xgrammar==0.2.9 xxhash \
    2>&1 | quiet

"$VENV/bin/python" - <<'EOF'
import torch
import vllm
import vllm.v1.core.kv_cache_manager
import vllm.v1.request

print(f"vllm {vllm.__version__} (torch {torch.__version__}): V1 KVCacheManager importable")
EOF
