#!/usr/bin/env bash
# Every GPU check in one prepared run, sized for a lent NVIDIA machine: one command of at
# most 600 s inside a 15-minute device lease (start-up included), so the cells' limits add
# up to <= 480 s. The machine has Python 3.12 with jax/jaxlib 0.11.2, pytest-timeout and no
# network: no install is attempted beyond an offline editable install, and a source-tree
# fallback (PYTHONPATH=$PWD plus a paged_jax/models link, as pyproject's package-dir maps it).
#
# Cells, most valuable first, each under `timeout`; a failing cell never stops the others.
# Each python cell gets `--output` and `--time-limit` (its limit less a margin: it stops
# starting new points and leaves valid JSON) and rewrites its JSON after every point, with a
# top-level "metrics" summary; $OUT/summary.json (every cell's status, seconds, metrics and
# log tail; the smoke cell's own results) is rewritten after every cell. At most 8 files
# come back from a device run: $OUT holds exactly the 7 named below, logs stay in $LOGS.
#
#   bash scripts/gpu_checks.sh                 the device run (python3, the GPU)
#   bash scripts/gpu_checks.sh --rehearse      every cell for real on CPU with the device's
#                                              software (.venv-device: Python 3.12, jax
#                                              0.11.2, pytest-timeout; scripts/device_venv.sh),
#                                              each script given --rehearse (interpret mode,
#                                              cut shapes), then the checks; exits 1 on any
#   bash scripts/gpu_checks.sh --dry-run       the plan and its budget, touching no device
#   ... --cells smoke,bench_decode             only these cells (also $GPU_CHECKS_CELLS)
#
# After every run the checks (scripts/gpu_checks_report.py) print a table and exit 1 unless:
# every cell ran is ok (exit 0 inside its limit, its JSON parses, its "metrics" hold the
# cell's required keys as finite numbers, the JSON was rewritten while it ran, gpu_tests ran
# >= 10 tests in the rehearsal with none failing), <= 8 files under $OUT, <= 480 s of limits.
# docs/kernels.md, "The first GPU run", says what each cell measures and what to commit.
set -uo pipefail
cd "$(dirname "$0")/.."
# The whole script is one block, read before it runs: an edit while it runs cannot shift it.
{
MODE=device
SELECTED=${GPU_CHECKS_CELLS:-all}
while [ $# -gt 0 ]; do
  case $1 in
  --dry-run) MODE=dry ;;
  --rehearse) MODE=rehearse ;;
  --cells) SELECTED=${2:?--cells needs a comma-separated list}; shift ;;
  --cells=*) SELECTED=${1#--cells=} ;;
  *) echo "gpu_checks: unknown argument $1 (--dry-run, --rehearse, --cells a,b)" >&2; exit 2 ;;
  esac
  shift
done
if [ "$MODE" = rehearse ]; then
  OUT=${OUT:-/tmp/gpu_checks_rehearsal/out}
  LOGS=${GPU_CHECKS_LOGS:-/tmp/gpu_checks_rehearsal/logs}
else
  OUT=${OUT:-gpu_results}
  LOGS=${GPU_CHECKS_LOGS:-/tmp/gpu_checks_logs}
fi
BUDGET_LIMIT=480
MAX_OUT_FILES=8

