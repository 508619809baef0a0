"""Benchmark paged decode: our Pallas kernel vs JAX's own Pallas paged_attention vs XLA.

On a GPU: decode at batch {256, 64, 1} x context {8k, 2k}, biggest cell first (so a time
limit cuts the small cells), Llama-3-8B-like heads (32 q / 8 kv, head_dim 128, bf16,
block 16). Each cell times four implementations side by side in one process:

* ``pallas``: ``pallas_kernels.paged_attention`` (this repo's decode kernel, Triton);
* ``mosaic``: ``get_attention_ops("mosaic_gpu").paged_attention`` (this repo's Mosaic GPU
  decode kernel), skipped with the reason when it cannot run (jax < 0.12, pre-Hopper);
* ``jax_pallas``: ``jax.experimental.pallas.ops.gpu.paged_attention`` (JAX's Triton op,
  head-major pages, q pre-scaled since it applies no softmax scale), when importable;
* ``xla_gather``: ``pallas_kernels.reference.paged_attention`` (plain XLA: gather the
  pages through the block table in chunks, masked softmax).

Per implementation: median (min, max) microseconds per call, achieved bytes/s, and the
fraction of 4.8 TB/s (``pallas_kernels.roofline``: every byte the call must move, at
peak); per cell: the roofline time, the fraction the kernel's design predicts
(``roofline.predicted_decode_fraction``) and our Triton kernel's speedup over the other
three (``speedup_vs_mosaic``, ...). A second cell times a step's decode rows on its
decode-only path, its mixed path and the ragged kernel alone, per token (target: the mixed
path within 1.3x of decode-only). Every output is compared with the XLA reference
(relative L2 error); the script exits 1 when one disagrees or one of our kernels (Triton,
Mosaic) fails. Timing: one jitted ``fori_loop`` of n dependent calls (n traced, sized so
a loop runs ~30 ms; n = 1 also gives the output to compare), REPS timed loops after a
warm-up. The pool holds only the blocks the biggest cell needs,
capped under 4 GiB per array as a real pool is (int32 element offsets); past the cap a
few blocks are shared between sequences, and the JSON says how many. The JSON
(--output) is rewritten after every implementation. ``--dry-run`` prints the cell order
and its time budget without touching a device. On CPU (without --dry-run) it says it
needs a GPU and runs a kernel-vs-reference smoke instead. ``--cpu-attention`` times the
pure-JAX reference attention (the engine's path without a GPU) on the CPU backend at the
step profile's decode shapes, a long context, one sequence and a prefill chunk, as
effective GB/s beside this machine's numpy read bandwidth, with the implementation it
replaced (``previous_reference``) timed in the same rounds.

    python scripts/bench_kernels.py --output gpu_results/bench_kernels.json
    python scripts/bench_kernels.py --cpu-attention --output docs/cpu_attention.json
    python scripts/bench_kernels.py --dry-run
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
import warnings
from collections.abc import Callable

from pallas_kernels import roofline

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE_NAME = "bfloat16"
BATCHES = (256, 64, 1)  # biggest first
CONTEXTS = (8192, 2048)
IMPLS = ("pallas", "mosaic", "jax_pallas", "xla_gather")
MOSAIC_BACKEND = "mosaic_gpu"  # the ops the "mosaic" impl runs (tests: "mosaic_gpu_interpret")
H200_PEAK_GBPS = roofline.H200_BYTES_PER_S / 1e9
PEAK_GBPS = {
    "H200": H200_PEAK_GBPS,
    "H100 SXM": 3350.0,
    "H100 PCIe": 2000.0,
    "H100": 3350.0,
    "A100": 2039.0,
}
# A real pool's arrays stay under 4 GiB (2^31 16-bit elements: int32 offsets suffice).
MAX_POOL_ARRAY_BYTES = 2**32 - 1
MAX_REL_ERR = 2e-2  # bf16 inputs and outputs
LOOP_SECONDS = 0.03  # device time of one timed loop
REPS = 3  # timed loops per implementation (median)
# Planning figures for the dry run's budget (seconds): a compile per (cell, impl), the
# timed loops, and the one-off start (jax import, cache fill, head-major copy).
PLAN_COMPILE_S = 4.0
PLAN_START_S = 20.0


def cells() -> list[tuple[int, int]]:
    """(batch, context) in run order: the most bytes first."""
    return sorted(((b, c) for b in BATCHES for c in CONTEXTS), key=lambda bc: -bc[0] * bc[1])


def plan_seconds() -> float:
    per_impl = PLAN_COMPILE_S + (REPS + 2) * LOOP_SECONDS + 0.5
    return PLAN_START_S + len(cells()) * len(IMPLS) * per_impl


def kv_bytes(contexts: list[int], itemsize: int = 2) -> int:
    """K and V bytes a decode call must read at least once: every context token, every KV head."""
    return sum(contexts) * NUM_KV_HEADS * HEAD_DIM * 2 * itemsize


def block_bytes(itemsize: int = 2) -> int:
    return NUM_KV_HEADS * BLOCK_SIZE * HEAD_DIM * itemsize


def pool_blocks(itemsize: int = 2) -> tuple[int, int]:
    """(blocks in the pool, blocks the biggest cell must share): what the cells need plus
    the null block, capped so each cache array stays under 4 GiB."""
    needed = max(b * -(-c // BLOCK_SIZE) for b, c in cells()) + 1
    cap = MAX_POOL_ARRAY_BYTES // block_bytes(itemsize)
    return min(needed, cap), max(0, needed - cap)


def peak_gbps(device_kind: str) -> float | None:
    """Peak HBM bandwidth (GB/s) by device name; the longest matching key wins."""
    hits = [k for k in PEAK_GBPS if k.lower() in device_kind.lower()]
    return PEAK_GBPS[max(hits, key=len)] if hits else None


def loop_count(nbytes: int) -> int:
    """Calls per timed loop: ~LOOP_SECONDS of device time at ~3 TB/s, within [10, 2000]."""
    return int(min(2000, max(10, LOOP_SECONDS * 3e12 / max(nbytes, 1))))


def time_in_loop(attend: Callable, q, n: int) -> tuple[list[float], object]:
    """(seconds per call of each timed loop, attend(q)) from one jitted loop of n calls.

    n is traced, so one compile serves both the single call whose output is compared
    and the timed loops. Each call's q is nudged by the previous output (1e-3), so XLA
    can neither hoist nor merge the calls; one dispatch and one sync per loop.
    """
    import jax
    import jax.numpy as jnp

    def body(_, carry):
        x, _ = carry
        o = attend(x)
        return x + (o * 1e-3).astype(x.dtype), o

    looped = jax.jit(lambda x, n: jax.lax.fori_loop(0, n, body, (x, jnp.zeros_like(x))))
    _, out = jax.block_until_ready(looped(q, 1))  # compile, and the output to compare
    jax.block_until_ready(looped(q, n))  # warm-up
    samples = []
    for _ in range(REPS):
        start = time.perf_counter()
        jax.block_until_ready(looped(q, n))
        samples.append((time.perf_counter() - start) / n)
    return samples, out


def median(samples: list[float]) -> float:
    return sorted(samples)[len(samples) // 2]


def us_stats(samples: list[float]) -> dict:
    """Median, min and max of per-call seconds, in microseconds (the JSON's us fields)."""
    return dict(us=median(samples) * 1e6, us_min=min(samples) * 1e6, us_max=max(samples) * 1e6)


def rel_err(got, want) -> float:
    import numpy as np

    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def jax_paged_attention():
    """(JAX's own Pallas GPU paged_attention, None) or (None, why it cannot be imported)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from jax.experimental.pallas.ops.gpu import paged_attention as mod
        return mod.paged_attention, None
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        return None, f"{type(e).__name__}: {str(e)[:200]}"


def mosaic_paged_attention():
    """(the Mosaic GPU decode op of MOSAIC_BACKEND, None) or (None, why it cannot run here)."""
    import pallas_kernels as pk
    from pallas_kernels.backend import mosaic_unavailable

    why = mosaic_unavailable(MOSAIC_BACKEND)
    if why is not None:
        return None, why
    return pk.get_attention_ops(MOSAIC_BACKEND).paged_attention, None


def make_tables(rng, contexts: list[int], num_blocks: int):  # -> (i32[S, W], i32[S])
    """Block tables over a random permutation of the pool's blocks (scattered pages).

    Blocks are dealt from the permutation in order and the deal wraps around when the
    contexts need more than the pool holds (then a few blocks are shared).
    """
    import jax.numpy as jnp
    import numpy as np

    needed = [-(-c // BLOCK_SIZE) for c in contexts]
    width = -(-max(needed) // 16) * 16  # JAX's kernel wants pages_per_seq % k_splits == 0
    perm = rng.permutation(np.arange(1, num_blocks))
    ids = perm[np.arange(sum(needed)) % perm.size]
    tables = np.zeros((len(contexts), width), np.int32)
    cursor = 0
    for i, n in enumerate(needed):
        tables[i, :n] = ids[cursor : cursor + n]
        cursor += n
    return jnp.asarray(tables), jnp.asarray(np.asarray(contexts, np.int32))


class Report:
    """The JSON report, rewritten after every change."""

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
    from pallas_kernels import reference

    device = jax.devices()[0]
    peak = args.peak_gbps or peak_gbps(device.device_kind) or H200_PEAK_GBPS
    dtype = jnp.dtype(DTYPE_NAME)
    theirs, theirs_missing = jax_paged_attention()
    mosaic, mosaic_missing = mosaic_paged_attention()
    num_blocks, shared = pool_blocks(dtype.itemsize)
    report = Report(
        pathlib.Path(args.output),
        dict(
            device=device.device_kind,
            peak_gbps=peak,
            jax_version=jax.__version__,
            jax_pallas_available=theirs is not None,
            jax_pallas_missing=theirs_missing,
            mosaic_backend=MOSAIC_BACKEND,
            mosaic_available=mosaic is not None,
            mosaic_missing=mosaic_missing,
            shapes=dict(
                num_q_heads=NUM_Q_HEADS,
                num_kv_heads=NUM_KV_HEADS,
                head_dim=HEAD_DIM,
                block_size=BLOCK_SIZE,
                dtype=DTYPE_NAME,
            ),
            pool=dict(
                num_blocks=num_blocks,
                bytes_per_array=num_blocks * block_bytes(dtype.itemsize),
                blocks_shared_by_the_biggest_cell=shared,
            ),
            timing=dict(
                method="jitted fori_loop of n dependent calls (n traced), seconds / n",
                loop_seconds=LOOP_SECONDS,
                reps=REPS,
                statistic="median (min, max)",
            ),
            check=f"relative L2 error vs xla_gather <= {MAX_REL_ERR}",
            fraction="roofline seconds (every byte at peak_gbps) / measured seconds",
        ),
    )
    rng = np.random.default_rng(0)
    key = jax.random.PRNGKey(0)
    shape = pk.kv_cache_shape(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = jax.random.normal(key, shape, dtype)
    v_cache = jax.random.normal(jax.random.fold_in(key, 1), shape, dtype)
    theirs_cache = None
    if theirs is not None:  # JAX's kernel wants head-major pages [kv, blocks, bs, d]
        theirs_cache = (k_cache.transpose(1, 0, 2, 3), v_cache.transpose(1, 0, 2, 3))
    scale = HEAD_DIM**-0.5
    deadline = time.monotonic() + args.time_limit
    failed = False
    for batch, context in cells():
        tables, lens = make_tables(rng, [context] * batch, num_blocks)
        q = jax.random.normal(
            jax.random.fold_in(key, batch * context), (batch, NUM_Q_HEADS, HEAD_DIM), dtype
        )
        shape_kw = dict(
            num_q_heads=NUM_Q_HEADS,
            num_kv_heads=NUM_KV_HEADS,
            head_dim=HEAD_DIM,
            block_size=BLOCK_SIZE,
            cache_itemsize=dtype.itemsize,
            q_itemsize=dtype.itemsize,
        )
        # Every byte the call must move (K/V, q, output, tables) at the device's peak.
        floor = roofline.decode_traffic([context] * batch, **shape_kw)
        fns = {
            "pallas": lambda q, t=tables, s=lens: pk.paged_attention(
                q, k_cache, v_cache, t, s, scale=scale
            ),
            "xla_gather": lambda q, t=tables, s=lens: reference.paged_attention(
                q, k_cache, v_cache, t, s, scale=scale
            ),
        }
        if mosaic is not None:
            fns["mosaic"] = lambda q, t=tables, s=lens: mosaic(
                q, k_cache, v_cache, t, s, scale=scale
            )
        if theirs_cache is not None:
            fns["jax_pallas"] = lambda q, t=tables, s=lens: theirs(q * scale, *theirs_cache, t, s)
        model = roofline.predicted_decode_fraction([context] * batch, **shape_kw)
        row = dict(
            batch=batch,
            context=context,
            kv_bytes=kv_bytes([context] * batch, dtype.itemsize),
            roofline_bytes=floor.total_bytes,
            roofline_us=floor.seconds(peak * 1e9) * 1e6,
            predicted_fraction_of_peak=model["fraction"],
            predicted_balance=model["balance"],
            impls={},
        )
        report.add(row)
        outputs = {}
        # The reference first: every other output is compared with it.
        for impl in ("xla_gather", "pallas", "mosaic", "jax_pallas"):
            res: dict = {}
            row["impls"][impl] = res
            if impl not in fns:
                res["skipped"] = (
                    f"{MOSAIC_BACKEND}: {mosaic_missing}"
                    if impl == "mosaic"
                    else f"jax.experimental.pallas.ops.gpu.paged_attention: {theirs_missing}"
                )
            elif time.monotonic() > deadline:
                res["skipped"] = f"--time-limit={args.time_limit:.0f}s reached"
            else:
                n = loop_count(floor.total_bytes)
                try:
                    samples, outputs[impl] = time_in_loop(fns[impl], q, n)
                    seconds = median(samples)
                    res.update(
                        calls_per_loop=n,
                        **us_stats(samples),
                        gbps=floor.total_bytes / seconds / 1e9,
                        fraction_of_peak=floor.fraction(seconds, peak * 1e9),
                    )
                except Exception as e:  # noqa: BLE001 - keep measuring the other cells
                    res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    failed |= impl in ("pallas", "mosaic")  # ours; JAX's may be absent
            if impl in outputs and impl != "xla_gather" and "xla_gather" in outputs:
                res["rel_err_vs_xla_gather"] = err = rel_err(outputs[impl], outputs["xla_gather"])
                res["agrees"] = err <= MAX_REL_ERR
                failed |= not res["agrees"]
            report.flush()
            print(f"decode b={batch:<3d} ctx={context:<5d} {impl:10s} {shown(res)}", flush=True)
        ours = row["impls"]["pallas"].get("us")
        for other in ("mosaic", "jax_pallas", "xla_gather"):
            theirs_us = row["impls"][other].get("us")
            if ours and theirs_us:
                row[f"speedup_vs_{other}"] = theirs_us / ours
        report.flush()
        del outputs
        if (batch, context) == cells()[0] and time.monotonic() <= deadline:
            # Second: the step's decode rows (the mixed-path target), before small cells.
            failed |= mixed_path_cell(report, k_cache, v_cache, num_blocks, rng, key, peak)
    print(
        f"wrote {report.path}{'; FAILED: an output disagrees or our kernel failed' if failed else ''}"
    )
    return 1 if failed else 0


MIXED_CELL = (64, 2048)  # decode rows of a step, batch x context
STEP_BACKEND = "pallas"  # the ops the mixed-path cell runs (tests: "pallas_interpret")


def mixed_path_cell(report, k_cache, v_cache, num_blocks, rng, key, peak) -> bool:
    """Decode tokens of a step on its three paths, per token, side by side: the step's
    decode-only path, the mixed path (step_attention with decode_only=False: the decode
    kernel for the single-token rows plus a ragged launch with no query block), and the
    ragged kernel alone (each decode token a block_q-token query block). Target: the
    mixed path within 1.3x of decode-only per token. Returns True on a disagreement."""
    import jax
    import jax.numpy as jnp

    import pallas_kernels as pk

    batch, context = MIXED_CELL
    tables, lens = make_tables(rng, [context] * batch, num_blocks)
    qsl = jnp.arange(batch + 1, dtype=jnp.int32)
    q = jax.random.normal(jax.random.fold_in(key, 7), (batch, NUM_Q_HEADS, HEAD_DIM), k_cache.dtype)
    ops = pk.get_attention_ops(STEP_BACKEND)
    scale = HEAD_DIM**-0.5

    def step(decode_only):
        return lambda x: pk.step_attention(
            ops.for_step(), x, k_cache, v_cache, tables, lens, qsl, decode_only=decode_only,
            scale=scale,
        )  # fmt: skip

    fns = {
        "step_decode_only": step(True),
        "step_mixed_path": step(False),
        "ragged_kernel": lambda x: ops.ragged_paged_attention(
            x, k_cache, v_cache, tables, lens, qsl, scale=scale
        ),
    }
    row = dict(cell="decode rows of a step", batch=batch, context=context, impls={})
    report.add(row)
    outputs, failed = {}, False
    n = loop_count(kv_bytes([context] * batch, k_cache.dtype.itemsize))
    for impl, fn in fns.items():
        res: dict = {}
        row["impls"][impl] = res
        try:
            samples, outputs[impl] = time_in_loop(fn, q, n)
            res.update(**us_stats(samples), us_per_token=median(samples) * 1e6 / batch)
        except Exception as e:  # noqa: BLE001 - keep measuring the others
            res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            failed = True
        if impl in outputs and "step_decode_only" in outputs and impl != "step_decode_only":
            res["rel_err_vs_decode_only"] = err = rel_err(
                outputs[impl], outputs["step_decode_only"]
            )
            res["agrees"] = err <= MAX_REL_ERR
            failed |= not res["agrees"]
        report.flush()
        print(f"step rows b={batch} ctx={context} {impl:18s} {res.get('us', res.get('error'))}")
    base = row["impls"]["step_decode_only"].get("us")
    for impl in ("step_mixed_path", "ragged_kernel"):
        us = row["impls"][impl].get("us")
        if base and us:
            row[f"{impl}_per_token_vs_decode_only"] = us / base
    report.flush()
    return failed


def shown(res: dict) -> str:
    if "us" not in res:
        return res.get("error", res.get("skipped", ""))[:90]
    agree = ""
    if "rel_err_vs_xla_gather" in res:
        agree = f"  err {res['rel_err_vs_xla_gather']:.1e}{'' if res['agrees'] else ' DISAGREES'}"
    return (
        f"{res['us']:9.1f} us ({res['us_min']:.1f}-{res['us_max']:.1f}) {res['gbps']:7.0f} GB/s "
        f"{100 * res['fraction_of_peak']:5.1f}% of peak{agree}"
    )


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


# CPU attention cells: (name, num_seqs, (context low, high) drawn uniformly, or one value,
# q_len (1: decode through paged_attention; more: a prefill chunk per sequence through
# ragged_paged_attention), num_q_heads, num_kv_heads, head_dim). The first matches
# scripts/bench_step_profile.py's decode-attention timing (the bench Llama's heads, 128
# sequences, contexts 150-450); the others check a long context, one sequence and a
# prefill shape do not regress.
CPU_ATTENTION_CELLS = (
    ("decode_128x300", 128, (150, 450), 1, 8, 4, 32),
    ("decode_32x2k", 32, (2048, 2048), 1, 8, 4, 32),
    ("decode_1x4k", 1, (4096, 4096), 1, 8, 4, 32),
    ("prefill_4x512_q256", 4, (512, 512), 256, 8, 4, 32),
)
CPU_TINY_CELLS = (("tiny", 4, (20, 60), 1, 4, 2, 16), ("tiny_prefill", 2, (24, 40), 8, 4, 2, 16))
CPU_ATTENTION_DTYPES = ("float32", "bfloat16")
CPU_POOL_BLOCKS = 4096  # as bench_step_profile's pool
HOST_BANDWIDTH_BYTES = 256 << 20
# Each cell times these side by side, one call of each per round (rotated order).
CPU_IMPLS = ("reference", "previous")


def host_bandwidth(nbytes: int = HOST_BANDWIDTH_BYTES, repeats: int = 5) -> dict:
    """This machine's memory bandwidth from numpy on one thread: a sum (reads ``nbytes``)
    and a copy (reads and writes ``nbytes``, counted as 2 * nbytes), best of ``repeats``."""
    import numpy as np

    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    sums, copies = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        src.sum()
        sums.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        np.copyto(dst, src)
        copies.append(time.perf_counter() - t0)
    return dict(
        array_bytes=nbytes,
        method="numpy float32, one thread, best of repeats",
        repeats=repeats,
        sum_read_gb_per_s=round(nbytes / min(sums) / 1e9, 2),
        copy_read_plus_write_gb_per_s=round(2 * nbytes / min(copies) / 1e9, 2),
    )


def previous_reference():  # -> (paged_attention, ragged_paged_attention), jitted, scale static
    """The reference attention as it was before the CPU restructure, for the side-by-side
    only (no window, soft cap or fp8: the cells use none). Groups of 16 sequences in the
    callers' order, pages gathered as [blocks, heads, offset, dim] and moved to a token
    axis before the dots, K widened to q's dtype (the whole pool, hoisted, for bf16)."""
    from functools import partial

    import jax
    import jax.numpy as jnp

    from pallas_kernels import reference

    def attend_rows(q, k_cache, v_cache, block_rows, positions, scale):
        n, b, num_q_heads, head_dim = q.shape
        _, num_kv_heads, block_size, _ = k_cache.shape
        group = num_q_heads // num_kv_heads
        per_chunk = max(1, min(block_rows.shape[1], 128 // block_size))
        num_chunks = -(-block_rows.shape[1] // per_chunk)
        block_rows = jnp.pad(
            block_rows, ((0, 0), (0, num_chunks * per_chunk - block_rows.shape[1]))
        )
        tokens = per_chunk * block_size
        qg = q.reshape(n, b, num_kv_heads, group, head_dim)

        def gather(cache, blocks):
            pages = cache[blocks].transpose(0, 2, 1, 3, 4)
            return pages.reshape(n, num_kv_heads, tokens, head_dim)

        def step(c, carry):
            m, denom, acc = carry
            blocks = jax.lax.dynamic_slice_in_dim(block_rows, c * per_chunk, per_chunk, 1)
            key_pos = c * tokens + jnp.arange(tokens, dtype=jnp.int32)
            visible = key_pos <= positions[..., None]
            k = gather(k_cache, blocks)
            v = jnp.where(jnp.any(visible, axis=1)[:, None, :, None], gather(v_cache, blocks), 0)
            s = jnp.einsum("nbhgd,nhkd->nhgbk", qg, k, preferred_element_type=jnp.float32) * scale
            mask = visible[:, None, None, :, :]
            s = jnp.where(mask, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
            alpha = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
            denom = denom * alpha + jnp.sum(p, axis=-1)
            acc = acc * alpha[..., None] + jnp.einsum("nhgbk,nhkd->nhgbd", p, v.astype(jnp.float32))
            return m_new, denom, acc

        last = jnp.max(jnp.where(positions >= 0, positions, -1)) // tokens
        init = (
            jnp.full((n, num_kv_heads, group, b), -jnp.inf, jnp.float32),
            jnp.zeros((n, num_kv_heads, group, b), jnp.float32),
            jnp.zeros((n, num_kv_heads, group, b, head_dim), jnp.float32),
        )
        _, denom, acc = jax.lax.fori_loop(0, last + 1, step, init)
        o = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
        return o.transpose(0, 3, 1, 2, 4).reshape(n, b, num_q_heads, head_dim)

    def tile_groups(q, k_cache, v_cache, tables, seq, pos, per_group, scale):
        n, b, num_q_heads, head_dim = q.shape
        chunk = min(per_group, n)
        pad = -(-n // chunk) * chunk - n
        q_p = jnp.pad(q, ((0, pad), (0, 0), (0, 0), (0, 0))).reshape(
            -1, chunk, b, num_q_heads, head_dim
        )
        seq_p = jnp.pad(seq, (0, pad)).reshape(-1, chunk)
        pos_p = jnp.pad(pos, ((0, pad), (0, 0)), constant_values=-1).reshape(-1, chunk, b)
        o = jax.lax.map(
            lambda a: attend_rows(a[0], k_cache, v_cache, tables[a[1]], a[2], scale),
            (q_p, seq_p, pos_p),
        )
        return o.reshape(-1, b, num_q_heads, head_dim)[:n]

    @partial(jax.jit, static_argnames="scale")
    def paged_attention(q, k_cache, v_cache, tables, seq_lens, *, scale):
        seq = jnp.arange(seq_lens.shape[0], dtype=jnp.int32)
        o = tile_groups(
            q[:, None], k_cache, v_cache, tables, seq, (seq_lens - 1)[:, None], 16, scale
        )
        return o[:, 0].astype(q.dtype)

    @partial(jax.jit, static_argnames="scale")
    def ragged_paged_attention(q, k_cache, v_cache, tables, seq_lens, query_start_loc, *, scale):
        num_tokens = q.shape[0]
        seq, row, pos = reference.query_tiles(query_start_loc, seq_lens, num_tokens, 8)
        q_t = q.at[row].get(mode="fill", fill_value=0)
        o = tile_groups(q_t, k_cache, v_cache, tables, seq, pos, 2, scale)
        out = jnp.zeros((num_tokens,) + q.shape[1:], jnp.float32)
        out = out.at[row.reshape(-1)].set(o.reshape((-1,) + q.shape[1:]), mode="drop")
        return out.astype(q.dtype)

    return paged_attention, ragged_paged_attention


def run_cpu_attention(args) -> int:
    """Times ``reference.paged_attention`` (decode cells) and ``ragged_paged_attention``
    (prefill cells) on the CPU backend, beside the previous implementation in the same
    rounds: effective GB/s (the K/V bytes of the live context, ``roofline``, over the
    median time) beside this machine's measured read bandwidth, per cell, dtype and
    implementation, and the previous/reference time ratio per round. Writes --output."""
    import os
    import statistics

    import jax
    import jax.numpy as jnp
    import numpy as np

    import pallas_kernels as pk
    from pallas_kernels import reference

    cpu = jax.devices("cpu")[0]
    cells = CPU_TINY_CELLS if args.cpu_tiny else CPU_ATTENTION_CELLS
    report = Report(
        pathlib.Path(args.output),
        dict(
            command="python scripts/bench_kernels.py " + " ".join(args.argv),
            device="cpu",
            jax_version=jax.__version__,
            machine=dict(
                cpu_count=os.cpu_count(), loadavg_1min_at_start=round(os.getloadavg()[0], 2)
            ),
            host_bandwidth=host_bandwidth(
                HOST_BANDWIDTH_BYTES >> 5 if args.cpu_tiny else HOST_BANDWIDTH_BYTES
            ),
            impls=dict(
                reference="pallas_kernels.reference (jitted, one call per sample)",
                previous="bench_kernels.previous_reference: the reference before the CPU "
                "restructure, timed in the same rounds",
            ),
            timing=dict(
                repeats=args.repeats,
                statistic="median (min, max) after one warm-up; implementations alternate "
                "call by call in rotated order",
            ),
            gb_per_s="kv_bytes / median_s / 1e9",
            python=sys.version.split()[0],
            speedups=[],
        ),
    )
    bw = report.data["host_bandwidth"]["sum_read_gb_per_s"]
    num_blocks = 64 if args.cpu_tiny else CPU_POOL_BLOCKS
    prev_decode, prev_ragged = previous_reference()
    with jax.default_device(cpu):
        for name, num_seqs, (lo, hi), q_len, num_q, num_kv, head_dim in cells:
            rng = np.random.default_rng(0)
            contexts = [int(c) for c in rng.integers(lo, hi + 1, num_seqs)]
            tables, lens = make_tables(rng, contexts, num_blocks)
            shape = pk.kv_cache_shape(num_blocks, BLOCK_SIZE, num_kv, head_dim)
            base = [rng.standard_normal(shape, np.float32) for _ in range(2)]
            q32 = rng.standard_normal((num_seqs * q_len, num_q, head_dim), np.float32)
            qsl = jnp.arange(num_seqs + 1, dtype=jnp.int32) * q_len
            scale = head_dim**-0.5
            if q_len == 1:
                impls = dict(reference=reference.paged_attention, previous=prev_decode)
            else:
                impls = dict(
                    reference=partial_qsl(reference.ragged_paged_attention, qsl),
                    previous=partial_qsl(prev_ragged, qsl),
                )
            for dtype_name in CPU_ATTENTION_DTYPES:
                dtype = jnp.dtype(dtype_name)
                k_cache, v_cache = (jnp.asarray(a, dtype) for a in base)
                q = jnp.asarray(q32, dtype)
                traffic = roofline.attention_traffic(
                    contexts,
                    [q_len] * num_seqs,
                    num_q_heads=num_q,
                    num_kv_heads=num_kv,
                    head_dim=head_dim,
                    block_size=BLOCK_SIZE,
                    cache_itemsize=dtype.itemsize,
                    q_itemsize=dtype.itemsize,
                )
                operands = (q, k_cache, v_cache, tables, lens)
                samples = {impl: [] for impl in CPU_IMPLS}
                outs = {}
                for impl in CPU_IMPLS:  # warm-up (compile), and the outputs to compare
                    outs[impl] = np.asarray(impls[impl](*operands, scale=scale), np.float32)
                for r in range(args.repeats):
                    for impl in CPU_IMPLS[r % 2 :] + CPU_IMPLS[: r % 2]:
                        t0 = time.perf_counter()
                        jax.block_until_ready(impls[impl](*operands, scale=scale))
                        samples[impl].append(time.perf_counter() - t0)
                diff = float(np.max(np.abs(outs["reference"] - outs["previous"])))
                for impl in CPU_IMPLS:
                    got = samples[impl]
                    median_s = statistics.median(got)
                    gbps = traffic.kv_bytes / median_s / 1e9
                    report.add(
                        dict(
                            cell=name,
                            impl=impl,
                            dtype=dtype_name,
                            num_seqs=num_seqs,
                            q_len=q_len,
                            context_tokens_mean=float(np.mean(contexts)),
                            num_q_heads=num_q,
                            num_kv_heads=num_kv,
                            head_dim=head_dim,
                            block_size=BLOCK_SIZE,
                            pool_blocks=num_blocks,
                            kv_bytes=traffic.kv_bytes,
                            total_bytes=traffic.total_bytes,
                            median_s=median_s,
                            min_s=min(got),
                            max_s=max(got),
                            samples_s=got,
                            gb_per_s=gbps,
                            gb_per_s_at_min=traffic.kv_bytes / min(got) / 1e9,
                            fraction_of_host_read_bandwidth=gbps / bw,
                        )
                    )
                    print(
                        f"cpu attention {name:18s} {dtype_name:8s} {impl:9s} "
                        f"{1e3 * median_s:8.2f} ms ({1e3 * min(got):.2f}-{1e3 * max(got):.2f}) "
                        f"{gbps:6.2f} GB/s (host sum read {bw:.1f} GB/s)",
                        flush=True,
                    )
                ratios = [p / c for p, c in zip(samples["previous"], samples["reference"])]
                report.data["speedups"].append(
                    dict(
                        cell=name,
                        dtype=dtype_name,
                        previous_over_reference_median=statistics.median(samples["previous"])
                        / statistics.median(samples["reference"]),
                        previous_over_reference_min=min(samples["previous"])
                        / min(samples["reference"]),
                        per_round_ratio_min=min(ratios),
                        per_round_ratio_median=statistics.median(ratios),
                        per_round_ratio_max=max(ratios),
                        max_abs_output_difference=diff,
                    )
                )
                report.flush()
                print(
                    f"cpu attention {name:18s} {dtype_name:8s} previous/reference "
                    f"{report.data['speedups'][-1]['previous_over_reference_median']:.2f}x "
                    f"(per round {min(ratios):.2f}-{max(ratios):.2f}), max |diff| {diff:.1e}",
                    flush=True,
                )
                del k_cache, v_cache
    print(f"wrote {report.path}")
    return 0


def partial_qsl(ragged, query_start_loc):
    """A ragged attention with its query starts bound: the decode cells' call signature."""

    def call(q, k_cache, v_cache, tables, seq_lens, *, scale):
        return ragged(q, k_cache, v_cache, tables, seq_lens, query_start_loc, scale=scale)

    return call


def print_plan(args) -> None:
    num_blocks, shared = pool_blocks()
    print(
        f"bench_kernels plan: decode, {NUM_Q_HEADS} q / {NUM_KV_HEADS} kv heads, head_dim "
        f"{HEAD_DIM}, {DTYPE_NAME}, block {BLOCK_SIZE}; peak {H200_PEAK_GBPS:.0f} GB/s (H200)"
    )
    print(
        f"bench_kernels pool: {num_blocks} blocks, {num_blocks * block_bytes()} B per array "
        f"(< 4 GiB), {shared} blocks shared by the biggest cell"
    )
    for i, (batch, context) in enumerate(cells()):
        for impl in IMPLS:
            print(f"  cell decode b={batch} ctx={context} {impl}")
        if i == 0:
            b, c = MIXED_CELL
            print(f"  cell step rows b={b} ctx={c} (decode-only / mixed / ragged)")
    print(
        f"bench_kernels budget: {len(cells()) * len(IMPLS)} cells x ~{PLAN_COMPILE_S:.0f} s "
        f"compile + {REPS + 2} loops x {LOOP_SECONDS * 1e3:.0f} ms, + {PLAN_START_S:.0f} s start "
        f"= ~{plan_seconds():.0f} s (stops starting cells after --time-limit={args.time_limit:.0f} s)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="bench_results/bench_kernels.json")
    parser.add_argument("--peak-gbps", type=float, default=None, help="override the device's peak")
    parser.add_argument(
        "--time-limit", type=float, default=120.0, help="start no new cell after this many s"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the plan; touch no device")
    parser.add_argument(
        "--cpu-attention",
        action="store_true",
        help="time the pure-JAX reference decode attention on the CPU backend (GB/s)",
    )
    parser.add_argument("--cpu-tiny", action="store_true", help="--cpu-attention at tiny shapes")
    parser.add_argument("--repeats", type=int, default=9, help="--cpu-attention timed calls")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.dry_run:
        print_plan(args)
        return 0
    if args.cpu_attention:
        return run_cpu_attention(args)
    import jax

    if jax.default_backend() == "gpu":
        return run_gpu(args)
    print("bench_kernels: timing needs an NVIDIA GPU; running a CPU correctness smoke instead.")
    return run_cpu_smoke(args)


if __name__ == "__main__":
    raise SystemExit(main())
