"""One GPU cell: the decode kernel on a bf16 cache vs fp8 caches (half the bytes per token).

    python scripts/bench_fp8_decode.py --output gpu_results/fp8_decode.json
    python scripts/bench_fp8_decode.py --rehearse --output /tmp/fp8_decode.json

Llama-3-8B-like heads (32 q / 8 kv, head_dim 128, block 16), batch x context from the
flags (default 64 x 2048). For each cache dtype (bf16, fp8 e4m3, fp8 e5m2, quantized from
one f32 pool with per-tensor scales amax / 200): the Pallas decode kernel timed by
``pallas_kernels.timing`` (a jitted loop of a static number of dependent calls; caches,
tables, lengths, q and the scales all enter as arguments), the K/V bytes it must read,
GB/s and the fraction of the device's peak; its output against the pure-JAX reference on
the same cache (``max_abs_err_vs_reference``) and against the bf16 cache's kernel output
(``max_abs_diff_vs_bf16``). The JSON is written after every dtype with a "metrics" summary
(cells_timed, fp8_max_abs_err_vs_bf16, fp8_time_over_bf16: e4m3 against bf16). Exit 1 when
the kernel disagrees with the reference.

Then 8-bit weights (docs/quantization.md): the decode step's weight products, the seven
projections of every layer of a 32-layer Llama-3-8B-shaped stack at batch 64 (attention
itself, norms and the LM head left out: they do not change with quantization), bf16
weights vs int8 and fp8 weights (scale on the product's output), timed the same way; the
"weights" section and the metrics weights_int8_time_over_bf16 / weights_fp8_time_over_bf16
(issue 43's target: <= 0.6). ``--rehearse`` runs the same code on CPU with the
kernel in Pallas interpret mode at small shapes (its times are not kernel times); on CPU
without it, a tiny smoke on the reference (no timing claims). Called by
scripts/gpu_checks.sh.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

from pallas_kernels import roofline
from pallas_kernels.names import cdiv

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
REHEARSE_SHAPE = dict(batch=2, context=48, q_heads=8, kv_heads=2, head_dim=64)
CACHES = {"bfloat16": "bfloat16", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
REHEARSE_CACHES = ("bfloat16", "fp8_e4m3")
# |kernel - reference| on the same cache: both dequantize the same bytes, so they differ by
# the kernel's bf16 rounding of probabilities and output (~1e-2 of values of order 1).
MAX_ABS_ERR_VS_REFERENCE = 5e-2


def make_inputs(batch: int, context: int, q_heads: int, kv_heads: int, head_dim: int, seed=0):
    """(q bf16, k f32, v f32, tables, lens): an f32 pool every cache dtype is made from."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    per_seq = cdiv(context, BLOCK_SIZE)
    num_blocks = batch * per_seq + 1
    tables = rng.permutation(np.arange(1, num_blocks))[: batch * per_seq]
    tables = tables.reshape(batch, per_seq).astype(np.int32)
    shape = (num_blocks, kv_heads, BLOCK_SIZE, head_dim)
    # N(0, 1) drawn on the host for up to 256 blocks and repeated over the pool (a threefry
    # fill compiles for tens of seconds on a loaded CPU; numpy over the whole pool takes
    # seconds on the device's host).
    nbase = min(num_blocks, 256)
    reps = cdiv(num_blocks, nbase)
    k, v = (
        jnp.tile(
            jnp.asarray(rng.standard_normal((nbase, *shape[1:]), np.float32)), (reps, 1, 1, 1)
        )[:num_blocks]
        for _ in range(2)
    )
    q = jnp.asarray(rng.standard_normal((batch, q_heads, head_dim), np.float32), jnp.bfloat16)
    lens = np.full(batch, context, np.int32)
    return q, k, v, jnp.asarray(tables), jnp.asarray(lens)


def caches_for(name: str, k32, v32):
    """(k, v, scales): the cache in dtype CACHES[name]; fp8 with per-tensor scales as a
    calibration picks them (amax / 200, vLLM's constant), as f32 arrays (arguments)."""
    import jax.numpy as jnp

    from pallas_kernels.quantization import quantize

    dtype = jnp.dtype(CACHES[name])
    if not name.startswith("fp8"):
        return k32.astype(dtype), v32.astype(dtype), ()
    ks = jnp.max(jnp.abs(k32)) / 200
    vs = jnp.max(jnp.abs(v32)) / 200
    return quantize(k32, ks, dtype), quantize(v32, vs, dtype), (ks, vs)


