"""The generate CLI keeps every finished record whatever fails later: an engine failure
mid-run becomes the unfinished requests' error records, and a file whose every line is
unusable gets one error record per line without loading the model."""

from __future__ import annotations

import json

import pytest

from paged_jax.engine import Engine
from paged_jax.entrypoints.generate_cli import main as generate_main

ENGINE = ["--block-size", "4", "--max-num-seqs", "8", "--max-num-batched-tokens", "16"]
ENGINE += ["--max-model-len", "64", "--no-compile-cache", "--no-tqdm"]
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"


@pytest.fixture
def no_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model must not be loaded when no request can be served")

    monkeypatch.setattr("paged_jax.llm.LLM", refuse)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _records(path):
    return {r["index"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_an_engine_failure_mid_run_keeps_the_finished_records(
    model_dir, tmp_path, capsys, monkeypatch
):
    # Two requests end after one token, two run long; the 6th engine step fails.
    real_step, calls = Engine.step, []

    def failing_step(self):
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("injected device failure")
        return real_step(self)

    monkeypatch.setattr(Engine, "step", failing_step)
    rows = [
        {"prompt": "a", "max_tokens": 1},
        {"prompt": "b", "max_tokens": 1, "id": "short"},
        {"prompt": "long one", "max_tokens": 40, "ignore_eos": True, "id": "long"},
        {"prompt": ""},  # refused before the engine sees it
        {"prompt": "c", "max_tokens": 40, "ignore_eos": True},
    ]
    prompts = _jsonl(tmp_path / "p.jsonl", rows)
    out, summary = tmp_path / "out.jsonl", tmp_path / "s.json"
    args = ["--model", str(model_dir), "--prompts", str(prompts), "--output", str(out)]
    code = generate_main([*args, "--summary-json", str(summary), *ENGINE])
    captured = capsys.readouterr()
    assert code == 1, captured.err
    assert "Traceback" not in captured.err
    assert "the engine failed (RuntimeError: injected device failure)" in captured.err
    # Every request has its record, and the file was completed (not left as .partial).
    assert not (tmp_path / "out.jsonl.partial").exists()
    records = _records(out)
    assert sorted(records) == [0, 1, 2, 3, 4]
    for i in (0, 1):  # finished before the failure: kept with their completions
        assert records[i]["error"] is None and len(records[i]["outputs"][0]["token_ids"]) == 1
    for i, line in ((2, 3), (4, 5)):
        assert records[i]["error"] == (
            f"line {line}: the engine failed before this request finished "
            "(RuntimeError: injected device failure)"
        )
    assert records[2]["id"] == "long"
    assert "prompt='' must be a non-empty string" in records[3]["error"]
    s = json.loads(summary.read_text())
    assert (s["requests"], s["succeeded"], s["failed"]) == (5, 2, 3)
    assert s["engine_error"] == "RuntimeError: injected device failure"
    assert sorted(e["index"] for e in s["errors"]) == [2, 3, 4]


def test_only_chat_lines_without_a_template_are_error_records_before_loading(
    model_dir, tmp_path, capsys, no_load
):
    rows = [{"messages": [{"role": "user", "content": "hi"}]}, {"messages": []}]
    prompts = _jsonl(tmp_path / "p.jsonl", rows)
    out, summary = tmp_path / "out.jsonl", tmp_path / "s.json"
    args = ["--model", str(model_dir), "--prompts", str(prompts), "--output", str(out)]
    code = generate_main([*args, "--summary-json", str(summary), *ENGINE])
    captured = capsys.readouterr()
    assert code == 1, captured.err
    records = _records(out)
    assert sorted(records) == [0, 1]
    for i, r in records.items():
        assert r["error"].startswith(f"line {i + 1}: the model has no chat template")
        assert "pass --chat-template FILE" in r["error"]
    s = json.loads(summary.read_text())
    assert (s["requests"], s["succeeded"], s["failed"]) == (2, 0, 2)
    assert "the model was not loaded" in captured.err


def test_chat_template_flag_renders_messages_lines(model_dir, tmp_path, capsys):
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    rows = [
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        {"messages": [{"role": "user"}, "not a message"]},  # bad message: its own error
    ]
    prompts = _jsonl(tmp_path / "p.jsonl", rows)
    out = tmp_path / "out.jsonl"
    args = ["--model", str(model_dir), "--prompts", str(prompts), "--output", str(out)]
    assert generate_main([*args, "--chat-template", str(template), *ENGINE]) == 1
    records = _records(out)
    assert records[0]["error"] is None and records[0]["prompt"] == "<user>hi<assistant>"
    assert records[0]["prompt_token_ids"] == [b + 3 for b in b"<user>hi<assistant>"]
    assert records[1]["error"].startswith("line 2: messages[1]=")


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (None, r"--chat-template='.*missing.jinja' cannot be read"),
        ("{% for m in messages %}", r"--chat-template='.*bad.jinja': .*syntax"),
    ],
)
def test_an_unusable_chat_template_file_is_fatal_before_loading(
    model_dir, tmp_path, capsys, no_load, content, match
):
    import re

    name = "missing.jinja" if content is None else "bad.jinja"
    if content is not None:
        (tmp_path / name).write_text(content)
    prompts = _jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    args = ["--model", str(model_dir), "--prompts", str(prompts), *ENGINE]
    assert generate_main([*args, "--chat-template", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err
    assert re.search(match, err, re.IGNORECASE), err
    assert err.count("\n") == 1 and "Traceback" not in err
