"""Benchmark paged decode: our kernels vs JAX's own Pallas paged_attention vs XLA, as a
fraction of 4.8 TB/s and of the copy ceiling measured on the same device in the same run.

``--part decode`` (default), on a GPU: decode at batch 1-256 x context 1k-32k
(DECODE_CELLS, biggest first, so a time limit cuts the small cells), Llama-3-8B-like heads
(32 q / 8 kv, head_dim 128, bf16, block 16). Each cell times four implementations:

* ``pallas``: ``get_attention_ops("pallas").paged_attention`` (this repo's Triton kernel);
* ``mosaic``: ``get_attention_ops("mosaic_gpu").paged_attention`` (this repo's Mosaic GPU
  kernel), skipped with the reason when it cannot run here (old jax, pre-Hopper GPU) and
  recorded with its error when it fails;
* ``jax_pallas``: ``jax.experimental.pallas.ops.gpu.paged_attention`` (JAX's Triton op,
  head-major pages, q pre-scaled since it applies no softmax scale), when importable;
* ``xla_gather``: ``pallas_kernels.reference.paged_attention`` (plain XLA).

Timing (``pallas_kernels.timing``): one compiled loop of a static number of dependent calls
per implementation and cell, every array (caches, tables, lengths, q) an argument of the
jitted loop, never captured (a captured array is compiled in as a constant: the script
refuses such a function before compiling it); the loop's first call gives the output that
is compared with xla_gather (relative L2 error), then REPS_PER_IMPL timed loops, one sync each.
Per implementation: median (min, max) us per call, GB/s of every byte the call must move
(``pallas_kernels.roofline``), ``fraction_of_peak`` (of 4.8 TB/s on an H200, or the
device's peak) and ``fraction_of_copy_ceiling`` (of ``timing.copy_ceiling``, measured at
the start of the run). The pool holds the blocks the biggest cell needs, capped under
4 GiB per array as a real pool is (int32 element offsets); past the cap blocks are shared
between sequences, and the JSON says how many. The JSON (--output) is rewritten after
every implementation and carries a "metrics" summary. Exit 1 when an output disagrees
with xla_gather or our Triton kernel fails.

``--part mixed``: the decode rows of a step per token, on the step's decode-only path
(the decode kernel), its mixed path (step_attention with decode_only=False) and the ragged
kernel alone, into its own JSON (target: mixed within 1.3x of decode-only per token).

``--rehearse`` runs the same code on CPU with the kernels in Pallas interpret mode (the
Mosaic ones in GPU interpret mode): one cell on a >= 256 MiB pool (every implementation
lowered with the pool as an argument and checked for captured constants; only xla_gather
timed, interpret mode takes minutes a call there) and one small cell with every
implementation timed; its times are not kernel times. ``--dry-run`` prints the plan and
its budget without touching a device. On CPU without --rehearse it runs a
kernel-vs-reference smoke. ``--cpu-attention`` times the pure-JAX reference attention (the
engine's path without a GPU) on the CPU backend as effective GB/s beside this machine's
numpy read bandwidth, with the implementation it replaced timed in the same rounds.

    python scripts/bench_kernels.py --output gpu_results/bench_kernels.json
    python scripts/bench_kernels.py --part mixed --output gpu_results/bench_mixed.json
    python scripts/bench_kernels.py --rehearse --output /tmp/bench_kernels.json
    python scripts/bench_kernels.py --cpu-attention --output docs/cpu_attention.json
    python scripts/bench_kernels.py --dry-run
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time
import warnings
from dataclasses import asdict, dataclass

from pallas_kernels import roofline
from pallas_kernels.names import cdiv

START = time.monotonic()

BLOCK_SIZE = 16
IMPLS = ("pallas", "mosaic", "jax_pallas", "xla_gather")
RUN_ORDER = ("xla_gather", "pallas", "jax_pallas", "mosaic")  # the reference first
OURS = ("pallas", "mosaic")
H200_PEAK_GBPS = roofline.PEAK_GBPS["H200"]
# A real pool's arrays stay under 4 GiB (2^31 16-bit elements: int32 offsets suffice).
MAX_POOL_ARRAY_BYTES = 2**32 - 1
# Device time of one timed loop: longer than the autotuner's (roofline.LOOP_SECONDS), as
# the published decode tables were measured (docs/kernels.md: ~30 ms loops).
DECODE_LOOP_SECONDS = 0.03
REPS_PER_IMPL = 3  # timed loops per implementation (median)
POOL_BASE_BLOCKS = 256  # distinct random blocks in a pool (repeated to fill it)
COPY_CEILING_BYTES = 1 << 30  # the copy ceiling's array (GPU); rehearsal: 32 MiB
# Planning figures for the dry run's budget (seconds): a compile per (cell, impl), the
# timed loops, and the one-off start (jax import, copy ceiling, pool fill, head-major copy).
PLAN_COMPILE_S = 4.0
PLAN_DECODE_START_S = 20.0


@dataclass(frozen=True)
class Heads:
    """Attention heads and cache layout of one pool."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int = BLOCK_SIZE
    dtype: str = "bfloat16"

    @property
    def itemsize(self) -> int:
        return 1 if "float8" in self.dtype else (4 if self.dtype == "float32" else 2)

    def block_bytes(self) -> int:
        """Bytes of one block of one cache array (K or V)."""
        return self.num_kv_heads * self.block_size * self.head_dim * self.itemsize

    def kv_bytes(self, contexts: list[int]) -> int:
        """K and V bytes a decode call must read at least once."""
        return sum(contexts) * self.num_kv_heads * self.head_dim * 2 * self.itemsize

    def roofline_kw(self) -> dict:
        return dict(
            num_q_heads=self.num_q_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=self.block_size,
            cache_itemsize=self.itemsize,
            q_itemsize=self.itemsize,
        )