def decode_fn(attend, head_dim: int, fp8: bool):
    """f(q, k, v, tables, lens[, k_scale, v_scale]) -> attend(...): every array an argument."""
    scale = head_dim**-0.5
    if fp8:
        return lambda x, k, v, t, s, ks, vs: attend(
            x, k, v, t, s, scale=scale, k_scale=ks, v_scale=vs
        )
    return lambda x, k, v, t, s: attend(x, k, v, t, s, scale=scale)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--reps", type=int, default=5, help="timed loops per dtype (median)")
    p.add_argument("--output", type=pathlib.Path, default=pathlib.Path("bench_fp8_decode.json"))
    p.add_argument("--time-limit", type=float, default=60.0, help="start no dtype after this")
    p.add_argument("--rehearse", action="store_true", help="CPU: the kernel in interpret mode")
    args = p.parse_args(argv)

    import jax
    import numpy as np

    import pallas_kernels as pk
    from pallas_kernels import reference, timing

    deadline = time.monotonic() + args.time_limit
    gpu = jax.default_backend() == "gpu"
    if gpu:
        shape = dict(batch=args.batch, context=args.context, q_heads=NUM_Q_HEADS,
                     kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM)  # fmt: skip
        backend = "pallas"
    elif args.rehearse:
        shape, backend = dict(REHEARSE_SHAPE), "pallas_interpret"
    else:
        shape, backend = dict(REHEARSE_SHAPE, context=64), "reference"
    device = str(getattr(jax.devices()[0], "device_kind", jax.devices()[0]))
    report = {
        "command": "python scripts/bench_fp8_decode.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": device,
        "jax": jax.__version__,
        "gpu": gpu,
        "backend": backend,
        "times_are_kernel_times": gpu,
        "shape": dict(shape, block_size=BLOCK_SIZE),
        "timing": "pallas_kernels.timing.looped: n dependent calls (n static), every array "
        "an argument; median of --reps loops",
        "check": f"max |kernel - reference| on the same cache <= {MAX_ABS_ERR_VS_REFERENCE}",
        "cells": {},
        "metrics": {},
    }  # fmt: skip
    if not gpu:
        report["note"] = (
            "CPU rehearsal: the kernel in Pallas interpret mode, times are not kernel times"
            if args.rehearse
            else "no GPU: tiny smoke on the pure-JAX reference, times are not kernel times"
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)

    def flush():
        tmp = args.output.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        tmp.replace(args.output)

    flush()
    q, k32, v32, tables, lens = make_inputs(**shape)
    attend = pk.get_attention_ops(backend).paged_attention
    peak = roofline.peak_gbps(device)
    batch, context = shape["batch"], shape["context"]
    failed = False
    base = None
    for name in CACHES:
        cell: dict = {}
        report["cells"][name] = cell
        if args.rehearse and not gpu and name not in REHEARSE_CACHES:
            cell["skipped"] = "rehearsal: the e4m3 cell runs the same fp8 code"
            flush()
            continue
        if time.monotonic() > deadline:
            cell["skipped"] = f"--time-limit={args.time_limit:.0f}s reached"
            flush()
            continue
        fp8 = name.startswith("fp8")
        k, v, scales = caches_for(name, k32, v32)
        operands = (k, v, tables, lens, *scales)
        kv_bytes = 2 * batch * context * shape["kv_heads"] * shape["head_dim"] * k.dtype.itemsize
        n = roofline.calls_per_loop(kv_bytes) if gpu else 1
        try:
            t, out = timing.time_loop(
                decode_fn(attend, shape["head_dim"], fp8), q, operands, n=n,
                reps=args.reps if gpu else 1,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - record, go on with the other dtypes
            cell["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            failed = True
            flush()
            continue
        want = jax.jit(decode_fn(reference.paged_attention, shape["head_dim"], fp8))(q, *operands)
        out32, want32 = np.asarray(out, np.float32), np.asarray(want, np.float32)
        if base is None:
            base = out32
        seconds = t.median_s
        gbps = kv_bytes / seconds / 1e9
        err = float(np.max(np.abs(out32 - want32)))
        cell.update(
            calls_per_loop=n,
            **t.us_stats(),
            seconds=seconds,
            compile_s=t.compile_s,
            kv_bytes=kv_bytes,
            gbps=gbps,
            fraction_of_peak=None if peak is None else gbps / peak,
            max_abs_err_vs_reference=err,
            agrees_with_reference=err <= MAX_ABS_ERR_VS_REFERENCE,
            max_abs_diff_vs_bf16=float(np.max(np.abs(out32 - base))),
            captured_constants=f"none over {timing.MAX_CONSTANT_BYTES} B",
        )
        failed |= not cell["agrees_with_reference"]
        report["metrics"] = metrics(report["cells"])
        flush()
        print(f"{name:9s} {seconds * 1e6:9.1f} us  {gbps:8.2f} GB/s  err vs reference {err:.2e}  "
              f"diff vs bf16 {cell['max_abs_diff_vs_bf16']:.2e}", flush=True)  # fmt: skip
    report["metrics"] = metrics(report["cells"])
    flush()
    if time.monotonic() <= deadline:
        report["weights"] = weight_products(gpu, args.reps if gpu else 1)
        report["metrics"].update(weight_metrics(report["weights"]))
    else:
        report["weights"] = {"skipped": f"--time-limit={args.time_limit:.0f}s reached"}
    flush()
    print(f"metrics {json.dumps(report['metrics'])}")
    print(
        f"wrote {args.output}{'; FAILED: the kernel disagrees with the reference' if failed else ''}"
    )
    return 1 if failed else 0


# The decode step's projections of a Llama-3-8B layer: (in, out) of q, k, v, o, gate, up,
# down; the rehearsal cuts every width by 16 and keeps 2 layers.
LLAMA8B_PROJECTIONS = ((4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096),
                       (4096, 14336), (4096, 14336), (14336, 4096))  # fmt: skip


def weight_products(gpu: bool, reps: int) -> dict:
    """bf16 vs int8 / fp8 weights: one pass of every layer's projections at batch 64."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from paged_jax.models.quantization import QUANTIZED_DTYPES, quantized_matmul
    from pallas_kernels import timing

    cut, layers = (1, 32) if gpu else (16, 2)
    shapes = [(i // cut, o // cut) for i, o in LLAMA8B_PROJECTIONS]
    hidden, batch = 4096 // cut, 64
    key = jax.random.key(0)
    x = jax.random.normal(key, (batch, hidden), jnp.bfloat16)

    def weights(method):
        out = []
        for j, (i, o) in enumerate(shapes):
            w = jax.random.normal(jax.random.fold_in(key, j), (layers, i, o), jnp.float32) * 0.02
            if method is None:
                out.append(w.astype(jnp.bfloat16))
                continue
            scale = jnp.max(jnp.abs(w), axis=-2) / (127.0 if method == "int8" else 448.0)
            q = w / scale[:, None, :]
            q = jnp.clip(jnp.rint(q), -127, 127) if method == "int8" else q
            out.append((q.astype(QUANTIZED_DTYPES[method]), scale))
        return out

    def step(x, *stacked):
        def layer(h, ws):
            def mm(a, w):
                if isinstance(w, tuple):
                    return quantized_matmul(a, *w)
                return jnp.dot(a, w, preferred_element_type=jnp.float32).astype(a.dtype)

            wq, wk, wv, wo, wg, wu, wd = ws
            attn = mm(mm(h, wq), wo) + 1e-3 * (mm(h, wk).sum() + mm(h, wv).sum())
            mlp = mm(jax.nn.silu(mm(h, wg)) * mm(h, wu), wd)
            return (h + 1e-2 * (attn + mlp)).astype(h.dtype), None

        return jax.lax.scan(layer, x, stacked)[0]

    report: dict = dict(batch=batch, layers=layers, projections=shapes)
    for name, method in (("bfloat16", None), ("int8", "int8"), ("fp8", "fp8")):
        ws = weights(method)
        nbytes = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(ws))
        n = 10 if gpu else 1
        t, _ = timing.time_loop(step, x, ws, n=n, reps=reps)
        report[name] = dict(**t.us_stats(), seconds=t.median_s, weight_bytes=nbytes)
        print(
            f"weights {name:9s} {t.median_s * 1e6:9.1f} us  {nbytes / 2**20:9.1f} MiB", flush=True
        )
        del ws
    return report


def weight_metrics(weights: dict) -> dict:
    """int8 / fp8 weight products' time over bf16's."""
    base = weights.get("bfloat16", {}).get("seconds")
    return {
        f"weights_{m}_time_over_bf16": weights[m]["seconds"] / base
        for m in ("int8", "fp8")
        if base and "seconds" in weights.get(m, {})
    }


def metrics(cells: dict) -> dict:
    """cells_timed, and e4m3 against bf16: max |out difference| and the time ratio."""
    out = dict(cells_timed=sum("us" in c for c in cells.values()))
    bf16, e4m3 = cells.get("bfloat16", {}), cells.get("fp8_e4m3", {})
    if "us" in bf16 and "us" in e4m3:
        out["fp8_max_abs_err_vs_bf16"] = e4m3["max_abs_diff_vs_bf16"]
        out["fp8_time_over_bf16"] = e4m3["us"] / bf16["us"]
        out["fp8_max_abs_err_vs_reference"] = e4m3["max_abs_err_vs_reference"]
    return out


if __name__ == "__main__":
    sys.exit(main())
