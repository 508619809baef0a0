"""scripts/bench_start.py's report: medians and spreads over rounds, the targets, the README table.

The timed runs themselves are the benchmark (never timed here); these check the arithmetic
and the table rewrite on made-up rounds.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_start", ROOT / "scripts/bench_start.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(start: str, load: float, warmup: float, gen: float, programs: int) -> dict:
    compiled = programs if start == "cold" else 0
    run = {
        "start": start,
        "programs": programs,
        "programs_compiled": compiled,
        "programs_loaded": programs - compiled,
        "warmup_compiles": compiled,
        "compiles_after_warmup": 0,
        "max_num_seqs": 64,
        "max_num_batched_tokens": 512,
        "load_s": load,
        "warmup_s": warmup,
        "warmup_trace_s": 0.1 * compiled,
        "warmup_lower_s": 0.1 * compiled,
        "warmup_compile_s": warmup * (start == "cold"),
        "warmup_cache_load_s": warmup * (start == "warm"),
        "warmup_cache_save_s": 0.0,
        "warmup_run_s": 0.1,
        "load_and_warmup_s": load + warmup,
        "generation_s": gen,
    }
    run["load_and_warmup_over_generation"] = round((load + warmup) / gen, 2)
    return run


def test_summary_takes_medians_and_checks_the_targets_on_them():
    bench = _bench()
    rounds = [
        {"cold": _run("cold", 1, 9, 3, 7), "warm": _run("warm", 1, 1, 3, 7)},  # 3.33x, 0.67x
        {"cold": _run("cold", 1, 19, 4, 7), "warm": _run("warm", 1, 4, 4, 7)},  # 5x, 1.25x
        {"cold": _run("cold", 1, 7, 2, 7), "warm": _run("warm", 1, 0.5, 2, 7)},  # 4x, 0.75x
    ]
    s = bench.summarize(rounds)
    assert s["cold"]["load_and_warmup_over_generation"] == {"median": 4.0, "min": 3.33, "max": 5.0}
    assert s["targets"]["cold"] == {"at_most": 4.0, "median_ratio": 4.0, "met": True}
    assert s["targets"]["warm"]["median_ratio"] == 0.75 and s["targets"]["warm"]["met"]
    assert s["cold"]["programs_compiled"] == [7] and s["warm"]["programs_loaded"] == [7]
    assert s["warm"]["starts"] == ["warm"]


def test_readme_table_is_rewritten_between_its_markers(tmp_path):
    bench = _bench()
    rounds = [{"cold": _run("cold", 1, 9, 3, 7), "warm": _run("warm", 1, 1, 3, 7)}]
    report = {
        "command": "python scripts/bench_start.py --rounds 1",
        "out": "docs/start_time.json",
        "machine": {"cpus": 2, "load_average_at_start": 0.5, "load_average_at_end": 1.5},
        "summary": bench.summarize(rounds),
        "rounds": rounds,
    }
    table = bench.markdown_table(report)
    assert "| cold | 7 compiled |" in table and "| warm | 7 loaded |" in table
    assert "**3.33x** (target <= 4x: met)" in table and "`python scripts/bench_start.py" in table
    assert "max_num_seqs=64 and max_num_batched_tokens=512" in table
    assert "JSON in `docs/start_time.json`" in table
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{bench.TABLE_BEGIN}\nold table\n{bench.TABLE_END}\nafter\n")
    bench.update_readme(readme, table)
    text = readme.read_text()
    assert "old table" not in text and table in text
    assert text.startswith("before\n") and text.endswith(f"{bench.TABLE_END}\nafter\n")
    readme.write_text("no markers")
    with pytest.raises(SystemExit, match="no start-time table markers"):
        bench.update_readme(readme, table)


def test_short_prompts_job_passes_a_prompts_file(tmp_path, monkeypatch):
    bench = _bench()
    seen = []

    def fake_run(cli_args, env, summary):
        prompts = pathlib.Path(cli_args[cli_args.index("--prompts") + 1])
        seen.append((cli_args, prompts.read_text()))
        start = "warm" if summary.endswith("warm.json") else "cold"
        return _run(start, 1, 2, 0.1, 4)

    monkeypatch.setattr(bench, "run_once", fake_run)
    monkeypatch.setattr("paged_jax.entrypoints.demo.ensure_demo_model", lambda: None)
    out = tmp_path / "small.json"
    assert (
        bench.main(["--short-prompts", "3", "--rounds", "1", "--out", str(out), "--", "--n", "2"])
        == 0
    )
    assert len(seen) == 2 and seen[0][0][:2] == ["--n", "2"]
    assert seen[0][1] == "Hello 0\nHello 1\nHello 2\n"
    report = json.loads(out.read_text())
    assert report["command"].startswith("python scripts/bench_start.py --short-prompts 3")
