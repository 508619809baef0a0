"""The PagedAttention paper's serving comparison on a simulated GPU clock (OPT-13B, A100-40GB).

    python scripts/sim_serving.py --output docs/serving_simulation.json --figures docs/figures

Paged, Orca (Oracle / Pow2 / Max) and FasterTransformer-style static batching serve
Poisson traces on a virtual clock (paged_jax/memory_study/serving_sim.py); the sustained
rate of each is found by bisection at 4x (and 2x, 8x) the unloaded normalized latency.
Prints the tables and saves the JSON (every constant, the command, the commit) and the
figure (needs matplotlib). The default run takes tens of minutes on one core.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shlex
import subprocess
import sys
import time


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="JSON path")
    parser.add_argument(
        "--tables-only", action="store_true", help="print the tables of an existing --output JSON"
    )
    parser.add_argument("--figures", default=None, help="folder for serving_sim_latency.png")
    parser.add_argument("--datasets", default="sharegpt,alpaca", help="comma-separated traces")
    parser.add_argument(
        "--duration-s", type=float, default=900.0, help="simulated seconds of arrivals"
    )
    parser.add_argument(
        "--rel-tol", type=float, default=0.04, help="bisection stops at hi/lo <= 1+tol"
    )
    parser.add_argument(
        "--overhead-scales", default="0.5,2", help="step-overhead multipliers for sensitivity rows"
    )
    parser.add_argument(
        "--flops-scales", default="0.25", help="peak-FLOPs multipliers for sensitivity rows"
    )
    parser.add_argument("--seed", type=int, default=0, help="trace seed")
    args = parser.parse_args(argv)

    from paged_jax.memory_study import serving_study

    if args.tables_only:
        print(serving_study.markdown_tables(json.loads(pathlib.Path(args.output).read_text())))
        return 0
    settings = dataclasses.replace(
        serving_study.SimStudySettings(),
        datasets=tuple(args.datasets.split(",")),
        duration_s=args.duration_s,
        rel_tol=args.rel_tol,
        overhead_scales=tuple(float(x) for x in args.overhead_scales.split(",") if x),
        flops_scales=tuple(float(x) for x in args.flops_scales.split(",") if x),
        seed=args.seed,
    )
    commit = _git("rev-parse", "--short", "HEAD")  # read before the run: what it ran
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    t0 = time.perf_counter()
    summary = serving_study.run_study(settings, progress=lambda m: print(m, flush=True))
    summary["run"] = {
        "command": "python "
        + shlex.join(["scripts/sim_serving.py", *(sys.argv[1:] if argv is None else argv)]),
        "commit": commit,
        "uncommitted_changes": dirty,
        "wall_s": time.perf_counter() - t0,
    }
    tables = serving_study.markdown_tables(summary)
    print(tables)
    out = pathlib.Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {out} ({summary['run']['wall_s']:.0f} s)")
    if args.figures:
        fig = pathlib.Path(args.figures) / "serving_sim_latency.png"
        fig.parent.mkdir(parents=True, exist_ok=True)
        serving_study.plot_latency(summary, fig)
        print(f"wrote {fig}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
