"""Benchmark the paged-attention kernels: time, achieved K/V bandwidth, fraction of peak.

On a GPU: decode at batch {1, 8, 64, 256} x context {512, 2k, 8k, 32k} and ragged
prefill+decode mixes, Llama-3-8B-like heads (32 q / 8 kv, head_dim 128, bf16, block 16),
side by side with the pure-JAX reference and (where importable) JAX's own Pallas GPU
paged_attention. On CPU it says it needs a GPU and runs a correctness smoke instead.

    python scripts/bench_kernels.py --output bench_results/bench_kernels.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
import warnings
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from pallas_kernels import reference

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = jnp.bfloat16
BATCHES = (1, 8, 64, 256)
CONTEXTS = (512, 2048, 8192, 32768)
# Ragged mixes: (name, [(context, new tokens), ...]).
MIXES = (
    ("4x512-prefill+60-decode@2k", [(512, 512)] * 4 + [(2048, 1)] * 60),
    ("chunk2k@8k+127-decode@4k", [(8192, 2048)] + [(4096, 1)] * 127),
    ("256-decode@2k", [(2048, 1)] * 256),
)
PEAK_GBPS = {
    "H200": 4800.0,
    "H100 SXM": 3350.0,
    "H100 PCIe": 2000.0,
    "H100": 3350.0,
    "A100": 2039.0,
}


def peak_gbps(device_kind: str) -> float | None:
    """Peak HBM bandwidth (GB/s) by device name; the longest matching key wins."""
    hits = [k for k in PEAK_GBPS if k.lower() in device_kind.lower()]
    return PEAK_GBPS[max(hits, key=len)] if hits else None


def time_fn(fn: Callable[[], object], warmup: int, reps: int) -> float:
    """Median wall seconds of fn() with block_until_ready, after warmup calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def kv_bytes(contexts: list[int]) -> int:
    """K and V bytes a kernel must read at least once: every context token, every KV head."""
    return sum(contexts) * NUM_KV_HEADS * HEAD_DIM * 2 * jnp.dtype(DTYPE).itemsize


