"""One process of a two-process engine, for tests/distributed (run as a script).

    python mp_worker.py --rank R --port P --model DIR --out OUT.json [--mode generate|desync|die]

Each process fakes two CPU devices; the engine's mesh spans both processes (TP=4).
Only process 0 passes prompts: the engine broadcasts them. Writes {"outputs": [...]} or
{"error": "..."} to --out and exits 0, or 3 on an error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from paged_jax.testing.cpu_devices import xla_flags_with_cpu_devices

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18, 19, 20, 21, 22, 23], [24]]
MAX_TOKENS = 12


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--mode", default="generate", choices=["generate", "desync", "die"])
    args = p.parse_args()
    # Set here, not at import: the test imports this module for its constants, and its
    # environment must stay the suite's (other tests' subprocesses inherit it).
    os.environ["XLA_FLAGS"] = xla_flags_with_cpu_devices(os.environ.get("XLA_FLAGS", ""), 2)

    from paged_jax import LLM, SamplingParams

    try:
        llm = LLM(
            args.model,
            tensor_parallel_size=4,
            distributed_coordinator_address=f"127.0.0.1:{args.port}",
            distributed_num_processes=2,
            distributed_process_id=args.rank,
            distributed_heartbeat_timeout_s=10,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            max_model_len=64,
            block_size=4,
        )
        if args.mode == "desync" and args.rank == 1:
            # An admission only this process makes: its schedule leaves the others'.
            llm.engine.add_request("rogue", [3, 4, 5], SamplingParams(max_tokens=4))
        if args.mode == "die" and args.rank == 1:
            step = llm.engine.step
            calls = [0]

            def dying_step():
                calls[0] += 1
                if calls[0] == 3:
                    os._exit(7)
                return step()

            llm.engine.step = dying_step
        prompts = [{"prompt_token_ids": t} for t in PROMPTS] if args.rank == 0 else None
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.get_stats()
        result = {
            "outputs": [list(o.outputs[0].token_ids) for o in outs],
            "compiles_after_warmup": stats["num_compiles_after_warmup"],
            "weight_bytes_per_device": stats.get("weight_bytes_per_device"),
        }
        code = 0
    except Exception as e:  # reported to the test through --out
        result, code = {"error": f"{type(e).__name__}: {e}"}, 3
    with open(args.out, "w") as f:
        json.dump(result, f)
    return code


if __name__ == "__main__":
    sys.exit(main())
