"""Autotune the attention kernels' tiling on a GPU and write the best configs to the table.

By default it tunes the keys the engine looks up for the device run's model (Llama-3-8B:
group 4, head_dim 128, block 16) with a bf16 and an fp8 e4m3 cache; ``--groups 4,8,1``
and ``--head-dims all`` (64, 256) widen the sweep, in that order of importance. Per key:

* decode (``paged_decode_attention``): block_k, then num_stages x num_warps at the best
  block_k (``--search grid``: the whole block_k x num_stages x num_warps product);
* ragged (``ragged_paged_attention``): block_q x block_k, then num_warps x num_stages
  at the best pair (block_q limited to tiles of 16-128 query rows);

passing each config explicitly to ``pallas_kernels.paged_attention`` /
``ragged_paged_attention``. Every config's output is checked against
``pallas_kernels.reference`` (relative L2 error); a config that fails to compile (e.g.
shared memory exhausted) or mismatches is recorded with the reason and skipped. Timing
(``pallas_kernels.timing``): one jitted loop of a static number of dependent calls whose
every array (caches, tables, lengths, query starts, fp8 scales, q) is an argument; its
first call is checked, then REPS_PER_CONFIG timed loops; median, min, max and spread are reported.
The kernel defaults (no knobs) are timed too; the best config is written to the table
(``--write``, ``--table``; default ``pallas_kernels/tuned_configs.json``) only when its
sweep completed and it is no slower than the defaults. The workload behind every key is
a Llama-3-like step: 64 sequences x 4096 tokens of context, 8 KV heads; decode = one
token each, ragged = two prefill chunks (256 and 194 tokens) and 62 decode tokens.

The JSON (``--output``) is rewritten after every config and the table after every key;
the JSON also holds the table as written so far ("tuned_configs") and a "metrics"
summary (keys_tuned, configs_timed). ``--time-limit`` stops starting configs cleanly.
``--dry-run`` prints the plan and its budget without touching a device. ``--interpret``
runs a tiny two-config sweep per kernel in Pallas interpret mode on CPU (device kind
"cpu-interpret"; its timings are meaningless and marked so), which exercises sweep,
check, pick and write; it needs ``--table``. ``--rehearse`` is ``--interpret`` whose
``--write`` without ``--table`` goes to a temporary table (folded into the JSON).

    python scripts/autotune_kernels.py --write --output gpu_results/autotune.json
    python scripts/autotune_kernels.py --dry-run
    python scripts/autotune_kernels.py --rehearse --write --output /tmp/autotune.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import sys
import time
from dataclasses import dataclass

from pallas_kernels import roofline, tuning
from pallas_kernels.names import cdiv

DECODE, RAGGED = "paged_decode_attention", "ragged_paged_attention"
CACHE_DTYPE_BY_FLAG = {"bf16": "bfloat16", "e4m3": "float8_e4m3fn"}
DTYPE_NAMES = tuple(CACHE_DTYPE_BY_FLAG.values())
HEAD_DIM_SETS = {"core": (128,), "all": (128, 64, 256)}
GROUPS = (4, 8, 1)  # Llama-3 8B/70B, Llama-3 405B-like, multi-head
# The keys the engine looks up (decode_defaults / ragged_defaults: cache dtype, head_dim,
# group = q heads per KV head, block_size) for the device run's model, Llama-3-8B (32 q /
# 8 KV heads, head_dim 128, block 16), with a bf16 and an fp8 e4m3 KV cache: the default
# sweep. --groups / --head-dims widen it.
ENGINE_GROUPS = (4,)
NUM_KV_HEADS, BLOCK_SIZE = 8, 16
FP8_SCALE = 0.02  # per-tensor scale of the fp8 caches (N(0, 1) data stays far inside e4m3)
INTERPRET_DEVICE_KIND = "cpu-interpret"
# The workload every key is timed on (the table's key omits it: one step shape per key).
BATCH, CONTEXT, PREFILL = 64, 4096, (256, 194)
# The rehearsal engine's cut of Llama-3-8B (8 q / 2 KV heads, head_dim 32: group 4).
INTERPRET_WORK = dict(batch=3, context=40, prefill=(5,), num_kv_heads=2, group=4, head_dim=32)
REPS_PER_CONFIG = 5  # timed loops per config (after one warm-up)
# Planning figures for the dry run (s): one config's compile + check + timing, and the
# one-off start (jax import, pools, reference outputs) per (dtype, head_dim).
PLAN_CONFIG_S = 1.5
PLAN_SWEEP_START_S = 10.0
PLAN_POOL_S = 3.0


@dataclass(frozen=True)
class ShapeKey:
    """One table key (the device kind aside) and the sweep that tunes it."""

    kernel: str
    dtype: str  # cache dtype name
    head_dim: int
    group: int
    block_size: int = BLOCK_SIZE

    @property
    def label(self) -> str:
        short = {v: k for k, v in CACHE_DTYPE_BY_FLAG.items()}.get(self.dtype, self.dtype)
        kind = "decode" if self.kernel == DECODE else "ragged"
        return f"{kind}-{short}-d{self.head_dim}-g{self.group}-bs{self.block_size}"


def shape_keys(head_dims, groups=GROUPS, dtypes=DTYPE_NAMES, kernels=(DECODE, RAGGED)):
    """Keys in order of importance: head_dim, then group, then dtype, then kernel."""
    return [
        ShapeKey(kernel, dtype, d, g)
        for d in head_dims
        for g in groups
        for dtype in dtypes
        for kernel in kernels
    ]


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def block_q_choices(group: int) -> tuple[int, ...]:
    """block_q values whose tile holds 16-128 query rows (rows = block_q x padded group)."""
    heads = _next_pow2(group)
    return tuple(b for b in (2, 4, 8, 16, 32, 64) if 16 <= b * heads <= 128)


def candidate_stages(key: ShapeKey, search: str) -> list[list[dict[str, int]]]:
    """The sweep as stages of configs; a stage after the first is expanded around the best
    config so far (``expand``). ``grid``: one stage, the whole product."""
    if key.kernel == DECODE:
        primary = {"block_k": (32, 64, 128, 256)}
        secondary = {"num_stages": (2, 3, 4), "num_warps": (4, 8)}
        base = {"num_stages": 3, "num_warps": 4}
    else:
        primary = {"block_q": block_q_choices(key.group), "block_k": (32, 64, 128)}
        secondary = {"num_warps": (4, 8), "num_stages": (2, 3)}
        base = {"num_warps": 4, "num_stages": 2}
    if search == "grid":
        axes = {**primary, **secondary}
        return [[dict(zip(axes, v)) for v in itertools.product(*axes.values())]]
    first = [dict(zip(primary, v), **base) for v in itertools.product(*primary.values())]
    second = [dict(zip(secondary, v)) for v in itertools.product(*secondary.values())]
    return [first, second]


def expand(stage: list[dict[str, int]], best: dict[str, int] | None) -> list[dict[str, int]]:
    """A later stage's partial configs completed with the best config's other knobs."""
    if best is None:
        return []
    return [dict(best, **partial) for partial in stage]


def interpret_configs(kernel: str) -> list[dict[str, int]]:
    if kernel == DECODE:
        return [
            dict(block_k=16, num_stages=1, num_warps=4),
            dict(block_k=32, num_stages=2, num_warps=4),
        ]
    return [
        dict(block_q=8, block_k=16, num_warps=4, num_stages=1),
        dict(block_q=16, block_k=32, num_warps=4, num_stages=2),
    ]


def plan_configs(key: ShapeKey, search: str) -> int:
    """Configs the sweep of `key` times (the default row included)."""
    stages = candidate_stages(key, search)
    # Later stages skip the config already timed in the first (the base knobs).
    return 1 + len(stages[0]) + sum(len(s) - 1 for s in stages[1:])


def plan_seconds(keys: list[ShapeKey], search: str) -> list[float]:
    """Cumulative planned seconds after each key (pools built once per dtype x head_dim)."""
    total, pools, out = PLAN_SWEEP_START_S, set(), []
    for key in keys:
        if (key.dtype, key.head_dim) not in pools:
            pools.add((key.dtype, key.head_dim))
            total += PLAN_POOL_S
        total += plan_configs(key, search) * PLAN_CONFIG_S
        out.append(total)
    return out


def print_plan(args, keys: list[ShapeKey]) -> None:
    print(
        f"autotune plan: {len(keys)} keys ({args.search} search), {NUM_KV_HEADS} KV heads, "
        f"workload {BATCH} seqs x {CONTEXT} context (ragged: prefill {'+'.join(map(str, PREFILL))} "
        f"+ {BATCH - len(PREFILL)} decodes)"
    )
    for key, cum in zip(keys, plan_seconds(keys, args.search)):
        fits = "" if cum <= args.time_limit else "  (past --time-limit: cut)"
        print(
            f"  key {key.label:28s} {plan_configs(key, args.search):3d} configs  ~{cum:5.0f} s{fits}"
        )
    total = plan_seconds(keys, args.search)[-1] if keys else PLAN_SWEEP_START_S
    print(
        f"autotune budget: ~{total:.0f} s at ~{PLAN_CONFIG_S} s per config; stops starting "
        f"configs after --time-limit={args.time_limit:.0f} s"
    )


# ------------------------------------------------------------------------- measuring


class Report:
    """The JSON of every config tried, rewritten atomically after every config."""

    def __init__(self, path: pathlib.Path, header: dict):
        self.path = path
        self.data = dict(header, keys=[], stopped=None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.flush()

    def flush(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        tmp.replace(self.path)


def loop_count(nbytes: int, interpret: bool) -> int:
    """Calls per timed loop: ~roofline.LOOP_SECONDS of device time (one in interpret mode)."""
    return 1 if interpret else roofline.calls_per_loop(nbytes)


class Workload:
    """Pools, tables, queries and reference outputs for one (dtype, head_dim), reused
    across groups and both kernels (64 sequences of CONTEXT tokens on one permuted pool)."""

    def __init__(self, dtype: str, head_dim: int, interpret: bool, seed: int = 0):
        import jax
        import jax.numpy as jnp
        import numpy as np

        from pallas_kernels.quantization import is_fp8, quantize

        w = INTERPRET_WORK if interpret else dict(batch=BATCH, context=CONTEXT, prefill=PREFILL)
        self.batch, self.context, self.prefill = w["batch"], w["context"], w["prefill"]
        self.num_kv_heads = w.get("num_kv_heads", NUM_KV_HEADS)
        self.head_dim = head_dim
        self.dtype = jnp.dtype(dtype)
        self.q_dtype = jnp.dtype(jnp.bfloat16)
        per_seq = cdiv(self.context, BLOCK_SIZE)
        num_blocks = self.batch * per_seq + 1  # block 0 is the null block
        rng = np.random.default_rng(seed)
        ids = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)
        self.tables = jnp.asarray(ids.reshape(self.batch, per_seq))
        self.seq_lens = jnp.full((self.batch,), self.context, jnp.int32)
        q_lens = np.array(list(self.prefill) + [1] * (self.batch - len(self.prefill)), np.int32)
        self.q_lens = q_lens
        self.query_start_loc = jnp.asarray(
            np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        )
        shape = (num_blocks, self.num_kv_heads, BLOCK_SIZE, head_dim)
        key = jax.random.PRNGKey(seed)
        fp8 = is_fp8(self.dtype)
        self.scales = (
            dict(k_scale=jnp.float32(FP8_SCALE), v_scale=jnp.float32(FP8_SCALE)) if fp8 else {}
        )

        def fill(i):
            x = jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)
            return quantize(x, FP8_SCALE, self.dtype) if fp8 else x.astype(self.dtype)

        self.k_cache = jax.jit(lambda: fill(0))()
        self.v_cache = jax.jit(lambda: fill(1))()
        self.key = key

    def queries(self, kernel: str, group: int):
        import jax

        rows = self.batch if kernel == DECODE else int(self.q_lens.sum())
        shape = (rows, self.num_kv_heads * group, self.head_dim)
        return jax.random.normal(jax.random.fold_in(self.key, 7 + group), shape, self.q_dtype)

    def operands(self, kernel: str) -> tuple:
        """The arrays `kernel` reads after q, in ``attend``'s argument order."""
        caches = (self.k_cache, self.v_cache, self.tables, self.seq_lens)
        if kernel == RAGGED:
            caches += (self.query_start_loc,)
        return caches + tuple(self.scales.values())

    def attend(self, module, kernel: str, **knobs):
        """f(q, *operands) -> output of `kernel` from `module` (pallas_kernels or its
        reference): every array an argument (``operands``), never captured."""
        scale = self.head_dim**-0.5
        fp8 = bool(self.scales)

        def call(fn, q, *arrays):
            if fp8:
                *arrays, ks, vs = arrays
                return fn(q, *arrays, scale=scale, k_scale=ks, v_scale=vs, **knobs)
            return fn(q, *arrays, scale=scale, **knobs)

        if kernel == DECODE:
            return lambda q, *arrays: call(module.paged_attention, q, *arrays)
        return lambda q, *arrays: call(module.ragged_paged_attention, q, *arrays)

    def traffic(self, kernel: str, group: int) -> roofline.Traffic:
        contexts = [self.context] * self.batch
        q_lens = [1] * self.batch if kernel == DECODE else [int(n) for n in self.q_lens]
        return roofline.attention_traffic(
            contexts,
            q_lens,
            num_q_heads=self.num_kv_heads * group,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=BLOCK_SIZE,
            cache_itemsize=self.dtype.itemsize,
            q_itemsize=self.q_dtype.itemsize,
        )


