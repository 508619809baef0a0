"""bench_structured runs end to end on a small tokenizer and saves its JSON with its command."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from paged_jax.testing.bpe_tokenizer import structured_corpus, train_byte_level_bpe

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytest.importorskip("llguidance", reason="needs the grammar library (pip install '.[structured]')")


def test_bench_reports_compile_and_per_step_host_times(tmp_path):
    tok_path = tmp_path / "tokenizer.json"
    train_byte_level_bpe(structured_corpus(50), vocab_size=400).save(str(tok_path))
    out = tmp_path / "host.json"
    args = ["--tokenizer", str(tok_path), "--num-schemas", "2", "--num-seqs", "4", "--steps", "6"]
    run = subprocess.run(
        [sys.executable, "scripts/bench_structured.py", *args, "--output", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert report["command"].startswith("python scripts/bench_structured.py --tokenizer")
    (one,) = report["runs"]
    assert len(one["compile_ms"]["json_schema_cold"]) == 2
    decode = one["decode"]
    assert decode["num_seqs"] == 4 and decode["steps"] == 6
    assert decode["bitmask_bytes_per_step"] == 4 * 4 * -(
        -one["tokenizer"]["model_vocab_size"] // 32
    )
    for name in ("fill_batched", "fill_one_by_one", "accept"):
        assert decode["per_seq_per_step_us"][name]["median"] > 0