# cell | limit (s) | the script's --time-limit (s) | its JSON under $OUT | what it measures
CELLS=(
  "smoke|40|20|summary.json|versions (jax, plugin, CUDA, GPU, SMs), one decode call vs the reference, the copy ceiling"
  "gpu_tests|100|-|gpu_tests.json|pytest -v -m gpu --timeout=60: each kernel vs its reference (dtype, head_dim, GQA, window, cap)"
  "bench_decode|90|60|bench_kernels.json|scripts/bench_kernels.py: decode GB/s vs 4.8 TB/s and the copy ceiling, 4 impls, biggest first"
  "bench_mixed|40|25|bench_mixed.json|scripts/bench_kernels.py --part mixed: a mixed step's decode rows per token vs the decode kernel"
  "bench_engine|80|55|bench_engine.json|scripts/bench_engine.py --device-run: one engine, Llama-3-8B-shaped bf16, tok/s per point"
  "fp8_decode|40|25|fp8_decode.json|scripts/bench_fp8_decode.py: fp8 decode vs the reference and vs bf16"
  "autotune|90|65|autotune.json|scripts/autotune_kernels.py --write: the engine's keys; the table folded in as tuned_configs"
)
NOT_REHEARSED="gpu-marked tests that need transformers' torch models (tests/engine/test_engine_hf.py): the rehearsal venv has no torch (no CPU build for Python 3.12 on these machines)"

field_of() { # cell, field index (1 limit, 2 time limit, 3 JSON file, 4 what)
  local s
  for s in "${CELLS[@]}"; do
    [ "${s%%|*}" = "$1" ] && { cut -d'|' -f$(($2 + 1)) <<<"$s"; return; }
  done
}
selected() { [[ ",$SELECTED," == *",all,"* || ",$SELECTED," == *",$1,"* ]]; }
names=()
total=0
for s in "${CELLS[@]}"; do
  name=${s%%|*}
  selected "$name" || continue
  names+=("$name")
  total=$((total + $(field_of "$name" 1)))
done
cell_list=$(IFS=,; echo "${names[*]}")
files=$(for n in "${names[@]}"; do field_of "$n" 3; done | sort -u | wc -l)

print_plan() {
  echo "gpu_checks plan ($MODE; results in $OUT/, logs in $LOGS/):"
  for n in "${names[@]}"; do
    printf "  cell %-13s <= %4d s  --time-limit %3s  -> %-19s %s\n" "$n" "$(field_of "$n" 1)" \
      "$(field_of "$n" 2)" "$(field_of "$n" 3)" "$(field_of "$n" 4)"
  done
  echo "gpu_checks files: ${files} under \$OUT (summary.json included) <= ${MAX_OUT_FILES}"
  echo "gpu_checks budget: total ${total} s <= ${BUDGET_LIMIT} s"
  echo "gpu_checks rehearsal: every cell on CPU in .venv-device (jax 0.11.2), Pallas kernels in"
  echo "  interpret mode at cut shapes; not rehearsed: $NOT_REHEARSED"
}

if [ "$MODE" = dry ]; then
  py=${PYTHON:-python3}
  print_plan
  if selected autotune; then
    $py scripts/autotune_kernels.py --dry-run --time-limit "$(field_of autotune 2)" || exit 1
  fi
  if selected bench_decode; then
    $py scripts/bench_kernels.py --dry-run --time-limit "$(field_of bench_decode 2)" || exit 1
  fi
  [ "$total" -le "$BUDGET_LIMIT" ] || { echo "budget exceeded"; exit 1; }
  [ "$files" -le "$MAX_OUT_FILES" ] || { echo "too many files under \$OUT"; exit 1; }
  exit 0
fi