def make_tables(rng, contexts: list[int], num_blocks: int):  # -> (i32[S, W], i32[S])
    """Block tables over a random permutation of the cache's blocks (scattered pages)."""
    needed = [-(-c // BLOCK_SIZE) for c in contexts]
    width = max(needed)
    width = -(-width // 16) * 16  # jax's kernel wants pages_per_seq % k_splits == 0
    ids = rng.permutation(np.arange(1, num_blocks))[: sum(needed)]
    tables = np.zeros((len(contexts), width), np.int32)
    cursor = 0
    for i, n in enumerate(needed):
        tables[i, :n] = ids[cursor : cursor + n]
        cursor += n
    return jnp.asarray(tables), jnp.asarray(np.asarray(contexts, np.int32))


def jax_paged_attention():
    """JAX's own Pallas GPU paged_attention, or None where it cannot be imported."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from jax.experimental.pallas.ops.gpu import paged_attention as mod
        return mod.paged_attention
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None


def record(rows, name, impl, fn, nbytes, args, peak) -> None:
    row = dict(case=name, impl=impl, kv_bytes=nbytes)
    try:
        seconds = time_fn(fn, args.warmup, args.reps)
        gbps = nbytes / seconds / 1e9
        row.update(ms=seconds * 1e3, gbps=gbps, frac_peak=gbps / peak if peak else None)
    except Exception as e:  # noqa: BLE001 - e.g. RESOURCE_EXHAUSTED on the big cells
        row.update(error=f"{type(e).__name__}: {str(e)[:200]}")
    rows.append(row)
    shown = f"{row['ms']:9.3f} ms {row['gbps']:8.1f} GB/s" if "ms" in row else row["error"][:60]
    frac = f" {100 * row['frac_peak']:5.1f}% of peak" if row.get("frac_peak") else ""
    print(f"{name:36s} {impl:10s} {shown}{frac}", flush=True)


def run_gpu(args) -> dict:
    device = jax.devices()[0]
    peak = args.peak_gbps or peak_gbps(device.device_kind)
    rng = np.random.default_rng(0)
    max_tokens = args.max_cache_tokens
    num_blocks = max_tokens // BLOCK_SIZE + 1
    key = jax.random.PRNGKey(0)
    shape = pk.kv_cache_shape(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = jax.random.normal(key, shape, DTYPE)
    v_cache = jax.random.normal(jax.random.fold_in(key, 1), shape, DTYPE)
    scale = HEAD_DIM**-0.5
    theirs = jax_paged_attention()
    # JAX's kernel wants head-major pages; the transposed copies cost memory, so they are
    # only made for caches that leave room (the H200 has ~141 GB).
    theirs_cache = None
    if theirs is not None and 4 * k_cache.nbytes < args.memory_gb * 1e9 * 0.8:
        theirs_cache = (k_cache.transpose(1, 0, 2, 3), v_cache.transpose(1, 0, 2, 3))
    rows: list[dict] = []
    for batch in BATCHES:
        for context in CONTEXTS:
            name = f"decode b={batch} ctx={context}"
            if batch * context > max_tokens:
                rows.append(dict(case=name, skipped=f"> --max-cache-tokens={max_tokens}"))
                continue
            tables, lens = make_tables(rng, [context] * batch, num_blocks)
            q = jax.random.normal(key, (batch, NUM_Q_HEADS, HEAD_DIM), DTYPE)
            nbytes = kv_bytes([context] * batch)
            call = (q, k_cache, v_cache, tables, lens)
            ops = {
                "pallas": partial(pk.paged_attention, *call, scale=scale),
                "reference": partial(reference.paged_attention, *call, scale=scale),
            }
            if theirs_cache is not None:  # it applies no softmax scale: pre-scale q
                q_scaled = (q.astype(jnp.float32) * scale).astype(DTYPE)
                ops["jax_pallas"] = partial(theirs, q_scaled, *theirs_cache, tables, lens)
            for impl, fn in ops.items():
                if impl == "reference" and 3 * nbytes > args.memory_gb * 1e9 * 0.3:
                    rows.append(dict(case=name, impl=impl, skipped="dense gather too large"))
                    continue
                record(rows, name, impl, fn, nbytes, args, peak)
    for mix_name, seqs in MIXES:
        contexts = [c for c, _ in seqs]
        q_lens = [n for _, n in seqs]
        if sum(contexts) > max_tokens:
            rows.append(
                dict(case=f"ragged {mix_name}", skipped=f"> --max-cache-tokens={max_tokens}")
            )
            continue
        tables, lens = make_tables(rng, contexts, num_blocks)
        qsl = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
        q = jax.random.normal(key, (int(sum(q_lens)), NUM_Q_HEADS, HEAD_DIM), DTYPE)
        call = (q, k_cache, v_cache, tables, lens, qsl)
        nbytes = kv_bytes(contexts)
        name = f"ragged {mix_name}"
        for impl, fn in {
            "pallas": partial(pk.ragged_paged_attention, *call, scale=scale),
            "reference": partial(reference.ragged_paged_attention, *call, scale=scale),
        }.items():
            record(rows, name, impl, fn, nbytes, args, peak)
    return dict(
        device=device.device_kind,
        peak_gbps=peak,
        jax_version=jax.__version__,
        jax_pallas_available=theirs is not None,
        shapes=dict(
            num_q_heads=NUM_Q_HEADS,
            num_kv_heads=NUM_KV_HEADS,
            head_dim=HEAD_DIM,
            block_size=BLOCK_SIZE,
            dtype=str(jnp.dtype(DTYPE)),
        ),
        timing=dict(warmup=args.warmup, reps=args.reps, statistic="median"),
        results=rows,
    )


def run_cpu_smoke() -> dict:
    """Kernel (interpret mode) vs reference on tiny shapes: a correctness smoke, not timing."""
    rng = np.random.default_rng(0)
    shape = pk.kv_cache_shape(12, 8, 2, 64)
    k_cache = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    v_cache = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    tables = jnp.asarray(rng.permutation(np.arange(1, 12))[:9].reshape(3, 3).astype(np.int32))
    lens = jnp.array([5, 24, 0], jnp.int32)
    q = jnp.asarray(rng.standard_normal((3, 8, 64)), jnp.float32)
    qsl = jnp.array([0, 5, 6, 6], jnp.int32)
    qr = jnp.asarray(rng.standard_normal((8, 8, 64)), jnp.float32)
    slots = jnp.array([9, -1, 40, 3], jnp.int32)
    new = jnp.asarray(rng.standard_normal((4, 2, 64)), jnp.float32)
    ids = (jnp.array([1, 2], jnp.int32), jnp.array([10, -1], jnp.int32))
    checks = {
        "paged_attention": lambda m, **kw: m.paged_attention(
            q, k_cache, v_cache, tables, lens, scale=0.125, **kw
        ),
        "ragged_paged_attention": lambda m, **kw: m.ragged_paged_attention(
            qr, k_cache, v_cache, tables, lens, qsl, scale=0.125, sliding_window=4, **kw
        ),
        "write_kv": lambda m, **kw: m.write_kv(k_cache, v_cache, new, new, slots, **kw),
        "copy_blocks": lambda m, **kw: m.copy_blocks(k_cache, v_cache, *ids, **kw),
    }
    smoke = {}
    for name, run in checks.items():
        got = jax.tree.leaves(run(pk, interpret=True))
        want = jax.tree.leaves(run(reference))
        err = max(float(jnp.max(jnp.abs(g - w))) for g, w in zip(got, want))
        smoke[name] = dict(max_abs_err=err, ok=err < 1e-4)
        print(f"smoke {name:24s} max |kernel - reference| = {err:.2e}", flush=True)
    return dict(device=jax.default_backend(), jax_version=jax.__version__, smoke=smoke, results=[])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="bench_results/bench_kernels.json")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--peak-gbps", type=float, default=None, help="override the device's peak")
    parser.add_argument(
        "--max-cache-tokens",
        type=int,
        default=256 * 32768,
        help="cache capacity in tokens; decode cells needing more are skipped",
    )
    parser.add_argument("--memory-gb", type=float, default=140.0, help="device memory budget")
    args = parser.parse_args(argv)
    if jax.default_backend() == "gpu":
        report = run_gpu(args)
    else:
        print("bench_kernels: timing needs an NVIDIA GPU; running a CPU correctness smoke instead.")
        report = run_cpu_smoke()
    out = pathlib.Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    ok = all(v["ok"] for v in report.get("smoke", {}).values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