def measure(fn, q, operands, want, n: int, reps: int) -> dict:
    """Compiles a loop of n (static) dependent calls of fn(q, *operands)
    (``pallas_kernels.timing.looped``: every array an argument), checks its first call
    against `want`, times `reps` loops. A config the compiler rejects is a recorded
    "compile_error"; a captured array (a bug of this script, not of a config) raises.
    """
    import jax
    import numpy as np

    from pallas_kernels import timing

    jitted = timing.looped(fn, n)
    start = time.perf_counter()
    lowered = timing.check_no_captured_arrays(jitted, q, *operands)
    try:
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 - a config the compiler rejects is a recorded skip
        return dict(status="compile_error", error=f"{type(e).__name__}: {str(e)[:400]}")
    row = dict(compile_s=round(time.perf_counter() - start, 3))
    try:
        got = jax.block_until_ready(compiled(q, *operands))  # also the warm-up
        got = np.asarray(got, np.float32)
        ref = np.asarray(want, np.float32)
        finite = bool(np.isfinite(got).all())
        rel = timing.rel_err(got, ref)
        row.update(rel_err=rel, max_abs_err=float(np.max(np.abs(got - ref))), finite=finite)
        if not finite or rel > timing.MAX_REL_ERR:
            return dict(row, status="mismatch", error=f"rel_err={rel:.3g} finite={finite}")
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(q, *operands))
            samples.append((time.perf_counter() - t0) / n * 1e6)
    except Exception as e:  # noqa: BLE001 - keep sweeping the other configs
        return dict(row, status="run_error", error=f"{type(e).__name__}: {str(e)[:400]}")
    med = float(np.median(samples))
    return dict(
        row,
        status="ok",
        calls_per_loop=n,
        us=med,
        us_min=min(samples),
        us_max=max(samples),
        spread=(max(samples) - min(samples)) / med,
        samples_us=[round(s, 3) for s in samples],
    )


