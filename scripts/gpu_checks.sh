#!/usr/bin/env bash
# Every GPU check in one prepared run, sized for a lent NVIDIA machine: one command of at
# most 600 s inside a 15-minute device lease (start-up included), so the cells' limits add
# up to <= 480 s. The machine has Python 3.12 with jax preinstalled and no network: no
# install is attempted beyond an offline editable install, and a source-tree fallback
# (PYTHONPATH=$PWD plus a paged_jax/models link, as pyproject's package-dir maps it).
# Cells, most informative first, each under `timeout`; a failing cell never stops the
# others, and $OUT/summary.json (every cell's rc, seconds, JSON file and log tail) is
# rewritten after every cell:
#   setup          import check, nvidia-smi, python/jax versions and devices
#   gpu_tests      pytest -m gpu (real Triton compiles of every kernel vs the reference)
#   autotune       scripts/autotune_kernels.py --write: the best tiling per shape key goes
#                  into pallas_kernels/tuned_configs.json (where the kernels read it), and
#                  the table is copied to $OUT: commit it from there after the run
#   bench_kernels  decode bandwidth vs the roofline: our Triton and Mosaic kernels, JAX's
#                  Pallas paged_attention and XLA
#   bench_engine   one engine cell (paged engine, bf16, Pallas kernels)
#   fp8_decode     decode on bf16 vs fp8 caches
#   compile_check  the deviceless H200 compile (5 cases) if its toolchain imports, else
#                  skipped with the reason
# Only 8 files come back from a device run, so $OUT holds exactly those named below;
# logs stay in $LOGS and their tails go into summary.json.
# `bash scripts/gpu_checks.sh --dry-run` prints the plan and its time budget without
# touching a GPU (tested on CPU).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_results}
LOGS=${GPU_CHECKS_LOGS:-/tmp/gpu_checks_logs}
py=${PYTHON:-python3}
BUDGET_LIMIT=480
MAX_OUT_FILES=8
# Seconds a python cell keeps after its script's --time-limit (import, one config/cell
# in flight, writing its JSON).
MARGIN=25

# cell | time limit (s) | its file(s) under $OUT (- : none of its own) | what it runs
CELLS=(
  "setup|40|-|import check, nvidia-smi, python/jax versions and devices"
  "gpu_tests|100|gpu_tests.json|pytest -m gpu on the files holding gpu tests (JUnit XML -> JSON)"
  "autotune|140|autotune.json,tuned_configs.json|scripts/autotune_kernels.py --write (table copied to \$OUT)"
  "bench_kernels|90|bench_kernels.json|scripts/bench_kernels.py: 6 decode cells x 4 implementations, biggest first"
  "bench_engine|60|bench_engine.json|scripts/bench_engine.py --systems paged, one cell"
  "fp8_decode|25|fp8_decode.json|scripts/bench_fp8_decode.py: decode on bf16 vs fp8 caches"
  "compile_check|25|gpu_compile.json|scripts/gpu_compile_check.py, 5 cases, if its toolchain imports"
)

field_of() { # cell name, field index (1 = limit, 2 = files)
  local s name rest
  for s in "${CELLS[@]}"; do
    IFS='|' read -r name rest <<<"$s"
    [ "$name" = "$1" ] && { cut -d'|' -f$(($2 + 1)) <<<"$s"; return; }
  done
}
limit_of() { field_of "$1" 1; }

total=0
files=1 # summary.json
for s in "${CELLS[@]}"; do
  IFS='|' read -r _ limit out _ <<<"$s"
  total=$((total + limit))
  [ "$out" = "-" ] || files=$((files + $(tr ',' '\n' <<<"$out" | wc -l)))
done

if [ "${1:-}" = "--dry-run" ]; then
  echo "gpu_checks plan (results in $OUT/, logs in $LOGS/):"
  for s in "${CELLS[@]}"; do
    IFS='|' read -r name limit out what <<<"$s"
    printf "  cell %-14s <= %4d s  -> %-34s %s\n" "$name" "$limit" "$out" "$what"
  done
  echo "gpu_checks files: ${files} under \$OUT (summary.json included) <= ${MAX_OUT_FILES}"
  echo "gpu_checks budget: total ${total} s <= ${BUDGET_LIMIT} s"
  $py scripts/autotune_kernels.py --dry-run --time-limit $(($(limit_of autotune) - MARGIN)) || exit 1
  $py scripts/bench_kernels.py --dry-run --time-limit $(($(limit_of bench_kernels) - MARGIN)) || exit 1
  [ "$total" -le "$BUDGET_LIMIT" ] || { echo "budget exceeded"; exit 1; }
  [ "$files" -le "$MAX_OUT_FILES" ] || { echo "too many files under \$OUT"; exit 1; }
  exit 0
