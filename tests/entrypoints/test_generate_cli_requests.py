"""The generate CLI as a batch job: isolated bad requests, fatal checks before loading,
every prompt kind from a JSONL file, streamed output, summary, compile cache."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from paged_jax.entrypoints.generate_cli import build_parser, sampling_params_from_args
from paged_jax.entrypoints.generate_cli import main as generate_main
from paged_jax.sampling_params import SamplingParams

ENGINE = ["--block-size", "4", "--max-num-seqs", "8", "--max-num-batched-tokens", "16"]
ENGINE += ["--max-model-len", "64", "--no-compile-cache"]
# The variables by which tests/conftest.py hands its shared XLA cache to subprocesses.
SUITE_XLA_CACHE = ("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE")
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}[assistant]"


@pytest.fixture(scope="module")
def chat_model_dir(model_dir, tmp_path_factory):
    """The tiny Llama with a chat template in its tokenizer_config.json."""
    dst = tmp_path_factory.mktemp("chat_model")
    shutil.copytree(model_dir, dst, dirs_exist_ok=True)
    (dst / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return dst


def _fatal(args, capsys):
    code = generate_main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err and "usage:" not in err, err
    return err


def test_every_sampling_field_has_a_flag_with_its_default_in_help():
    parser = build_parser()
    dests = {a.dest for a in parser._actions}
    fields = {f for f in SamplingParams.__dataclass_fields__}
    assert fields <= dests, f"no CLI flag for {sorted(fields - dests)}"
    text = parser.format_help()
    for flag in ("--repetition-penalty", "--presence-penalty", "--logprobs", "--top-k"):
        assert re.search(re.escape(flag) + r"[^\n]*\n?[^\n]*\(default: ", text), flag
    assert "(default: 0.0)" in text and "API: 1.0" in text  # the CLI's greedy default


def test_fatal_problems_are_found_before_loading(model_dir, tmp_path, capsys, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the model must not be loaded when the run cannot succeed")

    monkeypatch.setattr("paged_jax.llm.LLM", no_load)
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    base = ["--model", str(model_dir), "--prompts", str(prompts), *ENGINE]
    out = str(tmp_path / "no_dir" / "o.jsonl")
    assert "directory" in _fatal([*base, "--output", out], capsys)
    err = _fatal([*base, "--summary-json", str(tmp_path)], capsys)
    assert "--summary-json" in err and "is a directory" in err
    # Unsupported architecture, listing the supported ones.
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    err = _fatal(["--model", str(bert), "--prompts", str(prompts)], capsys)
    assert "unsupported architecture: model_type='bert'" in err and "llama" in err
    # A truncated weights file is named.
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    err = _fatal(["--model", str(broken), "--prompts", str(prompts), *ENGINE], capsys)
    assert f"weights file {weights} is corrupted" in err
    # Pallas kernels need a GPU: the error lists what runs here.
    import jax

    if jax.default_backend() == "cpu":
        err = _fatal([*base, "--attention-backend", "pallas"], capsys)
        assert "valid here: 'auto', 'pallas_interpret', 'reference'" in err
    # A file with no valid line at all is not worth loading the model for.
    prompts.write_text('{"prompt": "x", "nope": 1}\n')
    assert "holds no valid line: line 1: unknown key 'nope'" in _fatal(base, capsys)
    assert not (tmp_path / "o.jsonl.partial").exists()


def test_a_batch_with_bad_lines_serves_the_rest(chat_model_dir, hf_greedy, tmp_path, capsys):
    lines = [
        {"prompt": "plain text", "id": "a"},
        {"prompt": ""},  # empty
        {"prompt_token_ids": [5, 6, 7, 8], "id": 42, "max_tokens": 3},
        {"prompt_token_ids": [5, 999]},  # outside the vocabulary
        {"prompt_token_ids": list(range(3, 103))},  # longer than max_model_len
        {"messages": [{"role": "user", "content": "hi"}], "id": "chat"},
        {"prompt": "x", "max_token": 3},  # unknown key
        {"prompt": "twice", "n": 2, "temperature": 1.0, "seed": 5, "stop": ["\n"]},
    ]
    prompts = tmp_path / "prompts.data"  # no .jsonl extension: detected by content
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out, summary = tmp_path / "out.jsonl", tmp_path / "summary.json"
    out.write_text("stale result of an earlier run\n")
    args = ["--model", str(chat_model_dir), "--prompts", str(prompts), "--output", str(out)]
    args += ["--summary-json", str(summary), "--max-tokens", "5", *ENGINE]
    assert generate_main(args) == 1  # some requests failed
    captured = capsys.readouterr()
    records = {r["index"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(records) == list(range(len(lines)))
    failed = sorted(i for i, r in records.items() if r["error"] is not None)
    assert failed == [1, 3, 4, 6]
    assert "line 2: prompt='' must be a non-empty string" in records[1]["error"]
    assert "line 4: " in records[3]["error"] and "vocab_size" in records[3]["error"]
    assert "line 5: " in records[4]["error"] and "max_model_len" in records[4]["error"]
    assert "line 7: unknown key 'max_token'" in records[6]["error"]
    assert records[0]["id"] == "a" and records[2]["id"] == 42
    # Token ids and the per-line max_tokens override, checked against transformers.
    assert records[2]["outputs"][0]["token_ids"] == hf_greedy(chat_model_dir, [5, 6, 7, 8], 3)
    chat = records[5]
    assert chat["prompt"] == "[user]hi[assistant]" and chat["id"] == "chat"
    assert chat["prompt_token_ids"] == [b + 3 for b in chat["prompt"].encode()]
    assert len(records[7]["outputs"]) == 2
    s = json.loads(summary.read_text())
    assert (s["requests"], s["succeeded"], s["failed"]) == (8, 4, 4)
    assert [e["index"] for e in sorted(s["errors"], key=lambda e: e["index"])] == failed
    assert s["compiles_after_warmup"] == 0 and s["compile_cache"] is None  # --no-compile-cache
    assert "failed: 4" in captured.out and "warm-up done" in captured.err
    # The progress bar's last rate is the summary's rate.
    assert f"out {s['generated_tokens_per_s']} tok/s" in captured.err.split("\r")[-1]
    assert not (tmp_path / "out.jsonl.partial").exists()


def test_second_run_loads_the_step_from_the_compile_cache(model_dir, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("cache me\n")
    # Without the suite's shared XLA cache (tests/conftest.py): these runs must find every
    # program in their own cache, cold then warm.
    env = {k: v for k, v in os.environ.items() if not k.startswith(SUITE_XLA_CACHE)}
    env["PAGED_JAX_COMPILE_CACHE"] = str(tmp_path / "jax_cache")
    runs = []
    for i in range(2):
        summary = tmp_path / f"s{i}.json"
        cmd = [sys.executable, "-m", "paged_jax.entrypoints.generate_cli", "--model"]
        cmd += [str(model_dir), "--prompts", str(prompts), "--summary-json", str(summary)]
        cmd += [*ENGINE[:-1], "--max-tokens", "2", "--no-tqdm"]  # cache on (env)
        # timeout: a hang guard only (minutes on a loaded 2-core machine are fine).
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, proc.stderr
        runs.append(json.loads(summary.read_text()))
    assert runs[0]["compile_cache"] == str(tmp_path / "jax_cache")
    assert runs[0]["compile_cache_misses"] > 0
    # Every bucket of the second run came from the cache.
    assert runs[1]["compile_cache_misses"] == 0
    assert runs[1]["compile_cache_hits"] == runs[0]["compile_cache_misses"]


def test_steering_vectors_flag_takes_inline_json_or_a_file(tmp_path, capsys):
    parser = build_parser()
    base = ["--model", "m", "--prompts", "p"]
    args = parser.parse_args([*base, "--steering-vectors", '{"1": [0.5, -1.0]}'])
    assert sampling_params_from_args(args).steering_vectors == ((1, (0.5, -1.0)),)
    path = tmp_path / "steer.json"
    path.write_text('{"0": [2.0], "-1": [1.0]}')
    args = parser.parse_args([*base, "--steering-vectors", str(path)])
    assert dict(sampling_params_from_args(args).steering_vectors) == {0: (2.0,), -1: (1.0,)}
    for bad, why in (("[1, 2]", "must be a JSON object"), ("{1: 2}", "not valid JSON")):
        with pytest.raises(SystemExit):
            parser.parse_args([*base, "--steering-vectors", bad])
        assert why in capsys.readouterr().err
