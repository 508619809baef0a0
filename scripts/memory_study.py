"""Memory study: paged vs contiguous KV allocation on synthetic traces, with figures.

    python scripts/memory_study.py --figures docs/figures/memory --summary docs/memory_study.md

needs the `plots` extra (matplotlib); the JSON goes next to the markdown summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import shlex
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--figures", required=True, help="folder the PNG figures go to")
    parser.add_argument("--summary", required=True, help="markdown summary path (.md)")
    parser.add_argument("--json", default=None, help="JSON path (default: summary with .json)")
    parser.add_argument("--small", action="store_true", help="a tiny trace (seconds), for CI")
    parser.add_argument("--seed", type=int, default=0, help="trace seed")
    parser.add_argument(
        "--check-invariants", action="store_true", help="check the KV manager every step (slow)"
    )
    parser.add_argument(
        "--forks",
        action="store_true",
        help="run the fork study (beam search, parallel sampling) instead; summary e.g. "
        "docs/memory_study_forks.md",
    )
    args = parser.parse_args(argv)
    if args.forks:
        return _forks(args, argv)

    from paged_jax.memory_study import markdown, plots, report

    settings = report.SMALL_STUDY if args.small else report.StudySettings()
    settings = dataclasses.replace(settings, seed=args.seed)
    command = "python scripts/memory_study.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    study = report.run_study(settings, check_invariants=args.check_invariants, progress=print)
    summary = report.summary_dict(study, command)
    md_path = pathlib.Path(args.summary)
    json_path = pathlib.Path(args.json) if args.json else md_path.with_suffix(".json")
    report.write_json(summary, json_path)
    figures = plots.make_all(study, args.figures)
    markdown.write_markdown(summary, figures, md_path, json_path)
    print(f"wrote {md_path}, {json_path} and {len(figures)} figures in {args.figures}")
    return 0


def _forks(args, argv) -> int:
    import json

    from paged_jax.memory_study import forks

    settings = forks.SMALL_FORKS if args.small else forks.ForkStudySettings()
    settings = dataclasses.replace(settings, seed=args.seed)
    command = "python scripts/memory_study.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    summary = forks.run_fork_study(settings, progress=print)
    summary["command"] = command
    md_path = pathlib.Path(args.summary)
    json_path = pathlib.Path(args.json) if args.json else md_path.with_suffix(".json")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(summary, indent=1) + "\n")
    fig_dir = pathlib.Path(args.figures)
    fig_dir.mkdir(parents=True, exist_ok=True)
    fig = fig_dir / "forks.png"
    forks.plot_forks(summary, fig)
    rel_fig = (
        pathlib.Path(*fig.parts[len(md_path.parent.parts) :])
        if fig.is_relative_to(md_path.parent)
        else fig
    )
    md_path.write_text(forks.fork_markdown(summary, str(rel_fig), json_path.name, command))
    print(f"wrote {md_path}, {json_path} and {fig}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
