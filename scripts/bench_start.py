"""Cold vs warm start of the generate CLI: the same run twice on an empty compile cache.

python scripts/bench_start.py --out docs/start_time.json            # the demo job
python scripts/bench_start.py --out x.json -- --max-num-seqs 8       # extra CLI flags

Each run is a fresh process (`python -m paged_jax.entrypoints.generate_cli`) with
PAGED_JAX_COMPILE_CACHE pointing at a new directory: the first compiles every step
bucket and fills the cache, the second loads them. Reports load, warm-up and
load+warm-up seconds from each run's --summary-json, and the speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time


def run_once(cli_args: list[str], env: dict[str, str], summary: str) -> dict:
    cmd = [sys.executable, "-m", "paged_jax.entrypoints.generate_cli", *cli_args]
    cmd += ["--summary-json", summary, "--no-tqdm"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    process_s = time.perf_counter() - t0
    if proc.returncode not in (0, 1):
        raise SystemExit(f"generate failed ({proc.returncode}): {proc.stderr[-2000:]}")
    with open(summary) as f:
        result = json.load(f)
    result.pop("errors", None)
    result["process_s"] = round(process_s, 2)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="start_time.json", help="where to save the JSON")
    p.add_argument("cli_args", nargs="*", help="flags passed to paged-jax-generate (after --)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PAGED_JAX_COMPILE_CACHE": os.path.join(tmp, "jax_cache")}
        cold = run_once(args.cli_args, env, os.path.join(tmp, "cold.json"))
        warm = run_once(args.cli_args, env, os.path.join(tmp, "warm.json"))
    keys = ("load_s", "warmup_s", "load_and_warmup_s", "process_s")
    report = {
        "command": "python scripts/bench_start.py " + " ".join(argv or sys.argv[1:]),
        "cli_args": args.cli_args,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "load_average_at_start": os.getloadavg()[0],
        "cold": {k: cold[k] for k in (*keys, "compile_cache_misses", "compile_cache_hits")},
        "warm": {k: warm[k] for k in (*keys, "compile_cache_misses", "compile_cache_hits")},
        "speedup_load_and_warmup": round(cold["load_and_warmup_s"] / warm["load_and_warmup_s"], 2),
        "speedup_process": round(cold["process_s"] / warm["process_s"], 2),
    }
    print(json.dumps(report, indent=2))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
