"""Benchmark paged decode: our Pallas kernel vs JAX's own Pallas paged_attention vs XLA.

On a GPU: decode at batch {1, 64, 256} x context {2k, 8k}, Llama-3-8B-like heads (32 q /
8 kv, head_dim 128, bf16, block 16), for three implementations:

* ``pallas``: ``pallas_kernels.paged_attention`` (this repo's decode kernel);
* ``jax_pallas``: ``jax.experimental.pallas.ops.gpu.paged_attention`` (JAX's Triton op,
  head-major pages, q pre-scaled since it applies no softmax scale);
* ``xla_gather``: ``pallas_kernels.reference.paged_attention`` (plain XLA: gather the
  pages through the block table in 128-key chunks, masked softmax).

Each cell is timed as one jitted ``fori_loop`` of N calls (N sized so the loop runs for
~30 ms) and divided by N, so small cells measure the device, not Python dispatch. The
figure of merit is K/V bytes read per second as a fraction of the H200's 4.8 TB/s. The
JSON (--output) is rewritten after every cell, so a run cut short keeps what it measured.
``--dry-run`` prints the plan and its time budget without touching a device. On CPU
(without --dry-run) it says it needs a GPU and runs a kernel-vs-reference smoke instead.

    python scripts/bench_kernels.py --output gpu_results/bench_kernels.json
    python scripts/bench_kernels.py --dry-run
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time
import warnings
from collections.abc import Callable
from functools import partial

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE_NAME = "bfloat16"
BATCHES = (1, 64, 256)
CONTEXTS = (2048, 8192)
IMPLS = ("pallas", "jax_pallas", "xla_gather")
H200_PEAK_GBPS = 4800.0
PEAK_GBPS = {
    "H200": H200_PEAK_GBPS,
    "H100 SXM": 3350.0,
    "H100 PCIe": 2000.0,
    "H100": 3350.0,
    "A100": 2039.0,
}
LOOP_SECONDS = 0.03  # device time of one timed loop
REPS = 3  # timed loops per cell (median)
# Planning figures for the dry run's budget (seconds): a compile per (cell, impl), the
# timed loops, and the one-off start (jax import, cache fill, head-major copy).
PLAN_COMPILE_S = 4.0
PLAN_START_S = 20.0


def cells() -> list[tuple[int, int, str]]:
    return [(b, c, impl) for b in BATCHES for c in CONTEXTS for impl in IMPLS]


def plan_seconds() -> float:
    per_cell = PLAN_COMPILE_S + (REPS + 1) * LOOP_SECONDS + 0.5
    return PLAN_START_S + len(cells()) * per_cell


def kv_bytes(contexts: list[int], itemsize: int = 2) -> int:
    """K and V bytes a decode call must read at least once: every context token, every KV head."""
    return sum(contexts) * NUM_KV_HEADS * HEAD_DIM * 2 * itemsize


def peak_gbps(device_kind: str) -> float | None:
    """Peak HBM bandwidth (GB/s) by device name; the longest matching key wins."""
    hits = [k for k in PEAK_GBPS if k.lower() in device_kind.lower()]
    return PEAK_GBPS[max(hits, key=len)] if hits else None


def loop_count(nbytes: int) -> int:
    """Calls per timed loop: ~LOOP_SECONDS of device time at ~3 TB/s, within [10, 2000]."""
    return int(min(2000, max(10, LOOP_SECONDS * 3e12 / max(nbytes, 1))))


def time_in_loop(attend: Callable, q, n: int) -> float:
    """Seconds per call of `attend(q)`, from one jitted fori_loop of n dependent calls.

    Each call's q depends on the previous output (a 1e-3 nudge), so XLA can neither
    hoist nor merge the calls; one dispatch and one sync per loop.
    """
    import jax

    def body(_, q):
        return q + (attend(q) * 1e-3).astype(q.dtype)

    looped = jax.jit(lambda q: jax.lax.fori_loop(0, n, body, q))
    jax.block_until_ready(looped(q))  # compile + warm up
    samples = []
    for _ in range(REPS):
        start = time.perf_counter()
        jax.block_until_ready(looped(q))
        samples.append((time.perf_counter() - start) / n)
    return sorted(samples)[len(samples) // 2]


def jax_paged_attention():
    """JAX's own Pallas GPU paged_attention, or None where it cannot be imported."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from jax.experimental.pallas.ops.gpu import paged_attention as mod
        return mod.paged_attention
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None


