"""The PagedAttention paper's serving comparison on a simulated GPU clock (OPT-13B, A100-40GB).

    python scripts/sim_serving.py --output docs/serving_simulation.json --figures docs/figures
    python scripts/sim_serving.py --figure14 --output docs/serving_simulation_forks.json \
        --figures docs/figures

With --figure14 it redraws the paper's Figure 14 instead: each request served as parallel
sampling (n = 2, 4, 6) or beam search (width 2, 4, 6) by paged (forks sharing blocks)
and Orca (n reservations each), plus basic sampling as the reference
(serving_study.run_fork_study); the figure is serving_sim_forks.png.

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
    parser.add_argument(
        "--figure14", action="store_true", help="parallel sampling and beam search (Fig. 14)"
    )
    parser.add_argument(
        "--datasets", default=None, help="comma-separated traces (default: sharegpt,alpaca; "
        "alpaca with --figure14)"
    )  # fmt: skip
    parser.add_argument(
        "--duration-s", type=float, default=None,
        help="simulated seconds of arrivals (default 900; 30 with --figure14)"
    )  # fmt: skip
    parser.add_argument(
        "--rel-tol", type=float, default=None,
        help="bisection stops at hi/lo <= 1+tol (default 0.04; 0.08 with --figure14)"
    )  # fmt: skip
    parser.add_argument(
        "--max-num-seqs", type=int, default=None,
        help="--figure14 only: sequences a step may run (default 256)"
    )  # fmt: skip
    parser.add_argument(
        "--other-factors", default=None,
        help="--figure14 only: more bounds than 4x, comma-separated (default 2,8)"
    )  # fmt: skip
    parser.add_argument(
        "--cells", default=None,
        help="--figure14 only: mode:width pairs, e.g. basic:1,parallel:2,beam:6 (default all)"
    )  # fmt: skip
    parser.add_argument(
        "--overhead-scales", default="0.5,2", help="step-overhead multipliers for sensitivity rows"
    )
    parser.add_argument(
        "--flops-scales", default="0.25", help="peak-FLOPs multipliers for sensitivity rows"
    )
    parser.add_argument("--seed", type=int, default=0, help="trace seed")
    args = parser.parse_args(argv)

    from paged_jax.memory_study import serving_study

    tables = serving_study.fork_markdown_tables if args.figure14 else serving_study.markdown_tables
    if args.tables_only:
        print(tables(json.loads(pathlib.Path(args.output).read_text())))
        return 0
    base = (
        serving_study.ForkServingSettings() if args.figure14 else serving_study.SimStudySettings()
    )
    changes = {"seed": args.seed}
    if args.datasets is not None:
        changes["datasets"] = tuple(args.datasets.split(","))
    if args.duration_s is not None:
        changes["duration_s"] = args.duration_s
    if args.rel_tol is not None:
        changes["rel_tol"] = args.rel_tol
    if args.figure14:
        if args.cells is not None:
            pairs = [c.split(":") for c in args.cells.split(",") if c]
            changes["cells"] = tuple((m, int(w)) for m, w in pairs)
        if args.max_num_seqs is not None:
            changes["max_num_seqs"] = args.max_num_seqs
        if args.other_factors is not None:
            changes["other_factors"] = tuple(float(x) for x in args.other_factors.split(",") if x)
    else:
        changes["overhead_scales"] = tuple(float(x) for x in args.overhead_scales.split(",") if x)
        changes["flops_scales"] = tuple(float(x) for x in args.flops_scales.split(",") if x)
    settings = dataclasses.replace(base, **changes)
    study = serving_study.run_fork_study if args.figure14 else serving_study.run_study
    commit = _git("rev-parse", "--short", "HEAD")  # read before the run: what it ran
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    t0 = time.perf_counter()
    summary = study(settings, progress=lambda m: print(m, flush=True))
    summary["run"] = {
        "command": "python "
        + shlex.join(["scripts/sim_serving.py", *(sys.argv[1:] if argv is None else argv)]),
        "commit": commit,
        "uncommitted_changes": dirty,
        "wall_s": time.perf_counter() - t0,
    }
    print(tables(summary))
    out = pathlib.Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {out} ({summary['run']['wall_s']:.0f} s)")
    if args.figures:
        name = "serving_sim_forks.png" if args.figure14 else "serving_sim_latency.png"
        fig = pathlib.Path(args.figures) / name
        fig.parent.mkdir(parents=True, exist_ok=True)
        if args.figure14:
            serving_study.plot_fork_latency(summary, fig, dataset=settings.datasets[-1])
        else:
            serving_study.plot_latency(summary, fig)
        print(f"wrote {fig}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
