"""The fork memory study (beam search, parallel sampling) on a small run, through the CLI."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("matplotlib")


def test_small_fork_study_writes_a_consistent_summary(tmp_path):
    import scripts.memory_study as cli

    md = tmp_path / "forks.md"
    args = ["--forks", "--small", "--figures", str(tmp_path / "figs"), "--summary", str(md)]
    assert cli.main(args) == 0
    png = (tmp_path / "figs" / "forks.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    summary = json.loads(md.with_suffix(".json").read_text())
    runs = {(r["mode"], r["dataset"], r["width"]): r for r in summary["runs"]}
    assert set(runs) == {
        (m, d, w) for m in ("beam", "parallel") for d in ("alpaca", "sharegpt") for w in (2, 4)
    }
    for r in runs.values():
        assert 0 < r["share_saved"] < 1
        assert r["mean_used_blocks"] < r["mean_logical_blocks"]
        assert r["peak_used_blocks"] <= r["peak_logical_blocks"]
        assert r["num_copies"] > 0  # partial blocks were shared and copied on write
    for d in ("alpaca", "sharegpt"):
        # Beams share generated blocks too; wider searches and more samples share more.
        assert runs[("beam", d, 2)]["share_saved"] > runs[("parallel", d, 2)]["share_saved"]
        for m in ("beam", "parallel"):
            assert runs[(m, d, 4)]["share_saved"] > runs[(m, d, 2)]["share_saved"]
    text = md.read_text()
    assert summary["command"] in text and "![blocks saved by forks]" in text
    assert "37.6-55.2%" in text  # the paper's beam-search range beside ours
