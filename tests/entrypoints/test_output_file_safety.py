"""Output files never lose a previous run's salvage, never follow a symlink, never
collide, and reach the disk before they replace the target."""

from __future__ import annotations

import json
import os

import pytest

from paged_jax.entrypoints.generate_cli import main as generate_main
from paged_jax.entrypoints.output_file import JsonlStream, write_json_atomic

ENGINE = ["--block-size", "4", "--max-num-seqs", "8", "--max-num-batched-tokens", "16"]
ENGINE += ["--max-model-len", "64", "--no-compile-cache", "--no-tqdm", "--max-tokens", "2"]


def test_a_leftover_partial_is_moved_aside_not_truncated(tmp_path, capsys):
    target = tmp_path / "out.jsonl"
    (tmp_path / "out.jsonl.partial").write_text("salvaged 1\n")
    (tmp_path / "out.jsonl.partial.1").write_text("salvaged 0\n")
    stream = JsonlStream(str(target))
    assert stream.moved_aside == tmp_path / "out.jsonl.partial.2"
    assert (tmp_path / "out.jsonl.partial.2").read_text() == "salvaged 1\n"
    assert (tmp_path / "out.jsonl.partial.1").read_text() == "salvaged 0\n"
    stream.write({"index": 0})
    stream.commit()
    assert target.read_text() == '{"index": 0}\n'


def test_a_symlinked_partial_is_moved_aside_and_its_target_kept(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "out.jsonl.partial").symlink_to(victim)
    stream = JsonlStream(str(tmp_path / "out.jsonl"))
    stream.write({"index": 0})
    assert victim.read_text() == "precious\n"
    assert (tmp_path / "out.jsonl.partial.1").is_symlink()
    assert not (tmp_path / "out.jsonl.partial").is_symlink()
    stream.commit()
    assert victim.read_text() == "precious\n"


def test_a_symlinked_output_is_refused(tmp_path):
    real = tmp_path / "real.jsonl"
    real.write_text("old\n")
    link = tmp_path / "out.jsonl"
    link.symlink_to(real)
    with pytest.raises(ValueError, match=r"--output='.*out.jsonl' is a symbolic link"):
        JsonlStream(str(link))
    assert link.is_symlink() and real.read_text() == "old\n"
    with pytest.raises(ValueError, match=r"--summary-json='.*out.jsonl' is a symbolic link"):
        write_json_atomic(link, {"a": 1}, flag="--summary-json")
    assert link.is_symlink() and real.read_text() == "old\n"


def test_a_device_output_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"--output='/dev/null' exists and is not a regular"):
        JsonlStream("/dev/null")


def test_commit_fsyncs_the_file_and_the_directory(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    stream = JsonlStream(str(tmp_path / "out.jsonl"))
    stream.write({"index": 0})
    monkeypatch.setattr(os, "fsync", fsync)
    stream.commit()
    assert synced == [str(tmp_path / "out.jsonl.partial"), str(tmp_path)]
    synced.clear()
    write_json_atomic(tmp_path / "s.json", {"a": 1})
    assert len(synced) == 2 and synced[1] == str(tmp_path)
    assert json.loads((tmp_path / "s.json").read_text()) == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "s.json"]


def _fatal(args, capsys):
    code = generate_main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_same_path_for_output_and_summary_is_refused(model_dir, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    same = tmp_path / "x.json"
    base = ["--model", str(model_dir), "--prompts", str(prompts), *ENGINE]
    err = _fatal([*base, "--output", str(same), "--summary-json", str(same)], capsys)
    assert "--output and --summary-json name the same file" in err
    # Spelled differently, still one file.
    other = str(tmp_path / "sub" / ".." / "x.json")
    (tmp_path / "sub").mkdir()
    err = _fatal([*base, "--output", str(same), "--summary-json", other], capsys)
    assert "--output and --summary-json name the same file" in err
    err = _fatal([*base, "--output", str(prompts)], capsys)
    assert "--prompts and --output name the same file" in err
    assert not same.exists() and prompts.read_text() == "hello\n"


def test_a_fast_failing_run_leaves_the_salvaged_partial_alone(model_dir, tmp_path, capsys):
    partial = tmp_path / "out.jsonl.partial"
    partial.write_text('{"index": 0}\n')
    args = ["--model", str(model_dir), "--prompts", str(tmp_path / "missing.txt")]
    _fatal([*args, "--output", str(tmp_path / "out.jsonl"), *ENGINE], capsys)
    assert partial.read_text() == '{"index": 0}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl.partial"]


def test_a_second_run_keeps_the_first_runs_salvage_and_says_so(model_dir, tmp_path, capsys):
    partial = tmp_path / "out.jsonl.partial"
    partial.write_text('{"index": 0}\n')
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    args = ["--model", str(model_dir), "--prompts", str(prompts)]
    assert generate_main([*args, "--output", str(tmp_path / "out.jsonl"), *ENGINE]) == 0
    err = capsys.readouterr().err
    assert f"{partial} (a previous run's records) was moved to {partial}.1" in err
    assert (tmp_path / "out.jsonl.partial.1").read_text() == '{"index": 0}\n'
    assert json.loads((tmp_path / "out.jsonl").read_text())["error"] is None
