"""`--data-parallel-size 2` and generate_dataset on a local Ray cluster: the records equal
the single-process CLI's per index, bad lines included, hidden-state .npy files too, and
a replica killed mid-run still leaves every request exactly once.

Each Ray run is a subprocess with a timeout (a stuck cluster fails the test instead of
hanging CI); the replicas are pinned to one core each and start warm from the compile
cache the single-process run fills.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytest.importorskip("ray.data", reason="needs Ray Data: pip install 'paged-jax[ray]'")
# Replicas compare bits with the one-process run (batch invariance): XLA's own CPU emitters.
pytestmark = pytest.mark.xla_default_cpu_codegen

from paged_jax.entrypoints.generate_cli import main as generate_main  # noqa: E402
from paged_jax.entrypoints.hidden_state_files import decode_hidden_states  # noqa: E402
from paged_jax.entrypoints.replica import CRASH_HOOK_ENV  # noqa: E402

ENGINE = ["--block-size", "4", "--max-num-seqs", "4", "--max-num-batched-tokens", "32"]
ENGINE += ["--max-model-len", "64", "--max-tokens", "6", "--no-tqdm"]
# Hidden states as .npy files; batch invariance makes a request's rows (and logprobs)
# bitwise the same whichever replica serves it beside whichever requests.
ENGINE += ["--hidden-state-layers", "0", "-1", "--batch-invariant"]
# A hang guard, not a speed limit: Ray start, replicas and their compiles take minutes on
# a loaded 2-core machine; no test asserts how long a run took.
RAY_TIMEOUT_S = 900
# Prompts with distinct first blocks, so prefix-cache hits (num_cached_tokens) do not
# depend on which replica serves which request.
LINES = [{"id": f"r{i}", "prompt": f"{chr(97 + i)}{i} request {i * 13}"} for i in range(12)]
LINES[3]["max_tokens"] = 2
LINES[5].update(temperature=0.8, seed=11)
LINES[7]["stop"] = ["e"]
for i in (1, 5, 9):  # hidden states: .npy files beside the output, named by index
    LINES[i]["return_hidden_states"] = True
LINES.insert(4, {"id": "bad", "prompt": 5})  # index 4: an error record
LINES.append({"id": "tok", "prompt_token_ids": [1, 9999]})  # rejected by the engine


def _stable(record):
    # "hidden_states" holds file names, which start with the output's name.
    volatile = ("time_to_first_token", "request_id", "hidden_states")
    return {k: v for k, v in record.items() if k not in volatile}


def _hidden_states(path, record):
    """A record's hidden-state files, loaded: {part: {layer: rows}} (None: it has none)."""
    files = record.get("hidden_states")
    if files is None:
        return None
    parts = {"prompt": files["prompt"], **{f"out{j}": f for j, f in enumerate(files["outputs"])}}
    for part, names in parts.items():
        for layer, name in names.items():
            assert name.startswith(f"{path.name}.{record['index']}.{part}.layer{layer}")
    load = lambda names: {int(k): np.load(path.parent / v) for k, v in names.items()}  # noqa: E731
    return {part: load(names) for part, names in parts.items()}


def _check_same_hidden_states(got, want):
    assert got.keys() == want.keys()
    for part in want:
        assert got[part].keys() == want[part].keys() == {0, -1}
        for layer, rows in want[part].items():
            assert got[part][layer].dtype == np.float32
            np.testing.assert_array_equal(got[part][layer], rows)  # f32, exactly


def _by_index(path):
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return records, {r["index"]: r for r in records}


@pytest.fixture(scope="module")
def job(model_dir, tmp_path_factory):
    """The prompts file, the single-process CLI's records and its (filled) compile cache."""
    root = tmp_path_factory.mktemp("dp_job")
    prompts = root / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in LINES))
    out = root / "single.jsonl"
    base = ["--model", str(model_dir), "--prompts", str(prompts), *ENGINE]
    base += ["--compile-cache-dir", str(root / "cache")]
    assert generate_main([*base, "--output", str(out)]) == 1  # two error records
    single = _by_index(out)[1]
    states = {i: _hidden_states(out, single[i]) for i in single}
    assert [i for i, s in states.items() if s is not None] == [1, 6, 10]  # bad line at 4
    return base, single, states


def _run_cli(args, env=None):
    cmd = [sys.executable, "-m", "paged_jax.entrypoints.generate_cli", *args]
    proc = subprocess.run(
        cmd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=RAY_TIMEOUT_S,
    )
    return proc


def _check_equal_to_single(records, single):
    indices = [r["index"] for r in records]
    assert sorted(indices) == sorted(single), "every request exactly once"
    got = {r["index"]: r for r in records}
    assert {i: _stable(r) for i, r in got.items()} == {i: _stable(r) for i, r in single.items()}


