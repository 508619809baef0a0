"""Structured outputs on the generate CLI: the file-wide flags (--json-schema, --regex,
--choice), a JSONL line's own "structured_outputs", and bad constraints as error records."""

from __future__ import annotations

import json
import re

import pytest

from paged_jax.entrypoints.generate_cli import main as generate_main

pytest.importorskip("llguidance", reason="needs the grammar library (pip install '.[structured]')")

ENGINE = ["--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--max-tokens", "24"]
ENGINE += ["--max-model-len", "96", "--no-compile-cache", "--no-tqdm"]
REGEX = r"[a-c]{2,4}-[0-9]{1,3}"


def _run(model_dir, tmp_path, lines, *flags):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "out.jsonl"
    args = ["--model", str(model_dir), "--prompts", str(prompts), "--output", str(out)]
    code = generate_main([*args, *ENGINE, *flags])
    records = {r["index"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(records) == list(range(len(lines)))
    return code, records


def test_at_most_one_constraint_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        generate_main(["--regex", "a+", "--choice", "a,b"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--choice" in err and "--regex" in err


def test_choice_for_the_file_and_a_line_of_its_own(model_dir, tmp_path):
    choices = ["yes", "no", "maybe so"]
    lines = [{"prompt": p} for p in ("is it", "hello there", "why not", "abc")]
    lines.append({"prompt": "code", "structured_outputs": {"regex": REGEX}})  # wins
    code, records = _run(model_dir, tmp_path, lines, "--choice", ",".join(choices))
    assert code == 0, records
    for i in range(4):
        (c,) = records[i]["outputs"]
        assert c["text"] in choices and c["finish_reason"] == "stop", records[i]
    (c,) = records[4]["outputs"]
    assert re.fullmatch(REGEX, c["text"]) and c["finish_reason"] == "stop", records[4]


def test_a_bad_regex_line_is_its_error_record(model_dir, tmp_path):
    lines = [
        {"prompt": "code", "structured_outputs": {"regex": REGEX}},
        {"prompt": "code", "structured_outputs": {"regex": "a(b"}},
        {"prompt": "free text"},
    ]
    code, records = _run(model_dir, tmp_path, lines)
    assert code == 1
    assert re.fullmatch(REGEX, records[0]["outputs"][0]["text"]), records[0]
    assert records[1]["error"].startswith("line 2: ") and "regex" in records[1]["error"]
    assert records[2]["error"] is None and records[2]["outputs"][0]["token_ids"]


def test_an_invalid_schema_is_an_error_record_for_each_line_it_covers(model_dir, tmp_path):
    # Valid JSON the grammar backend refuses: found at submission, after loading. (The
    # same schema given with --json-schema is refused before loading, exit 2:
    # test_constraint_flags.py.)
    schema = {"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}
    lines = [{"prompt": p, "structured_outputs": schema} for p in ("one", "two")]
    lines.append({"prompt": "three", "structured_outputs": {"choice": ["x", "y"]}})
    code, records = _run(model_dir, tmp_path, lines)
    assert code == 1
    for i in (0, 1):
        assert records[i]["error"].startswith(f"line {i + 1}: ") and "json" in records[i]["error"]
    assert records[2]["outputs"][0]["text"] in ("x", "y"), records[2]


def test_bad_constraints_known_before_loading_are_error_records(
    model_dir, tmp_path, monkeypatch, capsys
):
    def no_load(*args, **kwargs):
        raise AssertionError("no line can be served: the model must not be loaded")

    monkeypatch.setattr("paged_jax.llm.LLM", no_load)
    # (A bad --json-schema file is fatal before loading, exit 2: test_constraint_flags.py.)
    lines = [
        {"prompt": "one", "structured_outputs": {"json": "{not json"}},
        {"prompt": "two", "structured_outputs": {"regex": "a", "choice": ["a"]}},
        {"prompt": "three", "structured_outputs": {"jsonn": {}}},
        {"prompt": "four", "structured_outputs": "a+"},
    ]
    code, records = _run(model_dir, tmp_path, lines)
    assert code == 1
    err = [records[i]["error"] for i in range(4)]
    assert err[0].startswith("line 1: ") and "JSON" in err[0], err[0]
    assert err[1].startswith("line 2: ") and "exactly one of" in err[1], err[1]
    assert err[2].startswith("line 3: ") and "'jsonn'" in err[2] and "regex" in err[2], err[2]
    assert err[3].startswith("line 4: structured_outputs='a+' must be"), err[3]
    assert "the model was not loaded" in capsys.readouterr().err


def test_an_unreadable_schema_file_is_fatal(model_dir, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    missing = str(tmp_path / "nope.json")
    args = ["--model", str(model_dir), "--prompts", str(prompts), "--json-schema", missing]
    assert generate_main([*args, *ENGINE]) == 2
    err = capsys.readouterr().err
    assert "--json-schema" in err and "nope.json" in err and "Traceback" not in err
