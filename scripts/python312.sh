# Sourced by the Python 3.12 CI stages: sets py312 to a python3.12 (pyenv's newest, else
# PATH), or prints "$1: SKIPPED: ..." and exits 0 where none exists.
py312=""
if command -v pyenv >/dev/null 2>&1; then
  py312=$(ls -d "$(pyenv root)"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V | tail -1 || true)
fi
if [ -z "$py312" ]; then
  py312=$(command -v python3.12 || true)
fi
if [ -z "$py312" ]; then
  echo "$1: SKIPPED: no python3.12 on this machine (pyenv or PATH)"
  exit 0
fi