LLAMA = Heads(32, 8, 128)  # Llama-3-8B
SMALL = Heads(8, 2, 64)  # the rehearsal's interpret-mode cells


@dataclass(frozen=True)
class CellGroup:
    """Decode cells (batch, context) on one pool, in run order; `timed` implementations
    are timed, the others only lowered and checked for captured constants (why: `untimed`)."""

    heads: Heads
    cells: tuple[tuple[int, int], ...]
    timed: tuple[str, ...] = IMPLS
    untimed: str = ""
    min_pool_blocks: int = 0  # a pool at least this big whatever the cells need

    def pool_blocks(self) -> tuple[int, int]:
        """(blocks in the pool, blocks the biggest cell must share): what the cells need
        plus the null block, capped so each cache array stays under 4 GiB."""
        needed = max(b * cdiv(c, self.heads.block_size) for b, c in self.cells) + 1
        needed = max(needed, self.min_pool_blocks)
        cap = MAX_POOL_ARRAY_BYTES // self.heads.block_bytes()
        return min(needed, cap), max(0, needed - cap)


def by_bytes(cells) -> tuple[tuple[int, int], ...]:
    """Cells with the most context tokens first (ties: the bigger batch first)."""
    return tuple(sorted(cells, key=lambda bc: (-bc[0] * bc[1], -bc[0])))


# batch 1-256 x context 1k-32k; the grid's corners and the target region (batch >= 64,
# context >= 2k), biggest first.
DECODE_CELLS = by_bytes(
    [(256, 32768), (256, 8192), (64, 32768), (64, 8192), (256, 2048), (64, 2048),
     (16, 8192), (256, 1024), (1, 32768), (16, 1024), (1, 1024)]
)  # fmt: skip
# The rehearsal: one cell on a pool of >= 256 MiB per array (Llama heads: 8,193 blocks of
# 32 KiB), timed on xla_gather only (Pallas interpret mode over that pool: 262 s a call on
# a loaded 2-core machine, jax 0.11.2), and one small cell where every implementation runs.
REHEARSE_BIG = CellGroup(
    LLAMA,
    ((2, 256),),
    min_pool_blocks=8193,
    timed=("xla_gather",),
    untimed="lowered with the >= 256 MiB pool as an argument and checked for captured "
    "constants; not timed (Pallas interpret mode over this pool takes minutes a call)",
)
REHEARSE_SMALL = CellGroup(
    SMALL,
    ((2, 48),),
    timed=("xla_gather", "pallas", "jax_pallas"),
    untimed="lowered and checked only: the Mosaic GPU interpret mode took 94 s a call here "
    "(batch 2, context 48) on a loaded 2-core machine",
)
MIXED_CELL = (64, 2048)  # decode rows of a step, batch x context
REHEARSE_MIXED_CELL = (2, 40)