mkdir -p "$OUT" "$LOGS"
: >"$LOGS/cells.tsv"
rm -f "$LOGS"/*.watch.json "$LOGS"/gpu_tests.xml "$LOGS"/smoke.json
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
rehearse=()
if [ "$MODE" = rehearse ]; then
  if [ -n "${PYTHON:-}" ]; then
    py=$PYTHON
  else
    py=$(bash scripts/device_venv.sh | tail -1)
    if [ ! -x "$py" ]; then
      echo "gpu_checks --rehearse: SKIPPED: no device venv (${py:-no python3.12})"
      exit 0
    fi
  fi
  # The device venv may hold the CUDA plugin (the deviceless compile check): CPU only.
  export JAX_PLATFORMS=cpu PAGED_JAX_GPU_TESTS_INTERPRET=1
  rehearse=(--rehearse)
else
  py=${PYTHON:-python3}
  [ "${GPU_CHECKS_SLOWDOWN:-1}" = 1 ] || { echo "GPU_CHECKS_SLOWDOWN is for --rehearse" >&2; exit 2; }
fi
# A shared, loaded CPU may run the rehearsal k times slower than CI's machine: its timeouts
# and --time-limits are then scaled by GPU_CHECKS_SLOWDOWN=k (an integer), and summary.json
# and the checks say so: such a run does not show the 480 s budget holds.
export GPU_CHECKS_SLOWDOWN=${GPU_CHECKS_SLOWDOWN:-1}
start=$(date +%s)
print_plan

report() { "$py" scripts/gpu_checks_report.py "$@" --out-dir "$OUT" --logs "$LOGS" --mode "$MODE"; }

# run_cell NAME COMMAND...: the command under the cell's limit, its output in the log and
# echoed as it comes; a watcher polls the cell's JSON (and, for gpu_tests, writes it from
# pytest's -v log as tests finish). Then a row in cells.tsv and summary.json rewritten.
run_cell() {
  local name=$1 limit json pid watcher seconds
  shift
  limit=$(($(field_of "$name" 1) * GPU_CHECKS_SLOWDOWN))
  json=$OUT/$(field_of "$name" 3)
  [ "$name" = smoke ] && json=$LOGS/smoke.json # folded into summary.json
  rm -f "$json" "$LOGS/$name.log"
  echo "== $name (limit $limit s, $(($(date +%s) - start)) s elapsed): $*"
  local t0=$(date +%s) cpu0
  children_cpu_ms >"$LOGS/cpu0.txt"
  cpu0=$(<"$LOGS/cpu0.txt")
  timeout -k 5 "$limit" "$@" >"$LOGS/$name.log" 2>&1 &
  pid=$!
  local extra=()
  [ "$name" = gpu_tests ] && extra=(--gpu-tests-log "$LOGS/$name.log" --gpu-tests-xml "$LOGS/gpu_tests.xml")
  "$py" scripts/gpu_checks_report.py watch --pid "$pid" --json "$json" --mode "$MODE" \
    --out "$LOGS/$name.watch.json" "${extra[@]}" &
  watcher=$!
  tail --pid="$pid" -n +1 -f "$LOGS/$name.log" 2>/dev/null
  wait "$pid"
  local rc=$?
  wait "$watcher"
  seconds=$(($(date +%s) - t0))
  children_cpu_ms >"$LOGS/cpu1.txt"
  local cpu_s=$((($(<"$LOGS/cpu1.txt") - cpu0 + 500) / 1000))
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$seconds" "$(field_of "$name" 1)" \
    "$(field_of "$name" 2)" "$(field_of "$name" 3)" "$json" "$*" "$cpu_s" >>"$LOGS/cells.tsv"
  report summary --start "$start" || echo "gpu_checks: could not write $OUT/summary.json"
  echo "== $name: rc $rc in $seconds s"
}
# CPU milliseconds (user + system) of this shell's finished children, from `times`: a cell's
# share is what a loaded machine cannot inflate the way it inflates wall seconds.
# (`times` runs in this shell, redirected: in a pipe or $(...) it would see a subshell's.)
children_cpu_ms() {
  times >"$LOGS/times.txt"
  awk 'NR == 2 { t = 0; for (i = 1; i <= 2; i++) { split($i, a, /m|s/); t += a[1] * 60 + a[2] }
    printf "%d", t * 1000 }' "$LOGS/times.txt"
}
tl() { echo --time-limit "$(($(field_of "$1" 2) * GPU_CHECKS_SLOWDOWN))"; }

# -- setup (device only, not a cell): the project importable, offline.
if [ "$MODE" = device ]; then
  {
    if ! timeout 15 "$py" -c "import paged_jax.models, pallas_kernels" 2>/dev/null; then
      if ! timeout 20 "$py" -m pip install -q --no-deps --no-build-isolation --no-index -e .; then
        # Source-tree fallback: pyproject maps paged_jax.models to models/; a link does too.
        [ -e paged_jax/models ] || ln -s ../models paged_jax/models
        export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
        echo "setup: editable install unavailable offline; using PYTHONPATH=$PWD"
      fi
    fi
  } >"$LOGS/setup.log" 2>&1
  cat "$LOGS/setup.log"
fi

if selected smoke; then
  # shellcheck disable=SC2046 # tl's words
  run_cell smoke "$py" scripts/gpu_smoke.py $(tl smoke) --output "$LOGS/smoke.json" "${rehearse[@]}"
fi

if selected gpu_tests; then
  # The files that hold gpu-marked tests, kernels first. pytest-timeout registers itself
  # through its entry point: `--timeout` alone (a `-p pytest_timeout` would register it a
  # second time and pytest would exit 3 before any test).
  gpu_test_files=$( (grep -rl "pytest.mark.gpu" tests/pallas_kernels --include='*.py'
    grep -rl "pytest.mark.gpu" tests --include='*.py' --exclude-dir=pallas_kernels) |
    awk '!seen[$0]++')
  timeout_flag=()
  "$py" -c "import pytest_timeout" 2>/dev/null && timeout_flag=(--timeout=$((60 * GPU_CHECKS_SLOWDOWN)))
  # Tests compile (Triton on the device, the interpreter on CPU) on one core each: workers.
  workers=()
  workers_n=$([ "$MODE" = rehearse ] && echo 2 || echo 4)
  "$py" -c "import xdist" 2>/dev/null && workers=(-n "${GPU_CHECKS_TEST_WORKERS:-$workers_n}")
  # shellcheck disable=SC2086 # one file per word; GPU_CHECKS_PYTEST_ARGS: e.g. -k ...
  run_cell gpu_tests "$py" -m pytest -v -m gpu -p no:cacheprovider "${timeout_flag[@]}" "${workers[@]}" \
    --junitxml="$LOGS/gpu_tests.xml" -o junit_family=xunit2 ${GPU_CHECKS_PYTEST_ARGS:-} \
    $gpu_test_files
fi

# shellcheck disable=SC2046
if selected bench_decode; then
  run_cell bench_decode "$py" scripts/bench_kernels.py $(tl bench_decode) \
    --output "$OUT/bench_kernels.json" "${rehearse[@]}"
fi

# shellcheck disable=SC2046
if selected bench_mixed; then
  run_cell bench_mixed "$py" scripts/bench_kernels.py --part mixed $(tl bench_mixed) \
    --output "$OUT/bench_mixed.json" "${rehearse[@]}"
fi

# shellcheck disable=SC2046
if selected bench_engine; then
  run_cell bench_engine "$py" scripts/bench_engine.py --device-run $(tl bench_engine) \
    --output "$OUT/bench_engine.json" "${rehearse[@]}"
fi

# shellcheck disable=SC2046
if selected fp8_decode; then
  run_cell fp8_decode "$py" scripts/bench_fp8_decode.py $(tl fp8_decode) \
    --output "$OUT/fp8_decode.json" "${rehearse[@]}"
fi

# --write updates the table the kernels read (on the device; the rehearsal writes a scratch
# copy so the repository's table keeps GPU numbers only); autotune.json carries it back.
if selected autotune; then
  table=()
  [ "$MODE" = rehearse ] && table=(--table "$LOGS/tuned_configs.json")
  # shellcheck disable=SC2046
  run_cell autotune "$py" scripts/autotune_kernels.py --write $(tl autotune) "${table[@]}" \
    --output "$OUT/autotune.json" "${rehearse[@]}"
fi

echo "== done in $(($(date +%s) - start)) s (cell limits ${total} s); results in $OUT/"
report check --cells "$cell_list"
exit
}
