"""The cost of activations (issue 40): throughput with the options built, idle and capturing.

    python scripts/bench_activations.py --output docs/activations.json

Two engines over the same random-weight Llama (nothing is downloaded), built once each:
"base" without the options, "options" with hidden_state_layers=(L // 2,), steering_layers=
(L // 2,) and enable_prompt_embeds=True. Side by side in one process, interleaved per
round (the order rotated each round), the same greedy workload runs:
"options_idle" asks nothing (no request steers, embeds or captures), "options_capture"
has every request capture the one layer (SamplingParams.return_hidden_states). The
throughput is generated tokens per second of the whole generate() call (and per CPU
second of this process); ratios are of per-configuration medians over the rounds. Prints
and saves JSON.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

from paged_jax.baselines.json_report import write_json_atomic

DEMO_LLAMA = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    vocab_size=260,
    hidden_size=256,
    intermediate_size=688,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
)
COST_TARGETS = {"options_idle_vs_base": 0.98, "capture_one_layer_vs_base": 0.8}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--output", default="bench_results/activations.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax
    import numpy as np

    from paged_jax import LLM, SamplingParams
    from paged_jax.models.random_init import random_model

    hf = dict(DEMO_LLAMA, num_hidden_layers=args.layers)
    layer = args.layers // 2
    common = dict(
        block_size=16,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.prompt_tokens + args.output_tokens + 16,
    )
    engines = {
        "base": LLM(random_model(hf, seed=0), **common),
        "options": LLM(
            random_model(hf, seed=0),
            hidden_state_layers=(layer,),
            steering_layers=(layer,),
            enable_prompt_embeds=True,
            **common,
        ),
    }
    rng = np.random.default_rng(0)
    plain = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    asking = SamplingParams(
        temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True, return_hidden_states=True
    )
    runs = {
        "base": ("base", plain),
        "options_idle": ("options", plain),
        "options_capture": ("options", asking),
    }
    tps: dict[str, list[float]] = {name: [] for name in runs}
    cpu_tps: dict[str, list[float]] = {name: [] for name in runs}
    rows_checked = 0
    for r in range(args.rounds + 1):  # round 0 warms the host paths up, not counted
        # Fresh prompts per round (no prefix-cache hits across rounds), the same for all.
        prompts = [
            [int(t) for t in rng.integers(3, hf["vocab_size"], args.prompt_tokens)]
            for _ in range(args.requests)
        ]
        names = list(runs)
        names = names[r % len(names) :] + names[: r % len(names)]  # rotated: no fixed order
        for name in names:
            engine, params = runs[name]
            llm = engines[engine]
            t0, c0 = time.perf_counter(), time.process_time()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            cpu_seconds = time.process_time() - c0
            generated = sum(len(o.outputs[0].token_ids) for o in outs)
            if params.return_hidden_states:
                for o in outs:
                    assert o.prompt_hidden_states[layer].shape[0] == args.prompt_tokens
                    rows_checked += 1
            if r > 0:
                tps[name].append(generated / seconds)
                cpu_tps[name].append(generated / cpu_seconds)
            print(
                f"round {r} {name:>16}: {generated / seconds:9.1f} generated tok/s, "
                f"{generated / cpu_seconds:9.1f} per CPU second",
                flush=True,
            )
    median = {name: statistics.median(v) for name, v in tps.items()}
    cpu_median = {name: statistics.median(v) for name, v in cpu_tps.items()}

    def ratios_of(m: dict[str, float]) -> dict[str, float]:
        return {
            "options_idle_vs_base": m["options_idle"] / m["base"],
            "capture_one_layer_vs_base": m["options_capture"] / m["base"],
        }

    ratios = ratios_of(median)
    cpu_ratios = ratios_of(cpu_median)
    compiles = {name: llm.get_stats()["num_compiles_after_warmup"] for name, llm in engines.items()}
    report = dict(
        command="python scripts/bench_activations.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        jax_version=jax.__version__,
        backend=jax.default_backend(),
        machine=dict(platform=platform.platform(), cpus=os.cpu_count()),
        model=dict(hf, dtype="float32"),
        workload=dict(
            requests=args.requests,
            prompt_tokens=args.prompt_tokens,
            output_tokens=args.output_tokens,
            rounds=args.rounds,
            captured_layer=layer,
        ),
        engine=common,
        generated_tokens_per_s=tps,
        median_generated_tokens_per_s=median,
        ratios=ratios,
        # Tokens per CPU second of this process (all its threads): steadier than wall time
        # on a machine other jobs share.
        generated_tokens_per_cpu_s=cpu_tps,
        median_generated_tokens_per_cpu_s=cpu_median,
        cpu_ratios=cpu_ratios,
        targets=COST_TARGETS,
        meets_targets={k: ratios[k] >= v for k, v in COST_TARGETS.items()},
        meets_targets_cpu={k: cpu_ratios[k] >= v for k, v in COST_TARGETS.items()},
        num_compiles_after_warmup=compiles,
        captured_requests_checked=rows_checked,
    )
    for k, v in ratios.items():
        print(f"{k}: {v:.3f} wall, {cpu_ratios[k]:.3f} CPU (target >= {COST_TARGETS[k]})")
    print(f"compiles after warm-up: {compiles}")
    print(f"wrote {write_json_atomic(args.output, report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
