"""Every config or tokenizer problem that dooms a run is one line naming the file and the
field, exit 2, found before the model loads (the CLI's preflight)."""

from __future__ import annotations

import json
import shutil

import pytest

from paged_jax.entrypoints.generate_cli import main as generate_main

ENGINE = ["--block-size", "4", "--max-num-seqs", "8", "--max-num-batched-tokens", "16"]
ENGINE += ["--no-compile-cache", "--no-tqdm", "--max-tokens", "2"]


@pytest.fixture
def no_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model must not be loaded when the run cannot succeed")

    monkeypatch.setattr("paged_jax.llm.LLM", refuse)


def _copy(src, tmp_path, name="model"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _edit_config(model, **fields):
    config = json.loads((model / "config.json").read_text())
    config.update(fields)
    (model / "config.json").write_text(json.dumps(config))


def _fatal(model, tmp_path, capsys, *extra):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    code = generate_main(["--model", str(model), "--prompts", str(prompts), *ENGINE, *extra])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err and "usage:" not in err, err
    return err


def test_garbage_tokenizer_json(model_dir, tmp_path, capsys, no_load):
    model = _copy(model_dir, tmp_path)
    (model / "tokenizer.json").write_text("garbage{")
    err = _fatal(model, tmp_path, capsys)
    assert f"{model / 'tokenizer.json'} is not a usable tokenizer" in err


def test_garbage_tokenizer_config_json(model_dir, tmp_path, capsys, no_load):
    model = _copy(model_dir, tmp_path)
    (model / "tokenizer_config.json").write_text("{")
    err = _fatal(model, tmp_path, capsys)
    assert str(model / "tokenizer_config.json") in err


@pytest.mark.parametrize(
    ("family", "fields", "field"),
    [
        ("llama", {"num_attention_heads": 0}, "num_attention_heads"),
        ("mistral", {"sliding_window": "16"}, "sliding_window"),
        ("llama", {"eos_token_id": "x"}, "eos_token_id"),
    ],
)
def test_bad_config_fields_name_the_file_and_the_field(
    tiny_hf_checkpoint, tmp_path, capsys, no_load, family, fields, field
):
    model = _copy(tiny_hf_checkpoint(family), tmp_path)
    capsys.readouterr()  # the checkpoint writer's progress bar
    _edit_config(model, **fields)
    err = _fatal(model, tmp_path, capsys)
    assert str(model / "config.json") in err and field in err


def test_deeply_nested_config_json(model_dir, tmp_path, capsys, no_load):
    model = _copy(model_dir, tmp_path)
    depth = 100_000
    (model / "config.json").write_text('{"a": ' + "[" * depth + "]" * depth + "}")
    err = _fatal(model, tmp_path, capsys)
    assert str(model / "config.json") in err


@pytest.mark.parametrize(
    ("error", "match"),
    [
        (ZeroDivisionError("integer division or modulo by zero"), "ZeroDivisionError"),
        (TypeError("'<=' not supported"), "TypeError"),
        (RecursionError("maximum recursion depth exceeded"), "nested too deeply"),
        (ValueError("invalid literal for int() with base 10: 'x'"), "invalid literal"),
    ],
)
def test_any_config_parsing_failure_is_one_line_naming_config_json(
    model_dir, tmp_path, capsys, monkeypatch, no_load, error, match
):
    """Whatever a family's parser raises on a config it did not expect, the CLI names
    the file in one line instead of a traceback."""

    def broken(*args, **kwargs):
        raise error

    monkeypatch.setattr("paged_jax.models.loader.check_model_dir", broken)
    err = _fatal(model_dir, tmp_path, capsys)
    assert f"{model_dir / 'config.json'}" in err and match in err


def test_max_position_embeddings_beyond_memory_hints_at_max_model_len(
    model_dir, tmp_path, capsys, no_load
):
    model = _copy(model_dir, tmp_path)
    _edit_config(model, max_position_embeddings=10**12)
    err = _fatal(model, tmp_path, capsys)
    assert str(model / "config.json") in err
    assert "max_position_embeddings=1000000000000" in err and "set --max-model-len" in err


def test_max_model_len_beyond_the_model_is_refused_before_loading(
    model_dir, tmp_path, capsys, no_load
):
    err = _fatal(model_dir, tmp_path, capsys, "--max-model-len", "100000")
    assert "--max-model-len=100000 must be <= max_position_embeddings=256" in err
    assert str(model_dir / "config.json") in err


def test_a_huge_max_position_embeddings_runs_with_max_model_len_set(model_dir, tmp_path):
    """The estimate refuses only what cannot fit: --max-model-len makes the same model run."""
    model = _copy(model_dir, tmp_path)
    _edit_config(model, max_position_embeddings=10**12)
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    args = ["--model", str(model), "--prompts", str(prompts), *ENGINE, "--max-model-len", "64"]
    assert generate_main(args) == 0
