"""The documented two-process command: paged-jax-generate on every process, TP over both.

Each process runs the same command with its own --process-id; only process 0 writes
the output file, and its records equal the one-process run's. Process 1 is given another
prompts file, 16 times longer: process 0's job is every process's (its requests are
served, its size sizes every engine), where each process used to size its engine to its
own file and both died in mismatched collectives (issue 38 item 3).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

from paged_jax.testing.cpu_devices import env_with_cpu_devices

PROMPTS = ["the cat sat", "on a mat", "paged attention", "x"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(model_dir, prompts, output, *extra):
    cmd = [sys.executable, "-m", "paged_jax.entrypoints.generate_cli", "--model", str(model_dir)]
    cmd += ["--prompts", str(prompts), "--output", str(output), "--no-tqdm"]
    cmd += ["--no-compile-cache", "--temperature", "0", "--max-tokens", "8", "--ignore-eos"]
    return cmd + list(extra)


def _records(path):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["id"]: (r.get("error"), [c["token_ids"] for c in r.get("outputs", [])]) for r in rows}


def test_two_process_cli_writes_once_and_equals_one_process(model_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    one = tmp_path / "one.jsonl"
    # Timeouts here are hang guards only (a lost peer would otherwise block CI).
    subprocess.run(_cli(model_dir, prompts, one), check=True, capture_output=True, timeout=900)

    other = tmp_path / "other.txt"  # process 1's own file: 64 longer lines
    other.write_text("".join(f"a longer prompt about paged attention {i}\n" for i in range(64)))
    port = _free_port()
    env = env_with_cpu_devices(2)
    procs, logs = [], []
    for rank in (0, 1):
        extra = ["--tensor-parallel-size", "4", "--coordinator-address", f"127.0.0.1:{port}"]
        extra += ["--num-processes", "2", "--process-id", str(rank)]
        log = (tmp_path / f"cli_{rank}.log").open("w")
        logs.append(log)
        out = tmp_path / f"out_{rank}.jsonl"
        cmd = _cli(model_dir, prompts if rank == 0 else other, out, *extra)
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
    try:
        codes = [p.wait(timeout=900) for p in procs]
    finally:
        for p in procs:
            p.kill()
        for log in logs:
            log.close()
    assert codes == [0, 0], (tmp_path / "cli_0.log").read_text()[-3000:]
    # Both engines were sized to process 0's 4 requests.
    for rank in (0, 1):
        assert "engine sized to the job (4 requests" in (tmp_path / f"cli_{rank}.log").read_text()
    assert not (tmp_path / "out_1.jsonl").exists()  # only process 0 writes
    assert _records(tmp_path / "out_0.jsonl") == _records(one)