def decode_plan(rehearse: bool) -> list[CellGroup]:
    return [REHEARSE_BIG, REHEARSE_SMALL] if rehearse else [CellGroup(LLAMA, DECODE_CELLS)]


def backends(rehearse: bool) -> dict[str, str]:
    """The attention backends the parts run ("pallas" ops, "mosaic" ops, the step's ops)."""
    if rehearse:
        return dict(pallas="pallas_interpret", mosaic="mosaic_gpu_interpret")
    return dict(pallas="pallas", mosaic="mosaic_gpu")


def plan_seconds(plan: list[CellGroup] | None = None) -> float:
    plan = plan or decode_plan(False)
    per_impl = PLAN_COMPILE_S + (REPS_PER_IMPL + 1) * DECODE_LOOP_SECONDS + 0.5
    return PLAN_DECODE_START_S + sum(len(g.cells) for g in plan) * len(IMPLS) * per_impl


def loop_count(nbytes: int) -> int:
    """Calls per timed loop: ~DECODE_LOOP_SECONDS of device time, within [10, 2000]."""
    return roofline.calls_per_loop(nbytes, DECODE_LOOP_SECONDS, lo=10, hi=2000)


def jax_paged_attention(interpret: bool = False):
    """(JAX's own Pallas GPU paged_attention, None) or (None, why it cannot be imported)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from jax.experimental.pallas.ops.gpu import paged_attention as mod
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        return None, f"{type(e).__name__}: {str(e)[:200]}"
    if interpret:
        import functools

        return functools.partial(mod.paged_attention, interpret=True), None
    return mod.paged_attention, None


def mosaic_paged_attention(backend: str):
    """(the Mosaic GPU decode op of `backend`, None) or (None, why it cannot run here)."""
    import pallas_kernels as pk
    from pallas_kernels.backend import mosaic_unavailable

    why = mosaic_unavailable(backend)
    if why is not None:
        return None, f"{backend}: {why}"
    try:
        return pk.get_attention_ops(backend).paged_attention, None
    except Exception as e:  # noqa: BLE001 - recorded as the reason it cannot run
        return None, f"{backend}: {type(e).__name__}: {str(e)[:200]}"


def decode_fns(heads: Heads, pallas, mosaic=None, theirs=None) -> dict:
    """impl -> f(q, *operands): every array an argument (``decode_operands`` gives them)."""
    from pallas_kernels import reference

    scale = heads.head_dim**-0.5
    fns = {
        "xla_gather": lambda x, k, v, t, s: reference.paged_attention(x, k, v, t, s, scale=scale),
        "pallas": lambda x, k, v, t, s: pallas(x, k, v, t, s, scale=scale),
    }
    if mosaic is not None:
        fns["mosaic"] = lambda x, k, v, t, s: mosaic(x, k, v, t, s, scale=scale)
    if theirs is not None:
        # JAX's op applies no softmax scale: q is pre-scaled.
        fns["jax_pallas"] = lambda x, kh, vh, t, s: theirs(x * scale, kh, vh, t, s)
    return fns


def decode_operands(impl: str, caches, head_major, tables, lens) -> tuple:
    """The arrays `impl` takes after q: block-major caches, or JAX's head-major ones."""
    k, v = head_major if impl == "jax_pallas" else caches
    return (k, v, tables, lens)


