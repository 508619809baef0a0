"""One GPU cell: the decode kernel on a bf16 cache vs fp8 caches (half the bytes per token).

    python scripts/bench_fp8_decode.py --output gpu_results/bench_fp8_decode.json

Llama-3-8B-like heads (32 q / 8 kv, head_dim 128, block 16), batch x context from the
flags (default 64 x 2048). For each cache dtype: median time of the Pallas decode kernel
(many calls per sync, so dispatch does not dominate), the K/V bytes it must read, achieved
GB/s and the fraction of the device's peak, and max |out - bf16 out|. The JSON is written
after every cell. Without a GPU it runs a tiny smoke of the same code on the pure-JAX
reference and says so (no timing claims). Called by scripts/gpu_checks.sh.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

import pallas_kernels as pk
from pallas_kernels import reference
from pallas_kernels.quantization import quantize

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
CACHES = {"bfloat16": jnp.bfloat16, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
PEAK_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0}


def _peak(kind: str) -> float | None:
    return next((v for k, v in PEAK_GBPS.items() if k.lower() in kind.lower()), None)


def make_inputs(batch: int, context: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    per_seq = pl.cdiv(context, BLOCK_SIZE)
    num_blocks = batch * per_seq + 1
    tables = rng.permutation(np.arange(1, num_blocks))[: batch * per_seq]
    tables = tables.reshape(batch, per_seq).astype(np.int32)
    shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    key = jax.random.key(seed)
    k1, k2, k3 = jax.random.split(key, 3)
    k = jax.random.normal(k1, shape, jnp.float32)
    v = jax.random.normal(k2, shape, jnp.float32)
    q = jax.random.normal(k3, (batch, NUM_Q_HEADS, HEAD_DIM), jnp.bfloat16)
    lens = np.full(batch, context, np.int32)
    return q, k, v, jnp.asarray(tables), jnp.asarray(lens)


def time_calls(fn, reps: int) -> float:
    """Median seconds per call over 5 rounds of `reps` back-to-back calls, one sync each."""
    jax.block_until_ready(fn())
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        out = None
        for _ in range(reps):
            out = fn()
        jax.block_until_ready(out)
        rounds.append((time.perf_counter() - start) / reps)
    return float(np.median(rounds))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--output", type=pathlib.Path, default=pathlib.Path("bench_fp8_decode.json"))
    args = p.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    batch, context = (args.batch, args.context) if gpu else (2, 64)
    device = str(getattr(jax.devices()[0], "device_kind", jax.devices()[0]))
    report = {
        "command": "python scripts/bench_fp8_decode.py " + " ".join(sys.argv[1:]),
        "device": device,
        "jax": jax.__version__,
        "gpu": gpu,
        "shape": dict(
            batch=batch,
            context=context,
            q_heads=NUM_Q_HEADS,
            kv_heads=NUM_KV_HEADS,
            head_dim=HEAD_DIM,
            block_size=BLOCK_SIZE,
        ),  # fmt: skip
        "cells": {},
    }
    if not gpu:
        report["note"] = "no GPU: tiny smoke on the pure-JAX reference, times are not kernel times"
    q, k32, v32, tables, lens = make_inputs(batch, context)
    attend = pk.paged_attention if gpu else reference.paged_attention
    peak = _peak(device)
    base = None
    for name, dtype in CACHES.items():
        fp8 = name.startswith("fp8")
        # Per-tensor scales as a calibration would pick them: amax / 200 (vLLM's constant).
        ks = float(jnp.max(jnp.abs(k32))) / 200 if fp8 else None
        vs = float(jnp.max(jnp.abs(v32))) / 200 if fp8 else None
        if fp8:
            k = quantize(k32, ks, dtype)
            v = quantize(v32, vs, dtype)
            scales = dict(k_scale=jnp.float32(ks), v_scale=jnp.float32(vs))
        else:
            k, v, scales = k32.astype(dtype), v32.astype(dtype), {}
        fn = jax.jit(lambda q, k, v, t, n, s: attend(q, k, v, t, n, scale=HEAD_DIM**-0.5, **s))
        out = fn(q, k, v, tables, lens, scales)
        if base is None:
            base = out
        seconds = time_calls(functools.partial(fn, q, k, v, tables, lens, scales), args.reps)
        kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * jnp.dtype(dtype).itemsize
        gbps = kv_bytes / seconds / 1e9
        report["cells"][name] = {
            "seconds": seconds,
            "kv_bytes": kv_bytes,
            "gbps": gbps,
            "fraction_of_peak": None if peak is None else gbps / peak,
            "max_abs_diff_vs_bf16": float(
                jnp.max(jnp.abs(out.astype(jnp.float32) - base.astype(jnp.float32)))
            ),
        }
        print(f"{name:9s} {seconds * 1e6:9.1f} us  {gbps:8.1f} GB/s  {report['cells'][name]}")
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n")  # after every cell
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
