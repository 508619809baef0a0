"""The prepared GPU run (scripts/gpu_checks.sh): its plan fits the device limits, its
bookkeeping (scripts/gpu_checks_report.py) fails what a device run must not return, and its
cells run for real on CPU in the rehearsal (here: the smoke cell, and the test cell with
pytest-timeout installed, as on the device)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEVICE_COMMAND_LIMIT_S = 480  # inside a 600 s device command and a 15-minute lease
MAX_FILES_BACK = 8  # files a device run returns from $OUT
CELLS = [  # in order of value
    "smoke",
    "gpu_tests",
    "bench_decode",
    "bench_mixed",
    "bench_engine",
    "fp8_decode",
    "autotune",
]


# The rehearsals run real cells on this CPU under gpu_checks.sh's per-cell limits, scaled by
# GPU_CHECKS_SLOWDOWN: these tests check what the cells write, never how fast they ran,
# so the scale is generous (a loaded 2-core machine runs many times slower than CI's).
REHEARSAL_SLOWDOWN = os.environ.get("GPU_CHECKS_SLOWDOWN", "20")


def gpu_checks(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    # timeout: a hang guard for the whole script, above every cell limit it scales.
    return subprocess.run(
        ["bash", "scripts/gpu_checks.sh", *args],
        cwd=ROOT,
        env={
            "PATH": "/usr/bin:/bin",
            "HOME": os.environ.get("HOME", "/tmp"),
            "PYTHON": sys.executable,
            "PYTHONPATH": str(ROOT),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def load_report():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_checks_report
    finally:
        sys.path.pop(0)
    return gpu_checks_report


def test_dry_run_prints_the_plan_and_a_budget_that_fits():
    run = gpu_checks("--dry-run")
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    cells = re.findall(r"cell (\w+)\s+<=\s+(\d+) s\s+--time-limit\s+(\S+)\s+-> (\S+)", out)
    assert [c[0] for c in cells] == CELLS
    limits = {c[0]: int(c[1]) for c in cells}
    assert limits["smoke"] <= 60
    total = int(re.search(r"budget: total (\d+) s <= (\d+) s", out).group(1))
    assert total == sum(limits.values()) <= DEVICE_COMMAND_LIMIT_S
    # Each script stops starting points well inside its cell's limit.
    for name, limit, time_limit, _ in cells:
        assert time_limit == "-" or int(time_limit) <= int(limit) - 15, name
    files = {c[3] for c in cells}
    assert "summary.json" in files and len(files) == len(CELLS) <= MAX_FILES_BACK
    assert int(re.search(r"gpu_checks files: (\d+)", out).group(1)) == len(files)
    assert "not rehearsed" in out and "torch" in out
    # The sub-plans run with the time limit their cell gives them.
    tune_limit = float(re.search(r"after --time-limit=(\d+) s\n", out).group(1))
    assert tune_limit < limits["autotune"]
    bench = re.search(r"stops starting cells after --time-limit=(\d+) s", out)
    assert int(bench.group(1)) < limits["bench_decode"]


def test_cells_option_selects_and_rejects_unknown_arguments():
    run = gpu_checks("--dry-run", "--cells", "smoke,bench_mixed")
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.findall(r"cell (\w+)\s+<=", run.stdout) == ["smoke", "bench_mixed"]
    run = gpu_checks("--bogus")
    assert run.returncode == 2 and "unknown argument --bogus" in run.stderr


# -- the bookkeeping: what makes a cell not ok ---------------------------------------------

GOOD = {
    "smoke": dict(decode_max_abs_err=0.004, copy_gbps=12.0),
    "bench_mixed": dict(decode_us_per_token=3.0, mixed_us_per_token=3.3, mixed_over_decode=1.1),
}


def test_judge_names_each_reason_a_cell_is_not_ok():
    report = load_report()
    seen = dict(writes_seen_running=3)
    assert report.judge("smoke", 0, dict(metrics=GOOD["smoke"]), seen, "rehearse") == []
    assert report.judge("smoke", 124, dict(metrics=GOOD["smoke"]), seen, "device") == [
        "killed at its limit (rc 124)"
    ]
    assert report.judge("smoke", 0, None, seen, "device") == [
        "its JSON is missing or does not parse"
    ]
    nan = dict(metrics=dict(GOOD["smoke"], copy_gbps=float("nan")))
    (why,) = report.judge("smoke", 0, nan, seen, "device")
    assert "copy_gbps" in why and "finite" in why
    why = report.judge("bench_mixed", 0, dict(metrics={"decode_us_per_token": 1}), seen, "x")
    assert len(why) == 2 and "'mixed_us_per_token'" in why[0] and "'mixed_over_decode'" in why[1]
    # Written only at exit: the watcher saw one state (or none) while the script ran.
    (why,) = report.judge("smoke", 0, dict(metrics=GOOD["smoke"]), dict(writes_seen_running=1), "x")
    assert "written only at exit" in why


def test_judge_gpu_tests_needs_tests_that_ran_and_passed():
    report = load_report()
    seen = dict(writes_seen_running=5)

    def tests(run, passed, failed, skipped):
        m = dict(tests_run=run, tests_passed=passed, tests_failed=failed, tests_skipped=skipped)
        return dict(metrics=m)

    assert report.judge("gpu_tests", 0, tests(12, 12, 0, 3), seen, "rehearse") == []
    (why,) = report.judge("gpu_tests", 0, tests(0, 0, 0, 17), seen, "rehearse")
    assert "only 0 tests ran (17 skipped)" in why  # all skipped is not ok
    assert report.judge("gpu_tests", 0, tests(3, 3, 0, 0), seen, "device") == []
    (why,) = report.judge("gpu_tests", 0, tests(12, 11, 1, 0), seen, "device")
    assert "1 tests failed" in why


def test_judge_bench_decode_excuses_only_an_explained_jax_pallas_gap():
    report = load_report()
    seen = dict(writes_seen_running=2)
    metrics = dict(
        cells_timed=2,
        best_fraction_of_peak=0.01,
        best_fraction_of_copy_ceiling=0.2,
        copy_ceiling_gbps=10.0,
        max_kv_cache_mib=256.0,
    )
    (why,) = report.judge("bench_decode", 0, dict(metrics=metrics), seen, "rehearse")
    assert "speedup_vs_jax_pallas" in why
    why_missing = dict(metrics=metrics, jax_pallas_missing="cannot import it")
    assert report.judge("bench_decode", 0, why_missing, seen, "rehearse") == []
    small = dict(why_missing, metrics=dict(metrics, max_kv_cache_mib=64.0))
    (why,) = report.judge("bench_decode", 0, small, seen, "rehearse")
    assert "captured constant" in why
    assert report.judge("bench_decode", 0, small, seen, "device") == []


def test_gpu_tests_json_from_the_verbose_log_and_the_xml(tmp_path):
    report = load_report()
    log = textwrap.dedent(
        """\
        collecting ... collected 4 items
        tests/a.py::test_x[base] PASSED                                      [ 25%]
        tests/a.py::test_x[d64] FAILED                                       [ 50%]
        tests/a.py::test_y SKIPPED (needs an NVIDIA GPU)                     [ 75%]
        tests/b.py::test_z ERROR                                             [100%]
        FAILED tests/a.py::test_x[d64] - AssertionError
        """
    )
    got = report.gpu_tests_report(log, None, mode="rehearse")
    assert got["metrics"] == dict(tests_run=3, tests_passed=1, tests_failed=2, tests_skipped=1)
    assert got["tests"][2] == dict(
        name="tests/a.py::test_y", outcome="skipped", message="needs an NVIDIA GPU"
    )
    assert got["tests"][1]["message"] == "AssertionError"  # from the -ra summary line
    # The same under pytest-xdist (the cell runs workers).
    xdist = "\n".join(
        f"[gw{i % 2}] [ {25 * (i + 1)}%] {r['outcome'].upper()} {r['name']} "
        for i, r in enumerate(got["tests"])
    ).replace("FAILED tests/b.py", "ERROR tests/b.py")
    assert report.gpu_tests_report(xdist, None, mode="x")["metrics"] == got["metrics"]
    # A killed pytest (no XML) keeps what finished; the XML, when written, adds messages.
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite><testcase classname="tests.a" name="test_x[d64]" time="2.5">'
        '<failure message="Failed: Timeout (>60.0s)"/></testcase></testsuite></testsuites>'
    )
    got = report.gpu_tests_report(log.splitlines()[1] + "\n", xml, mode="device")
    assert got["metrics"]["tests_run"] == 2 and got["metrics"]["tests_failed"] == 1
    assert got["tests"][1]["message"] == "Failed: Timeout (>60.0s)"
    assert got["tests"][1]["seconds"] == 2.5


WRITER = """
import json, pathlib, sys, time
path, points, only_at_exit = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
report = dict(metrics={})
for i in range(points):
    time.sleep(1.5)  # the watcher polls every 0.1 s: it must miss a whole 1.5 s to fail
    report["metrics"]["points"] = i + 1
    if not only_at_exit:
        path.write_text(json.dumps(report))
