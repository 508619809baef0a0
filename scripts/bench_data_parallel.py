"""Data parallel on Ray Data: N engine replicas vs one on the same work, per thread setting.

python scripts/bench_data_parallel.py --out docs/data_parallel.json            # the demo job
python scripts/bench_data_parallel.py --rounds 1 --num-prompts 64 --out x.json

Every configuration runs in a fresh process, the configurations interleaved within each
round so the shared machine's load falls on all of them alike:
  single-Tt     the single-process CLI (paged-jax-generate), its process on T cores;
  dpN-Tt        generate_dataset on a local Ray cluster, N replicas, each pinned to T
                cores (XLA's CPU thread pools follow the cores a process may use);
  dpN-Tt-free   the same unpinned: every replica sees every core.
The work is the same for all: the built-in demo model and prompts, greedy, the same
engine sizes, a compile cache warmed before the first round (start-up is reported, not
compared). The figure is generation throughput: generated tokens over the span from the
first batch's start to the last batch's end on any replica (the CLI's wall_s, which also
excludes load and warm-up); the end-to-end process time is beside it. On a multi-GPU host
the script runs unchanged (replicas then take --tensor-parallel-size GPUs each).
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

ENGINE = {"max_num_seqs": 64, "max_num_batched_tokens": 512}


def configs(cores: int, replicas: int) -> list[dict]:
    """The configurations a user of this host would choose between."""
    out = [{"name": f"single-{t}t", "kind": "single", "threads": t} for t in (cores, 1)]
    for t in (cores, 1):
        out.append({"name": f"dp1-{t}t", "kind": "ray", "replicas": 1, "threads": t})
    share = max(1, cores // replicas)
    out.append(
        {"name": f"dp{replicas}-{share}t", "kind": "ray", "replicas": replicas, "threads": share}
    )
    out.append(
        {
            "name": f"dp{replicas}-{cores}t-free",
            "kind": "ray",
            "replicas": replicas,
            "threads": cores,
            "pin": False,
        }
    )
    unique = {c["name"]: c for c in out}  # on a 1-core host some coincide
    return list(unique.values())


def run_child(config: dict, args: argparse.Namespace) -> dict:
    """One configuration in this (fresh) process; its figures as a dict."""
    from paged_jax.entrypoints.demo import ensure_demo_model

    model_dir = ensure_demo_model(args.cache_dir)
    t_start = time.perf_counter()
    if config["kind"] == "single":
        cores = sorted(os.sched_getaffinity(0))[: config["threads"]]
        os.sched_setaffinity(0, cores)  # before jax starts: XLA sizes its pools from it
        from paged_jax.entrypoints.generate_cli import main as generate_main

        summary = pathlib.Path(args.work) / f"summary-{os.getpid()}.json"
        cli = ["--model", str(model_dir), "--num-prompts", str(args.num_prompts)]
        cli += ["--max-tokens", str(args.max_tokens), "--compile-cache-dir", args.compile_cache]
        cli += ["--max-num-seqs", str(ENGINE["max_num_seqs"])]
        cli += ["--max-num-batched-tokens", str(ENGINE["max_num_batched_tokens"])]
        cli += ["--summary-json", str(summary), "--no-tqdm"]
        code = generate_main(cli)
        s = json.loads(summary.read_text())
        return {
            "exit": code,
            "generated_tokens": s["generated_tokens"],
            "generation_s": s["wall_s"],
            "load_and_warmup_s": s["load_and_warmup_s"],
            "steps": s["steps"],
            "process_s": time.perf_counter() - t_start,
        }
    import ray
    import ray.data

    from paged_jax.constants import cdiv
    from paged_jax.entrypoints.data_parallel import DEFAULT_BATCH_SIZE, generate_dataset, start_ray
    from paged_jax.entrypoints.demo_prompts import builtin_prompts
    from paged_jax.sampling_params import SamplingParams

    ray.data.DataContext.get_current().enable_progress_bars = False
    start_ray(None)
    texts = builtin_prompts(args.num_prompts)
    rows = [{"index": i, "line": i + 1, "prompt": t} for i, t in enumerate(texts)]
    n = config["replicas"]
    batch = min(DEFAULT_BATCH_SIZE, max(1, cdiv(len(rows), 2 * n)))  # as the CLI chooses
    out = generate_dataset(
        ray.data.from_items(rows),
        model_dir,
        SamplingParams(temperature=0.0, max_tokens=args.max_tokens),
        data_parallel_size=n,
        batch_size=batch,
        cpus_per_replica=min(config["threads"], os.cpu_count() or 1)
        if config.get("pin", True)
        else 1,
        pin_cpus=config.get("pin", True),
        compile_cache=args.compile_cache,
        **ENGINE,
    )
    generated, replicas = 0, {}
    for b in out.iter_batches(batch_size=None, batch_format="pyarrow"):
        for text, stats in zip(b["record"].to_pylist(), b["replica"].to_pylist()):
            record = json.loads(text)
            generated += sum(len(c["token_ids"]) for c in record["outputs"])
            info = json.loads(stats)
            if info["batches"] >= replicas.get(info["name"], {}).get("batches", 0):
                replicas[info["name"]] = info
    ray.shutdown()
    each = list(replicas.values())
    return {
        "exit": 0,
        "generated_tokens": generated,
        "generation_s": max(r["last_end"] for r in each) - min(r["first_start"] for r in each),
        "load_and_warmup_s": max(r["load_s"] + r["warmup_s"] for r in each),
        "steps": sum(r["steps"] for r in each),
        "batch_size": batch,
        "replicas": [{k: r[k] for k in ("cores", "requests", "busy_s", "steps")} for r in each],
        "process_s": time.perf_counter() - t_start,
    }


def run_fresh(config: dict, args: argparse.Namespace) -> dict:
    """`config` in a new process (this script's --child mode), with the load around it."""
    cmd = [sys.executable, __file__, "--child", json.dumps(config), "--work", args.work]
    cmd += ["--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens)]
    cmd += ["--compile-cache", args.compile_cache]
    if args.cache_dir:
        cmd += ["--cache-dir", args.cache_dir]
    load_before = os.getloadavg()[0]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{config['name']} failed:\n{proc.stderr[-4000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    result = json.loads(line[len("RESULT ") :])
    result["tokens_per_s"] = result["generated_tokens"] / result["generation_s"]
    result["loadavg_before"], result["loadavg_after"] = load_before, os.getloadavg()[0]
    return result


def spread(values: list[float]) -> dict:
    return {
        "median": round(statistics.median(values), 2),
        "min": round(min(values), 2),
        "max": round(max(values), 2),
        "runs": [round(v, 2) for v in values],
    }


def summarize(todo: list[dict], runs: dict[str, list[dict]]) -> tuple[dict, str]:
    """Per configuration: its spread, and its throughput over the best single-process
    setting's (the one with the highest median: what a user of one process would pick),
    per round too (the runs of one round share the machine's load), and for Ray runs
    over the one-replica Ray run with the same cores per replica (the scaling itself)."""
    singles = [c["name"] for c in todo if c["kind"] == "single"]
    best = max(singles, key=lambda n: statistics.median(x["tokens_per_s"] for x in runs[n]))
    table = {}
    for config in todo:
        rs = runs[config["name"]]
        tps = [x["tokens_per_s"] for x in rs]
        per_round = [x["tokens_per_s"] / b["tokens_per_s"] for x, b in zip(rs, runs[best])]
        same = f"dp1-{config.get('threads')}t"
        scaling = {}
        if config["kind"] == "ray" and same in runs and same != config["name"]:
            ratios = [x["tokens_per_s"] / b["tokens_per_s"] for x, b in zip(rs, runs[same])]
            scaling = {"vs_" + same: spread(ratios)}
        table[config["name"]] = {
            "config": config,
            **scaling,
            "tokens_per_s": spread(tps),
            "vs_best_single": spread(per_round)
            | {
                "of_medians": round(
                    statistics.median(tps)
                    / statistics.median(x["tokens_per_s"] for x in runs[best]),
                    3,
                )
            },
            "generation_s": spread([x["generation_s"] for x in rs]),
            "process_s": spread([x["process_s"] for x in rs]),
            "load_and_warmup_s": spread([x["load_and_warmup_s"] for x in rs]),
            "generated_tokens": rs[0]["generated_tokens"],
            "loadavg_before": spread([x["loadavg_before"] for x in rs]),
        }
    return table, best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the report as JSON here")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--cache-dir", help="where the demo model lives (default: the CLI's)")
    p.add_argument("--compile-cache", help="compile cache (default: a fresh one, warmed first)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(run_child(json.loads(args.child), args)), flush=True)
        return 0
    args.work = tempfile.mkdtemp(prefix="bench_dp_")
    args.compile_cache = args.compile_cache or os.path.join(args.work, "compile_cache")
    cores = len(os.sched_getaffinity(0))
    todo = configs(cores, args.replicas)
    print(f"warming the compile cache ({todo[0]['name']}) ...", file=sys.stderr, flush=True)
    run_fresh(todo[0], args)
    runs: dict[str, list[dict]] = {c["name"]: [] for c in todo}
    for r in range(args.rounds):
        order = todo[r % len(todo) :] + todo[: r % len(todo)]  # rotate: no fixed slot
        for config in order:
            result = run_fresh(config, args)
            runs[config["name"]].append(result)
            print(
                f"round {r + 1} {config['name']:>14}: {result['tokens_per_s']:7.1f} tok/s "
                f"(generation {result['generation_s']:.2f} s, process {result['process_s']:.1f} s, "
                f"load {result['loadavg_before']:.1f})",
                file=sys.stderr,
                flush=True,
            )
    table, best = summarize(todo, runs)
    report = {
        "command": "python scripts/bench_data_parallel.py " + " ".join(argv or sys.argv[1:]),
        "machine": {
            "platform": platform.platform(),
            "cores": cores,
            "python": platform.python_version(),
        },
        "work": {
            "model": "built-in demo (Llama, 4 layers, hidden 256, f32, random weights)",
            "prompts": args.num_prompts,
            "max_tokens": args.max_tokens,
            "engine": ENGINE,
            "rounds": args.rounds,
        },
        "baseline": todo[0]["name"],
        "best_single": best,
        "results": table,
        "runs": runs,
    }
    text = json.dumps(report, indent=2)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")
    for name, row in table.items():
        print(
            f"{name:>14}: {row['tokens_per_s']['median']:7.1f} tok/s "
            f"({row['tokens_per_s']['min']}-{row['tokens_per_s']['max']}), "
            f"{row['vs_best_single']['median']}x {best} (per round "
            f"{row['vs_best_single']['runs']})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
