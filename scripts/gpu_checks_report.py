"""The bookkeeping of scripts/gpu_checks.sh: watches a running cell's JSON, turns pytest's
verbose log into gpu_tests.json as tests finish, writes summary.json after every cell and
checks what a run left under $OUT (the rehearsal's pass/fail). No jax: it runs in whatever
Python the device run uses, in a fraction of a second.

    python scripts/gpu_checks_report.py watch --pid PID --json F --out W [--gpu-tests-log L]
    python scripts/gpu_checks_report.py summary --out-dir OUT --logs LOGS --start T --mode M
    python scripts/gpu_checks_report.py check --out-dir OUT --logs LOGS --mode M
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
import sys
import time
import xml.etree.ElementTree as ET

MAX_OUT_FILES = 8  # files a device run returns from $OUT
BUDGET_S = 480  # the cells' limits together, inside a 600 s device command
# Each cell's top-level "metrics" must hold these as finite numbers (docs/kernels.md,
# "The first GPU run").
REQUIRED_METRICS = {
    "smoke": ("decode_max_abs_err", "copy_gbps"),
    "gpu_tests": ("tests_run", "tests_passed", "tests_failed", "tests_skipped"),
    "bench_decode": (
        "cells_timed",
        "best_fraction_of_peak",
        "best_fraction_of_copy_ceiling",
        "copy_ceiling_gbps",
        "max_kv_cache_mib",
        "speedup_vs_jax_pallas",
    ),
    "bench_mixed": ("decode_us_per_token", "mixed_us_per_token", "mixed_over_decode"),
    "bench_engine": ("points", "tok_s", "compiles_after_warmup"),
    "fp8_decode": ("cells_timed", "fp8_max_abs_err_vs_bf16", "fp8_time_over_bf16"),
    "autotune": ("keys_tuned", "configs_timed"),
}
# A required key a cell may leave out when its JSON says why under this top-level key.
EXCUSED_BY = {("bench_decode", "speedup_vs_jax_pallas"): "jax_pallas_missing"}
MIN_TESTS_RUN = {"device": 1, "rehearse": 10}  # non-skipped gpu-marked tests
MIN_KV_CACHE_MIB = 256  # the rehearsal's bench_decode keeps one cache this big
MIN_WRITES_SEEN = 2  # distinct JSON contents seen while the cell ran: not only at exit
POLL_S = 0.1

# `pytest -v` result lines: "tests/x.py::test_y[id] PASSED    [ 12%]", under pytest-xdist
# "[gw0] [ 12%] PASSED tests/x.py::test_y[id]", and the short summary's
# "FAILED tests/x.py::test_y[id] - AssertionError ..." (-ra).
_OUTCOME = r"(?P<outcome>PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)"
RESULT_LINE = re.compile(
    rf"^(?P<name>\S+::\S.*?) {_OUTCOME}(?: \((?P<reason>.*)\))?(?:\s+\[\s*\d+%\])?\s*$"
)
RESULT_LINE_XDIST = re.compile(rf"^\[gw\d+\] \[\s*\d+%\] {_OUTCOME} (?P<name>\S+::\S.*?)\s*$")
SUMMARY_LINE = re.compile(r"^(?:FAILED|ERROR) (?P<name>\S+::\S.*?) - (?P<reason>.*)$")
OUTCOMES = {
    "PASSED": "passed",
    "XPASS": "passed",
    "FAILED": "failed",
    "ERROR": "failed",
    "SKIPPED": "skipped",
    "XFAIL": "skipped",
}


def read_json(path: pathlib.Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def strict(value):
    """`value` with every non-finite float as its string ("nan"), so the file is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, list):
        return [strict(v) for v in value]
    return value