def make_pool(heads: Heads, num_blocks: int, seed: int = 0) -> dict:
    """K and V caches of `num_blocks` blocks, block-major ("caches") and head-major
    ("head_major", JAX's kernel's layout): N(0, 1) values drawn on the host (numpy) for up
    to POOL_BASE_BLOCKS blocks and repeated over the pool on the device by one jitted tile
    (a random fill of a multi-GiB pool, or a threefry compile, on a loaded 2-core CPU takes
    longer than the rehearsal cell). Nothing is captured: the base is an argument."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pallas_kernels as pk

    shape = pk.kv_cache_shape(num_blocks, heads.block_size, heads.num_kv_heads, heads.head_dim)
    nbase = min(num_blocks, POOL_BASE_BLOCKS)
    rng = np.random.default_rng(seed)
    base = jnp.asarray(rng.standard_normal((2, nbase, *shape[1:]), np.float32), heads.dtype)
    reps = cdiv(num_blocks, nbase)

    @jax.jit
    def tile(base):  # [2, nbase, kv, bs, d] -> the four caches
        pool = jnp.tile(base, (1, reps, 1, 1, 1))[:, :num_blocks]
        head_major = jnp.tile(base.transpose(0, 2, 1, 3, 4), (1, 1, reps, 1, 1))
        return pool[0], pool[1], head_major[0, :, :num_blocks], head_major[1, :, :num_blocks]

    k, v, kh, vh = tile(base)
    return dict(caches=(k, v), head_major=(kh, vh))


def make_tables(rng, contexts: list[int], num_blocks: int, block_size: int = BLOCK_SIZE):
    """(i32[S, W] block tables, i32[S] lengths) over a random permutation of the pool's
    blocks (scattered pages). Blocks are dealt from the permutation in order and the deal
    wraps around when the contexts need more than the pool holds (a few blocks shared)."""
    import jax.numpy as jnp
    import numpy as np

    needed = [cdiv(c, block_size) for c in contexts]
    width = cdiv(max(needed), 16) * 16  # JAX's kernel wants pages_per_seq % k_splits == 0
    perm = rng.permutation(np.arange(1, num_blocks))
    ids = perm[np.arange(sum(needed)) % perm.size]
    tables = np.zeros((len(contexts), width), np.int32)
    cursor = 0
    for i, n in enumerate(needed):
        tables[i, :n] = ids[cursor : cursor + n]
        cursor += n
    return jnp.asarray(tables), jnp.asarray(np.asarray(contexts, np.int32))


def header(args, part: str, device_kind: str) -> dict:
    """The fields a --part's JSON opens with: the command, the part, the device, and
    whether it is a CPU rehearsal (whose times are not kernel times)."""
    import jax

    return dict(
        command="python scripts/bench_kernels.py " + " ".join(args.argv),
        part=part,
        device=device_kind,
        rehearse=args.rehearse,
        times_are_kernel_times=not args.rehearse,
        jax_version=jax.__version__,
    )


class Report:
    """The JSON report, rewritten (atomically) after every change."""

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


def time_impl(fn, q, operands, *, n: int, reps: int, timed: bool, res: dict, nbytes: int,
              peak_bps: float, ceiling_bps: float | None):  # fmt: skip
    """Times one implementation into `res`; returns its first call's output (or None)."""
    from pallas_kernels import timing

    t, out = timing.time_loop(fn, q, operands, n=n, reps=reps, time_it=timed)
    res["captured_constants"] = f"none over {timing.MAX_CONSTANT_BYTES} B"
    res["lower_s"] = t.lower_s
    if not t.samples_s:
        return None
    seconds = t.median_s
    res.update(
        calls_per_loop=n,
        **t.us_stats(),
        compile_s=t.compile_s,
        gbps=nbytes / seconds / 1e9,
        fraction_of_peak=nbytes / seconds / peak_bps,
    )
    if ceiling_bps:
        res["fraction_of_copy_ceiling"] = nbytes / seconds / ceiling_bps
    return out


def decode_metrics(data: dict) -> dict:
    """The top-level metrics of a decode report (every value a finite number)."""
    rows = [r for r in data["results"] if "impls" in r]
    timed = [(r, impl, res) for r in rows for impl, res in r["impls"].items() if "us" in res]
    ours = [x for x in timed if x[1] in OURS] or timed  # ours, else whatever was timed
    metrics = dict(
        cells_timed=sum(any("us" in res for res in r["impls"].values()) for r in rows),
        copy_ceiling_gbps=data["copy_ceiling"]["gbps"],
        max_kv_cache_mib=max((g["kv_cache_mib"] for g in data["pools"]), default=0.0),
    )
    if ours:
        metrics["best_fraction_of_peak"] = max(x[2]["fraction_of_peak"] for x in ours)
        metrics["best_fraction_of_copy_ceiling"] = max(
            x[2]["fraction_of_copy_ceiling"] for x in ours
        )
        best = max(ours, key=lambda x: x[2]["fraction_of_peak"])
        data["best_fraction_of"] = dict(impl=best[1], batch=best[0]["batch"],
                                        context=best[0]["context"])  # fmt: skip
    speedups = [r["speedup_vs_jax_pallas"] for r in rows if "speedup_vs_jax_pallas" in r]
    if speedups:  # geometric mean over the cells where both ran
        metrics["speedup_vs_jax_pallas"] = math.exp(sum(map(math.log, speedups)) / len(speedups))
        data.pop("speedup_vs_jax_pallas_missing", None)
    else:
        data["speedup_vs_jax_pallas_missing"] = (
            data.get("jax_pallas_missing") or "no cell timed both pallas and jax_pallas"
        )
    return metrics