fi

mkdir -p "$OUT" "$LOGS"
: >"$LOGS/cells.tsv"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s)

write_summary() {
  OUT="$OUT" LOGS="$LOGS" START="$start" BUDGET="$total" $py - <<'EOF'
import json, os, pathlib, time
out, logs = pathlib.Path(os.environ["OUT"]), pathlib.Path(os.environ["LOGS"])
cells = []
for line in (logs / "cells.tsv").read_text().splitlines():
    name, rc, seconds, limit, files = line.split("\t")
    rc = int(rc)
    log = logs / f"{name}.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    status = "ok" if rc == 0 else ("timeout" if rc in (124, 137) else "failed")
    cell = dict(name=name, rc=rc, status=status, seconds=int(seconds), limit_s=int(limit))
    if name == "compile_check" and rc == 2 and "cannot run:" in text:
        cell.update(status="skipped", reason=text.split("cannot run:", 1)[1].strip()[:300])
    names = [] if files == "-" else files.split(",")
    cell["json"] = names[0] if names else None
    cell["files"] = {n: (out / n).exists() for n in names}
    cell["log_tail"] = text[-3000:]
    cells.append(cell)
summary = dict(
    script="scripts/gpu_checks.sh",
    budget_s=int(os.environ["BUDGET"]),
    elapsed_s=int(time.time()) - int(os.environ["START"]),
    cells=cells,
)
tmp = out / "summary.json.tmp"
tmp.write_text(json.dumps(summary, indent=1) + "\n")
tmp.replace(out / "summary.json")
EOF
}


# run_cell NAME COMMAND...: the command under the cell's limit, its output in the log
# (and on stdout); CELL_RC and CELL_T0 are left for finish_cell, which appends the row
# to cells.tsv and rewrites summary.json (after any quick post-processing in between).
run_cell() {
  local name=$1 limit
  shift
  limit=$(limit_of "$name")
  echo "== $name (limit $limit s, $(($(date +%s) - start)) s elapsed)"
  CELL_T0=$(date +%s)
  timeout -k 5 "$limit" "$@" 2>&1 | tee "$LOGS/$name.log"
  CELL_RC=${PIPESTATUS[0]}
}
finish_cell() { # name
  local seconds=$(($(date +%s) - CELL_T0))
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$CELL_RC" "$seconds" "$(limit_of "$1")" \
    "$(field_of "$1" 2)" >>"$LOGS/cells.tsv"
  write_summary || echo "gpu_checks: could not write $OUT/summary.json"
  echo "== $1: rc $CELL_RC in $seconds s"
}

# -- setup: runs in this shell (not under `timeout`) so a PYTHONPATH fallback carries on;
# each of its commands has its own limit, together within the cell's.
setup() {
  if ! timeout 15 $py -c "import paged_jax.models, pallas_kernels" 2>/dev/null; then
    if ! timeout 15 $py -m pip install -q --no-deps --no-build-isolation --no-index -e . \
      >"$LOGS/install.log" 2>&1; then
      # Source-tree fallback: pyproject maps paged_jax.models to models/; a link does too.
      [ -e paged_jax/models ] || ln -s ../models paged_jax/models
      export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
      echo "setup: editable install unavailable offline; using PYTHONPATH=$PWD"
    fi
  fi
  timeout 5 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem \
    --format=csv 2>&1
  timeout 15 $py -c "import sys, jax, paged_jax.models, pallas_kernels.tuning as t
print(sys.version.split()[0], 'jax', jax.__version__, jax.default_backend(), jax.devices())
print('tuned table:', t.TABLE_PATH, len(t.load_table().entries), 'entries')"
}
# GPU_CHECKS_CELLS=a,b,... runs only those cells (the CPU test of this script uses it).
selected() { [[ ",${GPU_CHECKS_CELLS:-all}," == *",all,"* || ",${GPU_CHECKS_CELLS:-}," == *",$1,"* ]]; }

