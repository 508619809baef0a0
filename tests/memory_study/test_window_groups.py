"""The window memory study drives the real managers; its curves follow the block arithmetic."""

from __future__ import annotations

import json

import pytest

from paged_jax.memory_study.window_groups import Variant, blocks_held_curve
from scripts.bench_window_memory import main

BS, W = 4, 8


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def test_curves_match_block_arithmetic():
    kwargs = dict(block_size=BS, prompt_len=12, max_len=48, chunk=8)
    full = blocks_held_curve(Variant("full", (None, None)), **kwargs)
    window = blocks_held_curve(Variant("window", (W, W)), **kwargs)
    hybrid = blocks_held_curve(Variant("hybrid", (W, None)), **kwargs)
    assert full["context_len"] == list(range(13, 49))
    # After a decode step with n tokens computed the table covers n (full: all blocks).
    assert full["blocks_held"] == [cdiv(n, BS) for n in full["context_len"]]
    # Window: blocks from (n - 1 - W + 1) // bs (the dead ones freed) to the last.
    assert window["blocks_held"] == [cdiv(n, BS) - (n - W) // BS for n in window["context_len"]]
    assert max(window["blocks_held"]) == cdiv(W, BS) + 1
    assert hybrid["blocks_held"] == [
        f + w for f, w in zip(full["blocks_held"], window["blocks_held"])
    ]
    # The last prefill chunk (from n=8) held blocks 0..2 after freeing none: 3.
    assert window["prefill_peak"] == [3]


def test_script_writes_json_and_figure(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out, fig = tmp_path / "w.json", tmp_path / "w.png"
    args = ["--num-layers", "4", "--window", "8", "--block-size", "4", "--prompt-len", "12"]
    args += ["--max-len", "64", "--chunk", "8", "--table-lengths", "32", "64"]
    args += ["--record-every", "1"]
    main(args + ["--output", str(out), "--figure", str(fig)])
    result = json.loads(out.read_text())
    row = result["table"][-1]
    assert row["context_len"] == 64
    # At 64 tokens (the step from 63 freed blocks below 56): full 16 blocks x 4 layers;
    # window 2 blocks (56..63) x 4 layers; hybrid (16 + 2) blocks x 2 shared tensors.
    assert row["full attention"]["blocks_held"] == 16
    assert row["sliding window W=8"]["kv_bytes_vs_full"] == 2 / 16
    assert row["Gemma-2-like hybrid (1:1, W=8)"]["kv_bytes_vs_full"] == (18 * 2) / (16 * 4)
    assert fig.stat().st_size > 0
    assert "context" in capsys.readouterr().out