def tune_key(key, work, report, args, deadline, device_kind) -> dict:
    """Sweeps one key; appends its record to the report (flushed after every config)."""
    import jax

    import pallas_kernels as pk
    from pallas_kernels import reference

    q = work.queries(key.kernel, key.group)
    operands = work.operands(key.kernel)
    want = jax.jit(work.attend(reference, key.kernel))(q, *operands)
    traffic = work.traffic(key.kernel, key.group)
    n = loop_count(traffic.total_bytes, args.interpret)
    reps = 2 if args.interpret else REPS_PER_CONFIG
    rec = dict(
        kernel=key.kernel,
        dtype=key.dtype,
        head_dim=key.head_dim,
        group=key.group,
        block_size=key.block_size,
        roofline_us=traffic.seconds() * 1e6,
        configs=[],
        default=None,
        best=None,
        complete=False,
        written=False,
    )
    report.data["keys"].append(rec)
    knobs = dict(interpret=True) if args.interpret else {}

    def run(config: dict | None) -> dict | None:
        if time.monotonic() + PLAN_CONFIG_S > deadline:
            report.data["stopped"] = f"--time-limit={args.time_limit:.0f}s reached at {key.label}"
            return None
        fn = work.attend(pk, key.kernel, **knobs, **(config or {}))
        row = measure(fn, q, operands, want, n, reps)
        if "us" in row:
            row["fraction_of_peak"] = traffic.seconds() * 1e6 / row["us"]
        row = dict(config=config, **row)
        if config is None:
            rec["default"] = row
        else:
            rec["configs"].append(row)
        report.flush()
        shown = (
            f"{row['us']:9.1f} us +-{100 * row['spread']:4.1f}% {100 * row['fraction_of_peak']:5.1f}% of peak"
            if "us" in row
            else f"{row['status']}: {row.get('error', '')[:90]}"
        )
        print(
            f"  {key.label:28s} {json.dumps(config) if config else 'defaults':64s} {shown}",
            flush=True,
        )
        return row

    if not args.interpret and run(None) is None:  # the defaults, for the no-regression rule
        return rec
    best = None
    stages = (
        [interpret_configs(key.kernel)] if args.interpret else candidate_stages(key, args.search)
    )
    tried: list[dict] = []
    for i, stage in enumerate(stages):
        configs = stage if i == 0 else expand(stage, best and best["config"])
        for config in configs:
            if config in tried:
                continue
            tried.append(config)
            row = run(config)
            if row is None:
                return rec
            if row["status"] == "ok" and (best is None or row["us"] < best["us"]):
                best = row
    rec["complete"] = True
    rec["best"] = best
    default = rec["default"]
    if best is None:
        rec["why_not_written"] = "no config compiled and matched the reference"
    elif default is not None and default.get("status") == "ok" and best["us"] > default["us"]:
        rec["why_not_written"] = (
            f"best {best['us']:.1f} us is slower than the defaults' {default['us']:.1f} us"
        )
    elif args.write:
        measured = dict(
            us=round(best["us"], 3),
            us_spread=round(best["spread"], 4),
            fraction_of_peak=round(best["fraction_of_peak"], 4),
            roofline_us=round(rec["roofline_us"], 3),
            default_us=None if default is None else default.get("us"),
            configs_tried=len(rec["configs"]),
            workload=report.data["workload"],
            jax_version=jax.__version__,
            command=report.data["command"],
            date=time.strftime("%Y-%m-%d"),
            timings_meaningful=not args.interpret,
        )
        tuning.write_entries(
            [
                tuning.TunedEntry(
                    key.kernel,
                    device_kind,
                    key.dtype,
                    key.head_dim,
                    key.group,
                    key.block_size,
                    best["config"],
                    measured,
                )
            ],
            args.table,
            note=(
                f"Filled by scripts/autotune_kernels.py on {device_kind} (jax {jax.__version__}); "
                "keys missing here keep the kernels' own defaults."
            ),
        )
        rec["written"] = True
    report.flush()
    return rec


