"""Mixture of experts on this machine: step time vs a dense model of the same active
parameters, the routing overhead per step, expert-parallel bytes and collectives.

    python scripts/bench_moe.py --output docs/moe_cpu.json
    python scripts/bench_moe.py --published --output docs/moe_tp_memory.json

Random-weight models (nothing is downloaded), built in memory, reference attention:
- MoE: a Mixtral of E experts, top-k, expert width F, once per grouped matmul
  (moe_tiled: the tiled batched matmul; moe_ragged_dot: jax.lax.ragged_dot; same
  weights); dense: a Llama with the same attention and an MLP of width k * F, so all
  run the same matmul FLOPs per token in an ideal grouped matmul. All serve the same
  trace (fixed prompts, greedy, ignore_eos) through LLM.generate after warm-up,
  interleaved over rounds; the figure is wall time over engine steps (median and range
  over the rounds).
- Routing overhead: the sort (argsort + bincount), the row gather and the weighted
  scatter-add of one MoE layer, jitted alone at each bucket of the trace, times the
  number of MoE layers (the tiled path adds its padded layout: tiled_layout_s); beside
  it the whole expert block with each grouped matmul.
- Expert parallelism (on forced CPU devices): per-device bytes of the stacked expert
  weights at N = 2, 4 against the total, and the collectives in the compiled TP step of
  the MoE model and of the dense model (the HLO's all-reduce / all-to-all / all-gather /
  reduce-scatter counts).
- --published: per-device weight and expert bytes of released MoE shapes at N = 1, 2, 4,
  8, from abstract models (nothing allocated), split by the families' partition rules
  exactly as the loader places them; only this section runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import sys
import time

from paged_jax.baselines.json_report import write_json_atomic

# config.json fields of released checkpoints (the Hugging Face hub's).
PUBLISHED_MOE_CONFIGS = {
    "Mixtral-8x7B": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8,
                         num_local_experts=8, num_experts_per_tok=2,
                         max_position_embeddings=32768),
    "Qwen1.5-MoE-A2.7B": dict(model_type="qwen2_moe", vocab_size=151936, hidden_size=2048,
                              intermediate_size=5632, moe_intermediate_size=1408,
                              shared_expert_intermediate_size=5632, num_hidden_layers=24,
                              num_attention_heads=16, num_key_value_heads=16,
                              num_experts=60, num_experts_per_tok=4,
                              max_position_embeddings=8192),
    "Qwen3-30B-A3B": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, head_dim=128,
                          num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, max_position_embeddings=40960),
}  # fmt: skip
COLLECTIVES = ("all-reduce", "all-to-all", "all-gather", "reduce-scatter", "collective-permute")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-width", type=int, default=256)
    p.add_argument("--prompts", type=int, default=8, help="prompts in the trace")
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--devices", default="2,4", help="expert-parallel sizes to measure")
    p.add_argument("--published", action="store_true", help="released shapes' bytes only")
    p.add_argument("--output", default="bench_results/moe.json")
    return p.parse_args(argv)


def hf_configs(args: argparse.Namespace) -> tuple[dict, dict]:
    """(Mixtral config.json dict, Llama config.json dict) of equal active parameters."""
    common = dict(
        vocab_size=512,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
    )
    moe = dict(
        common,
        intermediate_size=args.expert_width,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
    )
    dense = dict(common, intermediate_size=args.top_k * args.expert_width)
    return moe, dense


def build(family: str, hf: dict):
    from flax import nnx

    from paged_jax.models.registry import MODEL_CLASSES

    cls = MODEL_CLASSES[family]
    config = cls.config_from_hf(dict(hf, model_type=family), {}, "float32")
    return cls(config, rngs=nnx.Rngs(0), attention_backend="reference")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        block_size=16,
        max_num_seqs=args.prompts,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.prompt_len + args.max_tokens + 16,
        attention_backend="reference",
    )


def trace(args: argparse.Namespace) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(3, 512, args.prompt_len).tolist() for _ in range(args.prompts)]


def time_trace(llm, prompts, params) -> dict:
    steps0 = llm.get_stats()["num_steps"]
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    steps = llm.get_stats()["num_steps"] - steps0
    return dict(wall_s=wall, steps=steps, step_s=wall / steps)


def routing_overhead(model, buckets: list[int], repeats: int = 50) -> dict:
    """Per bucket: seconds of sort + gather + scatter of one MoE layer, and of the block."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from paged_jax.models.moe import (
        EXPERT_MATMULS,
        combine_expert_outputs,
        route,
        set_expert_matmul,
        sort_by_expert,
        tile_rows_and_count,
        tiled_layout,
    )

    block = model.layers[0].mlp
    moe = model.config.moe
    e, k, d = moe.num_experts, moe.num_experts_per_tok, model.config.hidden_size

    @jax.jit
    def routing_only(x, weights, experts):
        plan = sort_by_expert(experts, e)
        rows = x[plan.tokens]  # the gather; the expert matmuls would read these rows
        return combine_expert_outputs(rows, weights, plan, x.shape[0])

    @jax.jit
    def layout_only(experts):
        n = experts.size
        m, tiles = tile_rows_and_count(n, e)
        return tiled_layout(sort_by_expert(experts, e).group_sizes, n, m, tiles)

    from flax import nnx

    wholes = {}
    for matmul in EXPERT_MATMULS:
        set_expert_matmul(block, matmul)
        graphdef, state = nnx.split(block)
        wholes[matmul] = jax.jit(lambda state, x, g=graphdef: nnx.merge(g, state)(x))

    def median_s(fn, *a) -> float:
        jax.block_until_ready(fn(*a))
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            jax.block_until_ready(fn(*a))
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    out = {}
    rng = np.random.default_rng(0)
    for t in buckets:
        x = jnp.asarray(rng.normal(size=(t, d)), jnp.float32)
        weights, experts = route(block.router(x), k, norm_topk_prob=True, weight_dtype="float32")
        out[t] = dict(
            routing_s_per_layer=median_s(routing_only, x, weights, experts),
            tiled_layout_s_per_layer=median_s(layout_only, experts),
            **{f"moe_block_{mm}_s_per_layer": median_s(fn, state, x) for mm, fn in wholes.items()},
        )
    return out


