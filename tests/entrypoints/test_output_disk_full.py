"""A full disk while the output is written (issue 38 item 7): the .partial file keeps whole
records only, the run stops with one line and exit 1, and every request without a record
is named in the summary.

The disk is made full by a write() that fails with ENOSPC for the .partial file only (the
way a full file system fails: a short write, then ENOSPC), so every other file of the
process is untouched. Host-only except the one CLI run on the tiny model.
"""

from __future__ import annotations

import errno
import json
import os
import sys

import pytest

from paged_jax.entrypoints.generate_cli import main as generate_main
from paged_jax.entrypoints.output_file import JsonlStream, OutputWriteError

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc/self/fd to find the file"
)
ENGINE = ["--block-size", "4", "--max-num-seqs", "8", "--max-num-batched-tokens", "16"]
ENGINE += ["--max-model-len", "64", "--no-compile-cache", "--no-tqdm", "--max-tokens", "2"]


@pytest.fixture
def full_disk(monkeypatch):
    """Once set, the .partial file takes `records` more write() calls whole, then one
    short write (half its bytes), then ENOSPC for every write."""
    real_write = os.write
    state = {"records": None}

    def write(fd, data):
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            name = ""
        if state["records"] is None or not name.endswith(".partial"):
            return real_write(fd, data)
        if state["records"] > 0:
            state["records"] -= 1
            return real_write(fd, data)
        if state["records"] == 0:
            state["records"] = -1
            return real_write(fd, bytes(data[: max(1, len(data) // 2)]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", write)
    return state


def _record(i):
    return {"index": i, "id": None, "line": i + 1, "text": "x" * 20}


def test_a_full_disk_leaves_whole_records_and_one_error(tmp_path, full_disk):
    target = tmp_path / "out.jsonl"
    stream = JsonlStream(target)
    full_disk["records"] = 2  # the third record is cut in half
    stream.write(_record(0))
    stream.write(_record(1))
    with pytest.raises(OutputWriteError, match=r"--output=.*out.jsonl.*No space left") as err:
        stream.write(_record(2))
    assert "\n" not in str(err.value)
    # Whole records only: the cut-off third one was taken back.
    lines = stream.partial.read_text().splitlines()
    assert [json.loads(x)["index"] for x in lines] == [0, 1]
    assert stream.num_records == 2 and stream.error is err.value
    # Later writes fail the same way without touching the file; closing never raises.
    with pytest.raises(OutputWriteError):
        stream.write(_record(3))
    with pytest.raises(OutputWriteError):
        stream.commit()
    assert stream.close_partial() == stream.partial
    assert len(stream.partial.read_text().splitlines()) == 2 and not target.exists()


def test_the_cli_on_a_full_disk_exits_1_in_one_line_with_valid_records(
    model_dir, tmp_path, capsys, full_disk
):
    prompts = tmp_path / "p.jsonl"
    rows = [{"prompt": p, "id": p} for p in ("a", "bb", "ccc", "dddd", "eeeee")]
    rows.insert(1, {"prompt": ""})  # a bad line: its record is written first
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, summary = tmp_path / "out.jsonl", tmp_path / "s.json"
    full_disk["records"] = 1  # the bad line's record fits, the first completion's does not
    args = ["--model", str(model_dir), "--prompts", str(prompts), "--output", str(out)]
    code = generate_main([*args, "--summary-json", str(summary), *ENGINE])
    captured = capsys.readouterr()
    assert code == 1, captured.err
    assert "Traceback" not in captured.err
    errors = [x for x in captured.err.splitlines() if "error:" in x]
    assert len(errors) == 1, captured.err
    assert "--output" in errors[0] and "No space left on device" in errors[0], errors[0]
    assert f"{out}.partial" in errors[0] and "not replaced" in errors[0], errors[0]
    assert not out.exists()
    kept = [json.loads(x) for x in (tmp_path / "out.jsonl.partial").read_text().splitlines()]
    assert [r["index"] for r in kept] == [1], kept
    # The summary (another disk may have room) names every request without a record.
    s = json.loads(summary.read_text())
    assert (s["requests"], s["succeeded"], s["failed"]) == (6, 0, 6), s
    missing = {e["index"]: e["error"] for e in s["errors"] if e["index"] != 1}
    assert sorted(missing) == [0, 2, 3, 4, 5], s["errors"]
    for i, error in missing.items():
        assert error.startswith(f"line {i + 1}: ") and "no record" in error, error
    assert s["output_error"].startswith("--output=") and "No space left" in s["output_error"]
