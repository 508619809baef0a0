"""The data-parallel replica without Ray: rows in, the single-process CLI's records out;
its core slots, its bound on batch retries and its test hook."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

from paged_jax.entrypoints.data_parallel import merge_replica_figures
from paged_jax.entrypoints.generate_cli import main as generate_main
from paged_jax.entrypoints.prompts_file import parse_jsonl_line, read_prompt_lines
from paged_jax.entrypoints.replica import (
    REQUEST_JSON,
    Replica,
    parse_crash_hook,
    request_json,
    request_line,
)
from paged_jax.sampling_params import SamplingParams

SMALL = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
FLAGS = ["--block-size", "4", "--max-num-seqs", "4", "--max-num-batched-tokens", "32"]
FLAGS += ["--max-model-len", "64", "--max-tokens", "5", "--no-compile-cache", "--no-tqdm"]
LINES = [
    {"id": "a", "prompt": "alpha beta"},
    {"id": 7, "prompt": "gamma", "max_tokens": 3, "stop": ["q"]},
    {"prompt": 12},  # a bad line
    {"id": "t", "prompt_token_ids": [1, 40, 50, 60]},
    {"id": "v", "prompt_token_ids": [1, 9999]},  # outside the vocabulary: engine rejects
    {"id": "s", "prompt": "delta", "temperature": 0.9, "seed": 5, "n": 2},
]
# The fields that differ by design between two runs: the time and the engine-local id.
VOLATILE = ("time_to_first_token", "request_id")


def _stable(record):
    return {k: v for k, v in record.items() if k not in VOLATILE}


@pytest.fixture(scope="module")
def replica(model_dir, tmp_path_factory):
    with warnings.catch_warnings():  # jax is already imported in this process
        warnings.simplefilter("ignore")
        return Replica(
            str(model_dir),
            SamplingParams(temperature=0.0, max_tokens=5),
            engine_args=SMALL,
            compile_cache=False,
            job_dir=str(tmp_path_factory.mktemp("job")),
            max_batch_retries=1,
        )


def test_a_line_survives_the_trip_as_request_json():
    line = parse_jsonl_line(3, 4, json.dumps({"id": [1, "x"], "prompt": "hi", "stop": ["a"]}))
    again = request_line({"index": 3, "line": 4, REQUEST_JSON: request_json(line)})
    assert again == line


def test_dataset_rows_skip_nulls_and_foreign_columns_and_errors_name_no_line():
    line = request_line({"prompt": "hi", "id": 3, "temperature": None, "label": "x"})
    assert (line.error, line.kind, line.id, line.overrides) == (None, "prompt", 3, {})
    bad = request_line({"prompt": "hi", "prompt_token_ids": [1, 2]})
    assert bad.error.startswith("line None: ")  # parse_jsonl_line's own text, cleaned below


def test_replica_records_equal_the_single_process_cli(replica, model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in LINES))
    out, summary = tmp_path / "o.jsonl", tmp_path / "s.json"
    args = ["--model", str(model_dir), "--prompts", str(prompts), "--output", str(out)]
    code = generate_main([*args, "--summary-json", str(summary), *FLAGS])
    assert code == 1  # the bad lines
    single = {r["index"]: r for r in map(json.loads, out.read_text().splitlines())}
    _, lines = read_prompt_lines(str(prompts))
    rows = [
        {"index": ln.index, "line": ln.line, REQUEST_JSON: request_json(ln)}
        for ln in lines
        if not ln.error
    ]
    records = replica.serve(rows)
    got = {r["index"]: r for r in records}
    assert len(records) == len(got) == 5  # the unparsable line stays with the driver
    assert {i: _stable(r) for i, r in got.items()} == {
        i: _stable(r) for i, r in single.items() if i != 2
    }
    assert got[4]["error"].startswith("line 5: prompt_token_ids contains 9999")
    assert len(got[5]["outputs"]) == 2
    # The data-parallel summary has every key of the single-process one (issue 38 item
    # 11: it lacked the start-up and spec_* keys): the job's own from the records, the
    # engine's merged from the replicas' figures.
    job_keys = {"requests", "succeeded", "failed", "completions", "prompt_tokens"}
    job_keys |= {"generated_tokens", "wall_s", "generated_tokens_per_s", "total_tokens_per_s"}
    job_keys |= {"engine_error", "output_error", "errors"}
    single_keys = set(json.loads(summary.read_text()))
    merged = merge_replica_figures([replica.stats(), replica.stats()])
    assert single_keys - job_keys - set(merged) == set()
    assert merged["start"] == "cold" and merged["programs_compiled"] > 0


def test_a_row_without_a_line_number_gets_an_error_without_one(replica):
    (record,) = replica.serve([{"id": "z", "prompt": ""}])
    assert record["error"] == "prompt='' must be a non-empty string"
    assert (record["index"], record["line"], record["id"]) == (None, None, "z")


def test_a_batch_past_its_retries_gets_error_records(replica, monkeypatch):
    """A retry is the same task's same batch in a new process (its count starts again)."""
    monkeypatch.setattr("paged_jax.entrypoints.replica.current_task_id", lambda: "task-7")
    rows = [{"index": 0, "line": 1, "prompt": "retry me"}]
    assert replica.serve(rows)[0]["error"] is None  # first try
    assert replica.serve(rows)[0]["error"] is None  # equal rows, the task's next batch
    replica.task_calls.clear()  # the replica died and was restarted
    assert replica.serve(rows)[0]["error"] is None  # the one retry allowed
    replica.task_calls.clear()
    (record,) = replica.serve(rows)
    assert record["error"] == (
        "line 1: the replicas serving this request's batch died 2 times (max_batch_retries=1)"
    )


def test_the_crash_hook_names_an_index_and_a_marker():
    assert parse_crash_hook(None) == (None, None)
    assert parse_crash_hook("4:/tmp/m") == (4, "/tmp/m")
    with pytest.raises(ValueError, match=r"PAGED_JAX_TEST_REPLICA_CRASH='x' must be INDEX:MARKER"):
        parse_crash_hook("x")


def test_replicas_on_one_host_take_their_own_cores_and_free_them_on_exit(tmp_path):
    """Two processes at once, as two replicas: pinning changes the caller's cores."""
    script = textwrap.dedent(
        f"""
        import json, os, sys
        from paged_jax.entrypoints.replica import pin_to_cores
        cores = sorted(os.sched_getaffinity(0))
        mine = pin_to_cores(1, {str(tmp_path)!r})
        print(json.dumps([cores, mine, sorted(os.sched_getaffinity(0))]), flush=True)
        sys.stdin.read()  # hold the slot until told
        """
    )

    def start():
        return subprocess.Popen(
            [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def finish(proc):
        out, _ = proc.communicate("", timeout=300)  # a hang guard only
        assert proc.returncode == 0
        return json.loads(out)

    first = start()
    line = json.loads(first.stdout.readline())
    second = finish(start())  # while the first holds its slot
    cores, mine, now = line
    assert mine == now == cores[:1]
    assert second[1] == (cores[1:2] if len(cores) > 1 else None)
    first.communicate("", timeout=300)
    assert finish(start())[1] == cores[:1]  # the exited process's slot is free again
    assert os.path.isdir(tmp_path)
