"""Scan over layers vs unrolled on this machine: step compile time and step time, per depth.

    python scripts/bench_layer_scan.py --output docs/layer_scan_cpu.json

Builds random-weight Llamas (nothing is downloaded) on a Runner with the reference
attention, one step bucket, and for each depth measures, in one process, interleaved
(unrolled, scanned, unrolled, scanned, ...): the time to trace+lower and to compile the
jitted step, and the median time of a padding-only step of that bucket (every matmul runs;
attention has no context), repeated. Prints and saves JSON. A deviceless H200 compile of the
same comparison is `scripts/gpu_compile_check.py --only '^step-llama8b'`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

from paged_jax.baselines.json_report import write_json_atomic

MODELS = {
    # the demo model's shape (paged_jax.entrypoints.demo), at several depths
    "demo": dict(vocab_size=260, hidden_size=256, intermediate_size=688, num_attention_heads=4,
                 num_key_value_heads=2),
    # the 80M-class Llama of scripts/bench_engine.py --model-preset 80m
    "80m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                num_attention_heads=12, num_key_value_heads=4),
}  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="demo")
    p.add_argument("--layers", default="4,32", help="comma list of depths")
    p.add_argument("--tokens", type=int, default=256, help="the step's token bucket")
    p.add_argument("--seqs", type=int, default=64, help="the step's sequence bucket")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds per depth")
    p.add_argument("--steps", type=int, default=15, help="timed steps per round")
    p.add_argument("--output", default="bench_results/layer_scan.json")
    return p.parse_args(argv)


def measure(model_cfg: dict, layers: int, scan: bool, args: argparse.Namespace) -> dict:
    from flax import nnx

    from paged_jax.config import EngineConfig
    from paged_jax.models.llama import LlamaForCausalLM
    from paged_jax.worker.input_batch import InputBatch
    from paged_jax.worker.runner import Runner

    hf = dict(model_cfg, num_hidden_layers=layers, max_position_embeddings=1024)
    hf.update(rms_norm_eps=1e-5, rope_theta=10000.0)
    config = LlamaForCausalLM.config_from_hf(hf, {}, "float32")
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0), attention_backend="reference")
    engine_config = EngineConfig(
        max_num_seqs=args.seqs,
        max_num_batched_tokens=max(args.tokens, args.seqs),
        max_model_len=1024,
        num_kv_blocks=256,
        scan_layers=scan,
    )
    runner = Runner(model, engine_config)
    assert (runner.layer_scan is not None) == scan
    batch = InputBatch(engine_config, kv_cache_groups=model.kv_cache_groups())
    step = batch.dummy_step_input(args.tokens, args.seqs)
    t0 = time.perf_counter()
    lowered = runner.jitted_step.lower(*runner.step_args(step))
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    runner.execute(step)  # the jit's own compile (cached executable: not timed above)
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        runner.execute(step)
        times.append(time.perf_counter() - t)
    return dict(lower_s=t1 - t0, compile_s=t2 - t1, step_median_s=statistics.median(times))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax

    rows = []
    for layers in (int(x) for x in args.layers.split(",")):
        runs: dict[str, list[dict]] = {"unrolled": [], "scanned": []}
        for _ in range(args.rounds):
            for name, scan in (("unrolled", False), ("scanned", True)):
                runs[name].append(measure(MODELS[args.model], layers, scan, args))
        row = dict(layers=layers)
        for name, samples in runs.items():
            for key in ("lower_s", "compile_s", "step_median_s"):
                values = [s[key] for s in samples]
                row[f"{name}_{key}"] = round(statistics.median(values), 4)
                row[f"{name}_{key}_range"] = [round(min(values), 4), round(max(values), 4)]
        row["compile_ratio_scanned_over_unrolled"] = round(
            row["scanned_compile_s"] / row["unrolled_compile_s"], 3
        )
        row["step_ratio_scanned_over_unrolled"] = round(
            row["scanned_step_median_s"] / row["unrolled_step_median_s"], 3
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    report = dict(
        command="python scripts/bench_layer_scan.py " + " ".join(sys.argv[1:] if argv is None else argv),
        model=args.model,
        model_config=MODELS[args.model],
        bucket=dict(num_tokens=args.tokens, num_seqs=args.seqs),
        backend=jax.default_backend(),
        jax_version=jax.__version__,
        machine=dict(platform=platform.platform(), cpus=os.cpu_count(),
                     loadavg_1min_at_end=round(os.getloadavg()[0], 2)),
        method="medians over interleaved rounds (unrolled, scanned, ...); [min, max] beside",
        rows=rows,
    )  # fmt: skip
    out = write_json_atomic(args.output, report)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
