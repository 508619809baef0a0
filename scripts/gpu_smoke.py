"""The device run's first cell: what the machine holds, one decode call of our kernel against
the pure-JAX reference, and the device's streaming-copy ceiling.

Versions (Python, jax, jaxlib, the CUDA plugin and pjrt, triton, the CUDA runtime and driver,
the GPU's name and SM count), then ``pallas_kernels.timing.copy_ceiling`` (a large
device-to-device copy: bytes read + written / s), then ``pallas_kernels.paged_attention`` at
Llama-3-8B heads (32 q / 8 kv, head_dim 128, bf16, block 16) on lengths that straddle block
edges vs ``reference.paged_attention``. The JSON is rewritten after each of the
three, with a top-level "metrics" (decode_max_abs_err, copy_gbps); scripts/gpu_checks.sh folds
it into summary.json. ``--rehearse``: the same path on CPU, the kernel in Pallas interpret
mode at cut shapes and a 64 MiB copy. Exits 1 when the kernel disagrees with the reference.

    python scripts/gpu_smoke.py --output smoke.json [--time-limit 20] [--rehearse]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import pathlib
import platform
import subprocess
import sys
import time

from pallas_kernels.names import cdiv

# Output tolerance vs the reference: bf16 outputs of magnitude ~1 round at 2^-8, and the
# kernel feeds bf16 probabilities to p @ V (tests/pallas_kernels/pk_testing.py's TOL).
MAX_ABS_ERR = 3e-2
PACKAGES = (
    "jax",
    "jaxlib",
    "jax-cuda13-plugin",
    "jax-cuda13-pjrt",
    "jax-cuda12-plugin",
    "jax-cuda12-pjrt",
    "triton",
    "flax",
    "numpy",
)
# (seq_lens, num_kv_heads, group, head_dim, block_size): Llama-3-8B heads on the device.
DEVICE_CASE = ([1, 15, 16, 17, 700, 1500, 2048, 4000], 8, 4, 128, 16)
REHEARSE_CASE = ([1, 15, 17, 40], 2, 4, 64, 16)
COPY_BYTES = {"device": 1 << 30, "rehearse": 64 << 20}


def versions() -> dict:
    """What this machine runs: packages, CUDA (runtime, driver, as jax's plugin reports
    them), nvidia-smi's line and jax's devices."""
    import jax

    info = dict(python=platform.python_version())
    for name in PACKAGES:
        try:
            info[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info[name] = None
    try:
        from jax._src.lib import cuda_versions  # the CUDA plugin's version queries
    except ImportError:
        cuda_versions = None
    if cuda_versions is not None:
        for fn in sorted(n for n in dir(cuda_versions) if n.endswith("_get_version")):
            try:
                info[fn.removesuffix("_get_version")] = getattr(cuda_versions, fn)()
            except Exception as e:  # a query the driver refuses: say so, carry on
                info[fn.removesuffix("_get_version")] = f"error: {e}"
    try:
        info["nvidia_smi"] = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        info["nvidia_smi"] = f"unavailable: {e}"
    devices = jax.devices()
    info.update(
        backend=jax.default_backend(),
        platform_version=getattr(devices[0].client, "platform_version", None),
        device_kind=devices[0].device_kind,
        num_devices=len(devices),
        sm_count=getattr(devices[0], "core_count", None),
    )
    return info


def decode_check(rehearse: bool) -> dict:
    """Our decode kernel vs the reference on one batch; max |difference| in f32."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pallas_kernels as pk
    from pallas_kernels import reference

    seq_lens, num_kv_heads, group, head_dim, block_size = REHEARSE_CASE if rehearse else DEVICE_CASE
    rng = np.random.default_rng(0)
    per_seq = [cdiv(n, block_size) for n in seq_lens]
    width = max(per_seq) + 1
    num_blocks = 1 + sum(per_seq)
    ids = rng.permutation(np.arange(1, num_blocks))  # scattered pages, 0 = null block pads
    tables = np.zeros((len(seq_lens), width), np.int32)
    cursor = 0
    for i, nb in enumerate(per_seq):
        tables[i, :nb] = ids[cursor : cursor + nb]
        cursor += nb
    key = jax.random.PRNGKey(0)
    shape = pk.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = jax.random.normal(key, shape, jnp.bfloat16)
    v_cache = jax.random.normal(jax.random.fold_in(key, 1), shape, jnp.bfloat16)
    q = jax.random.normal(
        jax.random.fold_in(key, 2), (len(seq_lens), num_kv_heads * group, head_dim), jnp.bfloat16
    )
    args = (q, k_cache, v_cache, jnp.asarray(tables), jnp.asarray(seq_lens, jnp.int32))
    scale = head_dim**-0.5
    t0 = time.perf_counter()
    got = jax.block_until_ready(pk.paged_attention(*args, scale=scale, interpret=rehearse))
    seconds = time.perf_counter() - t0
    want = reference.paged_attention(*args, scale=scale)
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
    return dict(
        kernel="pallas_kernels.paged_attention" + (" (interpret=True)" if rehearse else ""),
        seq_lens=seq_lens,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        dtype="bfloat16",
        first_call_s=round(seconds, 3),  # compile included
        max_abs_err=err,
        tolerance=MAX_ABS_ERR,
        agrees=err <= MAX_ABS_ERR,
    )


def write(path: pathlib.Path, report: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", type=pathlib.Path, default=pathlib.Path("gpu_smoke.json"))
    p.add_argument(
        "--time-limit", type=float, default=60.0, help="seconds; no new step starts past it"
    )
    p.add_argument("--rehearse", action="store_true", help="CPU: interpret mode, cut shapes")
    p.add_argument("--copy-bytes", type=int, default=None, help="the copy ceiling's array")
    args = p.parse_args(argv)
    deadline = time.monotonic() + args.time_limit
    import jax

    from pallas_kernels import timing

    if not args.rehearse and jax.default_backend() != "gpu":
        print(f"gpu_smoke: needs an NVIDIA GPU (backend {jax.default_backend()}); or --rehearse")
        return 2
    mode = "rehearse" if args.rehearse else "device"
    report = dict(script="scripts/gpu_smoke.py", mode=mode, metrics={})
    report["versions"] = versions()
    write(args.output, report)
    print("gpu_smoke versions:", json.dumps(report["versions"]))

    if time.monotonic() > deadline:
        report["copy"] = dict(skipped=f"past --time-limit {args.time_limit} s")
    else:
        copy = timing.copy_ceiling(args.copy_bytes or COPY_BYTES[mode])
        report["copy"] = copy
        report["metrics"]["copy_gbps"] = copy["gbps"]
    write(args.output, report)
    print("gpu_smoke copy:", json.dumps(report["copy"]))

    if time.monotonic() > deadline:
        report["decode"] = dict(skipped=f"past --time-limit {args.time_limit} s", agrees=False)
        write(args.output, report)
        return 1
    report["decode"] = decode_check(args.rehearse)
    report["metrics"]["decode_max_abs_err"] = report["decode"]["max_abs_err"]
    write(args.output, report)
    print("gpu_smoke decode:", json.dumps(report["decode"]))
    if not report["decode"]["agrees"]:
        print(f"gpu_smoke: decode max |err| {report['decode']['max_abs_err']} > {MAX_ABS_ERR}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
