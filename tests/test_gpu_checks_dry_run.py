"""The prepared GPU run: its CPU dry run prints a plan that fits the device limits, and its
cell machinery (timeouts, summary.json, at most 8 files under $OUT) works on CPU."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEVICE_COMMAND_LIMIT_S = 480  # inside a 600 s device command and a 15-minute lease
MAX_FILES_BACK = 8  # files a device run returns from $OUT
CELLS = [
    "setup",
    "gpu_tests",
    "autotune",
    "bench_kernels",
    "bench_engine",
    "fp8_decode",
    "compile_check",
]


def gpu_checks(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "scripts/gpu_checks.sh", *args],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_dry_run_prints_the_plan_and_a_budget_that_fits():
    run = gpu_checks("--dry-run")
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    cells = re.findall(r"cell (\w+)\s+<=\s+(\d+) s\s+-> (\S+)", out)
    assert [c[0] for c in cells] == CELLS  # most informative first
    total = int(re.search(r"budget: total (\d+) s <= (\d+) s", out).group(1))
    assert total == sum(int(c[1]) for c in cells) <= DEVICE_COMMAND_LIMIT_S
    files = {"summary.json"} | {f for c in cells if c[2] != "-" for f in c[2].split(",")}
    assert "tuned_configs.json" in files and len(files) <= MAX_FILES_BACK
    assert int(re.search(r"gpu_checks files: (\d+)", out).group(1)) == len(files)
    limits = {c[0]: int(c[1]) for c in cells}
    # The sub-plans run with a time limit inside their cell's.
    tune_limit = float(re.search(r"after --time-limit=(\d+) s\n", out).group(1))
    assert tune_limit < limits["autotune"]
    assert re.search(r"key decode-bf16-d128-g4-bs16\s+\d+ configs\s+~\s*\d+ s\n", out)
    bench = re.search(r"= ~(\d+) s \(stops starting cells after --time-limit=(\d+) s", out)
    assert int(bench.group(2)) < limits["bench_kernels"]


def test_bench_kernels_runs_the_biggest_cells_first_on_a_pool_under_4_gib():
    out = gpu_checks("--dry-run").stdout
    cells = re.findall(r"cell decode b=(\d+) ctx=(\d+) (\w+)", out)
    order = [(int(b), int(c)) for b, c, _ in cells]
    assert order == sorted(order, key=lambda bc: (-bc[0], -bc[1]))
    assert order[0] == (256, 8192) and order[-1] == (1, 2048)
    assert set(order) == {(b, c) for b in (1, 64, 256) for c in (2048, 8192)}
    assert {impl for *_, impl in cells} == {"pallas", "mosaic", "jax_pallas", "xla_gather"}
    pool = re.search(r"pool: (\d+) blocks, (\d+) B per array.*, (\d+) blocks shared", out)
    blocks, nbytes, shared = map(int, pool.groups())
    assert nbytes == blocks * 8 * 16 * 128 * 2 < 2**32  # int32 offsets address every element
    assert blocks + shared == 256 * 8192 // 16 + 1


def load_bench():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bench_kernels
    finally:
        sys.path.pop(0)
    return bench_kernels


def test_bench_report_is_written_after_every_cell(tmp_path):
    bench_kernels = load_bench()
    path = tmp_path / "r.json"
    report = bench_kernels.Report(path, dict(device="x"))
    assert json.loads(path.read_text())["results"] == []
    report.add(dict(batch=1, context=2048, impls={}))
    report.data["results"][0]["impls"]["pallas"] = dict(us=10.0)
    report.flush()
    assert json.loads(path.read_text())["results"][0]["impls"]["pallas"]["us"] == 10.0
    # Small cells loop many calls per sync; the biggest still loop at least 10.
    assert bench_kernels.loop_count(bench_kernels.kv_bytes([2048])) >= 1000
    assert bench_kernels.loop_count(bench_kernels.kv_bytes([8192] * 256)) == 10


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


def test_cells_run_on_and_the_summary_lists_each(tmp_path):
    """A failing cell (autotune needs a GPU) does not stop the others; every cell lands in
    summary.json with rc, seconds and its files; a missing toolchain is a skip."""
    out, logs = tmp_path / "out", tmp_path / "logs"
    run = gpu_checks(
        timeout=300,
        OUT=str(out),
        GPU_CHECKS_LOGS=str(logs),
        GPU_CHECKS_CELLS="setup,autotune,compile_check",
    )
    assert run.returncode == 0, run.stdout + run.stderr
    summary = json.loads((out / "summary.json").read_text())
    cells = {c["name"]: c for c in summary["cells"]}
    assert list(cells) == ["setup", "autotune", "compile_check"]
    assert cells["setup"]["rc"] == 0 and cells["setup"]["json"] is None
    assert cells["autotune"]["rc"] == 2 and cells["autotune"]["status"] == "failed"
    assert "needs an NVIDIA GPU" in cells["autotune"]["log_tail"]
    assert cells["autotune"]["files"] == {"autotune.json": False, "tuned_configs.json": True}
    assert cells["compile_check"]["json"] == "gpu_compile.json"
    if cells["compile_check"]["status"] == "skipped":  # no CUDA plugin in this venv
        assert "not installed" in cells["compile_check"]["reason"]
    assert all(isinstance(c["seconds"], int) and c["limit_s"] > 0 for c in cells.values())
    assert len(list(out.iterdir())) <= MAX_FILES_BACK
    table = json.loads((out / "tuned_configs.json").read_text())
    assert table["format"] == 1


def tiny_gpu_path(monkeypatch, tmp_path, attend=None, mosaic=None):
    """bench_kernels' GPU path on CPU: tiny shapes, the Pallas kernels in interpret mode.

    The "mosaic" impl runs "mosaic_gpu_interpret" where jax runs it (else it is skipped,
    saying why), or `mosaic` (a stand-in decode op) when given."""
    import functools
    import types

    import pallas_kernels as pk

    bench_kernels = load_bench()
    for name, value in dict(
        BATCHES=(2,),
        CONTEXTS=(40,),
        NUM_Q_HEADS=8,
        NUM_KV_HEADS=2,
        HEAD_DIM=32,
        REPS=1,
        MIXED_CELL=(2, 40),
        STEP_BACKEND="pallas_interpret",
        MOSAIC_BACKEND="mosaic_gpu_interpret",
    ).items():
        monkeypatch.setattr(bench_kernels, name, value)
    monkeypatch.setattr(bench_kernels, "LOOP_SECONDS", 0.0)
    ours = attend or functools.partial(pk.paged_attention, interpret=True)
    monkeypatch.setattr(pk, "paged_attention", ours)
    theirs, why = bench_kernels.jax_paged_attention()
    assert theirs is not None, why
    monkeypatch.setattr(
        bench_kernels,
        "jax_paged_attention",
        lambda: (functools.partial(theirs, interpret=True), None),
    )
    if mosaic is not None:
        monkeypatch.setattr(bench_kernels, "mosaic_paged_attention", lambda: (mosaic, None))
    path = tmp_path / "bench.json"
    args = types.SimpleNamespace(output=str(path), peak_gbps=None, time_limit=600.0)
    return bench_kernels.run_gpu(args), json.loads(path.read_text())


def test_bench_gpu_path_compares_all_three_side_by_side(monkeypatch, tmp_path):
    rc, report = tiny_gpu_path(monkeypatch, tmp_path)
    assert rc == 0
    row, step_rows = report["results"]
    # The step's decode rows on its three paths agree and are compared per token.
    assert list(step_rows["impls"]) == ["step_decode_only", "step_mixed_path", "ragged_kernel"]
    for impl in ("step_mixed_path", "ragged_kernel"):
        assert step_rows["impls"][impl]["agrees"]
        assert step_rows[f"{impl}_per_token_vs_decode_only"] == pytest.approx(
            step_rows["impls"][impl]["us"] / step_rows["impls"]["step_decode_only"]["us"]
        )
    assert 0 < row["predicted_fraction_of_peak"] <= 1
    assert list(row["impls"]) == ["xla_gather", "pallas", "mosaic", "jax_pallas"]
    mosaic = row["impls"]["mosaic"]
    if report["mosaic_available"]:
        assert mosaic["agrees"] and "speedup_vs_mosaic" in row
    else:  # jax < 0.12: skipped with the reason, not a failure
        assert mosaic["skipped"] == f"mosaic_gpu_interpret: {report['mosaic_missing']}"
        assert "jax >=" in mosaic["skipped"] and "speedup_vs_mosaic" not in row
    for impl in ("pallas", "jax_pallas"):
        res = row["impls"][impl]
        assert res["agrees"] and res["rel_err_vs_xla_gather"] < 2e-2
        assert res["fraction_of_peak"] == pytest.approx(row["roofline_us"] / res["us"])
        assert res["gbps"] == pytest.approx(row["roofline_bytes"] / res["us"] / 1e3)
    assert row["speedup_vs_jax_pallas"] == pytest.approx(
        row["impls"]["jax_pallas"]["us"] / row["impls"]["pallas"]["us"]
    )
    assert "speedup_vs_xla_gather" in row and report["pool"]["num_blocks"] == 2 * 3 + 1


def test_bench_exits_nonzero_when_an_output_disagrees(monkeypatch, tmp_path):
    wrong = lambda q, *a, **kw: q * 0  # noqa: E731
    # ours on Triton and a stand-in Mosaic op, both wrong: each compared with xla_gather
    rc, report = tiny_gpu_path(monkeypatch, tmp_path, attend=wrong, mosaic=wrong)
    assert rc == 1
    assert report["results"][0]["impls"]["pallas"]["agrees"] is False
    row = report["results"][0]
    assert report["mosaic_available"] and row["impls"]["mosaic"]["agrees"] is False
    assert row["speedup_vs_mosaic"] == pytest.approx(
        row["impls"]["mosaic"]["us"] / row["impls"]["pallas"]["us"]
    )