def run_decode(args) -> int:
    import jax
    import numpy as np

    from pallas_kernels import get_attention_ops, timing

    rehearse = args.rehearse
    names = backends(rehearse)
    device = jax.devices()[0]
    peak = args.peak_gbps or roofline.peak_gbps(device.device_kind) or H200_PEAK_GBPS
    theirs, theirs_missing = jax_paged_attention(interpret=rehearse)
    mosaic, mosaic_missing = mosaic_paged_attention(names["mosaic"])
    pallas = get_attention_ops(names["pallas"]).paged_attention
    ceiling = timing.copy_ceiling(COPY_CEILING_BYTES >> 5 if rehearse else COPY_CEILING_BYTES,
                                  n=3 if rehearse else 10)  # fmt: skip
    plan = decode_plan(rehearse)
    report = Report(
        pathlib.Path(args.output),
        dict(
            **header(args, "decode", device.device_kind),
            peak_gbps=peak,
            copy_ceiling=ceiling,
            pallas_backend=names["pallas"],
            jax_pallas_available=theirs is not None,
            jax_pallas_missing=theirs_missing,
            mosaic_backend=names["mosaic"],
            mosaic_available=mosaic is not None,
            mosaic_missing=mosaic_missing,
            pools=[],
            timing=dict(
                method="pallas_kernels.timing.looped: one jitted fori_loop of n dependent "
                "calls (n static), every array an argument; seconds per call = loop / n",
                loop_seconds=DECODE_LOOP_SECONDS,
                reps=1 if rehearse else REPS_PER_IMPL,
                statistic="median (min, max)",
            ),
            check=f"relative L2 error vs xla_gather <= {timing.MAX_REL_ERR}",
            fraction_of_peak="roofline bytes (every byte the call must move) / s / peak_gbps",
            fraction_of_copy_ceiling="roofline bytes / s / copy_ceiling.gbps",
            metrics={},
        ),
    )
    if rehearse:
        report.data["note"] = "CPU rehearsal: interpret-mode times, not kernel times"
    deadline = time.monotonic() + args.time_limit
    failed = False
    rng = np.random.default_rng(0)
    for group in plan:
        heads = group.heads
        num_blocks, shared = group.pool_blocks()
        if time.monotonic() > deadline:
            break
        pool = make_pool(heads, num_blocks)
        print(f"pool of {num_blocks} blocks ready [{time.monotonic() - START:.0f} s]", flush=True)
        # JAX's kernel wants head-major pages [kv, blocks, bs, d].
        caches, head_major = pool["caches"], pool["head_major"]
        report.data["pools"].append(
            dict(
                heads=asdict(heads),
                cells=[list(c) for c in group.cells],
                num_blocks=num_blocks,
                bytes_per_array=num_blocks * heads.block_bytes(),
                kv_cache_mib=2 * num_blocks * heads.block_bytes() / 2**20,
                blocks_shared_by_the_biggest_cell=shared,
                timed=list(group.timed),
                untimed=group.untimed or None,
            )
        )
        fns = decode_fns(heads, pallas, mosaic, theirs)
        for batch, context in group.cells:
            failed |= decode_cell(report, group, caches, head_major, fns, batch, context, rng,
                                  peak, ceiling, deadline, args, theirs_missing, mosaic_missing)  # fmt: skip
        del caches, head_major, pool
    report.data["metrics"] = decode_metrics(report.data)
    report.flush()
    print(f"metrics {json.dumps(report.data['metrics'])}")
    print(
        f"wrote {report.path}{'; FAILED: an output disagrees or our kernel failed' if failed else ''}"
    )
    return 1 if failed else 0