def expert_parallel(moe_model, dense_model, sizes: list[int], args: argparse.Namespace) -> dict:
    """Per N: expert bytes per device vs total, and the TP step's collectives (MoE, dense)."""
    from flax import nnx

    from paged_jax.config import EngineConfig
    from paged_jax.worker.input_batch import InputBatch
    from paged_jax.worker.runner import Runner
    from paged_jax.worker.sharding import expert_bytes_per_device

    total = expert_bytes_per_device(nnx.state(moe_model))
    out = {"expert_bytes_total": total}
    for n in sizes:
        row = {}
        for name, model in (("moe", moe_model), ("dense", dense_model)):
            config = EngineConfig(
                max_num_seqs=16,
                max_num_batched_tokens=64,
                max_model_len=256,
                num_kv_blocks=64,
                tensor_parallel_size=n,
                attention_backend="reference",
            )
            runner = Runner(model, config)
            batch = InputBatch(config, kv_cache_groups=model.kv_cache_groups())
            step = batch.dummy_step_input(64, 16)
            hlo = runner.jitted_step.lower(*runner.step_args(step)).compile().as_text()
            # Count op instructions ("= f32[...] all-reduce(" or async "-start(") only.
            counts = {c: len(re.findall(rf"\s{c}(?:-start)?\(", hlo)) for c in COLLECTIVES}
            row[f"{name}_collectives"] = {c: v for c, v in counts.items() if v}
            if name == "moe":
                per_device = expert_bytes_per_device(runner.weights)
                row["expert_bytes_per_device"] = per_device
                row["expert_fraction_of_total"] = round(per_device / total, 4)
                row["within_5pct_of_1_over_n"] = abs(per_device * n / total - 1) <= 0.05
        out[n] = row
        print(json.dumps({"devices": n, **row}), flush=True)
    return out


