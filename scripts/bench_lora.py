"""Multi-LoRA cost: one batch spread over 4 adapters of rank 16 against the base alone.

    python scripts/bench_lora.py --output docs/lora_benchmark.json
    python scripts/bench_lora.py --model-preset demo --output docs/lora_benchmark_demo.json

On a random-weight Llama (nothing is downloaded: --model-preset 80m, the 80M-class model
of scripts/bench_engine.py, or demo, the built-in demo model), in one process, two engines of the same settings: "base" without LoRA and
"lora" with enable_lora=True, max_loras=4, max_lora_rank=16. Each round generates the same
prompts (token ids, greedy, fixed lengths, prefix caching off) as (1) the base engine,
(2) the LoRA engine with every prompt on the base model, (3) the LoRA engine with the
prompts spread round-robin over 4 all-linear rank-16 adapters (written with numpy, PEFT's
layout). Rounds interleave (1, 2, 3, 1, 2, 3, ...); output tokens/s is reported per run,
medians and [min, max], and the ratios of medians. Also the device bytes one resident
adapter takes (its slot of every stack). Prints and saves JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

from paged_jax.baselines.json_report import write_json_atomic

NUM_ADAPTERS = 4
RANK = 16


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model-preset",
        choices=("demo", "80m"),
        default="80m",
        help="demo: the built-in demo Llama (hidden 256, 4 layers); 80m: the 80M-class "
        "random Llama of scripts/bench_engine.py (hidden 768, 8 layers, vocab 32000)",
    )
    p.add_argument("--prompts", type=int, default=32, help="prompts per run")
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--output", default="bench_results/lora_benchmark.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax
    import numpy as np

    from paged_jax import LLM, LoRARequest, SamplingParams
    from paged_jax.entrypoints.demo import DEMO_CONFIG, ensure_demo_model
    from paged_jax.testing.tiny_lora import ALL_LINEAR_TARGETS, write_numpy_peft_adapter

    work = pathlib.Path(tempfile.mkdtemp(prefix="bench_lora_"))
    if args.model_preset == "demo":
        model_dir, c = ensure_demo_model(work / "cache"), dict(DEMO_CONFIG)
    else:
        from paged_jax.baselines.hf_generate import MODEL_PRESETS, build_random_llama

        model_dir = build_random_llama(work / "m80", preset=args.model_preset)
        c = dict(MODEL_PRESETS[args.model_preset])
    c.setdefault("head_dim", c["hidden_size"] // c["num_attention_heads"])
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    q_dim = c["num_attention_heads"] * c["head_dim"]
    kv_dim = c["num_key_value_heads"] * c["head_dim"]
    shapes = dict(
        q_proj=(hidden, q_dim), k_proj=(hidden, kv_dim), v_proj=(hidden, kv_dim),
        o_proj=(q_dim, hidden), gate_proj=(hidden, inter), up_proj=(hidden, inter),
        down_proj=(inter, hidden),
    )  # fmt: skip
    adapters = [
        LoRARequest(
            f"a{i}",
            i + 1,
            str(
                write_numpy_peft_adapter(
                    work / f"a{i}", num_layers=c["num_hidden_layers"], shapes=shapes,
                    rank=RANK, target_modules=ALL_LINEAR_TARGETS, seed=i,
                )
            ),
        )
        for i in range(NUM_ADAPTERS)
    ]  # fmt: skip
    engine = dict(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.prompt_len + args.max_tokens + 16,
        enable_prefix_caching=False,
        dtype="float32",
    )
    llms = {
        "base": LLM(str(model_dir), **engine),
        "lora": LLM(
            str(model_dir), enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=RANK, **engine
        ),
    }
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(3, c["vocab_size"], size=args.prompt_len).tolist() for _ in range(args.prompts)
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    spread = [adapters[i % NUM_ADAPTERS] for i in range(args.prompts)]
    runs = {
        "base_engine": ("base", None),
        "lora_engine_base_rows": ("lora", None),
        "lora_engine_4_adapters": ("lora", spread),
    }
    # One untimed pass of each run first: adapters read and swapped in, host caches warm.
    for which, loras in runs.values():
        llms[which].generate(prompts[:4], params, lora_request=loras and loras[:4], use_tqdm=False)
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, (which, loras) in runs.items():
            t0 = time.perf_counter()
            outs = llms[which].generate(prompts, params, lora_request=loras, use_tqdm=False)
            elapsed = time.perf_counter() - t0
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            samples[name].append(tokens / elapsed)
            print(
                json.dumps(dict(run=name, output_tokens_per_s=round(tokens / elapsed, 1))),
                flush=True,
            )
    medians = {name: statistics.median(v) for name, v in samples.items()}
    # Each round's runs ran back to back: their ratio shares the machine's load of the
    # moment, so the median of per-round ratios is the steadier figure on a busy machine.
    per_round = [a / b for a, b in zip(samples["lora_engine_4_adapters"], samples["base_engine"])]
    stats = llms["lora"].engine.get_stats()
    device = llms["lora"].engine.runner.lora
    report = dict(
        command="python scripts/bench_lora.py " + " ".join(sys.argv[1:] if argv is None else argv),
        model_preset=args.model_preset,
        model_config={k: c[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                        "num_hidden_layers", "num_attention_heads",
                                        "num_key_value_heads", "head_dim")},
        adapters=dict(count=NUM_ADAPTERS, rank=RANK, target_modules=list(ALL_LINEAR_TARGETS)),
        engine=dict(engine, max_loras=NUM_ADAPTERS, max_lora_rank=RANK),
        workload=dict(prompts=args.prompts, prompt_len=args.prompt_len,
                      max_tokens=args.max_tokens, rounds=args.rounds),
        output_tokens_per_s={
            name: dict(median=round(m, 1), range=[round(min(samples[name]), 1),
                                                  round(max(samples[name]), 1)])
            for name, m in medians.items()
        },
        ratio_4_adapters_over_base_engine_per_round=dict(
            median=round(statistics.median(per_round), 3),
            range=[round(min(per_round), 3), round(max(per_round), 3)],
        ),
        ratio_4_adapters_over_base_engine=round(
            medians["lora_engine_4_adapters"] / medians["base_engine"], 3
        ),
        ratio_4_adapters_over_lora_engine_base_rows=round(
            medians["lora_engine_4_adapters"] / medians["lora_engine_base_rows"], 3
        ),
        ratio_lora_engine_base_rows_over_base_engine=round(
            medians["lora_engine_base_rows"] / medians["base_engine"], 3
        ),
        device_bytes_per_resident_adapter=device.bytes_per_adapter,
        lora_stack_bytes_per_device=stats.get("lora_bytes_per_device"),
        weight_bytes_per_device=stats["weight_bytes_per_device"],
        num_compiles_after_warmup=stats["num_compiles_after_warmup"],
        adapter_loads=llms["lora"].engine.lora.slots.num_loads,
        backend=jax.default_backend(),
        jax_version=jax.__version__,
        machine=dict(platform=platform.platform(), cpus=os.cpu_count(),
                     loadavg_1min_at_end=round(os.getloadavg()[0], 2)),
        method="interleaved rounds (base engine, LoRA engine base rows, LoRA engine 4 "
        "adapters, ...); medians and [min, max] of output tokens/s per run; the ratio of "
        "medians and the median of per-round ratios",
    )  # fmt: skip
    print(json.dumps({k: report[k] for k in report if k.startswith(("ratio", "device"))}))
    out = write_json_atomic(args.output, report)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