def decode_cell(report, group, caches, head_major, fns, batch, context, rng, peak, ceiling,
                deadline, args, theirs_missing, mosaic_missing) -> bool:  # fmt: skip
    """Times every implementation on one (batch, context) cell; True on a failure."""
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import timing

    heads = group.heads
    tables, lens = make_tables(rng, [context] * batch, caches[0].shape[0], heads.block_size)
    q = rng.standard_normal((batch, heads.num_q_heads, heads.head_dim), np.float32)
    q = jnp.asarray(q, heads.dtype)
    floor = roofline.decode_traffic([context] * batch, **heads.roofline_kw())
    model = roofline.predicted_decode_fraction([context] * batch, **heads.roofline_kw())
    row = dict(
        batch=batch,
        context=context,
        kv_bytes=heads.kv_bytes([context] * batch),
        roofline_bytes=floor.total_bytes,
        roofline_us=floor.seconds(peak * 1e9) * 1e6,
        predicted_fraction_of_peak=model["fraction"],
        predicted_balance=model["balance"],
        impls={},
    )
    report.add(row)
    outputs, failed = {}, False
    n = 1 if args.rehearse else loop_count(floor.total_bytes)
    for impl in RUN_ORDER:
        res: dict = {}
        row["impls"][impl] = res
        if impl not in fns:
            res["skipped"] = mosaic_missing if impl == "mosaic" else (
                f"jax.experimental.pallas.ops.gpu.paged_attention: {theirs_missing}")  # fmt: skip
        elif time.monotonic() > deadline:
            res["skipped"] = f"--time-limit={args.time_limit:.0f}s reached"
        else:
            timed = impl in group.timed
            if not timed:
                res["not_timed"] = group.untimed
            operands = decode_operands(impl, caches, head_major, tables, lens)
            try:
                out = time_impl(fns[impl], q, operands, n=n, reps=1 if args.rehearse else REPS_PER_IMPL,
                                timed=timed, res=res, nbytes=floor.total_bytes,
                                peak_bps=peak * 1e9, ceiling_bps=ceiling["gbps"] * 1e9)  # fmt: skip
                if out is not None:
                    outputs[impl] = out
            except Exception as e:  # noqa: BLE001 - keep measuring the other cells
                res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                failed |= (
                    impl == "pallas"
                )  # ours; Mosaic's failures are recorded, JAX's may be absent
        if impl in outputs and impl != "xla_gather" and "xla_gather" in outputs:
            res["rel_err_vs_xla_gather"] = err = timing.rel_err(
                outputs[impl], outputs["xla_gather"]
            )
            res["agrees"] = err <= timing.MAX_REL_ERR
            failed |= not res["agrees"]
        report.data["metrics"] = decode_metrics(report.data)
        report.flush()
        elapsed = f"[{time.monotonic() - START:.0f} s]"
        print(
            f"decode b={batch:<3d} ctx={context:<5d} {impl:10s} {shown(res)} {elapsed}", flush=True
        )
    ours = row["impls"]["pallas"].get("us")
    for other in ("mosaic", "jax_pallas", "xla_gather"):
        theirs_us = row["impls"][other].get("us")
        if ours and theirs_us:
            row[f"speedup_vs_{other}"] = theirs_us / ours
    report.data["metrics"] = decode_metrics(report.data)
    report.flush()
    return failed


def mixed_fns(heads: Heads, ops) -> dict:
    """The step's decode rows on its three paths: impl -> f(q, k, v, tables, lens, qsl)."""
    import pallas_kernels as pk

    scale = heads.head_dim**-0.5

    def step(decode_only):
        return lambda x, k, v, t, s, qsl: pk.step_attention(
            ops.for_step(), x, k, v, t, s, qsl, decode_only=decode_only, scale=scale
        )

    return {
        "step_decode_only": step(True),
        "step_mixed_path": step(False),
        "ragged_kernel": lambda x, k, v, t, s, qsl: ops.ragged_paged_attention(
            x, k, v, t, s, qsl, scale=scale
        ),
    }


