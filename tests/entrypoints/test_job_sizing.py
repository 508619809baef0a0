"""The CLI sizes the engine to the job when the user did not: a few short prompts warm up
a few small step programs, not the 64-sequence, 512-token defaults; explicit flags win."""

from __future__ import annotations

import json
import re

import pytest

from paged_jax.config import EngineConfig
from paged_jax.entrypoints.generate_cli import main as generate_main
from paged_jax.entrypoints.job import size_engine


def test_a_small_job_gets_a_small_engine():
    # 8 prompts of 5 tokens, n=1: 8 sequences, 40 prompt tokens.
    args, size = size_engine({}, num_sequences=8, num_prompt_tokens=40)
    assert (args["max_num_seqs"], args["max_num_batched_tokens"]) == (8, 64)
    assert size.sized == ("max_num_seqs", "max_num_batched_tokens")
    assert EngineConfig(**args).token_buckets == (16, 64)
    # Tiny jobs share one size (so they share compiled programs): 1..8 sequences -> 8.
    for seqs, tokens in ((1, 3), (3, 10), (8, 16)):
        args, _ = size_engine({}, num_sequences=seqs, num_prompt_tokens=tokens)
        assert (args["max_num_seqs"], args["max_num_batched_tokens"]) == (8, 16)
    # n > 1 counts every sample as a sequence; prompt tokens round up to a token bucket.
    args, _ = size_engine({}, num_sequences=2 * 12, num_prompt_tokens=100)
    assert (args["max_num_seqs"], args["max_num_batched_tokens"]) == (32, 256)


def test_a_large_job_keeps_the_defaults():
    default = EngineConfig()
    args, size = size_engine({}, num_sequences=200, num_prompt_tokens=20_000)
    assert args["max_num_seqs"] == default.max_num_seqs
    assert args["max_num_batched_tokens"] == default.max_num_batched_tokens
    assert "max_num_seqs=64" in size.note()


def test_explicit_flags_win():
    args, size = size_engine({"max_num_seqs": 16}, num_sequences=2, num_prompt_tokens=10)
    assert (args["max_num_seqs"], args["max_num_batched_tokens"]) == (16, 16)
    assert size.sized == ("max_num_batched_tokens",)
    given = {"max_num_seqs": 4, "max_num_batched_tokens": 2048}
    args, size = size_engine(given, num_sequences=100, num_prompt_tokens=10)
    assert (args["max_num_seqs"], args["max_num_batched_tokens"]) == (4, 2048)
    assert size.sized == () and size.note() is None
    # A token budget below the sized sequence count lowers the sequences to fit it.
    args, _ = size_engine({"max_num_batched_tokens": 16}, num_sequences=40, num_prompt_tokens=9)
    assert (args["max_num_seqs"], args["max_num_batched_tokens"]) == (16, 16)
    EngineConfig(**args)
    # A sequence count above the default budget raises the budget with it.
    args, _ = size_engine({"max_num_seqs": 1024}, num_sequences=4, num_prompt_tokens=9)
    assert args["max_num_batched_tokens"] == 1024
    EngineConfig(**args)


@pytest.mark.parametrize(
    ("flags", "seqs", "tokens"),
    [
        ([], 8, 16),  # sized: one token bucket (16) of 8 sequences
        (["--max-num-seqs", "16"], 16, 16),
    ],
)
def test_the_cli_says_what_it_sized_and_its_warmup_line_matches_the_summary(
    model_dir, tmp_path, capsys, flags, seqs, tokens
):
    prompts = tmp_path / "p.txt"
    prompts.write_text("one\ntwo\nthree\n")
    summary = tmp_path / "s.json"
    args = ["--model", str(model_dir), "--prompts", str(prompts), "--max-tokens", "2"]
    args += ["--block-size", "4", "--max-model-len", "64", "--no-compile-cache"]
    assert generate_main([*args, "--summary-json", str(summary), *flags]) == 0
    err = capsys.readouterr().err
    s = json.loads(summary.read_text())
    assert (s["max_num_seqs"], s["max_num_batched_tokens"]) == (seqs, tokens)
    notes = [line for line in err.splitlines() if line.startswith("engine sized to the job")]
    assert len(notes) == 1, err
    assert f"max_num_seqs={seqs}" in notes[0] and f"max_num_batched_tokens={tokens}" in notes[0]
    assert "3 requests, 3 sequences" in notes[0]
    if flags:
        assert "--max-num-seqs given" in notes[0]
    # Only the sized job's step programs are built (the defaults' would reach 512 tokens).
    assert f"compiling step tokens=16 seqs={seqs}" in err
    assert "tokens=64" not in err and "tokens=512" not in err
    # The warm-up line's count is the summary's (programs and compiles alike), and the
    # progress line's total too.
    compiled = int(re.search(r"cold start: (\d+) compiled", err).group(1))
    assert compiled == s["programs"] == s["programs_compiled"] == s["warmup_compiles"]
    assert f"warm-up {compiled}/{compiled}: " in err


def test_no_note_when_every_size_is_given(model_dir, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("one\n")
    args = ["--model", str(model_dir), "--prompts", str(prompts), "--max-tokens", "1"]
    args += ["--block-size", "4", "--max-num-seqs", "8", "--max-num-batched-tokens", "32"]
    args += ["--max-model-len", "64", "--no-compile-cache", "--no-tqdm"]
    assert generate_main(args) == 0
    assert "engine sized to the job" not in capsys.readouterr().err
