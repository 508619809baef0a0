"""Bounded inputs: prompts files are read with a per-line and a total limit, and text
prompts are checked for length before they are tokenized, so no input exhausts memory."""

from __future__ import annotations

import io
import json

import pytest

from paged_jax.constants import PROMPT_BYTES_PER_TOKEN
from paged_jax.entrypoints.generate_cli import main as generate_main
from paged_jax.entrypoints.prompts_file import line_byte_limit, read_prompt_lines
from paged_jax.testing.bounded import call_within

# A hang guard, not a speed limit: an endless read or a stuck engine fails the test
# instead of blocking CI. Far above any of these calls, including a first compile on a
# loaded 2-core machine (a SumModel LLM start and generate took 55 s at load average 15);
# no test here asserts a duration.
HANG_GUARD_S = 600
# The same for the prompt-file reads: the longest, /dev/zero up to the 1 GiB limit, took
# 0.54 s on a loaded 2-core machine.
READ_GUARD_S = 60

ENGINE = ["--block-size", "4", "--max-num-seqs", "8", "--max-num-batched-tokens", "16"]
ENGINE += ["--max-model-len", "64", "--no-compile-cache", "--no-tqdm"]


def test_the_line_limit_leaves_room_for_any_prompt_that_fits():
    # A prompt that fits has at most max_model_len tokens of PROMPT_BYTES_PER_TOKEN bytes
    # each; JSON may escape each byte into 6 ("\u0001"), and other fields need room too.
    assert line_byte_limit(64) >= 6 * PROMPT_BYTES_PER_TOKEN * 64 + 2**20


def test_an_endless_line_is_refused_after_the_total_limit(tmp_path):
    # /dev/zero never sends a newline: the reader stops at the total limit, keeping
    # at most one line's limit in memory, instead of growing until the OOM killer.
    with pytest.raises(ValueError, match=r"--prompts='/dev/zero' is longer than 1024 bytes"):
        call_within(READ_GUARD_S, read_prompt_lines, "/dev/zero", 4, max_total_bytes=1024)
    with pytest.raises(ValueError, match=r"endless input"):
        call_within(READ_GUARD_S, read_prompt_lines, "/dev/zero", 64)


def test_too_many_lines_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"y\n" * 50)))
    with pytest.raises(ValueError, match=r"--prompts='-' holds more than 10 lines"):
        read_prompt_lines("-", 64, max_lines=10)


def test_an_overlong_line_is_an_error_record_and_the_others_are_kept(tmp_path):
    limit = line_byte_limit(4)
    path = tmp_path / "p.jsonl"
    long_line = json.dumps({"prompt": "x" * (limit + 10)})
    path.write_text(f'{{"prompt": "a"}}\n{long_line}\n{{"prompt": "b"}}\n')
    fmt, lines = call_within(READ_GUARD_S, read_prompt_lines, str(path), 4)
    assert fmt == "jsonl"
    assert [(x.line, x.value) for x in lines if x.error is None] == [(1, "a"), (3, "b")]
    assert lines[1].line == 2 and lines[1].value is None
    assert lines[1].error == (
        f"line 2: longer than {limit} bytes, the line limit for max_model_len=4 "
        "(no prompt that long fits)"
    )


def test_a_32_mb_line_is_rejected_by_size_and_the_others_complete(model_dir, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    with open(prompts, "w") as f:
        f.write("one\n" + "x" * (32 << 20) + "\nthree\n")
    out = tmp_path / "out.jsonl"
    args = ["--model", str(model_dir), "--prompts", str(prompts), "--output", str(out)]
    code = call_within(HANG_GUARD_S, generate_main, [*args, "--max-tokens", "2", *ENGINE])
    assert code == 1, capsys.readouterr().err
    records = {r["line"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert records[1]["error"] is None and records[3]["error"] is None
    assert records[2]["error"].startswith(f"line 2: longer than {line_byte_limit(64)} bytes")


def test_prompts_from_dev_zero_exit_2_in_one_line(model_dir, capsys, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the model must not be loaded for an endless prompts file")

    monkeypatch.setattr("paged_jax.llm.LLM", no_load)
    args = ["--model", str(model_dir), "--prompts", "/dev/zero", *ENGINE]
    assert call_within(HANG_GUARD_S, generate_main, args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "--prompts='/dev/zero' is longer than" in err and "endless input" in err


class _CountingTokenizer:
    """Bytes + 3 as ids, like the demo's byte tokenizer; records every text it encodes."""

    def __init__(self):
        self.lengths: list[int] = []

    def encode(self, text, add_special_tokens=True):
        self.lengths.append(len(text))
        return type("Encoding", (), {"ids": [b % 90 + 3 for b in text.encode()]})()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_a_huge_string_to_llm_generate_is_rejected_before_tokenizing():
    from paged_jax.llm import LLM
    from paged_jax.sampling_params import SamplingParams
    from paged_jax.testing.fake_model import SumModel

    tokenizer = _CountingTokenizer()
    llm = LLM(
        SumModel(),
        tokenizer=tokenizer,
        warmup=False,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=64,
    )
    bound = 64 * PROMPT_BYTES_PER_TOKEN
    huge = "y" * (32 << 20)
    for n, text in ((len(huge), huge), (bound + 1, "z" * (bound + 1))):
        expected = (
            f"prompts[0]: prompt of {n} characters cannot fit max_model_len=64: a token "
            f"covers at most {PROMPT_BYTES_PER_TOKEN} bytes of text, so a prompt that fits "
            f"has at most {bound} characters"
        )
        with pytest.raises(ValueError) as info:
            call_within(
                HANG_GUARD_S, llm.generate, text, SamplingParams(max_tokens=2), use_tqdm=False
            )
        assert str(info.value) == expected
    assert tokenizer.lengths == []  # neither long text reached the tokenizer
    # generate_iter: the long prompt gets an error output, the other one completes.
    outs = dict(
        call_within(
            HANG_GUARD_S, list, llm.generate_iter([huge, "hi"], SamplingParams(max_tokens=2))
        )
    )
    assert "cannot fit max_model_len=64" in outs[0].error
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 2
    assert tokenizer.lengths == [2]
    # At the bound the length check lets the text through: the tokenizer decides.
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate("z" * bound, SamplingParams(max_tokens=1), use_tqdm=False)
    assert tokenizer.lengths[-1] == bound