def make_tables(rng, contexts: list[int], num_blocks: int):  # -> (i32[S, W], i32[S])
    """Block tables over a random permutation of the cache's blocks (scattered pages)."""
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental.pallas import cdiv

    needed = [cdiv(c, BLOCK_SIZE) for c in contexts]
    width = cdiv(max(needed), 16) * 16  # JAX's kernel wants pages_per_seq % k_splits == 0
    ids = rng.permutation(np.arange(1, num_blocks))[: sum(needed)]
    tables = np.zeros((len(contexts), width), np.int32)
    cursor = 0
    for i, n in enumerate(needed):
        tables[i, :n] = ids[cursor : cursor + n]
        cursor += n
    return jnp.asarray(tables), jnp.asarray(np.asarray(contexts, np.int32))


class Report:
    """The JSON report, rewritten after every cell."""

    def __init__(self, path: pathlib.Path, header: dict):
        self.path = path
        self.data = dict(header, results=[])
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.flush()

    def add(self, row: dict) -> None:
        self.data["results"].append(row)
        self.flush()

    def flush(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2))
        tmp.replace(self.path)


def run_gpu(args) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pallas_kernels as pk
    from pallas_kernels import reference, roofline

    device = jax.devices()[0]
    peak = args.peak_gbps or peak_gbps(device.device_kind) or H200_PEAK_GBPS
    dtype = jnp.dtype(DTYPE_NAME)
    theirs = jax_paged_attention()
    report = Report(
        pathlib.Path(args.output),
        dict(
            device=device.device_kind,
            peak_gbps=peak,
            jax_version=jax.__version__,
            jax_pallas_available=theirs is not None,
            shapes=dict(
                num_q_heads=NUM_Q_HEADS,
                num_kv_heads=NUM_KV_HEADS,
                head_dim=HEAD_DIM,
                block_size=BLOCK_SIZE,
                dtype=DTYPE_NAME,
            ),
            timing=dict(
                method="jitted fori_loop of n dependent calls, seconds / n",
                loop_seconds=LOOP_SECONDS,
                reps=REPS,
                statistic="median",
            ),
        ),
    )
    rng = np.random.default_rng(0)
    num_blocks = max(BATCHES) * max(CONTEXTS) // BLOCK_SIZE + 1
    key = jax.random.PRNGKey(0)
    shape = pk.kv_cache_shape(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = jax.random.normal(key, shape, dtype)
    v_cache = jax.random.normal(jax.random.fold_in(key, 1), shape, dtype)
    theirs_cache = None
    if theirs is not None:  # JAX's kernel wants head-major pages [kv, blocks, bs, d]
        theirs_cache = (k_cache.transpose(1, 0, 2, 3), v_cache.transpose(1, 0, 2, 3))
    scale = HEAD_DIM**-0.5
    deadline = time.monotonic() + args.time_limit
    for batch in BATCHES:
        for context in CONTEXTS:
            tables, lens = make_tables(rng, [context] * batch, num_blocks)
            q = jax.random.normal(key, (batch, NUM_Q_HEADS, HEAD_DIM), dtype)
            nbytes = kv_bytes([context] * batch, dtype.itemsize)
            # Every byte the call must move (K/V, q, output, tables) at the device's peak.
            floor = roofline.decode_traffic(
                [context] * batch,
                num_q_heads=NUM_Q_HEADS,
                num_kv_heads=NUM_KV_HEADS,
                head_dim=HEAD_DIM,
                block_size=BLOCK_SIZE,
                cache_itemsize=dtype.itemsize,
                q_itemsize=dtype.itemsize,
            )
            fns = {
                "pallas": partial(
                    lambda q, t, s: pk.paged_attention(q, k_cache, v_cache, t, s, scale=scale),
                    t=tables,
                    s=lens,
                ),
                "xla_gather": partial(
                    lambda q, t, s: reference.paged_attention(
                        q, k_cache, v_cache, t, s, scale=scale
                    ),
                    t=tables,
                    s=lens,
                ),
            }
            if theirs_cache is not None:
                fns["jax_pallas"] = partial(
                    lambda q, t, s: theirs(q * scale, *theirs_cache, t, s), t=tables, s=lens
                )
            for impl in IMPLS:
                row = dict(batch=batch, context=context, impl=impl, kv_bytes=nbytes)
                row["roofline_us"] = floor.seconds(peak * 1e9) * 1e6
                if impl not in fns:
                    row["skipped"] = (
                        "jax.experimental.pallas.ops.gpu.paged_attention not importable"
                    )
                elif time.monotonic() > deadline:
                    row["skipped"] = f"--time-limit={args.time_limit}s reached"
                else:
                    n = loop_count(nbytes)
                    try:
                        seconds = time_in_loop(fns[impl], q, n)
                        gbps = nbytes / seconds / 1e9
                        row.update(calls_per_loop=n, us=seconds * 1e6, gbps=gbps)
                        row["frac_peak"] = gbps / peak
                        row["frac_roofline"] = floor.fraction(seconds, peak * 1e9)
                    except Exception as e:  # noqa: BLE001 - keep measuring the other cells
                        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                report.add(row)
                shown = (
                    f"{row['us']:9.1f} us {row['gbps']:7.0f} GB/s {100 * row['frac_peak']:5.1f}% "
                    f"(roofline {row['roofline_us']:.1f} us: {100 * row['frac_roofline']:5.1f}%)"
                    if "us" in row
                    else row.get("error", row.get("skipped", ""))[:70]
                )
                print(f"decode b={batch:<3d} ctx={context:<5d} {impl:10s} {shown}", flush=True)
    print(f"wrote {report.path}")
    return 0


def run_cpu_smoke(args) -> int:
    """Kernel (interpret mode) vs reference on tiny shapes: a correctness smoke, not timing."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pallas_kernels as pk
    from pallas_kernels import reference

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
    report = Report(
        pathlib.Path(args.output),
        dict(device=jax.default_backend(), jax_version=jax.__version__, smoke={}),
    )
    ok = True
    for name, run in checks.items():
        got = jax.tree.leaves(run(pk, interpret=True))
        want = jax.tree.leaves(run(reference))
        err = max(float(jnp.max(jnp.abs(g - w))) for g, w in zip(got, want))
        report.data["smoke"][name] = dict(max_abs_err=err, ok=err < 1e-4)
        report.flush()
        ok &= err < 1e-4
        print(f"smoke {name:24s} max |kernel - reference| = {err:.2e}", flush=True)
    print(f"wrote {report.path}")
    return 0 if ok else 1


def print_plan(args) -> None:
    print(
        f"bench_kernels plan: decode, {NUM_Q_HEADS} q / {NUM_KV_HEADS} kv heads, head_dim "
        f"{HEAD_DIM}, {DTYPE_NAME}, block {BLOCK_SIZE}; peak {H200_PEAK_GBPS:.0f} GB/s (H200)"
    )
    for batch, context, impl in cells():
        print(f"  cell decode b={batch} ctx={context} {impl}")
    print(
        f"bench_kernels budget: {len(cells())} cells x ~{PLAN_COMPILE_S:.0f} s compile + "
        f"{REPS + 1} loops x {LOOP_SECONDS * 1e3:.0f} ms, + {PLAN_START_S:.0f} s start = "
        f"~{plan_seconds():.0f} s (stops starting cells after --time-limit={args.time_limit} s)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="bench_results/bench_kernels.json")
    parser.add_argument("--peak-gbps", type=float, default=None, help="override the device's peak")
    parser.add_argument(
        "--time-limit", type=float, default=120.0, help="start no new cell after this many s"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the plan; touch no device")
    args = parser.parse_args(argv)
    if args.dry_run:
        print_plan(args)
        return 0
    import jax

    if jax.default_backend() == "gpu":
        return run_gpu(args)
    print("bench_kernels: timing needs an NVIDIA GPU; running a CPU correctness smoke instead.")
    return run_cpu_smoke(args)


if __name__ == "__main__":
    raise SystemExit(main())
