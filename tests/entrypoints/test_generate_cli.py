"""The generate CLI and the built-in demo model on tiny random-weight checkpoints."""

from __future__ import annotations

import json
import re

import pytest

from paged_jax.entrypoints.demo import ensure_demo_model
from paged_jax.entrypoints.generate_cli import main as generate_main
from paged_jax.llm import LLM
from paged_jax.sampling_params import SamplingParams

SMALL = dict(block_size=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128)


def test_demo_model_from_an_empty_cache_dir(tmp_path):
    path = ensure_demo_model(tmp_path / "cache")
    assert (path / "model.safetensors").is_file()
    mtime = (path / "model.safetensors").stat().st_mtime
    assert ensure_demo_model(tmp_path / "cache") == path  # reused, not rewritten
    assert (path / "model.safetensors").stat().st_mtime == mtime
    llm = LLM(str(path), warmup=False, **SMALL)
    out = llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1


def test_generate_cli_writes_valid_jsonl(model_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["one", "two two", "three"]))
    out = tmp_path / "out.jsonl"
    args = ["--model", str(model_dir), "--prompts", str(prompts), "--output", str(out)]
    args += ["--max-tokens", "4", "--block-size", "4", "--max-num-seqs", "8"]
    args += ["--max-num-batched-tokens", "32", "--max-model-len", "64", "--no-tqdm"]
    assert generate_main([*args, "--no-compile-cache"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    records.sort(key=lambda r: r["index"])  # written in finish order
    assert [r["prompt"] for r in records] == ["one", "two two", "three"]
    assert all(1 <= len(r["outputs"][0]["token_ids"]) <= 4 for r in records)
    summary = capsys.readouterr().out
    assert "compiles_after_warmup: 0" in summary and "requests: 3" in summary


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--model", "/no/such/dir"], r"--model='/no/such/dir' must be a Hugging Face model"),
        (["--prompts", "/no/such/file.txt"], r"--prompts='/no/such/file.txt' cannot be read"),
        (["--block-size", "12"], r"block_size=12 must be a power of two"),
        (["--temperature", "-1"], r"temperature=-1.0 must be"),
        (["--repetition-penalty", "0"], r"repetition_penalty=0.0 must be a number > 0"),
        (["--tensor-parallel-size", "0"], r"tensor_parallel_size=0 must be an int >= 1"),
    ],
)
def test_generate_cli_errors_are_one_line_exit_2(args, match, capsys):
    assert generate_main(args) == 2
    err = capsys.readouterr().err
    assert re.search(match, err)
    assert err.count("\n") == 1 and "usage:" not in err and "Traceback" not in err


def test_tensor_parallel_size_beyond_the_devices_is_a_clear_error(model_dir, capsys):
    """This process has one CPU device; the flag reaches make_mesh, which names the fix."""
    code = generate_main(["--model", str(model_dir), "--tensor-parallel-size", "2", "--no-tqdm"])
    assert code == 2
    err = capsys.readouterr().err
    assert "tensor_parallel_size=2 must be <= the number of devices (1 cpu)" in err
    assert "--xla_force_host_platform_device_count=2" in err