if selected setup; then
  echo "== setup (limit $(limit_of setup) s)"
  CELL_T0=$(date +%s)
  setup >"$LOGS/setup.log" 2>&1
  CELL_RC=$?
  cat "$LOGS/setup.log"
  finish_cell setup
fi

# gpu_tests.json from pytest's JUnit XML: counts, and each test's outcome and message.
gpu_tests_json() {
  OUT="$OUT" LOGS="$LOGS" timeout 20 $py - <<'EOF'
import json, os, pathlib
import xml.etree.ElementTree as ET
out, logs = pathlib.Path(os.environ["OUT"]), pathlib.Path(os.environ["LOGS"])
xml = logs / "gpu_tests.xml"
summary = dict(command="pytest -q -m gpu (the files holding gpu tests)", tests=[])
if not xml.exists():
    summary["error"] = "no JUnit XML: pytest did not finish (see summary.json's log tail)"
else:
    counts = dict(passed=0, failed=0, error=0, skipped=0)
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        row = dict(name=name, seconds=float(case.get("time", 0)), outcome="passed")
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                row["outcome"] = "failed" if tag == "failure" else tag
                row["message"] = (node.get("message") or node.text or "")[:500]
        counts[row["outcome"]] += 1
        summary["tests"].append(row)
    summary.update(counts)
(out / "gpu_tests.json").write_text(json.dumps(summary, indent=1) + "\n")
EOF
}

# -- gpu_tests: the files that hold gpu-marked tests, kernels first; pytest-timeout (on
# the device image) turns a hung test into a failure instead of losing the XML.
if selected gpu_tests; then
  gpu_test_files=$( (grep -rl "pytest.mark.gpu" tests/pallas_kernels --include='*.py'
    grep -rl "pytest.mark.gpu" tests --include='*.py' --exclude-dir=pallas_kernels) |
    awk '!seen[$0]++')
  timeout_flag=()
  if $py -c "import pytest_timeout" 2>/dev/null; then
    timeout_flag=(-p pytest_timeout --timeout=60)
  fi
  rm -f "$LOGS/gpu_tests.xml"
  # shellcheck disable=SC2086 # one file per word
  run_cell gpu_tests $py -m pytest -q -m gpu -p no:cacheprovider "${timeout_flag[@]}" \
    --junitxml="$LOGS/gpu_tests.xml" -o junit_family=xunit2 $gpu_test_files
  gpu_tests_json
  finish_cell gpu_tests
fi

# -- autotune: --write updates the table the kernels read; the copy in $OUT is what
# comes back from the device.
if selected autotune; then
  run_cell autotune $py scripts/autotune_kernels.py --write \
    --time-limit $(($(limit_of autotune) - MARGIN)) --output "$OUT/autotune.json"
  cp pallas_kernels/tuned_configs.json "$OUT/tuned_configs.json"
  finish_cell autotune
fi

if selected bench_kernels; then
  run_cell bench_kernels $py scripts/bench_kernels.py \
    --time-limit $(($(limit_of bench_kernels) - MARGIN)) --output "$OUT/bench_kernels.json"
  finish_cell bench_kernels
fi

if selected bench_engine; then
  run_cell bench_engine $py scripts/bench_engine.py --systems paged --repeats 2 \
    --dtype bfloat16 --num-requests 32 --max-num-seqs 32 --max-num-batched-tokens 128 \
    --max-model-len 1024 --output "$OUT/bench_engine.json"
  finish_cell bench_engine
fi

if selected fp8_decode; then
  run_cell fp8_decode $py scripts/bench_fp8_decode.py --output "$OUT/fp8_decode.json"
  finish_cell fp8_decode
fi

# Deviceless: JAX_PLATFORMS=cpu, so no CUDA client; exits 2 at once ("cannot run: ...")
# where the CUDA plugin or the assemblers it needs are missing: recorded as skipped.
if selected compile_check; then
  run_cell compile_check env JAX_PLATFORMS=cpu $py scripts/gpu_compile_check.py --grid ci \
    --only '^(decode|ragged)-(bf16|e4m3)-d128-g4-bs16-b64' --output "$OUT/gpu_compile.json"
  finish_cell compile_check
fi

echo "== done in $(($(date +%s) - start)) s (budget ${total} s); results in $OUT/"
