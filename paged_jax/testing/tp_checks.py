"""Runs LLM(tensor_parallel_size=N) on several checkpoints in one process; writes JSON.

Tensor-parallel tests need several devices, and jax fixes the CPU device count when it
starts, so they run this module in a subprocess (XLA_FLAGS=
--xla_force_host_platform_device_count=8) while the rest of the suite keeps one device:

    python -m paged_jax.testing.tp_checks spec.json out.json

spec.json: a list of runs, each {"name", "path", "tensor_parallel_size", "engine": {EngineConfig
fields}, "prompts": [[ids]], "max_tokens", "sampling_seeds": [seeds] (optional)}.
out.json: {name: {"greedy": [[ids]], "seeded": [[ids]], "prompt_logprobs": [[logprob, rank]]
(the first prompt's), "stats": {...}, "devices": n}}.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def run_one(run: dict[str, Any]) -> dict[str, Any]:
    """Builds the LLM of one run, generates greedy and seeded tokens, returns them + stats."""
    from paged_jax.llm import LLM
    from paged_jax.sampling_params import SamplingParams
    from paged_jax.worker.sharding import expert_bytes_per_device

    t0 = time.perf_counter()
    llm = LLM(run["path"], tensor_parallel_size=run["tensor_parallel_size"], **run["engine"])
    build_s = time.perf_counter() - t0
    prompts, max_tokens = run["prompts"], run["max_tokens"]
    greedy = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False
    )
    seeded = []
    if run.get("sampling_seeds"):
        params = [
            SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=s, max_tokens=max_tokens)
            for s in run["sampling_seeds"]
        ]
        seeded = llm.generate(prompts[: len(params)], params, use_tqdm=False)
    # The prompt-logprobs program reads the step's hidden states (sharded model, one
    # replicated chunk): each prompt token's logprob and rank.
    scored = llm.generate(
        prompts[:1], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False
    )[0]
    prompt_logprobs = [
        [lp[t].logprob, lp[t].rank]
        for lp, t in zip(scored.prompt_logprobs[1:], scored.prompt_token_ids[1:])
    ]
    activations = (
        run_activations(llm, prompts[0]) if run["engine"].get("hidden_state_layers") else {}
    )
    stats = llm.get_stats()
    kv = llm.engine.kv_cache_manager
    kv.check_invariants()
    runner = llm.engine.runner
    return {
        "greedy": [o.outputs[0].token_ids for o in greedy],
        "seeded": [o.outputs[0].token_ids for o in seeded],
        "prompt_logprobs": prompt_logprobs,
        "activations": activations,
        "stats": {
            **stats,
            "all_blocks_free": kv.num_free_blocks == kv.num_usable_blocks,
            "num_kv_heads_per_device": int(
                runner.kv_caches[0][0].addressable_shards[0].data.shape[1]
            ),
            "replicated_fallbacks": [] if runner.tp is None else runner.tp.replicated_fallbacks,
            "expert_bytes_per_device": expert_bytes_per_device(runner.weights),
            "build_s": build_s,
        },
    }


def run_activations(llm: Any, prompt: list[int]) -> dict[str, Any]:
    """With the engine's activation options (docs/research_integration.md, "Activations"):
    a steered request and a prompt-embeddings request, both capturing; their tokens and
    {layer: rows} (prompt then generated) as lists."""
    import numpy as np

    from paged_jax.sampling_params import SamplingParams

    engine = llm.engine
    rng = np.random.default_rng(0)
    hidden = engine.steering.hidden_size
    vectors = {layer: rng.normal(0, 1, hidden).tolist() for layer in engine.steering.layers}
    rows = rng.normal(0, 1, (9, hidden)).astype(np.float32)
    params = dict(temperature=0.0, max_tokens=4, ignore_eos=True, return_hidden_states=True)
    outs = llm.generate(
        [prompt, {"prompt_embeds": rows}],
        [SamplingParams(**params, steering_vectors=vectors), SamplingParams(**params)],
        use_tqdm=False,
    )
    return {
        name: {
            "tokens": out.outputs[0].token_ids,
            "rows": {
                str(layer): np.concatenate(
                    [out.prompt_hidden_states[layer], out.outputs[0].hidden_states[layer]]
                ).tolist()
                for layer in out.prompt_hidden_states
            },
        }
        for name, out in (("steered", outs[0]), ("embeds", outs[1]))
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    import jax

    with open(argv[0]) as f:
        runs = json.load(f)
    out = {run["name"]: {**run_one(run), "devices": jax.device_count()} for run in runs}
    with open(argv[1], "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