def write_json(path: pathlib.Path, data: dict) -> None:
    """Atomically: a reader (the watcher, a killed run) sees the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(strict(data), indent=1, allow_nan=False) + "\n")
    tmp.replace(path)


# -- gpu_tests.json ------------------------------------------------------------------------


def gpu_tests_report(log_text: str, xml_path: pathlib.Path | None, *, mode: str) -> dict:
    """gpu_tests.json from pytest's -v log (written as tests finish, so a killed run keeps
    what finished) and, when pytest got to write it, its JUnit XML (messages, seconds)."""
    tests: dict[str, dict] = {}
    for line in log_text.splitlines():
        line = line.strip()
        summary = SUMMARY_LINE.match(line)
        if summary and summary["name"] in tests:
            tests[summary["name"]]["message"] = summary["reason"][:300]
            continue
        m = RESULT_LINE.match(line) or RESULT_LINE_XDIST.match(line)
        if m:
            row = dict(name=m["name"], outcome=OUTCOMES[m["outcome"]])
            if m.groupdict().get("reason"):
                row["message"] = m["reason"][:300]
            tests[m["name"]] = row
    xml_read = False
    if xml_path is not None and xml_path.exists():
        try:
            root = ET.parse(xml_path).getroot()
        except ET.ParseError:
            root = None
        for case in root.iter("testcase") if root is not None else ():
            path = (case.get("classname") or "").replace(".", "/")
            key = next((k for k in tests if k.endswith("::" + (case.get("name") or ""))), None)
            row = tests.setdefault(key or f"{path}::{case.get('name')}", {})
            row.setdefault("name", key or f"{path}::{case.get('name')}")
            row["seconds"] = round(float(case.get("time") or 0), 3)
            row.setdefault("outcome", "passed")
            for tag in ("failure", "error", "skipped"):
                node = case.find(tag)
                if node is not None:
                    row["outcome"] = "skipped" if tag == "skipped" else "failed"
                    row["message"] = (node.get("message") or node.text or "")[:500]
        xml_read = root is not None
    rows = list(tests.values())
    count = {o: sum(r["outcome"] == o for r in rows) for o in ("passed", "failed", "skipped")}
    return dict(
        mode=mode,
        source="pytest -v log" + (" + JUnit XML" if xml_read else " (no JUnit XML yet)"),
        metrics=dict(
            tests_run=count["passed"] + count["failed"],
            tests_passed=count["passed"],
            tests_failed=count["failed"],
            tests_skipped=count["skipped"],
        ),
        tests=rows,
    )


# -- watch ---------------------------------------------------------------------------------


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped) is not running.
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def watch(args) -> int:
    """Polls a running cell's JSON until its process ends; records how many distinct valid
    contents holding a "metrics" dict it saw while the process still ran. A script that
    writes its JSON only at exit shows at most one (a killed run would leave nothing)."""
    json_path, out = pathlib.Path(args.json), pathlib.Path(args.out)
    log = pathlib.Path(args.gpu_tests_log) if args.gpu_tests_log else None
    xml = pathlib.Path(args.gpu_tests_xml) if args.gpu_tests_xml else None
    t0, seen, first_s, last_log = time.monotonic(), set(), None, None

    def convert(final: bool) -> None:
        nonlocal last_log
        text = log.read_text(errors="replace") if log.exists() else ""
        if text != last_log or final:
            last_log = text
            report = gpu_tests_report(text, xml if final else None, mode=args.mode)
            write_json(json_path, report)

    while True:
        if log is not None:
            convert(final=False)
        data = read_json(json_path)
        running = alive(args.pid)  # after the read: the content was there while it ran
        if running and data is not None and isinstance(data.get("metrics"), dict):
            seen.add(json.dumps(data, sort_keys=True))
            first_s = first_s if first_s is not None else time.monotonic() - t0
        if not running:
            break
        time.sleep(POLL_S)
    if log is not None:
        convert(final=True)
    write_json(
        out,
        dict(
            writes_seen_running=len(seen),
            first_json_s=None if first_s is None else round(first_s, 2),
            ended_s=round(time.monotonic() - t0, 2),
            watcher_cpu_s=round(time.process_time(), 2),  # not the cell's: taken off its cpu_s
        ),
    )
    return 0


# -- summary.json and the check -------------------------------------------------------------


def finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def judge(name: str, rc: int, data: dict | None, watched: dict | None, mode: str) -> list[str]:
    """Why cell `name` is not ok (empty: ok)."""
    problems = []
    if rc in (124, 137):
        problems.append(f"killed at its limit (rc {rc})")
    elif rc != 0:
        problems.append(f"exit status {rc}")
    if data is None:
        return problems + ["its JSON is missing or does not parse"]
    metrics = data.get("metrics")
    if not isinstance(metrics, dict):
        return problems + ['its JSON has no top-level "metrics"']
    for key in REQUIRED_METRICS[name]:
        if key not in metrics and data.get(EXCUSED_BY.get((name, key), "")):
            continue  # left out, and the JSON says why
        if not finite(metrics.get(key)):
            problems.append(f"metrics[{key!r}] = {metrics.get(key)!r} is not a finite number")
    if name == "gpu_tests" and finite(metrics.get("tests_run")):
        if metrics["tests_failed"]:
            problems.append(f"{metrics['tests_failed']} tests failed")
        if metrics["tests_run"] < MIN_TESTS_RUN[mode]:
            problems.append(
                f"only {metrics['tests_run']} tests ran ({metrics['tests_skipped']} skipped); "
                f"needs >= {MIN_TESTS_RUN[mode]}"
            )
    big = metrics.get("max_kv_cache_mib")
    if name == "bench_decode" and mode == "rehearse" and finite(big) and big < MIN_KV_CACHE_MIB:
        problems.append(
            f"max_kv_cache_mib {metrics['max_kv_cache_mib']} < {MIN_KV_CACHE_MIB}: no cache "
            "big enough that a captured constant would show"
        )
    if watched is not None and watched["writes_seen_running"] < MIN_WRITES_SEEN:
        problems.append(
            f"its JSON was seen in {watched['writes_seen_running']} state(s) while it ran "
            f"(< {MIN_WRITES_SEEN}): not rewritten after every point (written only at exit?)"
        )
    return problems


def out_files(out: pathlib.Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if not p.is_dir())


def build_summary(out: pathlib.Path, logs: pathlib.Path, *, start: float, mode: str) -> dict:
    cells = []
    slowdown = int(os.environ.get("GPU_CHECKS_SLOWDOWN", "1"))
    summary = dict(script="scripts/gpu_checks.sh", mode=mode, budget_s=BUDGET_S)
    if slowdown != 1:
        summary["limits_scaled_by"] = slowdown  # a loaded machine: the budget is not shown
    rows = (logs / "cells.tsv").read_text().splitlines() if (logs / "cells.tsv").exists() else []
    for line in rows:
        name, rc, seconds, limit, time_limit, json_name, json_at, command, *cpu = line.split("\t")
        rc = int(rc)
        data = read_json(pathlib.Path(json_at))
        watched = read_json(logs / f"{name}.watch.json")
        problems = judge(name, rc, data, watched, mode)
        status = "ok" if not problems else ("timeout" if rc in (124, 137) else "failed")
        log = logs / f"{name}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        cell = dict(
            name=name,
            status=status,
            problems=problems,
            rc=rc,
            seconds=int(seconds),
            # user + system seconds of the cell's processes (the shell's, less the watcher's)
            cpu_s=None if not cpu else round(int(cpu[0]) - (watched or {}).get("watcher_cpu_s", 0)),
            limit_s=int(limit),
            time_limit_s=None if time_limit == "-" else int(time_limit),
            json=json_name,
            metrics=(data or {}).get("metrics"),
            json_writes_seen=None if watched is None else watched["writes_seen_running"],
            command=command,
            log_tail=text[-2500:],
        )
        if name == "smoke" and data is not None:
            summary["smoke"] = data  # the smoke cell's own file is summary.json
        cells.append(cell)
    summary["elapsed_s"] = int(time.time() - start)
    summary["cells"] = cells
    setup = logs / "setup.log"
    if setup.exists():
        summary["setup_log_tail"] = setup.read_text(errors="replace")[-1500:]
    return summary


def summary_cmd(args) -> int:
    out, logs = pathlib.Path(args.out_dir), pathlib.Path(args.logs)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "summary.json", build_summary(out, logs, start=args.start, mode=args.mode))
    return 0


def fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def check(out: pathlib.Path, *, mode: str, expect: list[str]) -> list[str]:
    """What is wrong with the run under `out` (empty: it passes); prints the cell table."""
    problems = []
    summary = read_json(out / "summary.json")
    if summary is None:
        return ["summary.json is missing or does not parse"]
    cells = {c["name"]: c for c in summary["cells"]}
    print(f"{'cell':<13} {'seconds':>7} {'cpu_s':>5} {'limit':>5}  {'status':<8} numbers")
    for c in summary["cells"]:
        numbers = ", ".join(f"{k}={fmt(v)}" for k, v in (c["metrics"] or {}).items())
        cpu = "-" if c.get("cpu_s") is None else c["cpu_s"]
        print(
            f"{c['name']:<13} {c['seconds']:>7} {cpu:>5} {c['limit_s']:>5}  {c['status']:<8} "
            f"{numbers}"
        )
        problems += [f"{c['name']}: {p}" for p in c["problems"]]
    missing = [name for name in expect if name not in cells]
    if missing:
        problems.append(f"summary.json lacks cells {missing}")
    files = out_files(out)
    if len(files) > MAX_OUT_FILES:
        problems.append(f"{len(files)} files under $OUT (> {MAX_OUT_FILES}): {files}")
    total = sum(c["limit_s"] for c in summary["cells"])
    if total > BUDGET_S:
        problems.append(f"the cells' limits add up to {total} s (> {BUDGET_S} s)")
    print(f"files under $OUT: {len(files)} (<= {MAX_OUT_FILES}): {' '.join(files)}")
    print(f"cell limits: {total} s (<= {BUDGET_S} s); wall {summary['elapsed_s']} s")
    if summary.get("limits_scaled_by", 1) != 1:
        print(
            f"NOTE: timeouts and --time-limits were scaled by {summary['limits_scaled_by']} "
            "(GPU_CHECKS_SLOWDOWN): this run does not show the cells fit their limits"
        )
    return problems


def check_cmd(args) -> int:
    problems = check(pathlib.Path(args.out_dir), mode=args.mode, expect=args.cells.split(","))
    for p in problems:
        print(f"gpu_checks: FAILED: {p}")
    if not problems:
        print(f"gpu_checks: {args.mode} run passed its checks")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("watch", help="poll a running cell's JSON until its process ends")
    w.add_argument("--pid", type=int, required=True)
    w.add_argument("--json", required=True)
    w.add_argument("--out", required=True)
    w.add_argument("--mode", choices=("device", "rehearse"), default="device")
    w.add_argument("--gpu-tests-log", default=None, help="also write --json from this log")
    w.add_argument("--gpu-tests-xml", default=None)
    for name in ("summary", "check"):
        s = sub.add_parser(name)
        s.add_argument("--out-dir", required=True)
        s.add_argument("--logs", required=True)
        s.add_argument("--mode", choices=("device", "rehearse"), required=True)
        s.add_argument("--start", type=float, default=time.time())
        s.add_argument("--cells", default=",".join(REQUIRED_METRICS))
    args = p.parse_args(argv)
    return dict(watch=watch, summary=summary_cmd, check=check_cmd)[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
