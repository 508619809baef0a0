"""The file-wide constraint flags are checked before the model loads (issue 38 item 10):
a --regex, --json-schema or --choice that cannot be used is one line and exit 2, never a
warm-up followed by one error record per line. --disable-any-whitespace (item 14) makes
--json-schema's JSON compact. The failed-request listing says how many it left out and
shows each error on one line (item 12)."""

from __future__ import annotations

import json

import pytest

from paged_jax.entrypoints.generate_cli import build_parser, constraint_from_args
from paged_jax.entrypoints.generate_cli import main as generate_main
from paged_jax.entrypoints.records import one_line

ENGINE = ["--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--max-tokens", "24"]
ENGINE += ["--max-model-len", "96", "--no-compile-cache", "--no-tqdm"]
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


@pytest.fixture
def no_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a doomed run must not load the model")

    monkeypatch.setattr("paged_jax.llm.LLM", refuse)


def _prompts(tmp_path, rows):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _schema_file(tmp_path, text):
    path = tmp_path / "schema.json"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("flag", "value", "match"),
    [
        ("--regex", "a(b", r"--regex='a\(b': StructuredOutputsParams.regex='a\(b' must be"),
        ("--json-schema", "{not json", "--json-schema='.*schema.json': .*JSON schema"),
        (
            "--json-schema",
            json.dumps({"type": "object", "properties": {"a": {"type": "nonsense"}}}),
            "--json-schema='.*schema.json': StructuredOutputsParams.json=",
        ),
        ("--choice", "", "--choice='': .*non-empty strings"),
        ("--choice", "yes,,no", "--choice='yes,,no': .*non-empty strings"),
    ],
)
def test_an_unusable_constraint_flag_exits_2_before_loading(
    model_dir, tmp_path, capsys, no_load, flag, value, match
):
    pytest.importorskip("llguidance")
    import re

    if flag == "--json-schema":
        value = _schema_file(tmp_path, value)
    prompts = _prompts(tmp_path, [{"prompt": "one"}, {"prompt": "two"}])
    out = tmp_path / "out.jsonl"
    args = ["--model", str(model_dir), "--prompts", str(prompts), "--output", str(out)]
    assert generate_main([*args, flag, value, *ENGINE]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert re.search(f"^paged-jax-generate: error: {match}", err), err
    assert not out.exists() and not (tmp_path / "out.jsonl.partial").exists()


def test_a_constraint_flag_without_a_tokenizer_exits_2(tmp_path, model_dir, capsys, no_load):
    pytest.importorskip("llguidance")
    import shutil

    bare = tmp_path / "model"
    shutil.copytree(model_dir, bare)
    (bare / "tokenizer.json").unlink()
    prompts = _prompts(tmp_path, [{"prompt_token_ids": [1, 2, 3]}])
    args = ["--model", str(bare), "--prompts", str(prompts), "--regex", "a+", *ENGINE]
    assert generate_main(args) == 2
    err = capsys.readouterr().err
    assert "--regex='a+' needs the checkpoint's tokenizer.json" in err, err


@pytest.mark.parametrize("other", [[], ["--regex", "a+"], ["--choice", "a,b"]])
def test_disable_any_whitespace_needs_json_schema(other):
    args = build_parser().parse_args(["--disable-any-whitespace", *other])
    with pytest.raises(ValueError, match="--disable-any-whitespace applies to --json-schema"):
        constraint_from_args(args)


def test_disable_any_whitespace_makes_the_schema_compact(tmp_path):
    schema = _schema_file(tmp_path, json.dumps(SCHEMA))
    loose = constraint_from_args(build_parser().parse_args(["--json-schema", schema]))
    args = build_parser().parse_args(["--json-schema", schema, "--disable-any-whitespace"])
    compact = constraint_from_args(args)
    assert loose.disable_any_whitespace is False and compact.disable_any_whitespace is True
    assert json.loads(compact.json) == SCHEMA and compact.key != loose.key
    assert "--disable-any-whitespace" in build_parser().format_help()


def test_compact_json_outputs_hold_no_newline(model_dir, tmp_path):
    pytest.importorskip("llguidance")
    schema = _schema_file(tmp_path, json.dumps(SCHEMA))
    prompts = _prompts(tmp_path, [{"prompt": p} for p in ("one", "two", "three")])
    out = tmp_path / "out.jsonl"
    args = ["--model", str(model_dir), "--prompts", str(prompts), "--output", str(out)]
    code = generate_main([*args, "--json-schema", schema, "--disable-any-whitespace", *ENGINE])
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert code == 0 and len(records) == 3, records
    for r in records:
        text = r["outputs"][0]["text"]
        assert text.startswith("{") and not any(c.isspace() for c in text), text


def test_the_failed_listing_says_how_many_more_and_keeps_one_line_each(
    model_dir, tmp_path, capsys, no_load
):
    prompts = _prompts(tmp_path, [{"prompt": "", "id": i} for i in range(8)])
    out, summary = tmp_path / "out.jsonl", tmp_path / "s.json"
    args = ["--model", str(model_dir), "--prompts", str(prompts), "--output", str(out)]
    assert generate_main([*args, "--summary-json", str(summary), *ENGINE]) == 1
    stdout = capsys.readouterr().out
    listed = [x for x in stdout.splitlines() if "failed request" in x]
    assert len(listed) == 5 and all("line " in x and "prompt=''" in x for x in listed), listed
    assert f"  ... and 3 more (their error records are in {out})" in stdout, stdout
    assert len(json.loads(summary.read_text())["errors"]) == 8
    # A grammar library's multi-line message is listed as one line, cut at a bound.
    assert one_line("regex error:\n  a(b\n   ^\nunclosed group") == (
        "regex error: a(b ^ unclosed group"
    )
    assert len(one_line("x" * 1000)) == 300 and one_line("x" * 1000).endswith("...")
