"""The whole study on a small trace: figures, JSON and markdown, consistent with the runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")


def test_small_study_writes_figures_and_a_consistent_summary(tmp_path):
    import scripts.memory_study as cli

    fig_dir = tmp_path / "figs"
    md = tmp_path / "out" / "summary.md"
    assert cli.main(["--small", "--figures", str(fig_dir), "--summary", str(md)]) == 0

    pngs = sorted(p.name for p in fig_dir.glob("*.png"))
    assert pngs == sorted(
        f"{n}.png" for n in ("batch_size", "block_table", "breakdown", "occupancy", "sharing")
    )
    for p in fig_dir.glob("*.png"):
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000

    summary = json.loads(md.with_suffix(".json").read_text())
    assert summary["command"].startswith("python scripts/memory_study.py --small")
    runs = summary["runs"]
    assert {r["allocator"] for r in runs} == {
        "paged-8",
        "paged-16",
        "paged-32",
        "orca-max",
        "orca-pow2",
        "orca-oracle",
        "contig-oracle",
        "static",
    }
    for r in runs:
        assert sum(r["breakdown_load"].values()) == pytest.approx(1.0)
        assert sum(r["breakdown_busy"].values()) == pytest.approx(1.0)
        assert r["utilization_load"] == r["breakdown_load"]["token_states"]
        if r["block_size"] is not None:
            assert r["max_tail_waste_tokens"] < r["block_size"]
            assert r["free_blocks_at_end"] == r["usable_blocks"]
            assert r["breakdown_load"]["external_frag"] == 0.0
            assert r["mean_blocks_saved_by_sharing"] == 0.0  # random prompts share nothing
        else:
            assert r["num_preemptions"] == 0
    for w in ("sharegpt", "alpaca"):
        util = {r["allocator"]: r["utilization_load"] for r in runs if r["workload"] == w}
        # The paper's ordering: paged >> oracle > pow2 > max; exact first-fit sizes beat
        # the buddy's rounding, and a static batch wastes the most.
        assert util["paged-16"] > util["orca-oracle"] > util["orca-pow2"] > util["orca-max"]
        assert util["contig-oracle"] > util["orca-oracle"] and util["static"] <= util["orca-max"]
    sharing = {x["workload"]: x for x in summary["sharing"]}
    assert set(sharing) == {
        "shared_prefix_alpaca",
        "parallel_n2_alpaca",
        "parallel_n4_alpaca",
        "parallel_n6_alpaca",
    }
    assert sharing["shared_prefix_alpaca"]["mean_blocks_saved"] > 0
    assert sharing["shared_prefix_alpaca"]["prefix_hit_tokens"] > 0

    text = md.read_text()
    assert summary["command"] in text
    assert "../figs/breakdown.png" in text and "summary.json" in text


def test_study_modules_import_neither_jax_nor_matplotlib():
    code = (
        "import sys\n"
        "import paged_jax.memory_study, paged_jax.memory_study.report\n"
        "import paged_jax.memory_study.plots, paged_jax.memory_study.markdown\n"
        "bad = sorted(k for k in sys.modules if k.split('.')[0] in ('jax', 'jaxlib', 'matplotlib'))\n"
        "print(bad)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"
