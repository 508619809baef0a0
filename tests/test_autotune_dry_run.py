"""The autotuner on CPU: its plan, and the whole sweep -> check -> pick -> write path in
Pallas interpret mode, read back through the kernels' lookup."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np

from pallas_kernels import timing, tuning

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "autotune_kernels.py"


def autotune(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    # timeout: a hang guard, not a speed limit (a jax import alone can take tens of
    # seconds on a loaded 2-core machine); no test asserts how long the script ran.
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def load_script():
    spec = importlib.util.spec_from_file_location("autotune_kernels", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, mod)  # dataclasses look their module up there
    spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules[spec.name]


def test_dry_run_plans_the_most_used_keys_first_and_marks_the_cut():
    out = autotune("--dry-run", "--time-limit", "100", "--groups", "4,8,1")
    assert out.returncode == 0, out.stderr
    keys = re.findall(r"key (\S+)\s+(\d+) configs\s+~\s*(\d+) s(.*)", out.stdout)
    labels = [k[0] for k in keys]
    assert labels[:4] == [
        "decode-bf16-d128-g4-bs16",
        "ragged-bf16-d128-g4-bs16",
        "decode-e4m3-d128-g4-bs16",
        "ragged-e4m3-d128-g4-bs16",
    ]
    assert len(labels) == 12 and {lab.split("-")[3] for lab in labels} == {"g1", "g4", "g8"}
    cumulative = [int(k[2]) for k in keys]
    assert cumulative == sorted(cumulative)
    # Exactly the keys planned past the time limit are marked as cut.
    assert [bool(k[3].strip()) for k in keys] == [c > 100 for c in cumulative]
    assert re.search(r"autotune budget: ~\d+ s", out.stdout)
    # By default: the keys the engine looks up for Llama-3-8B (group 4, head_dim 128).
    default = autotune("--dry-run")
    assert re.findall(r"key (\S+)", default.stdout) == labels[:4]


def test_search_spaces():
    at = load_script()
    dec = at.ShapeKey(at.DECODE, "bfloat16", 128, 4)
    stages = at.candidate_stages(dec, "greedy")
    assert [c["block_k"] for c in stages[0]] == [32, 64, 128, 256]
    full = at.expand(stages[1], dict(block_k=64, num_stages=3, num_warps=4))
    assert {c["block_k"] for c in full} == {64} and len(full) == 6
    assert at.expand(stages[1], None) == []
    assert len(at.candidate_stages(dec, "grid")[0]) == 4 * 3 * 2
    # Ragged query tiles hold 16-128 rows: block_q x the group padded to a power of two.
    assert at.block_q_choices(1) == (16, 32, 64)
    assert at.block_q_choices(4) == (4, 8, 16, 32)
    assert at.block_q_choices(8) == (2, 4, 8, 16)
    assert at.plan_configs(dec, "greedy") == 1 + 4 + 5


def test_a_config_that_disagrees_with_the_reference_is_rejected():
    at = load_script()
    q = jnp.ones((4, 2, 16), jnp.bfloat16)
    two = jnp.full((4, 2, 16), 2, jnp.bfloat16)
    row = at.measure(lambda x, w: x * w, q, (two,), np.ones((4, 2, 16)), n=1, reps=1)
    assert row["status"] == "mismatch" and row["rel_err"] > timing.MAX_REL_ERR
    ok = at.measure(lambda x, w: x * w, q, (two,), 2 * np.ones((4, 2, 16)), n=3, reps=2)
    assert ok["status"] == "ok" and ok["rel_err"] == 0 and len(ok["samples_us"]) == 2


def test_rehearsal_sweep_writes_a_table_the_lookup_returns_and_folds_it_in(tmp_path):
    output = tmp_path / "autotune.json"
    out = autotune("--rehearse", "--write", "--output", str(output))
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(output.read_text())
    assert report["interpret"] and not report["timings_meaningful"]
    assert len(report["keys"]) == 2 and report["stopped"] is None
    # --rehearse --write without --table: a temporary table, never the packaged one.
    table = pathlib.Path(report["table"])
    assert table != tuning.TABLE_PATH and table.exists()
    assert report["tuned_configs"] == json.loads(table.read_text())
    assert len(report["tuned_configs"]["entries"]) == 2
    assert report["metrics"] == dict(keys_tuned=2, configs_timed=4)
    for rec in report["keys"]:
        assert rec["complete"] and rec["written"], rec
        assert [c["status"] for c in rec["configs"]] == ["ok", "ok"], rec["configs"]
        assert all(c["rel_err"] <= 2e-2 for c in rec["configs"])
        fastest = min(rec["configs"], key=lambda c: c["us"])
        got = tuning.tuned_config(
            rec["kernel"],
            device_kind="cpu-interpret",
            dtype=jnp.bfloat16,
            head_dim=rec["head_dim"],
            group=rec["group"],
            block_size=rec["block_size"],
            path=table,
        )
        assert got == fastest["config"]
        entry = tuning.load_table(table).lookup(
            rec["kernel"], "cpu-interpret", "bfloat16", rec["head_dim"], rec["group"], 16
        )
        assert entry.measured["timings_meaningful"] is False
        assert entry.measured["command"].startswith("python scripts/autotune_kernels.py")
    # Not on a GPU, the real lookup misses: interpret entries never act as GPU defaults.
    assert (
        tuning.tuned_config(
            "paged_decode_attention",
            device_kind=tuning.current_device_kind(),
            dtype="bfloat16",
            head_dim=32,
            group=4,
            block_size=16,
            path=table,
        )
        is None
    )


def test_time_limit_stops_cleanly_and_writes_nothing(tmp_path):
    table, output = tmp_path / "tuned.json", tmp_path / "autotune.json"
    out = autotune(
        "--interpret", "--write", "--table", str(table), "--output", str(output),
        "--time-limit", "0",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = json.loads(output.read_text())
    assert report["stopped"].startswith("--time-limit=0s reached")
    assert report["metrics"] == dict(keys_tuned=0, configs_timed=0)
    assert not table.exists()


def test_interpret_never_writes_the_packaged_table():
    out = autotune("--interpret", "--write")
    assert out.returncode == 2 and "needs --table" in out.stderr
