"""Cold vs warm start of the demo job, per phase, beside each run's generation time.

python scripts/bench_start.py --out docs/start_time.json --readme README.md   # the demo job
python scripts/bench_start.py --rounds 1 --out x.json -- --max-num-seqs 8       # extra flags
python scripts/bench_start.py --short-prompts 8 --out docs/start_time_small.json  # a small job

Each round makes an empty compile-cache directory and runs the job twice, each time in a
fresh process (``python -m paged_jax.entrypoints.generate_cli``, what scripts/generate.py and
``bash scripts/demo.sh`` run): the first ("cold") traces, lowers and compiles every step
program and saves it; the second ("warm") loads them. From each run's --summary-json it
reports load, warm-up and its phases (trace, lower, compile, cache load), the programs
compiled and loaded, the generation time and the ratio (load + warm-up) / generation,
with the machine's load average around each process. The targets: cold <= 4x the
generation time, warm <= 1x (medians over the rounds). --readme rewrites the start-time
table between its markers from the report. The warm run's programs are keyed by a hash of
the package sources, so run it on a tree nobody edits meanwhile (for example a `git
archive` of the commit, with PYTHONPATH pointing at it).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

START_PHASES = (
    "load_s",
    "warmup_s",
    "warmup_trace_s",
    "warmup_lower_s",
    "warmup_compile_s",
    "warmup_cache_load_s",
    "warmup_cache_save_s",
    "warmup_run_s",
    "load_and_warmup_s",
    "wall_s",
)
COUNTS = (
    "start",
    "programs",
    "programs_compiled",
    "programs_loaded",
    "warmup_compiles",
    "compiles_after_warmup",
    "max_num_seqs",
    "max_num_batched_tokens",
)
TARGETS = {"cold": 4.0, "warm": 1.0}  # (load + warm-up) / generation, at most
SHORT_PROMPT = "Hello {}"  # --short-prompts: 7-8 tokens each with the demo byte tokenizer
TABLE_BEGIN = "<!-- start-time table: scripts/bench_start.py --readme -->"
TABLE_END = "<!-- end of start-time table -->"


def run_once(cli_args: list[str], env: dict[str, str], summary: str) -> dict:
    """One fresh process of the job; its summary's start-up figures and the machine load."""
    cmd = [sys.executable, "-m", "paged_jax.entrypoints.generate_cli", *cli_args]
    cmd += ["--summary-json", summary, "--no-tqdm"]
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    process_s = time.perf_counter() - t0
    if proc.returncode not in (0, 1):
        raise SystemExit(f"generate failed ({proc.returncode}): {proc.stderr[-2000:]}")
    with open(summary) as f:
        s = json.load(f)
    out = {k: s[k] for k in (*COUNTS, *START_PHASES)}
    out["generation_s"] = out.pop("wall_s")
    out["load_and_warmup_over_generation"] = round(
        s["load_and_warmup_s"] / max(s["wall_s"], 1e-9), 2
    )
    out["process_s"] = round(process_s, 2)
    out["load_average"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return out


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 2),
        "min": round(min(values), 2),
        "max": round(max(values), 2),
    }


def summarize(rounds: list[dict]) -> dict:
    """Medians and spreads over the rounds, and which targets the medians meet."""
    out: dict = {}
    for start in ("cold", "warm"):
        runs = [r[start] for r in rounds]
        out[start] = {
            k: _spread([r[k] for r in runs])
            for k in (*START_PHASES, "generation_s", "load_and_warmup_over_generation")
            if k != "wall_s"
        }
        out[start]["programs_compiled"] = sorted({r["programs_compiled"] for r in runs})
        out[start]["programs_loaded"] = sorted({r["programs_loaded"] for r in runs})
        out[start]["starts"] = sorted({r["start"] for r in runs})
    out["targets"] = {
        start: {
            "at_most": limit,
            "median_ratio": out[start]["load_and_warmup_over_generation"]["median"],
            "met": out[start]["load_and_warmup_over_generation"]["median"] <= limit,
        }
        for start, limit in TARGETS.items()
    }
    return out