def test_two_replicas_write_the_single_process_records(job, tmp_path):
    base, single, single_states = job
    out, summary = tmp_path / "dp.jsonl", tmp_path / "s.json"
    args = [*base, "--output", str(out), "--summary-json", str(summary)]
    proc = _run_cli([*args, "--data-parallel-size", "2", "--cpus-per-replica", "1"])
    assert proc.returncode == 1, proc.stderr[-3000:]  # the two error records, as single
    records, _ = _by_index(out)
    _check_equal_to_single(records, single)
    assert single[4]["error"] == "line 5: prompt=5 must be a string"
    for r in records:  # the same .npy files, beside dp.jsonl, equal bit for bit
        want = single_states[r["index"]]
        if want is None:
            assert "hidden_states" not in r
        else:
            _check_same_hidden_states(_hidden_states(out, r), want)
    s = json.loads(summary.read_text())
    assert (s["requests"], s["succeeded"], s["failed"]) == (14, 12, 2)
    assert s["data_parallel_size"] == 2 and s["compiles_after_warmup"] == 0
    # The actor pool hands each batch to whichever replica is ready: on a loaded machine
    # the first replica up may serve them all before the second finishes its warm-up.
    assert 1 <= s["replica_processes"] <= 2, s["replicas"]
    assert {e["index"] for e in s["errors"]} == {4, 13}
    assert "== paged-jax generate summary ==" in proc.stdout


def test_a_replica_killed_mid_run_still_yields_every_request_once(job, tmp_path):
    base, single, _ = job
    out, marker = tmp_path / "dp.jsonl", tmp_path / "crashed"
    args = [*base, "--output", str(out), "--data-parallel-size", "2", "--cpus-per-replica", "1"]
    proc = _run_cli(args, env={CRASH_HOOK_ENV: f"8:{marker}"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert marker.is_file(), "the hook never fired: no replica died"
    records, _ = _by_index(out)
    _check_equal_to_single(records, single)


def test_generate_dataset_serves_a_parquet_dataset(job, model_dir, tmp_path):
    """The Python entry point on a Ray Dataset read from Parquet (nulls = not given)."""
    _, single, single_states = job
    rows = [dict(r, index=i) for i, r in enumerate(LINES) if isinstance(r.get("prompt"), str)]
    assert len(rows) == 12  # batches of 3: the last two batches are the same six rows
    dups = [{"id": "dup", "prompt": "same again"}] * 6
    script = textwrap.dedent(
        f"""
        import base64, json, sys
        import pyarrow as pa, pyarrow.parquet as pq, ray, ray.data
        from paged_jax import SamplingParams
        from paged_jax.entrypoints.data_parallel import generate_dataset
        rows = json.loads(sys.argv[1])
        keys = sorted({{k for r in rows for k in r}})  # from_pylist keeps row 0's keys only
        table = pa.Table.from_pydict({{k: [r.get(k) for r in rows] for k in keys}})
        pq.write_table(table, {str(tmp_path / "p.parquet")!r})
        ray.init(num_cpus=3, include_dashboard=False, logging_level="WARNING")
        ds = ray.data.read_parquet({str(tmp_path / "p.parquet")!r})
        out = generate_dataset(
            ds, {str(model_dir)!r}, SamplingParams(temperature=0.0, max_tokens=6),
            data_parallel_size=2, batch_size=3, cpus_per_replica=1, max_batch_retries=0,
            compile_cache={str(job[0][job[0].index("--compile-cache-dir") + 1])!r},
            block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
            hidden_state_layers=(0, -1), batch_invariant=True,
        )
        got = out.take_all()
        print("RECORDS", json.dumps([json.loads(r["record"]) for r in got]))
        states = {{r["index"]: base64.b64encode(r["hidden_states"]).decode()
                  for r in got if r["hidden_states"] is not None}}
        print("STATES", json.dumps(states))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(rows + dups)],
        capture_output=True,
        text=True,
        timeout=RAY_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RECORDS ")]
    records = json.loads(line[len("RECORDS ") :])
    # Equal batches of one job are not retries of each other (no retry is allowed here).
    same = [r for r in records if r["index"] is None]
    assert len(same) == 6 and all(r["error"] is None for r in same), same
    assert len({json.dumps(r["outputs"]) for r in same}) == 1
    records = [r for r in records if r["index"] is not None]
    assert sorted(r["index"] for r in records) == [r["index"] for r in rows]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("STATES ")]
    payloads = json.loads(line[len("STATES ") :])
    assert sorted(map(int, payloads)) == [1, 6, 10]
    for index, payload in payloads.items():
        got = decode_hidden_states(base64.b64decode(payload))
        _check_same_hidden_states(got, single_states[int(index)])
    for r in records:  # a dataset row has no line number; the rest is the CLI's record
        assert r.pop("line") is None
        want = dict(single[r["index"]])
        want.pop("line")
        assert _stable(r) == _stable(want)
