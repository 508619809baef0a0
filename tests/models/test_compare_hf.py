"""scripts/compare_hf.py end to end on tiny checkpoints (token-id and text prompts)."""

from __future__ import annotations

import pathlib
import runpy
import shutil

import pytest

SCRIPT = pathlib.Path(__file__).parents[2] / "scripts" / "compare_hf.py"


@pytest.fixture(scope="module")
def compare_main():
    return runpy.run_path(str(SCRIPT), run_name="compare_hf")["main"]


def test_compare_hf_passes_on_generated_prompts(compare_main, tiny_hf_checkpoint, capsys):
    path = tiny_hf_checkpoint("gpt2")
    argv = [
        "--model",
        str(path),
        "--max-new-tokens",
        "3",
        "--num-prompts",
        "2",
        "--block-size",
        "4",
    ]
    assert compare_main(argv) == 0
    out = capsys.readouterr().out
    assert "max |logit diff| dense:" in out and "max |logit diff| paged:" in out
    assert "top-1 agreement: 15/15" in out and "greedy continuation match: 6/6" in out
    assert "engine greedy continuation match: 6/6" in out


def test_compare_hf_text_prompts_and_failing_tolerance(
    compare_main, tiny_hf_checkpoint, tmp_path, capsys
):
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path / "ckpt"
    shutil.copytree(tiny_hf_checkpoint("llama"), path)
    words = ["[UNK]", "the", "cat", "sat", "on", "mat"]
    tokenizer = Tokenizer(models.WordLevel({w: i + 10 for i, w in enumerate(words)}, "[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the cat sat\non the mat\n")
    argv = ["--model", str(path), "--prompts", str(prompts), "--max-new-tokens", "2"]
    assert compare_main([*argv, "--atol", "1e-12"]) == 1
    out = capsys.readouterr().out
    assert "top-1 agreement: 6/6" in out and "FAIL: max |logit diff|" in out