if only_at_exit:
    path.write_text(json.dumps(report))
"""


@pytest.mark.parametrize("only_at_exit", [False, True], ids=["every_point", "only_at_exit"])
def test_watcher_tells_a_json_rewritten_per_point_from_one_written_at_exit(tmp_path, only_at_exit):
    report = load_report()
    json_path, watched = tmp_path / "cell.json", tmp_path / "cell.watch.json"
    cell = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(json_path), "4", str(int(only_at_exit))]
    )
    watcher = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts/gpu_checks_report.py"),
            "watch",
            "--pid",
            str(cell.pid),
            "--json",
            str(json_path),
            "--out",
            str(watched),
        ],
        timeout=300,  # a hang guard only: the writer ends after 4 x 1.5 s
    )
    assert cell.wait() == 0 and watcher.returncode == 0
    seen = json.loads(watched.read_text())
    data = json.loads(json_path.read_text())
    why = report.judge("bench_engine", 0, data, seen, "rehearse")
    assert ("written only at exit" in " ".join(why)) == only_at_exit, (seen, why)
    if not only_at_exit:
        assert seen["writes_seen_running"] >= 3


def fake_run(out: pathlib.Path, logs: pathlib.Path, names: list[str]) -> None:
    """$OUT and $LOGS as a device run whose cells all passed would leave them."""
    report = load_report()
    out.mkdir()
    logs.mkdir()
    rows = []
    for name in names:
        json_name = "summary.json" if name == "smoke" else f"{name}.json"
        at = logs / "smoke.json" if name == "smoke" else out / json_name
        at.write_text(json.dumps(dict(metrics=GOOD[name])))
        (logs / f"{name}.watch.json").write_text(json.dumps(dict(writes_seen_running=2)))
        rows.append(f"{name}\t0\t3\t40\t20\t{json_name}\t{at}\tpython x.py")
    (logs / "cells.tsv").write_text("\n".join(rows) + "\n")
    report.write_json(out / "summary.json", report.build_summary(out, logs, start=0, mode="x"))


def test_check_fails_a_ninth_file_and_a_missing_cell(tmp_path, capsys):
    report = load_report()
    out, logs = tmp_path / "out", tmp_path / "logs"
    fake_run(out, logs, ["smoke", "bench_mixed"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["smoke"]["metrics"] == GOOD["smoke"]  # the smoke cell's file
    assert [c["status"] for c in summary["cells"]] == ["ok", "ok"]
    assert report.check(out, mode="device", expect=["smoke", "bench_mixed"]) == []
    table = capsys.readouterr().out
    assert re.search(r"smoke\s+3\s+-\s+40\s+ok\s+decode_max_abs_err=0.004, copy_gbps=12", table)
    (why,) = report.check(out, mode="device", expect=["smoke", "bench_mixed", "autotune"])
    assert "lacks cells ['autotune']" in why
    for i in range(7):  # 2 files + 7 = 9 under $OUT
        (out / f"extra{i}.json").write_text("{}")
    (why,) = report.check(out, mode="device", expect=["smoke", "bench_mixed"])
    assert "9 files under $OUT (> 8)" in why


# -- real cells on CPU (the rehearsal's path) ----------------------------------------------


def test_rehearsed_smoke_cell_folds_into_summary_json(tmp_path):
    out, logs = tmp_path / "out", tmp_path / "logs"
    run = gpu_checks(
        "--rehearse",
        "--cells",
        "smoke",
        timeout=40 * int(REHEARSAL_SLOWDOWN) + 600,  # above the smoke cell's scaled limit
        OUT=str(out),
        GPU_CHECKS_LOGS=str(logs),
        GPU_CHECKS_SLOWDOWN=REHEARSAL_SLOWDOWN,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"]
    summary = json.loads((out / "summary.json").read_text())
    (cell,) = summary["cells"]
    assert cell["status"] == "ok" and cell["json_writes_seen"] >= 2, cell
    smoke = summary["smoke"]
    assert smoke["versions"]["jax"] and smoke["decode"]["agrees"]
    assert 0 <= smoke["metrics"]["decode_max_abs_err"] <= smoke["decode"]["tolerance"]
    assert smoke["metrics"]["copy_gbps"] > 0
    assert re.search(
        r"smoke\s+\d+\s+\d+\s+40\s+ok\s+copy_gbps=\S+, decode_max_abs_err=", run.stdout
    )


def python_with_pytest_timeout() -> str:
    for py in (sys.executable, str(ROOT / ".venv-device/bin/python")):
        probe = subprocess.run([py, "-c", "import pytest_timeout"], capture_output=True)
        if os.path.exists(py) and probe.returncode == 0:
            return py
    pytest.skip("no python with pytest-timeout here (the `test` extra installs it)")


def test_rehearsed_test_cell_runs_tests_under_pytest_timeout(tmp_path):
    """The blocker: with pytest-timeout installed (as on the device), `-p pytest_timeout`
    registered the plugin twice and pytest exited 3 before any test. The cell passes
    --timeout alone and records each result from the -v log as tests finish."""
    out, logs = tmp_path / "out", tmp_path / "logs"
    run = gpu_checks(
        "--rehearse",
        "--cells",
        "gpu_tests",
        timeout=100 * int(REHEARSAL_SLOWDOWN) + 600,  # above gpu_tests' scaled limit
        OUT=str(out),
        GPU_CHECKS_LOGS=str(logs),
        PYTHON=python_with_pytest_timeout(),
        GPU_CHECKS_PYTEST_ARGS="-k write_kv",
        GPU_CHECKS_SLOWDOWN=REHEARSAL_SLOWDOWN,
    )
    summary = json.loads((out / "summary.json").read_text())
    (cell,) = summary["cells"]
    assert cell["rc"] == 0, cell["log_tail"]
    limit = int(re.search(r"--timeout=(\d+)", cell["command"]).group(1))
    assert limit == 60 * int(REHEARSAL_SLOWDOWN) and "-p pytest_timeout" not in cell["command"]
    assert f"timeout: {limit}.0s" in (logs / "gpu_tests.log").read_text()  # the plugin is on
    tests = json.loads((out / "gpu_tests.json").read_text())
    assert tests["metrics"] == dict(tests_run=2, tests_passed=2, tests_failed=0, tests_skipped=0)
    assert {t["name"].split("::")[-1] for t in tests["tests"]} == {
        "test_write_kv_and_copy_blocks_match_reference[bfloat16]",
        "test_write_kv_and_copy_blocks_match_reference[fp8_e4m3]",
    }
    # -k picked 2 tests: the rehearsal asks for >= 10, so the run itself is not ok.
    assert cell["problems"] == ["only 2 tests ran (0 skipped); needs >= 10"]
    assert run.returncode == 1


# bench_kernels' decode report, its exit on a disagreement and its rehearsal pool are tested
# beside the script (tests/test_bench_kernels_decode.py, tests/test_bench_timing.py).


def load_bench():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bench_kernels
    finally:
        sys.path.pop(0)
    return bench_kernels


def test_bench_tables_wrap_around_a_capped_pool():
    import numpy as np

    bench_kernels = load_bench()
    rng = np.random.default_rng(0)
    tables, lens = bench_kernels.make_tables(rng, [40, 33], 6)  # 3 + 3 blocks, 5 real ones
    t = np.asarray(tables)
    assert t.shape == (2, 16) and list(np.asarray(lens)) == [40, 33]
    used = np.concatenate([t[0, :3], t[1, :3]])
    assert set(used) == {1, 2, 3, 4, 5} and used[5] == used[0]  # the deal wrapped once
    assert (t[:, 3:] == 0).all()
