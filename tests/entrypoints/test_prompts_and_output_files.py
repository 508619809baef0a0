"""The CLI's prompts file (format by content, per-line records) and streamed atomic output."""

from __future__ import annotations

import io
import json

import pytest

from paged_jax.entrypoints.output_file import JsonlStream, check_writable, write_json_atomic
from paged_jax.entrypoints.prompts_file import params_for, read_prompt_lines
from paged_jax.sampling_params import SamplingParams


def test_jsonl_is_detected_by_content_whatever_the_extension(tmp_path):
    path = tmp_path / "prompts.txt"
    lines = [
        {"prompt": "a", "id": "x1"},
        {"prompt_token_ids": [1, 2, 3], "max_tokens": 2},
        {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.5, "n": 2},
    ]
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n\n")
    fmt, got = read_prompt_lines(str(path))
    assert fmt == "jsonl"
    assert [(g.index, g.line, g.kind, g.id) for g in got] == [
        (0, 1, "prompt", "x1"),
        (1, 2, "prompt_token_ids", None),
        (2, 3, "messages", None),
    ]
    assert got[1].value == [1, 2, 3] and got[1].overrides == {"max_tokens": 2}
    p = params_for(SamplingParams(temperature=0, max_tokens=8), got[2])
    assert (p.temperature, p.n, p.max_tokens) == (0.5, 2, 8)


def test_plain_text_named_jsonl_is_text_and_dash_reads_stdin(tmp_path, monkeypatch):
    path = tmp_path / "prompts.jsonl"
    path.write_text('first line\n\n{"prompt": "second"}\n')
    fmt, got = read_prompt_lines(str(path))
    assert fmt == "text"
    assert [(g.line, g.value) for g in got] == [(1, "first line"), (3, '{"prompt": "second"}')]
    monkeypatch.setattr("sys.stdin", io.StringIO('{"prompt": "from stdin"}\n'))
    fmt, got = read_prompt_lines("-")
    assert fmt == "jsonl" and got[0].value == "from stdin"


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('{"prompt": "x", "max_token": 3}', r"line 2: unknown key 'max_token'"),
        ("not json", r"line 2: not valid JSON"),
        ("[1, 2]", r"line 2: must be a JSON object, not list"),
        ('{"prompt": "x", "messages": []}', r"line 2: needs exactly one of"),
        ('{"id": 3}', r"line 2: needs exactly one of .* found \[\]"),
        ('{"prompt": 5}', r"line 2: prompt=5 must be a string"),
        ('{"prompt_token_ids": [1, "2"]}', r"line 2: prompt_token_ids=\[1, '2'\] must be"),
        ('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", r"not valid JSON \(nested too"),
    ],
)
def test_bad_lines_become_errors_naming_the_line(tmp_path, line, match):
    path = tmp_path / "p"
    path.write_text('{"prompt": "good"}\n' + line + "\n")
    _, got = read_prompt_lines(str(path))
    assert got[0].error is None
    assert got[1].error is not None and pytest.importorskip("re").search(match, got[1].error)


def test_bad_override_values_name_the_line_and_field(tmp_path):
    path = tmp_path / "p"
    path.write_text('{"prompt": "x", "top_p": 0}\n')
    _, got = read_prompt_lines(str(path))
    with pytest.raises(ValueError, match=r"line 1: SamplingParams.top_p=0 must be in \(0, 1\]"):
        params_for(SamplingParams(), got[0])


def test_unreadable_or_empty_prompts_files_raise(tmp_path):
    with pytest.raises(ValueError, match=r"--prompts='.*nope' cannot be read"):
        read_prompt_lines(str(tmp_path / "nope"))
    (tmp_path / "empty").write_text("\n  \n")
    with pytest.raises(ValueError, match="holds no prompts"):
        read_prompt_lines(str(tmp_path / "empty"))


def test_stream_writes_as_it_goes_and_replaces_the_old_file_only_on_commit(tmp_path):
    target = tmp_path / "out.jsonl"
    target.write_text("old run\n")
    stream = JsonlStream(str(target))
    stream.write({"index": 0})
    # Already on disk in the .partial file; the old output is untouched.
    assert (tmp_path / "out.jsonl.partial").read_text() == '{"index": 0}\n'
    assert target.read_text() == "old run\n"
    stream.write({"index": 1, "text": "ü"})
    stream.commit()
    assert [json.loads(x) for x in target.read_text().splitlines()] == [
        {"index": 0},
        {"index": 1, "text": "ü"},
    ]
    assert not (tmp_path / "out.jsonl.partial").exists()
    failed = JsonlStream(str(target))
    failed.write({"index": 9})
    assert failed.close_partial().read_text() == '{"index": 9}\n'
    assert target.read_text().count("\n") == 2  # a failed run does not replace it


def test_unwritable_targets_fail_at_once(tmp_path):
    with pytest.raises(ValueError, match=r"--output='.*/missing/o.jsonl': directory .* does not"):
        JsonlStream(str(tmp_path / "missing" / "o.jsonl"))
    with pytest.raises(ValueError, match=r"--summary-json='.*' is a directory"):
        check_writable(str(tmp_path), "--summary-json")
    write_json_atomic(tmp_path / "s.json", {"a": 1})
    assert json.loads((tmp_path / "s.json").read_text()) == {"a": 1}
