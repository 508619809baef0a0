"""lm-eval's `paged-jax` backend against its `hf` backend on the local tasks, each backend
at its best batch size.

Builds one random ~85M Llama checkpoint (byte tokenizer with BOS), writes larger documents
for the local tasks of tests/lm_eval/tasks (multiple choice, rolling perplexity,
generate_until), then runs lm-eval's simple_evaluate on the three tasks once per backend
and batch setting, each run in a fresh process of its own (no backend warms the other's
caches or shares its memory). Reports per run: the model's load seconds (paged-jax: its
warm-up compiles included, also reported apart), evaluation seconds and the load average;
per backend the best setting; two ratios of the bests (evaluation alone, and load +
warm-up + evaluation); and the largest per-document difference of every run from the
first hf run.

Exits 1 when a run's per-document results disagree with the hf run's: a loglikelihood
(multiple-choice choice or rolling document) further than --tolerance-per-token times its
number of scored tokens, an is_greedy flag, or a greedy generation that differs. The
bound is measured first, in a process of its own (f32_error): both backends' f32 per-token
logprobs against a float64 forward of the same checkpoint.

    python scripts/bench_lm_eval.py --out docs/lm_eval_speed.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import multiprocessing
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

# ~85M parameters (GPT-2 small's layer shapes) with the 259-token byte vocabulary.
MODEL_SHAPE = dict(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    max_position_embeddings=1024,
    vocab_size=259,
)
# The 85M random model's f32 logprobs (|logprob| ~9) each carry up to ~2e-4 of rounding
# against a float64 forward (f32_error measured paged-jax 1.9e-4, the hf backend 1.3e-4,
# 1.7e-4 between the two; docs/lm_eval_speed.json), so a loglikelihood summed over n
# tokens may differ by up to n times the per-token bound, below the two errors' sum.
TOLERANCE_PER_TOKEN = 3e-4


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a comma-separated list of ints >= 1")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=pathlib.Path, default=None, help="write the JSON report here")
    p.add_argument("--tasks-dir", type=pathlib.Path, default=pathlib.Path("tests/lm_eval/tasks"))
    p.add_argument("--num-mc", type=int, default=400, help="questions (4 requests each)")
    p.add_argument("--num-rolling", type=int, default=100, help="rolling documents")
    p.add_argument("--num-gen", type=int, default=200, help="generation prompts")
    p.add_argument("--max-length", type=int, default=128, help="lm-eval's context window")
    p.add_argument("--layers", type=int, default=MODEL_SHAPE["num_hidden_layers"])
    p.add_argument("--hidden", type=int, default=MODEL_SHAPE["hidden_size"])
    p.add_argument("--intermediate", type=int, default=MODEL_SHAPE["intermediate_size"])
    p.add_argument("--heads", type=int, default=MODEL_SHAPE["num_attention_heads"])
    p.add_argument("--hf-batch-sizes", type=_int_list, default=[64, 256])
    p.add_argument("--paged-jax-max-num-seqs", type=_int_list, default=[64, 256])
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each backend's best setting (the sweep's run included); >1 reports "
        "the spread and uses the median",
    )
    p.add_argument("--tolerance-per-token", type=float, default=TOLERANCE_PER_TOKEN)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats={args.repeats} must be >= 1")
    return args


def build_model(directory: pathlib.Path, args: argparse.Namespace) -> int:
    """Saves the random checkpoint + tokenizer into directory; returns its parameter count."""
    from paged_jax.testing.lm_eval_tasks import save_byte_tokenizer
    from paged_jax.testing.tiny_models import build_tiny_hf_checkpoint

    shape = dict(
        MODEL_SHAPE,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
    )
    build_tiny_hf_checkpoint("llama", directory, **shape)
    save_byte_tokenizer(directory)
    h, i, v, n = args.hidden, args.intermediate, shape["vocab_size"], args.layers
    return n * (4 * h * h + 3 * h * i + 2 * h) + 2 * v * h + h


def run_backend(spec: dict[str, Any]) -> dict[str, Any]:
    """One backend at one setting, in the (fresh) process that calls it: loads the model,
    evaluates the three tasks, returns the timings, metrics and per-document results."""
    from paged_jax.testing.lm_eval_tasks import TASK_NAMES, evaluate_local_tasks, per_document

    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    if spec["backend"] == "hf":
        from lm_eval.models.huggingface import HFLM

        model = HFLM(
            pretrained=spec["model_dir"],
            dtype="float32",
            max_length=spec["max_length"],
            batch_size=spec["batch_size"],
            device="cpu",
        )
        batch_size: Any = spec["batch_size"]
    else:
        from paged_jax.lm_eval import PagedJaxLM

        model = PagedJaxLM(
            pretrained=spec["model_dir"],
            dtype="float32",
            max_model_len=spec["max_length"],
            max_num_seqs=spec["max_num_seqs"],
            max_num_batched_tokens=spec["max_num_batched_tokens"],
            batch_size="auto",
        )
        batch_size = "auto"
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    results = evaluate_local_tasks(
        model, spec["tasks_dir"], batch_size=batch_size, data_dir=spec["data_dir"]
    )
    eval_s = time.perf_counter() - start
    run = {k: spec[k] for k in ("backend", "batch_size", "max_num_seqs") if k in spec}
    run.update(load_s=load_s, eval_s=eval_s, load_s_plus_eval_s=load_s + eval_s)
    run.update(loadavg_1min_before=load_before, loadavg_1min_after=os.getloadavg()[0])
    if spec["backend"] == "paged-jax":
        report = model.llm.engine.warmup_report.summary()
        stats = model.llm.get_stats()
        run.update(
            warmup=report,
            warmup_s=sum(v for k, v in report.items() if k.endswith("_s")),
            prefix_cache_hit_rate=stats["prefix_cache_hit_rate"],
            num_compiles_after_warmup=stats["num_compiles_after_warmup"],
        )
    metrics = {
        task: {k: v for k, v in row.items() if k != "alias" and "stderr" not in k}
        for task, row in results["results"].items()
    }
    docs = {task: per_document(results, task) for task in TASK_NAMES}
    return {"run": run, "metrics": metrics, "docs": docs, "n_samples": results["n-samples"]}


def f32_error(spec: dict[str, Any]) -> dict[str, Any]:
    """Largest per-token |f32 logprob - float64 logprob| of each backend's forward on the
    first rolling document's first max_length tokens (BOS first), and the largest
    |difference| of the two backends' sums over those tokens."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from paged_jax import LLM, SamplingParams

    with open(pathlib.Path(spec["data_dir"]) / "pj_rolling.jsonl", encoding="utf-8") as f:
        text = json.loads(f.readline())["text"]
    ids = [1, *text.encode()][: spec["max_length"]]  # the byte tokenizer: id = byte + 3
    ids = [ids[0], *(b + 3 for b in ids[1:])]
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], torch_dtype=torch.float32)

    def torch_logprobs() -> np.ndarray:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
            lp = torch.log_softmax(logits, -1)
        return np.array([lp[i, ids[i + 1]].item() for i in range(len(ids) - 1)])

    hf32 = torch_logprobs()
    model = model.double()
    exact = torch_logprobs()
    llm = LLM(
        spec["model_dir"], dtype="float32", max_model_len=spec["max_length"] + 2, warmup=False
    )
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    pj32 = np.array([e[t].logprob for e, t in zip(out[0].prompt_logprobs[1:], ids[1:])])
    return {
        "num_tokens": len(ids) - 1,
        "mean_abs_logprob": float(np.abs(exact).mean()),
        "hf_max_abs_err_per_token": float(np.abs(hf32 - exact).max()),
        "paged_jax_max_abs_err_per_token": float(np.abs(pj32 - exact).max()),
        "hf_vs_paged_jax_max_abs_diff_per_token": float(np.abs(hf32 - pj32).max()),
        "hf_vs_paged_jax_abs_diff_of_sums": float(abs(hf32.sum() - pj32.sum())),
    }


