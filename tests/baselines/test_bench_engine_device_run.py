"""scripts/bench_engine.py --device-run: the engine cell's points, its JSON after every point,
the time limit, and (slow) the rehearsal for real on CPU."""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import sys

import jax.numpy as jnp
import pytest
from flax import nnx

from paged_jax.baselines import engine_cell, harness
from paged_jax.baselines.harness import SystemResult
from paged_jax.baselines.hf_generate import llama_num_parameters

REPO = pathlib.Path(__file__).resolve().parents[2]
# scripts/gpu_checks.sh's command line for this cell (rehearsal form).
DEVICE_RUN_ARGV = ["--device-run", "--rehearse", "--time-limit", "600"]


def _load_script():
    spec = importlib.util.spec_from_file_location("bench_engine", REPO / "scripts/bench_engine.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


def _strict_json(path: pathlib.Path) -> dict:
    """The file's JSON, refusing NaN and Infinity (not JSON, though Python writes them)."""

    def refuse(name: str) -> float:
        raise ValueError(f"{path} holds {name}")

    return json.loads(path.read_text(), parse_constant=refuse)


class _Clock:
    """Virtual seconds: the fake system advances it by each phase's duration."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _FakeEngine:
    def __init__(self, compiles: int) -> None:
        self.compiles = compiles
        self.warmup_report = self

    def summary(self) -> dict:
        return {"programs": 2}

    def get_stats(self) -> dict:
        return {"num_compiles_after_warmup": self.compiles, "num_steps": 7}


class _FakeSystem:
    """Stands in for PagedSystem: warm-up and each run take virtual seconds; every run first
    reads the report on disk (what a kill at that moment would leave)."""

    clock: _Clock | None = None
    output: pathlib.Path | None = None
    run_s = 10.0
    compiles = 0
    lose_tokens = False

    def __init__(self, model, *, owns_model, **engine_kwargs):
        assert owns_model, "the cell hands its model over (one copy of the weights)"
        self.engine_kwargs = engine_kwargs
        self.warmup_s = 5.0
        if self.clock is not None:
            self.clock.now += self.warmup_s
        self.num_warmup_shapes = 2
        self.engine = _FakeEngine(self.compiles)
        self.on_disk: list[dict] = []
        _FakeSystem.last = self

    def run(self, trace):
        self.on_disk.append(_strict_json(self.output))
        if self.clock is not None:
            self.clock.now += self.run_s
        tokens = sum(r.num_output_tokens for r in trace) - (1 if self.lose_tokens else 0)
        return SystemResult(
            name="paged-jax",
            elapsed_s=self.run_s,
            num_requests=len(trace),
            num_output_tokens=tokens,
            max_concurrent_seqs=len(trace),
            kv_utilization=0.5,
            outputs={},
            extra={"num_steps": 7},
        )


class _FakeModel(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.zeros((3, 4)))

    def kv_bytes_per_block(self, num_tokens, dtype=None):
        return 64 * num_tokens


@pytest.fixture
def fake_cell(monkeypatch, tmp_path):
    """The cell with a fake model and engine: (plan, output path, clock)."""
    import paged_jax.models.random_init as random_init

    monkeypatch.setattr(random_init, "random_model", lambda *a, **k: _FakeModel())
    monkeypatch.setattr(harness, "PagedSystem", _FakeSystem)
    clock = _Clock()
    out = tmp_path / "cell" / "bench_engine.json"
    monkeypatch.setattr(_FakeSystem, "clock", clock)
    monkeypatch.setattr(_FakeSystem, "output", out)
    plan = engine_cell.CellPlan(
        model_config=engine_cell.REHEARSAL_MODEL_CONFIG,
        dtype="bfloat16",
        batches=(4, 2, 1),
        prompt_len=8,
        output_len=5,
        max_num_batched_tokens=16,
    )
    return plan, out, clock


def test_the_report_is_on_disk_after_every_point(fake_cell):
    """A kill during point k leaves the k-1 points before it, metrics included."""
    plan, out, clock = fake_cell
    report = engine_cell.run_cell(plan, out, time_limit=None, start=clock(), clock=clock)
    seen = _FakeSystem.last.on_disk
    assert [len(r["points"]) for r in seen] == [0, 1, 2]
    assert [r["metrics"]["points"] for r in seen] == [0, 1, 2]
    assert seen[1]["phase"] == "points"
    # 4 requests x 5 tokens in 10 s; the best point is the largest batch.
    assert seen[1]["metrics"] == {
        "points": 1,
        "tok_s": 2.0,
        "best_batch": 4,
        "compiles_after_warmup": 0,
    }
    final = _strict_json(out)
    assert final == json.loads(json.dumps(report))
    assert final["phase"] == "done" and len(final["points"]) == 3
    assert [p["tok_s"] for p in final["points"]] == [2.0, 1.0, 0.5]
    assert [p["started_at_s"] for p in final["points"]] == [5.0, 15.0, 25.0]
    assert final["metrics"]["tok_s"] == 2.0 and final["skipped_points"] == []
    assert engine_cell.cell_ok(final) == []
    kwargs = _FakeSystem.last.engine_kwargs
    # The pool holds the largest batch whole: 4 x (cdiv(13, 16) + 1 spare) + the null block.
    assert kwargs["num_kv_blocks"] == 9 and kwargs["max_num_seqs"] == 4
    assert kwargs["max_model_len"] == 13


def test_the_time_limit_stops_starting_points(fake_cell):
    """A point starts only while used + the last point's duration fits in the limit."""
    plan, out, clock = fake_cell
    # Warm-up ends at 5 s; point 1 ends at 15 (15 + 10 <= 28: point 2 runs), point 2 at
    # 25 (25 + 10 > 28: point 3 is skipped).
    engine_cell.run_cell(plan, out, time_limit=28.0, start=clock(), clock=clock)
    final = _strict_json(out)
    assert [p["batch"] for p in final["points"]] == [4, 2]
    assert [s["batch"] for s in final["skipped_points"]] == [1]
    assert "time limit 28.0" in final["skipped_points"][0]["why"]
    assert final["metrics"]["points"] == 2


def test_the_first_point_runs_even_past_the_limit(fake_cell):
    plan, out, clock = fake_cell
    engine_cell.run_cell(plan, out, time_limit=0.001, start=clock(), clock=clock)
    final = _strict_json(out)
    assert [p["batch"] for p in final["points"]] == [4]
    assert [s["batch"] for s in final["skipped_points"]] == [2, 1]


@pytest.mark.parametrize(
    ("setting", "problem"),
    [("compiles", "1 compiles after warm-up"), ("lose_tokens", "incomplete")],
)
def test_a_compile_after_warmup_or_a_lost_token_fails_the_cell(
    fake_cell, monkeypatch, capsys, setting, problem
):
    _, out, _ = fake_cell
    monkeypatch.setattr(_FakeSystem, "clock", None)  # real time: every point runs
    monkeypatch.setattr(_FakeSystem, setting, 1 if setting == "compiles" else True)
    assert _load_script().main([*DEVICE_RUN_ARGV, "--output", str(out)]) == 1
    assert problem in capsys.readouterr().err
    final = _strict_json(out)
    assert final["mode"] == "rehearsal (CPU, cut shape)" and final["phase"] == "done"
    if setting == "compiles":
        assert final["metrics"]["compiles_after_warmup"] == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rehearse"], "--rehearse needs --device-run"),
        (["--time-limit", "30"], "--time-limit needs --device-run"),
        (["--device-run", "--time-limit", "0"], "--time-limit=0.0 must be > 0"),
        (["--device-run", "--batches", "4,0"], "--batches='4,0' must be a comma list"),
        (["--device-run", "--batches", "x"], "--batches='x' must be a comma list"),
    ],
)
def test_device_run_flags_are_checked(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        _load_script().parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_bad_plan_exits_2_before_building_anything(tmp_path, capsys):
    out = tmp_path / "bench_engine.json"
    argv = ["--device-run", "--prompt-len", "0", "--output", str(out)]
    assert _load_script().main(argv) == 2
    assert "CellPlan.prompt_len=0 must be >= 1" in capsys.readouterr().err
    assert not out.exists()


def test_plans_are_checked():
    with pytest.raises(ValueError, match=r"CellPlan.max_num_batched_tokens=64 must be >= the"):
        engine_cell.CellPlan({}, "bfloat16", (128,), 8, 8, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match=r"CellPlan.batches=\(\) must be"):
        engine_cell.CellPlan({}, "bfloat16", (), 8, 8)


def test_device_plan_is_the_llama3_8b_shape():
    """The numbers the issue names, checked against the plan (not derived from it)."""
    cfg = engine_cell.DEVICE_PLAN.model_config
    shape = {
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 14336,
        "vocab_size": 128256,
    }
    assert {k: cfg[k] for k in shape} == shape
    assert engine_cell.DEVICE_PLAN.dtype == "bfloat16"
    assert llama_num_parameters(cfg) == 8_030_261_248  # Meta-Llama-3-8B's count


@pytest.mark.slow
def test_rehearsal_for_real_writes_the_report_after_each_point(tmp_path, monkeypatch):
    """The exact device-run command line, rehearsed on CPU: a real engine on the random
    model, every point complete, 0 compiles after warm-up, and the report on disk holds
    point 1 while point 2 runs (a report written only at exit fails here)."""
    out = tmp_path / "bench_engine.json"
    on_disk = []
    real_run = harness.PagedSystem.run

    def spying_run(self, trace):
        if out.exists():
            on_disk.append(_strict_json(out))
        return real_run(self, trace)

    monkeypatch.setattr(harness.PagedSystem, "run", spying_run)
    assert _load_script().main([*DEVICE_RUN_ARGV, "--output", str(out)]) == 0
    assert [len(r["points"]) for r in on_disk] == [0, 1, 2]
    assert on_disk[1]["metrics"]["points"] == 1 and on_disk[1]["metrics"]["tok_s"] > 0
    final = _strict_json(out)
    metrics = final["metrics"]
    assert metrics["points"] == 3 and metrics["compiles_after_warmup"] == 0
    assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in metrics.values())
    assert metrics["tok_s"] == max(p["tok_s"] for p in final["points"])
    plan = engine_cell.REHEARSAL_PLAN
    for point in final["points"]:
        assert point["complete"] and point["summary"]["num_preemptions"] == 0
        assert point["num_output_tokens"] == point["batch"] * plan.output_len
    cfg = engine_cell.REHEARSAL_MODEL_CONFIG
    assert final["model"]["num_parameters"] == llama_num_parameters(cfg)
    assert final["device"]["backend"] == "cpu" and final["phase"] == "done"
    assert final["warmup"]["num_programs"] >= 2  # two token buckets (16, 64)