def run_mixed(args) -> int:
    """Decode tokens of a step on its three paths, per token, side by side: the step's
    decode-only path (the decode kernel), the mixed path (step_attention with
    decode_only=False: the decode kernel for the single-token rows plus a ragged launch
    with no query block), and the ragged kernel alone (each decode token a block_q-token
    query block). Target: the mixed path within 1.3x of decode-only per token."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pallas_kernels as pk
    from pallas_kernels import timing

    rehearse = args.rehearse
    heads = SMALL if rehearse else LLAMA
    batch, context = REHEARSE_MIXED_CELL if rehearse else MIXED_CELL
    group = CellGroup(heads, ((batch, context),))
    num_blocks, _ = group.pool_blocks()
    backend = backends(rehearse)["pallas"]
    device = jax.devices()[0]
    report = Report(
        pathlib.Path(args.output),
        dict(
            **header(args, "mixed", device.device_kind),
            step_backend=backend,
            heads=asdict(heads),
            pool=dict(num_blocks=num_blocks, bytes_per_array=num_blocks * heads.block_bytes()),
            timing="pallas_kernels.timing.looped: n dependent calls (n static), every array "
            "an argument; us per token = us per call / batch",
            metrics={},
        ),
    )
    if rehearse:
        report.data["note"] = "CPU rehearsal: interpret-mode times, not kernel times"
    rng = np.random.default_rng(0)
    caches = make_pool(heads, num_blocks)["caches"]
    tables, lens = make_tables(rng, [context] * batch, num_blocks, heads.block_size)
    qsl = jnp.arange(batch + 1, dtype=jnp.int32)
    q = rng.standard_normal((batch, heads.num_q_heads, heads.head_dim), np.float32)
    q = jnp.asarray(q, heads.dtype)
    fns = mixed_fns(heads, pk.get_attention_ops(backend))
    row = dict(cell="decode rows of a step", batch=batch, context=context, impls={})
    report.add(row)
    outputs, failed = {}, False
    n = 1 if rehearse else loop_count(heads.kv_bytes([context] * batch))
    deadline = time.monotonic() + args.time_limit
    for impl, fn in fns.items():
        res: dict = {}
        row["impls"][impl] = res
        if time.monotonic() > deadline:
            res["skipped"] = f"--time-limit={args.time_limit:.0f}s reached"
            continue
        try:
            out = time_impl(fn, q, (*caches, tables, lens, qsl), n=n,
                            reps=1 if rehearse else REPS_PER_IMPL, timed=True, res=res,
                            nbytes=heads.kv_bytes([context] * batch), peak_bps=H200_PEAK_GBPS * 1e9,
                            ceiling_bps=None)  # fmt: skip
            outputs[impl] = out
            res["us_per_token"] = res["us"] / batch
        except Exception as e:  # noqa: BLE001 - keep measuring the others
            res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            failed = True
        if impl in outputs and "step_decode_only" in outputs and impl != "step_decode_only":
            res["rel_err_vs_decode_only"] = err = timing.rel_err(
                outputs[impl], outputs["step_decode_only"]
            )
            res["agrees"] = err <= timing.MAX_REL_ERR
            failed |= not res["agrees"]
        report.data["metrics"] = mixed_metrics(row)
        report.flush()
        print(f"step rows b={batch} ctx={context} {impl:18s} {res.get('us', res.get('error'))}")
    base = row["impls"]["step_decode_only"].get("us")
    for impl in ("step_mixed_path", "ragged_kernel"):
        us = row["impls"][impl].get("us")
        if base and us:
            row[f"{impl}_per_token_vs_decode_only"] = us / base
    report.data["metrics"] = mixed_metrics(row)
    report.flush()
    print(f"metrics {json.dumps(report.data['metrics'])}")
    print(f"wrote {report.path}{'; FAILED: a path disagrees or failed' if failed else ''}")
    return 1 if failed else 0


def mixed_metrics(row: dict) -> dict:
    impls = row["impls"]
    out = {}
    dec = impls.get("step_decode_only", {}).get("us_per_token")
    mix = impls.get("step_mixed_path", {}).get("us_per_token")
    if dec is not None:
        out["decode_us_per_token"] = dec
    if mix is not None:
        out["mixed_us_per_token"] = mix
    if dec and mix:
        out["mixed_over_decode"] = mix / dec
    return out


def shown(res: dict) -> str:
    if "us" not in res:
        return res.get("error", res.get("skipped", res.get("not_timed", "")))[:90]
    agree = ""
    if "rel_err_vs_xla_gather" in res:
        agree = f"  err {res['rel_err_vs_xla_gather']:.1e}{'' if res['agrees'] else ' DISAGREES'}"
    return (
        f"{res['us']:9.1f} us ({res['us_min']:.1f}-{res['us_max']:.1f}) {res['gbps']:7.1f} GB/s "
        f"{100 * res['fraction_of_peak']:5.1f}% of peak "
        f"{100 * res.get('fraction_of_copy_ceiling', float('nan')):5.1f}% of copy{agree}"
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
        num_chunks = cdiv(block_rows.shape[1], per_chunk)
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
        pad = cdiv(n, chunk) * chunk - n
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
    if args.part == "mixed":
        b, c = REHEARSE_MIXED_CELL if args.rehearse else MIXED_CELL
        print(f"bench_kernels plan (mixed): step rows b={b} ctx={c} "
              "(decode-only / mixed / ragged), per token")  # fmt: skip
        return
    plan = decode_plan(args.rehearse)
    for group in plan:
        h = group.heads
        num_blocks, shared = group.pool_blocks()
        print(
            f"bench_kernels plan: decode, {h.num_q_heads} q / {h.num_kv_heads} kv heads, head_dim "
            f"{h.head_dim}, {h.dtype}, block {h.block_size}; peak {H200_PEAK_GBPS:.0f} GB/s (H200) "
            "and the copy ceiling measured at the start"
        )
        print(
            f"bench_kernels pool: {num_blocks} blocks, {num_blocks * h.block_bytes()} B per array "
            f"(< 4 GiB), {shared} blocks shared by the biggest cell"
        )
        for batch, context in group.cells:
            for impl in IMPLS:
                timed = "" if impl in group.timed else " (lowered only)"
                print(f"  cell decode b={batch} ctx={context} {impl}{timed}")
    cells = sum(len(g.cells) for g in plan)
    print(
        f"bench_kernels budget: {cells * len(IMPLS)} cells x ~{PLAN_COMPILE_S:.0f} s "
        f"compile + {REPS_PER_IMPL + 1} loops x {DECODE_LOOP_SECONDS * 1e3:.0f} ms, + {PLAN_DECODE_START_S:.0f} s start "
        f"= ~{plan_seconds(plan):.0f} s (stops starting cells after --time-limit={args.time_limit:.0f} s)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=None, help="default bench_results/bench_<part>.json")
    parser.add_argument("--part", choices=("decode", "mixed"), default="decode")
    parser.add_argument("--peak-gbps", type=float, default=None, help="override the device's peak")
    parser.add_argument(
        "--time-limit", type=float, default=120.0, help="start no new cell after this many s"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the plan; touch no device")
    parser.add_argument(
        "--rehearse",
        action="store_true",
        help="the same code on CPU, kernels in interpret mode, shapes cut to fit a CPU",
    )
    parser.add_argument(
        "--cpu-attention",
        action="store_true",
        help="time the pure-JAX reference decode attention on the CPU backend (GB/s)",
    )
    parser.add_argument("--cpu-tiny", action="store_true", help="--cpu-attention at tiny shapes")
    parser.add_argument("--repeats", type=int, default=9, help="--cpu-attention timed calls")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.output is None:
        name = "bench_kernels" if args.part == "decode" else "bench_mixed"
        args.output = f"bench_results/{name}.json"
    if args.dry_run:
        print_plan(args)
        return 0
    if args.cpu_attention:
        return run_cpu_attention(args)
    import jax

    if jax.default_backend() == "gpu" or args.rehearse:
        return run_mixed(args) if args.part == "mixed" else run_decode(args)
    print("bench_kernels: timing needs an NVIDIA GPU; running a CPU correctness smoke instead.")
    return run_cpu_smoke(args)


if __name__ == "__main__":
    raise SystemExit(main())