def published_bytes(sizes: list[int], dtype: str = "bfloat16") -> list[dict]:
    """Per (released model, N): weight and expert bytes per device, from abstract models."""
    from flax import nnx

    from paged_jax.models import model_class_for
    from paged_jax.models.loader import abstract_model
    from paged_jax.models.partitioning import per_device_param_bytes, tensor_parallel_config

    rows = []
    for name, hf in PUBLISHED_MOE_CONFIGS.items():
        cls = model_class_for(hf)
        config = cls.config_from_hf(hf, {}, dtype)
        for n in sizes:
            try:
                tp_config = tensor_parallel_config(config, n)
            except ValueError as err:  # experts or heads that do not split whole
                rows.append(dict(model=name, tensor_parallel_size=n, skipped=str(err)))
                continue
            _, state = abstract_model(cls, tp_config, "reference")
            shapes = [
                (path, tuple(v.get_value().shape), v.get_value().dtype.itemsize)
                for path, v in nnx.to_flat_state(state)
            ]
            experts = [s for s in shapes if "experts" in map(str, s[0])]
            total_experts = sum(math.prod(shape) * size for _, shape, size in experts)
            per_device = per_device_param_bytes(experts, cls.partition_rules, n)
            rows.append(
                dict(
                    model=name,
                    tensor_parallel_size=n,
                    num_params=sum(math.prod(shape) for _, shape, _ in shapes),
                    weight_bytes_per_device=per_device_param_bytes(shapes, cls.partition_rules, n),
                    expert_bytes_total=total_experts,
                    expert_bytes_per_device=per_device,
                    expert_fraction=round(per_device / total_experts, 6),
                )
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.published:
        rows = published_bytes([1, 2, 4, 8])
        command = "python scripts/bench_moe.py " + " ".join(sys.argv[1:] if argv is None else argv)
        out = write_json_atomic(args.output, dict(command=command, dtype="bfloat16", rows=rows))
        print(f"wrote {out}")
        return 0
    sizes = [int(n) for n in args.devices.split(",") if n]
    flags = os.environ.get("XLA_FLAGS", "")
    if sizes and "force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={max(sizes)}"
    import jax

    from paged_jax import LLM, SamplingParams

    moe_hf, dense_hf = hf_configs(args)
    prompts = trace(args)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    from paged_jax.models.moe import set_expert_matmul

    llms = {}
    for matmul in ("tiled", "ragged_dot"):
        model = build("mixtral", moe_hf)  # the same seed: the same weights
        set_expert_matmul(model, matmul)
        llms[f"moe_{matmul}"] = LLM(model, **engine_kwargs(args))
    llms["dense"] = LLM(build("llama", dense_hf), **engine_kwargs(args))
    runs: dict[str, list[dict]] = {name: [] for name in llms}
    for _ in range(args.rounds):
        for name, llm in llms.items():
            runs[name].append(time_trace(llm, prompts, params))
    timing = {}
    for name, samples in runs.items():
        steps = [s["step_s"] for s in samples]
        timing[name] = dict(
            step_median_s=round(statistics.median(steps), 5),
            step_range_s=[round(min(steps), 5), round(max(steps), 5)],
            steps_per_trace=samples[0]["steps"],
            compiles_after_warmup=llms[name].get_stats()["num_compiles_after_warmup"],
        )
    for name in ("moe_tiled", "moe_ragged_dot"):
        timing[f"{name}_over_dense_step"] = round(
            timing[name]["step_median_s"] / timing["dense"]["step_median_s"], 3
        )
    timing["ragged_dot_over_tiled_step"] = round(
        timing["moe_ragged_dot"]["step_median_s"] / timing["moe_tiled"]["step_median_s"], 3
    )
    print(json.dumps(timing), flush=True)
    moe_model = build("mixtral", moe_hf)
    buckets = sorted({16, args.max_num_batched_tokens})
    routing = routing_overhead(moe_model, buckets)
    for row in routing.values():
        row["routing_s_per_step"] = row["routing_s_per_layer"] * args.layers
        for mm in ("tiled", "ragged_dot"):
            block = row[f"moe_block_{mm}_s_per_layer"]
            row[f"moe_blocks_{mm}_s_per_step"] = block * args.layers
            extra = row["tiled_layout_s_per_layer"] if mm == "tiled" else 0.0
            row[f"routing_share_of_moe_blocks_{mm}"] = round(
                (row["routing_s_per_layer"] + extra) / block, 3
            )
    print(json.dumps(routing), flush=True)
    ep = expert_parallel(moe_model, build("llama", dense_hf), sizes, args) if sizes else {}
    n_active = args.top_k * args.expert_width
    report = dict(
        command="python scripts/bench_moe.py " + " ".join(sys.argv[1:] if argv is None else argv),
        models=dict(
            moe=dict(family="mixtral", **moe_hf),
            dense=dict(family="llama", **dense_hf),
            note=f"dense MLP width {n_active} = top_k x expert width: equal active MLP params",
        ),
        trace=dict(
            prompts=args.prompts,
            prompt_len=args.prompt_len,
            max_tokens=args.max_tokens,
            max_num_batched_tokens=args.max_num_batched_tokens,
        ),
        backend=jax.default_backend(),
        jax_version=jax.__version__,
        machine=dict(
            platform=platform.platform(),
            cpus=os.cpu_count(),
            loadavg_1min_at_end=round(os.getloadavg()[0], 2),
        ),
        step_time=timing,
        routing_overhead_by_bucket=routing,
        expert_parallel=ep,
    )
    out = write_json_atomic(args.output, report)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
