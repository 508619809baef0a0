"""Multi-process tensor parallelism on one machine: per-device memory and equal outputs.

Runs the same greedy job three ways, each in fresh processes:
  one process, TP=1;  one process with 4 forced CPU devices, TP=4;
  two processes x 2 forced CPU devices, TP=4 across them (jax.distributed, gloo).
and reports each run's per-device weight and KV bytes, their ratio to TP=1, and the wall
time of generate (CPU collectives between processes are not a speed claim). Exits 1 when
the outputs differ. Writes JSON (default docs/multiprocess_tp.json).

    python scripts/bench_multiprocess_tp.py [--model DIR] [--output docs/multiprocess_tp.json]

Without --model a tiny random-weight Llama (hidden 256, 4 layers) is built (needs torch
and transformers).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

PROMPTS = [[5 + i, 6, 7, 8, 9, 10, 11, 12][: 2 + i] for i in range(8)]
MAX_TOKENS = 16

WORKER = r"""
import json, os, sys, time
rank, n, port, tp, path, out = sys.argv[1:7]
rank, n, tp = int(rank), int(n), int(tp)
from paged_jax import LLM, SamplingParams
kw = {}
if n > 1:
    kw = dict(distributed_coordinator_address=f"127.0.0.1:{port}",
              distributed_num_processes=n, distributed_process_id=rank)
llm = LLM(path, tensor_parallel_size=tp, max_num_seqs=8, max_num_batched_tokens=64,
          max_model_len=128, **kw)
prompts = [{"prompt_token_ids": p} for p in json.loads(os.environ["BENCH_PROMPTS"])]
params = SamplingParams(temperature=0.0, max_tokens=int(os.environ["BENCH_MAX_TOKENS"]),
                        ignore_eos=True)
t0 = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
wall = time.perf_counter() - t0
s = llm.get_stats()
json.dump({"outputs": [list(o.outputs[0].token_ids) for o in outs], "generate_s": wall,
           "weight_bytes_per_device": s["weight_bytes_per_device"],
           "kv_cache_bytes_per_device": s["kv_cache_bytes_per_device"],
           "num_kv_blocks": s["num_kv_blocks"],
           "compiles_after_warmup": s["num_compiles_after_warmup"]}, open(out, "w"))
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(path: str, processes: int, devices_per_process: int, tp: int, tmp: pathlib.Path) -> dict:
    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}",
        BENCH_PROMPTS=json.dumps(PROMPTS),
        BENCH_MAX_TOKENS=str(MAX_TOKENS),
    )
    port = _port()
    outs = [tmp / f"r{processes}_{tp}_{rank}.json" for rank in range(processes)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                WORKER,
                str(rank),
                str(processes),
                str(port),
                str(tp),
                path,
                str(outs[rank]),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(processes)
    ]
    for p in procs:
        _, err = p.communicate(timeout=900)
        if p.returncode:
            raise SystemExit(f"a worker failed ({p.returncode}):\n{err[-3000:]}")
    results = [json.loads(o.read_text()) for o in outs]
    first = results[0]
    assert all(r["outputs"] == first["outputs"] for r in results), "processes disagree"
    return {
        "processes": processes,
        "devices_per_process": devices_per_process,
        "tensor_parallel_size": tp,
        **{k: first[k] for k in first if k != "outputs"},
        "outputs": first["outputs"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--output", default="docs/multiprocess_tp.json")
    args = ap.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp())
    path = args.model
    if path is None:
        from paged_jax.testing.tiny_models import build_tiny_hf_checkpoint

        path = str(
            build_tiny_hf_checkpoint(
                "llama",
                tmp / "model",
                hidden_size=256,
                intermediate_size=512,
                num_hidden_layers=4,
                num_attention_heads=8,
                num_key_value_heads=4,
                vocab_size=512,
            )
        )
    runs = []
    for processes, devices, tp in ((1, 1, 1), (1, 4, 4), (2, 2, 4)):
        t0 = time.perf_counter()
        r = run(path, processes, devices, tp, tmp)
        r["process_wall_s"] = time.perf_counter() - t0
        runs.append(r)
        print(
            f"{processes} process(es) x {devices} device(s), TP={tp}: weights/device "
            f"{r['weight_bytes_per_device']:,} B, KV/device {r['kv_cache_bytes_per_device']:,} B, "
            f"generate {r['generate_s']:.2f} s"
        )
    base = runs[0]
    for r in runs:
        r["weight_bytes_ratio_to_tp1"] = (
            r["weight_bytes_per_device"] / base["weight_bytes_per_device"]
        )
    same = all(r["outputs"] == base["outputs"] for r in runs)
    for r in runs:
        r.pop("outputs")
    result = {
        "command": "python scripts/bench_multiprocess_tp.py"
        + (f" --model {args.model}" if args.model else ""),
        "model": "tiny random Llama: hidden 256, 4 layers, 8 heads / 4 KV heads, vocab 512"
        if args.model is None
        else args.model,
        "outputs_equal": same,
        "runs": runs,
    }
    pathlib.Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    for r in runs:
        print(
            f"  TP={r['tensor_parallel_size']} over {r['processes']} process(es): weight bytes/device = "
            f"{r['weight_bytes_ratio_to_tp1']:.3f} x TP=1"
        )
    print("outputs equal:", same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
