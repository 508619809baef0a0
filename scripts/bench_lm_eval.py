"""lm-eval's `paged-jax` backend against its `hf` backend on the local tasks, side by side.

Builds one random Llama checkpoint (byte tokenizer with BOS), writes larger documents for
the local tasks of tests/lm_eval/tasks (multiple choice, rolling perplexity,
generate_until), then runs lm-eval's simple_evaluate on the three tasks with each backend
at each batch size given, in one process. Reports evaluation seconds (the model built
beforehand, its load time apart), the best of each backend, their ratio, and whether
the two backends' metrics agree.

    python scripts/bench_lm_eval.py --out docs/lm_eval_speed.json
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import platform
import sys
import tempfile
import time
from typing import Any

# ~80M parameters (GPT-2 small's layer shapes) with the 259-token byte vocabulary.
MODEL_SHAPE = dict(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    max_position_embeddings=1024,
    vocab_size=259,
)


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a comma-separated list of ints >= 1")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=pathlib.Path, default=None, help="write the JSON report here")
    p.add_argument("--tasks-dir", type=pathlib.Path, default=pathlib.Path("tests/lm_eval/tasks"))
    p.add_argument("--num-mc", type=int, default=500, help="questions (4 requests each)")
    p.add_argument("--num-rolling", type=int, default=200, help="rolling documents")
    p.add_argument("--num-gen", type=int, default=300, help="generation prompts")
    p.add_argument("--max-length", type=int, default=128, help="lm-eval's context window")
    p.add_argument("--layers", type=int, default=MODEL_SHAPE["num_hidden_layers"])
    p.add_argument("--hidden", type=int, default=MODEL_SHAPE["hidden_size"])
    p.add_argument("--intermediate", type=int, default=MODEL_SHAPE["intermediate_size"])
    p.add_argument("--heads", type=int, default=MODEL_SHAPE["num_attention_heads"])
    p.add_argument("--hf-batch-sizes", type=_int_list, default=[16, 64])
    p.add_argument("--paged-jax-max-num-seqs", type=_int_list, default=[64, 256])
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    return p.parse_args(argv)


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


def evaluate(model: Any, tasks_dir: pathlib.Path, data_dir: pathlib.Path, batch_size: Any):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(
        include_path=str(tasks_dir), include_defaults=False, metadata={"data_dir": str(data_dir)}
    )
    start = time.perf_counter()
    results = simple_evaluate(
        model=model,
        tasks=["pj_mc", "pj_rolling", "pj_gen"],
        task_manager=manager,
        batch_size=batch_size,
        device="cpu",
        bootstrap_iters=0,
        log_samples=False,
    )
    seconds = time.perf_counter() - start
    metrics = {
        task: {k: v for k, v in row.items() if k != "alias" and "stderr" not in k}
        for task, row in results["results"].items()
    }
    return seconds, metrics, results["n-samples"]


def metrics_agree(a: dict, b: dict, rel: float = 1e-3) -> bool:
    for task, row in a.items():
        for key, value in row.items():
            other = b[task][key]
            if isinstance(value, float) and not math.isclose(value, other, rel_tol=rel):
                return False
    return True


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import jax
    from lm_eval.models.huggingface import HFLM

    from paged_jax.lm_eval import PagedJaxLM
    from paged_jax.testing.lm_eval_tasks import write_task_data

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench_lm_eval_"))
    num_params = build_model(tmp / "model", args)
    data_dir = write_task_data(tmp / "data", args.num_mc, args.num_rolling, args.num_gen)
    runs: list[dict[str, Any]] = []
    metrics: dict[str, dict] = {}
    for size in args.hf_batch_sizes:
        start = time.perf_counter()
        hf = HFLM(
            pretrained=str(tmp / "model"),
            dtype="float32",
            max_length=args.max_length,
            batch_size=size,
            device="cpu",
        )
        load = time.perf_counter() - start
        seconds, metrics["hf"], counts = evaluate(hf, args.tasks_dir, data_dir, size)
        runs.append(dict(backend="hf", batch_size=size, load_s=load, eval_s=seconds))
        print(f"hf batch_size={size}: load {load:.1f} s, eval {seconds:.1f} s", flush=True)
        del hf
    for seqs in args.paged_jax_max_num_seqs:
        start = time.perf_counter()
        lm = PagedJaxLM(
            pretrained=str(tmp / "model"),
            dtype="float32",
            max_model_len=args.max_length,
            max_num_seqs=seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            batch_size="auto",
        )
        load = time.perf_counter() - start
        seconds, metrics["paged-jax"], counts = evaluate(lm, args.tasks_dir, data_dir, "auto")
        stats = lm.llm.get_stats()
        runs.append(
            dict(
                backend="paged-jax",
                max_num_seqs=seqs,
                load_s=load,
                eval_s=seconds,
                prefix_cache_hit_rate=stats["prefix_cache_hit_rate"],
            )
        )
        print(
            f"paged-jax max_num_seqs={seqs}: load {load:.1f} s (warm-up included), "
            f"eval {seconds:.1f} s",
            flush=True,
        )
        del lm
    best = {
        name: min((r for r in runs if r["backend"] == name), key=lambda r: r["eval_s"])
        for name in ("hf", "paged-jax")
    }
    num_requests = 4 * args.num_mc + args.num_gen  # + rolling windows (several per document)
    report = {
        "command": " ".join(["python scripts/bench_lm_eval.py", *(argv or sys.argv[1:])]),
        "platform": {
            "jax_backend": jax.default_backend(),
            "machine": platform.machine(),
            "python": platform.python_version(),
            "jax": jax.__version__,
        },
        "model": {"family": "llama", "num_params": num_params, "dtype": "float32"},
        "tasks": {"documents": counts, "requests_without_rolling_windows": num_requests},
        "max_length": args.max_length,
        "runs": runs,
        "best": best,
        "speedup_eval": best["hf"]["eval_s"] / best["paged-jax"]["eval_s"],
        # With the model's load (paged-jax: its warm-up compiles, saved by compile_cache).
        "speedup_load_and_eval": (best["hf"]["eval_s"] + best["hf"]["load_s"])
        / (best["paged-jax"]["eval_s"] + best["paged-jax"]["load_s"]),
        "metrics": metrics,
        "metrics_agree_rel_1e-3": metrics_agree(metrics["hf"], metrics["paged-jax"]),
    }
    keys = ("best", "speedup_eval", "speedup_load_and_eval", "metrics_agree_rel_1e-3")
    print(json.dumps({k: report[k] for k in keys}, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