def in_fresh_process(fn: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """fn(spec) in a new (spawned) Python process."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(fn, spec).result()


def scored_tokens(data_dir: pathlib.Path) -> dict[str, list]:
    """Tokens each loglikelihood sums (the byte tokenizer: one per byte): per choice of
    each question (lm-eval prefixes its target delimiter " "), per rolling document."""

    def rows(name: str) -> list[dict]:
        with open(data_dir / name, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    return {
        "pj_mc": [[len((" " + c).encode()) for c in row["choices"]] for row in rows("pj_mc.jsonl")],
        "pj_rolling": [len(row["text"].encode()) for row in rows("pj_rolling.jsonl")],
    }


def compare_docs(
    want: dict[str, list], got: dict[str, list], tokens: dict[str, list], per_token: float
) -> dict[str, Any]:
    """got's per-document differences from want (per_document's shapes): the largest
    absolute ones, the largest per scored token, and how many exceed per_token times
    their tokens."""
    mc = [
        (a[0], b[0], bool(a[1]) != bool(b[1]), n)
        for x, y, ns in zip(want["pj_mc"], got["pj_mc"], tokens["pj_mc"], strict=True)
        for a, b, n in zip(x, y, ns, strict=True)
    ]
    rolling = [
        (a[0], b[0], False, n)
        for a, b, n in zip(want["pj_rolling"], got["pj_rolling"], tokens["pj_rolling"], strict=True)
    ]
    gens = list(zip(want["pj_gen"], got["pj_gen"], strict=True))

    def worst(rows: list) -> dict[str, float]:
        return {
            "max_abs_diff": max((abs(a - b) for a, b, _, _ in rows), default=0.0),
            "max_abs_diff_per_token": max((abs(a - b) / n for a, b, _, n in rows), default=0.0),
            "num_beyond_tolerance": sum(abs(a - b) > per_token * n for a, b, _, n in rows),
        }

    return {
        "mc": worst(mc),
        "num_is_greedy_differ": sum(flag for _, _, flag, _ in mc),
        "rolling": worst(rolling),
        "num_generations_differ": sum(a != b for a, b in gens),
        "num_generations": len(gens),
    }


def agrees(diff: dict[str, Any]) -> bool:
    return (
        diff["mc"]["num_beyond_tolerance"] == 0
        and diff["rolling"]["num_beyond_tolerance"] == 0
        and diff["num_is_greedy_differ"] == 0
        and diff["num_generations_differ"] == 0
    )


def rolling_windows(data_dir: pathlib.Path, max_length: int) -> int:
    """Rolling windows the documents make: the byte tokenizer gives one token per byte
    (plus the window's prefix token), lm-eval cuts windows of max_length targets."""
    with open(data_dir / "pj_rolling.jsonl", encoding="utf-8") as f:
        lengths = [len(json.loads(line)["text"].encode()) for line in f if line.strip()]
    return sum(math.ceil(n / max_length) for n in lengths)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median (and spread) of repeated runs of one setting."""
    evals = [r["eval_s"] for r in runs]
    totals = [r["load_s_plus_eval_s"] for r in runs]
    return {
        **runs[0],
        "eval_s": statistics.median(evals),
        "load_s_plus_eval_s": statistics.median(totals),
        "eval_s_all": evals,
        "load_s_plus_eval_s_all": totals,
        "num_runs": len(runs),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import jax

    from paged_jax.testing.lm_eval_tasks import write_task_data

    started = time.time()
    loadavg_start = os.getloadavg()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench_lm_eval_"))
    num_params = build_model(tmp / "model", args)
    data_dir = write_task_data(tmp / "data", args.num_mc, args.num_rolling, args.num_gen)
    tokens = scored_tokens(data_dir)
    num_windows = rolling_windows(data_dir, args.max_length)
    common = dict(
        model_dir=str(tmp / "model"),
        tasks_dir=str(args.tasks_dir.resolve()),
        data_dir=str(data_dir),
        max_length=args.max_length,
    )
    f32 = in_fresh_process(f32_error, common)
    print(f"f32 logprob error against float64: {f32}", flush=True)
    specs = [dict(common, backend="hf", batch_size=n) for n in args.hf_batch_sizes]
    specs += [
        dict(
            common,
            backend="paged-jax",
            max_num_seqs=n,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
        for n in args.paged_jax_max_num_seqs
    ]
    reference: dict[str, Any] | None = None
    counts: dict[str, Any] = {}
    metrics: dict[str, dict] = {}
    outcomes: list[tuple[dict[str, Any], dict[str, Any]]] = []  # (spec, run)
    best: dict[str, Any] = {}

    def report(complete: bool) -> dict[str, Any]:
        """The JSON report; written after every run (complete=False until the last)."""
        done = len(best) == 2
        out = {
            "command": " ".join(["python scripts/bench_lm_eval.py", *(argv or sys.argv[1:])]),
            "complete": complete,
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)),
            "wall_s": time.time() - started,
            "platform": {
                "jax_backend": jax.default_backend(),
                "machine": platform.machine(),
                "cpu_count": os.cpu_count(),
                "python": platform.python_version(),
                "jax": jax.__version__,
                "loadavg_start": loadavg_start,
                "loadavg_end": os.getloadavg(),
            },
            "model": {"family": "llama", "num_params": num_params, "dtype": "float32"},
            "tasks": {
                "documents": counts,
                "requests": {
                    "loglikelihood": 4 * args.num_mc,
                    "rolling_windows": num_windows,
                    "generate_until": args.num_gen,
                    "total": 4 * args.num_mc + num_windows + args.num_gen,
                },
            },
            "max_length": args.max_length,
            "f32_error_vs_float64": f32,
            "tolerance_per_token": args.tolerance_per_token,
            "runs": [r for _, r in outcomes],
            "best": best,
            "speedup_eval": best["hf"]["eval_s"] / best["paged-jax"]["eval_s"] if done else None,
            # Each backend's load counted (paged-jax's: its warm-up compiles, no compile cache).
            "speedup_load_and_eval": best["hf"]["load_s_plus_eval_s"]
            / best["paged-jax"]["load_s_plus_eval_s"]
            if done
            else None,
            "metrics": metrics,
            "all_runs_agree_with_hf": all(r["agrees"] for _, r in outcomes),
        }
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(out, indent=1) + "\n")
        return out

    def execute(spec: dict[str, Any]) -> None:
        nonlocal reference
        out = in_fresh_process(run_backend, spec)
        run = out["run"]
        if reference is None:
            reference = out
            counts.update(out["n_samples"])
        diff = compare_docs(reference["docs"], out["docs"], tokens, args.tolerance_per_token)
        run.update(vs_first_hf_run=diff, agrees=agrees(diff))
        metrics.setdefault(spec["backend"], out["metrics"])
        outcomes.append((spec, run))
        setting = {k: run[k] for k in ("batch_size", "max_num_seqs") if k in run}
        print(
            f"{spec['backend']} {setting}: load {run['load_s']:.1f} s, eval "
            f"{run['eval_s']:.1f} s, load average {run['loadavg_1min_before']:.1f} -> "
            f"{run['loadavg_1min_after']:.1f}, agrees with hf: {run['agrees']} {diff}",
            flush=True,
        )
        report(complete=False)

    for spec in specs:
        execute(spec)
    for name in ("hf", "paged-jax"):
        mine = [(s, r) for s, r in outcomes if s["backend"] == name]
        spec, _ = min(mine, key=lambda sr: sr[1]["eval_s"])
        for _ in range(args.repeats - 1):
            execute(spec)
        best[name] = summarize([r for s, r in outcomes if s is spec])
    final = report(complete=True)
    keys = ("best", "speedup_eval", "speedup_load_and_eval", "all_runs_agree_with_hf")
    print(json.dumps({k: final[k] for k in keys}, indent=1))
    if not final["all_runs_agree_with_hf"]:
        raise SystemExit(
            f"per-document results differ from the hf backend's beyond "
            f"{args.tolerance_per_token} per scored token (see vs_first_hf_run in the runs)"
        )
    return final


if __name__ == "__main__":
    main()
