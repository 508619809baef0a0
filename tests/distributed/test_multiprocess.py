"""A two-process engine (jax.distributed on 127.0.0.1, gloo CPU collectives).

Two processes with two forced CPU devices each run one engine with TP=4 across them,
in lockstep. Greedy outputs must equal the one-process TP=1 engine and transformers;
a request admitted by one process only is caught by the lockstep guard on both; a
process that dies ends the other with an error within the heartbeat timeout.
"""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import sys
import time

import pytest

from paged_jax import LLM, SamplingParams

WORKER = pathlib.Path(__file__).with_name("mp_worker.py")
sys.path.insert(0, str(WORKER.parent))
from mp_worker import MAX_TOKENS, PROMPTS  # noqa: E402

# A hang guard, not a speed limit: two engine processes start, compile and run, minutes
# on a loaded 2-core machine; no test asserts how long they took.
TIMEOUT_S = 900


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pair(model: pathlib.Path, tmp: pathlib.Path, mode: str = "generate"):
    """Starts both processes; returns [(returncode, result dict, seconds)] per rank."""
    port = _free_port()
    procs = []
    start = time.monotonic()
    for rank in (0, 1):
        out = tmp / f"{mode}_{rank}.json"
        cmd = [sys.executable, str(WORKER), "--rank", str(rank), "--port", str(port)]
        cmd += ["--model", str(model), "--out", str(out), "--mode", mode]
        log = open(tmp / f"{mode}_{rank}.log", "w")  # noqa: SIM115 (closed after wait)
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), out, log))
    results = []
    for proc, out, log in procs:
        try:
            code = proc.wait(timeout=max(1.0, TIMEOUT_S - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            for other, _, _ in procs:
                other.kill()
            pytest.fail(f"{mode}: a process did not exit within {TIMEOUT_S} s (a hang)")
        log.close()
        elapsed = time.monotonic() - start
        result = json.loads(out.read_text()) if out.exists() else None
        results.append((code, result, elapsed))
    return results


def _log(tmp: pathlib.Path, mode: str, rank: int) -> str:
    return (tmp / f"{mode}_{rank}.log").read_text()[-3000:]


# One family: Qwen2 takes Llama's path through the two processes (the same layers, split
# the same way) and adds the q/k/v biases split with their columns. Llama across two
# processes is test_multiprocess_cli.py's two-process CLI run (its records equal the
# one-process run's) and this file's desync and dead-process tests; Llama under TP against
# transformers is tests/worker/test_tensor_parallel.py's (one process, forced devices).
@pytest.mark.parametrize("family", ["qwen2"])
def test_two_processes_tp4_equal_one_process_and_transformers(
    tiny_hf_checkpoint, hf_greedy, tmp_path, family
):
    path = tiny_hf_checkpoint(family)
    (c0, r0, _), (c1, r1, _) = run_pair(path, tmp_path)
    assert c0 == 0 and c1 == 0, (r0, r1, _log(tmp_path, "generate", 0))
    llm = LLM(str(path), max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": t} for t in PROMPTS]
    one = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert r0["outputs"] == one
    assert r1["outputs"] == one  # process 1 passed no prompts: admission came from process 0
    assert r0["compiles_after_warmup"] == 0 and r1["compiles_after_warmup"] == 0
    # Each device holds a quarter of the split weights (replicated norms aside).
    single = llm.get_stats()["weight_bytes_per_device"]
    assert r0["weight_bytes_per_device"] < 0.5 * single
    for prompt, got in zip(PROMPTS, one):
        want = hf_greedy(path, prompt, MAX_TOKENS)
        assert got[: len(want)] == want


def test_an_admission_on_one_process_only_is_caught_on_both(tiny_hf_checkpoint, tmp_path):
    (c0, r0, _), (c1, r1, _) = run_pair(tiny_hf_checkpoint("llama"), tmp_path, "desync")
    assert c0 == 3 and c1 == 3, (r0, r1, _log(tmp_path, "desync", 0))
    for r in (r0, r1):
        assert r["error"].startswith("LockstepError: the engine's processes diverged"), r


def test_a_dead_process_ends_the_other_with_an_error(tiny_hf_checkpoint, tmp_path):
    (c0, r0, _), (c1, _, _) = run_pair(tiny_hf_checkpoint("llama"), tmp_path, "die")
    assert c1 == 7
    assert c0 != 0, (r0, _log(tmp_path, "die", 0))
    # It does not wait out the test's limit (run_pair fails the test then): the heartbeat
    # ends it, as its log says. No duration is asserted, only the cause.
    log0 = (tmp_path / "die_0.log").read_text()
    assert "heartbeat" in log0, (r0, log0[-3000:])