def run(args, keys: list[ShapeKey]) -> int:
    import jax

    from pallas_kernels import timing

    device_kind = INTERPRET_DEVICE_KIND if args.interpret else tuning.current_device_kind()
    deadline = time.monotonic() + args.time_limit
    start = time.monotonic()
    work_desc = (
        INTERPRET_WORK
        if args.interpret
        else dict(batch=BATCH, context=CONTEXT, prefill=list(PREFILL), num_kv_heads=NUM_KV_HEADS)
    )
    report = Report(
        pathlib.Path(args.output),
        dict(
            command="python scripts/autotune_kernels.py " + " ".join(args.argv),
            device_kind=device_kind,
            jax_version=jax.__version__,
            interpret=args.interpret,
            timings_meaningful=not args.interpret,
            search="interpret" if args.interpret else args.search,
            workload=dict(work_desc, q_dtype="bfloat16"),
            timing=dict(
                method="pallas_kernels.timing.looped: n dependent calls (n static), every "
                "array an argument; us per call",
                loop_seconds=roofline.LOOP_SECONDS,
                reps=2 if args.interpret else REPS_PER_CONFIG,
                statistic="median; min, max, spread = (max - min) / median",
            ),
            check=f"relative L2 error vs pallas_kernels.reference <= {timing.MAX_REL_ERR}, all finite",
            peak_bytes_per_s=roofline.H200_BYTES_PER_S,
            table=str(args.table) if args.write else None,
            tuned_configs=None,
            metrics=dict(keys_tuned=0, configs_timed=0),
        ),
    )
    works: dict[tuple[str, int], Workload] = {}
    for key in keys:
        if report.data["stopped"]:
            break
        pool = (key.dtype, key.head_dim)
        try:
            if pool not in works:
                works.clear()  # one pool on the device at a time
                works[pool] = Workload(key.dtype, key.head_dim, args.interpret)
            tune_key(key, works[pool], report, args, deadline, device_kind)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: record, try the next key
            report.data["keys"].append(
                dict(label=key.label, error=f"{type(e).__name__}: {str(e)[:400]}")
            )
            print(f"  {key.label}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        report.data["wall_s"] = round(time.monotonic() - start, 1)
        fold_in(report, args)
    written = sum(bool(r.get("written")) for r in report.data["keys"])
    print(
        f"autotune: {len(report.data['keys'])}/{len(keys)} keys in {time.monotonic() - start:.0f} s, "
        f"{written} written{' to ' + str(args.table) if args.write else ''}"
        f"{'; ' + report.data['stopped'] if report.data['stopped'] else ''}; wrote {report.path}"
    )
    errors = [r for r in report.data["keys"] if "error" in r]
    return 1 if errors else 0


def fold_in(report: Report, args) -> None:
    """The metrics, and the tuned table as written so far (under "tuned_configs"), into
    the report, then rewrites it: the one file a device run returns holds both."""
    keys = [r for r in report.data["keys"] if "configs" in r]
    report.data["metrics"] = dict(
        keys_tuned=sum(bool(r["complete"] and r["best"]) for r in keys),
        configs_timed=sum(c.get("status") == "ok" for r in keys for c in r["configs"]),
    )
    if args.write and pathlib.Path(args.table).exists():
        report.data["tuned_configs"] = json.loads(pathlib.Path(args.table).read_text())
    report.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", default="bench_results/autotune.json", help="every config tried")
    p.add_argument("--write", action="store_true", help="write each key's best into --table")
    p.add_argument("--table", type=pathlib.Path, default=None, help=f"default {tuning.TABLE_PATH}")
    p.add_argument(
        "--time-limit", type=float, default=150.0, help="start no config after this many s"
    )
    p.add_argument("--search", choices=("greedy", "grid"), default="greedy")
    p.add_argument("--head-dims", choices=sorted(HEAD_DIM_SETS), default="core")
    p.add_argument(
        "--groups",
        default=",".join(map(str, ENGINE_GROUPS)),
        help=f"comma-separated (default: the engine's; all: {','.join(map(str, GROUPS))})",
    )
    p.add_argument(
        "--dtypes", default=",".join(CACHE_DTYPE_BY_FLAG), help=f"of {sorted(CACHE_DTYPE_BY_FLAG)}"
    )
    p.add_argument("--kernels", default="decode,ragged", help="decode, ragged or both")
    p.add_argument("--dry-run", action="store_true", help="print the plan; touch no device")
    p.add_argument("--interpret", action="store_true", help="tiny CPU sweep in interpret mode")
    p.add_argument(
        "--rehearse",
        action="store_true",
        help="--interpret; with --write and no --table, the table goes to a temporary file "
        "(folded into --output like a device run's)",
    )
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.rehearse:
        args.interpret = True
        if args.write and args.table is None:
            import tempfile

            args.table = pathlib.Path(tempfile.mkdtemp(prefix="autotune_")) / "tuned_configs.json"
    try:
        dtypes = tuple(CACHE_DTYPE_BY_FLAG[d] for d in args.dtypes.split(","))
        groups = tuple(int(g) for g in args.groups.split(","))
        kernels = tuple({"decode": DECODE, "ragged": RAGGED}[k] for k in args.kernels.split(","))
    except (KeyError, ValueError) as e:
        p.error(f"bad --dtypes/--groups/--kernels value: {e}")
    if args.interpret:
        if args.write and args.table is None:
            p.error(
                "--interpret --write needs --table: interpret timings never go into the packaged table"
            )
        keys = shape_keys(
            (INTERPRET_WORK["head_dim"],), (INTERPRET_WORK["group"],), ("bfloat16",), kernels
        )
    else:
        keys = shape_keys(HEAD_DIM_SETS[args.head_dims], groups, dtypes, kernels)
    args.table = args.table or tuning.TABLE_PATH
    if args.dry_run:
        print_plan(args, keys)
        return 0
    import jax

    if not args.interpret and jax.default_backend() != "gpu":
        print("autotune_kernels: timing needs an NVIDIA GPU (use --interpret or --dry-run on CPU)")
        return 2
    return run(args, keys)


if __name__ == "__main__":
    raise SystemExit(main())
