"""Where a paged engine step's time goes on this machine: per step kind and bucket.

Serves bench_engine's default trace (128 requests, 128 greedy tokens each) once with the
engine in sync mode, timing every jitted step from dispatch to its sampled tokens, and
groups the times by (decode-only or mixed, token bucket, sequence bucket). Then it times
the attention backend alone on one layer of a decode step shaped like the trace's
(128 sequences, contexts 150-450). Prints and saves JSON.

    python scripts/bench_step_profile.py --output docs/step_profile.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time


def _median_ms(times: list[float]) -> float:
    return round(1e3 * statistics.median(times), 3)


def profile_engine(args: argparse.Namespace, model) -> dict:
    from paged_jax.baselines.harness import PagedSystem
    from paged_jax.baselines.workload import WorkloadConfig, make_trace

    system = PagedSystem(
        model,
        budget_bytes=args.kv_budget_bytes,
        block_size=16,
        max_model_len=512,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        async_scheduling=False,
    )
    runner = system.engine.runner
    dispatch = runner.dispatch
    times: dict[tuple, list[float]] = collections.defaultdict(list)

    class _Done:
        def __init__(self, result):
            self._result = result

        def result(self):
            return self._result

    def timed(step, **kwargs):
        t0 = time.perf_counter()
        result = dispatch(step, **kwargs).result()
        kind = "decode" if step.attention.decode_only else "mixed"
        times[(kind, *step.bucket)].append(time.perf_counter() - t0)
        return _Done(result)

    runner.dispatch = timed
    trace = make_trace(
        WorkloadConfig(
            num_requests=128,
            input_median=128.0,
            input_sigma=0.8,
            input_max=384,
            output_median=128.0,
            output_sigma=0.0,
            output_min=4,
            output_max=128,
            vocab_size=int(model.config.vocab_size),
            seed=0,
        )
    )
    t0 = time.perf_counter()
    result = system.run(trace)
    wall = time.perf_counter() - t0
    rows = [
        {
            "kind": kind,
            "token_bucket": tokens,
            "seq_bucket": seqs,
            "steps": len(ts),
            "total_s": round(sum(ts), 3),
            "median_ms": _median_ms(ts),
        }
        for (kind, tokens, seqs), ts in sorted(times.items(), key=lambda kv: -sum(kv[1]))
    ]
    return {
        "wall_s": round(wall, 3),
        "tokens_per_s": round(result.tokens_per_s, 1),
        "warmup_s": round(system.warmup_s, 1),
        "step_time_total_s": round(sum(sum(ts) for ts in times.values()), 3),
        "by_step_kind": rows,
    }


def time_decode_attention(model, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pallas_kernels as pk

    cfg = model.config
    kv_heads = cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    from bench_kernels import BLOCK_SIZE, make_tables

    num_seqs, num_blocks = 128, 4096
    rng = np.random.default_rng(0)
    caches = [
        jnp.asarray(rng.standard_normal((num_blocks, kv_heads, BLOCK_SIZE, head_dim), np.float32))
        for _ in range(2)
    ]
    contexts = [int(c) for c in rng.integers(150, 450, num_seqs)]
    tables, seq_lens = make_tables(rng, contexts, num_blocks)
    q = jnp.asarray(rng.standard_normal((num_seqs, cfg.num_attention_heads, head_dim), np.float32))
    ops = pk.get_attention_ops("auto")
    fn = jax.jit(lambda q, t, s: ops.paged_attention(q, *caches, t, s, scale=head_dim**-0.5))
    fn(q, tables, seq_lens).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(q, tables, seq_lens).block_until_ready()
        times.append(time.perf_counter() - t0)
    kv_bytes = int(2 * int(jnp.sum(seq_lens)) * kv_heads * head_dim * 4)
    return {
        "backend": jax.default_backend(),
        "num_seqs": num_seqs,
        "context_tokens_mean": float(np.mean(np.asarray(seq_lens))),
        "median_ms_per_layer": _median_ms(times),
        "min_ms": round(1e3 * min(times), 3),
        "max_ms": round(1e3 * max(times), 3),
        "kv_bytes_read": kv_bytes,
        "effective_gb_per_s": round(kv_bytes / statistics.median(times) / 1e9, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-budget-bytes", type=int, default=128 << 20)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=9, help="timed decode-attention calls")
    parser.add_argument("--output", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)

    from paged_jax.baselines.hf_generate import build_random_llama
    from paged_jax.models import load_model

    with tempfile.TemporaryDirectory() as tmp:
        build_random_llama(tmp)
        model = load_model(tmp)
    report = {
        "command": "python scripts/bench_step_profile.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": {
            "cpu_count": os.cpu_count(),
            "loadavg_1min_at_start": round(os.getloadavg()[0], 2),
        },
        "engine": profile_engine(args, model),
        "decode_attention_one_layer": time_decode_attention(model, args.repeats),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
