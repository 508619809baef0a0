"""bench_kernels' decode and mixed parts on CPU: the device run's code path, the kernels
in interpret mode at tiny shapes; the report's fractions, speedups and metrics follow
from its own timings, and a disagreeing kernel fails the run."""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load():
    name = "bench_kernels"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def run_tiny(monkeypatch, tmp_path, wrong_pallas=False):
    bk = load()
    group = bk.CellGroup(bk.SMALL, ((2, 40),), timed=("xla_gather", "pallas", "jax_pallas"),
                         untimed="too slow here")  # fmt: skip
    monkeypatch.setattr(bk, "decode_plan", lambda rehearse: [group])
    monkeypatch.setattr(bk, "COPY_CEILING_BYTES", 64 << 20)  # the rehearsal uses 1/32
    if wrong_pallas:
        fns = bk.decode_fns
        monkeypatch.setattr(
            bk, "decode_fns", lambda *a: dict(fns(*a), pallas=lambda x, *arrays: x * 0)
        )
    path = tmp_path / "bench.json"
    args = types.SimpleNamespace(output=str(path), peak_gbps=None, time_limit=600.0,
                                 rehearse=True, argv=["--rehearse"])  # fmt: skip
    return bk.run_decode(args), json.loads(path.read_text())


def test_decode_report_metrics_follow_from_its_timings(monkeypatch, tmp_path):
    rc, report = run_tiny(monkeypatch, tmp_path)
    assert rc == 0
    (row,) = report["results"]
    assert list(row["impls"]) == ["xla_gather", "pallas", "jax_pallas", "mosaic"]
    ceiling = report["copy_ceiling"]["gbps"] * 1e9
    for impl in ("xla_gather", "pallas", "jax_pallas"):
        res = row["impls"][impl]
        assert res["captured_constants"].startswith("none over")
        seconds = res["us"] * 1e-6
        assert res["fraction_of_peak"] == pytest.approx(row["roofline_bytes"] / seconds / 4.8e12)
        assert res["fraction_of_copy_ceiling"] == pytest.approx(
            row["roofline_bytes"] / seconds / ceiling
        )
        if impl != "xla_gather":
            assert res["agrees"] and res["rel_err_vs_xla_gather"] < 2e-2
    mosaic = row["impls"]["mosaic"]
    if report["mosaic_available"]:  # lowered and checked, not timed
        assert mosaic["not_timed"] == "too slow here" and "us" not in mosaic
    else:
        assert mosaic["skipped"] == report["mosaic_missing"] and "jax >=" in mosaic["skipped"]
    speedup = row["impls"]["jax_pallas"]["us"] / row["impls"]["pallas"]["us"]
    assert row["speedup_vs_jax_pallas"] == pytest.approx(speedup)
    m = report["metrics"]
    assert set(m) == {
        "cells_timed", "best_fraction_of_peak", "best_fraction_of_copy_ceiling",
        "copy_ceiling_gbps", "max_kv_cache_mib", "speedup_vs_jax_pallas",
    }  # fmt: skip
    assert all(math.isfinite(v) for v in m.values())
    assert m["cells_timed"] == 1 and m["speedup_vs_jax_pallas"] == pytest.approx(speedup)
    # The best fraction is our Triton kernel's (Mosaic was not timed).
    assert m["best_fraction_of_peak"] == row["impls"]["pallas"]["fraction_of_peak"]
    pool = report["pools"][0]
    assert m["max_kv_cache_mib"] == 2 * pool["bytes_per_array"] / 2**20
    assert pool["num_blocks"] == 2 * 3 + 1  # what the cell needs, plus the null block


def test_decode_exits_nonzero_when_our_kernel_disagrees(monkeypatch, tmp_path):
    rc, report = run_tiny(monkeypatch, tmp_path, wrong_pallas=True)
    assert rc == 1
    assert report["results"][0]["impls"]["pallas"]["agrees"] is False


def test_rehearsal_plan_keeps_a_pool_of_at_least_256_mib():
    bk = load()
    plan = bk.decode_plan(rehearse=True)
    biggest = max(g.pool_blocks()[0] * g.heads.block_bytes() for g in plan)
    assert biggest >= 256 << 20
    device = bk.decode_plan(rehearse=False)
    (group,) = device
    assert group.cells == bk.by_bytes(group.cells) and group.timed == bk.IMPLS
    batches = {b for b, _ in group.cells}
    contexts = {c for _, c in group.cells}
    assert min(batches) == 1 and max(batches) == 256
    assert min(contexts) == 1024 and max(contexts) == 32768
    assert group.pool_blocks()[0] * group.heads.block_bytes() < 2**32