def markdown_table(report: dict) -> str:
    """The README's start-time table (medians, with min-max) and the command under it."""
    s = report["summary"]

    def cell(start: str, key: str, unit: str = " s") -> str:
        v = s[start][key]
        return f"{v['median']}{unit} ({v['min']}-{v['max']})"

    rows = [
        "| run (demo job) | programs | load | warm-up: trace / lower / compile / cache load "
        "| load + warm-up | generation | (load + warm-up) / generation |",
        "|---|---|---|---|---|---|---|",
    ]
    for start, what in (("cold", "compiled"), ("warm", "loaded")):
        n = s[start][f"programs_{what}"]
        phases = " / ".join(
            f"{s[start][k]['median']}"
            for k in ("warmup_trace_s", "warmup_lower_s", "warmup_compile_s", "warmup_cache_load_s")
        )
        target = s["targets"][start]
        met = "met" if target["met"] else "not met"
        rows.append(
            f"| {start} | {'/'.join(map(str, n))} {what} | {cell(start, 'load_s')} | "
            f"{cell(start, 'warmup_s')}: {phases} s | {cell(start, 'load_and_warmup_s')} | "
            f"{cell(start, 'generation_s')} | **{target['median_ratio']}x** "
            f"(target <= {target['at_most']:g}x: {met}) |"
        )
    m = report["machine"]
    first = report["rounds"][0]["cold"]
    engine = ""
    if "max_num_seqs" in first:
        engine = (
            f", engine max_num_seqs={first['max_num_seqs']} and max_num_batched_tokens="
            f"{first['max_num_batched_tokens']}"
        )
    rows.append("")
    rows.append(
        f"Medians (min-max) of {len(report['rounds'])} rounds, `{report['command']}`{engine}, "
        f"on a {m['cpus']}-core machine (load average {m['load_average_at_start']} at the "
        f"start, {m['load_average_at_end']} at the end; JSON in `{report['out']}`)."
    )
    return "\n".join(rows)


def update_readme(path: pathlib.Path, table: str) -> None:
    """Replaces the text between TABLE_BEGIN and TABLE_END in the README."""
    text = path.read_text()
    if TABLE_BEGIN not in text or TABLE_END not in text:
        raise SystemExit(f"{path} has no start-time table markers ({TABLE_BEGIN!r})")
    head, rest = text.split(TABLE_BEGIN, 1)
    _, tail = rest.split(TABLE_END, 1)
    path.write_text(f"{head}{TABLE_BEGIN}\n{table}\n{TABLE_END}{tail}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="start_time.json", help="where to save the JSON")
    p.add_argument("--rounds", type=int, default=3, help="cold + warm pairs, each on a new cache")
    p.add_argument("--readme", help="rewrite the start-time table in this README")
    p.add_argument(
        "--short-prompts",
        type=int,
        help="instead of the built-in set, this many one-line prompts (SHORT_PROMPT)",
    )
    p.add_argument("cli_args", nargs="*", help="flags passed to paged-jax-generate (after --)")
    args = p.parse_args(argv)
    from paged_jax.entrypoints.demo import ensure_demo_model

    if "--model" not in args.cli_args:
        ensure_demo_model()  # written once, outside every timed run
    load_at_start = os.getloadavg()[0]
    rounds = []
    with tempfile.TemporaryDirectory() as job_dir:
        cli_args = list(args.cli_args)
        if args.short_prompts:
            prompts = pathlib.Path(job_dir) / "prompts.txt"
            prompts.write_text(
                "".join(SHORT_PROMPT.format(i) + "\n" for i in range(args.short_prompts))
            )
            cli_args += ["--prompts", str(prompts)]
        for i in range(args.rounds):
            with tempfile.TemporaryDirectory() as tmp:
                env = {**os.environ, "PAGED_JAX_COMPILE_CACHE": os.path.join(tmp, "cache")}
                cold = run_once(cli_args, env, os.path.join(tmp, "cold.json"))
                warm = run_once(cli_args, env, os.path.join(tmp, "warm.json"))
            rounds.append({"cold": cold, "warm": warm})
            print(f"round {i + 1}: {json.dumps(rounds[-1])}", file=sys.stderr)
    report = {
        "command": "python scripts/bench_start.py " + " ".join(argv or sys.argv[1:]),
        "out": args.out,
        "cli_args": args.cli_args,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average_at_start": round(load_at_start, 2),
            "load_average_at_end": round(os.getloadavg()[0], 2),
        },
        "targets": {k: f"(load + warm-up) / generation <= {v:g}" for k, v in TARGETS.items()},
        "summary": summarize(rounds),
        "rounds": rounds,
    }
    print(json.dumps(report["summary"], indent=2))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    if args.readme:
        update_readme(pathlib.Path(args.readme), markdown_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
