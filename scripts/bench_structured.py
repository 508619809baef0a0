"""Structured outputs, host side: grammar compile time per distinct schema (cold and cached)
and the host time per constrained sequence per step (bitmask fill, token accept).

No model runs: a batch of constrained sequences decodes random allowed tokens (EOS with
probability 1/2 when allowed); a sequence that ends starts over with a fresh matcher, so
the batch stays full. The tokenizer is a byte-level BPE trained on the Python standard
library, once per --vocab-sizes entry (or --tokenizer FILE, a checkpoint's tokenizer.json).
Example:

    python scripts/bench_structured.py --vocab-sizes 32000 128000 --num-seqs 64 --steps 64
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import numpy as np

from paged_jax.structured_outputs import (
    GrammarCompiler,
    StructuredOutputsParams,
    allocate_bitmask,
)
from paged_jax.testing.bpe_tokenizer import EOS_TOKEN_ID, stdlib_corpus, train_byte_level_bpe
from paged_jax.testing.structured_cases import nested_schema


def compile_seconds(compiler, params) -> tuple[list[float], list[float]]:
    """Seconds of each params' compile cold, then of each again (a cache hit)."""
    cold, cached = [], []
    for times in (cold, cached):
        for p in params:
            t0 = time.perf_counter()
            compiler.compile(p)
            times.append(time.perf_counter() - t0)
    return cold, cached


def summary_us(samples: list[float]) -> dict:
    us = sorted(1e6 * s for s in samples)
    return {
        "mean": round(statistics.fmean(us), 2),
        "median": round(statistics.median(us), 2),
        "p90": round(us[int(0.9 * (len(us) - 1))], 2),
        "max": round(us[-1], 2),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", help="a tokenizer.json (default: train a byte-level BPE)")
    p.add_argument(
        "--vocab-sizes", type=int, nargs="+", default=[32000], help="trained BPEs' vocabularies"
    )
    p.add_argument("--extra-ids", type=int, default=0, help="model vocabulary = tokenizer's + this")
    p.add_argument("--num-schemas", type=int, default=8, help="distinct schemas compiled")
    p.add_argument("--num-seqs", type=int, default=64, help="constrained sequences per step")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed")
    p.add_argument(
        "--threads", type=int, default=None, help="GrammarCompiler num_threads (default: its own)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="docs/structured_outputs_host.json")
    return p.parse_args(argv)


def allowed_ids(row: np.ndarray, vocab_size: int) -> np.ndarray:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


def run_one(args: argparse.Namespace, bpe_vocab_size: int | None) -> dict:
    """One tokenizer's compile and decode figures."""
    t0 = time.perf_counter()
    if bpe_vocab_size is None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(args.tokenizer)
        source = args.tokenizer
    else:
        # About 320 characters of source per token reaches the target vocabulary.
        corpus = stdlib_corpus(max(8_000_000, 320 * bpe_vocab_size))
        tokenizer = train_byte_level_bpe(corpus, vocab_size=bpe_vocab_size)
        source = f"byte-level BPE trained on the Python {platform.python_version()} stdlib"
    train_s = time.perf_counter() - t0
    vocab_size = tokenizer.get_vocab_size() + args.extra_ids

    t0 = time.perf_counter()
    compiler = GrammarCompiler(
        tokenizer,
        vocab_size=vocab_size,
        eos_token_ids=(EOS_TOKEN_ID,),
        cache_size=1024,
        num_threads=args.threads,
    )
    init_s = time.perf_counter() - t0

    # Compile: each distinct schema cold, then again from the cache.
    params = [StructuredOutputsParams(json=nested_schema(i)) for i in range(args.num_schemas)]
    cold, cached = compile_seconds(compiler, params)
    others = {
        "regex": StructuredOutputsParams(regex=r"[a-z]{2,12}@[a-z]{2,12}\.(com|org|net)"),
        "choice": StructuredOutputsParams(choice=["positive", "negative", "neutral"]),
        "grammar": StructuredOutputsParams(
            grammar='start: expr\nexpr: NUM | expr ("+" | "*") expr | "(" expr ")"\nNUM: /[0-9]+/\n'
        ),
        "json_object": StructuredOutputsParams(json_object=True),
    }
    other_ms = {}
    for name, p in others.items():
        t0 = time.perf_counter()
        compiler.compile(p)
        other_ms[name] = round(1e3 * (time.perf_counter() - t0), 3)

    # Decode: a full batch of constrained sequences, every step timed.
    rng = np.random.default_rng(args.seed)
    matchers = [compiler.matcher(params[i % len(params)]) for i in range(args.num_seqs)]
    batched = allocate_bitmask(args.num_seqs, vocab_size)
    one_by_one = allocate_bitmask(args.num_seqs, vocab_size)
    fill_s, fill_seq_s, accept_s = [], [], []
    restarts = 0
    # One untimed batched fill starts the backend's thread pool (an engine's warm-up).
    compiler.fill_bitmasks(matchers, batched)
    for step in range(args.steps):
        # The first fill of a state warms caches the second reuses: alternate the order.
        for way in (0, 1) if step % 2 == 0 else (1, 0):
            t0 = time.perf_counter()
            if way == 0:
                compiler.fill_bitmasks(matchers, batched)
            else:
                for i, m in enumerate(matchers):
                    m.fill_bitmask(one_by_one[i])
            (fill_s if way == 0 else fill_seq_s).append((time.perf_counter() - t0) / args.num_seqs)
        assert np.array_equal(batched, one_by_one), "batched and per-row masks differ"
        tokens = []
        for i in range(args.num_seqs):
            allowed = allowed_ids(batched[i], vocab_size)
            if EOS_TOKEN_ID in allowed and (allowed.size == 1 or rng.random() < 0.5):
                tokens.append(EOS_TOKEN_ID)
            else:
                tokens.append(int(rng.choice(allowed[allowed != EOS_TOKEN_ID])))
        t0 = time.perf_counter()
        for m, token in zip(matchers, tokens):
            ok = m.accept(token)
            assert ok, "a token the mask allowed was refused"
        accept_s.append((time.perf_counter() - t0) / args.num_seqs)
        for i, token in enumerate(tokens):
            if token == EOS_TOKEN_ID:
                matchers[i] = compiler.matcher(params[i % len(params)])
                restarts += 1

    fill, fill_seq, accept = summary_us(fill_s), summary_us(fill_seq_s), summary_us(accept_s)
    return {
        "tokenizer": {
            "source": source,
            "tokenizer_vocab_size": tokenizer.get_vocab_size(),
            "model_vocab_size": vocab_size,
            "train_s": round(train_s, 3),
        },
        "compiler_init_s": round(init_s, 3),
        "compile_ms": {
            "json_schema_cold": [round(1e3 * s, 3) for s in cold],
            "json_schema_cold_median": round(1e3 * statistics.median(cold), 3),
            "json_schema_cached_median_us": round(1e6 * statistics.median(cached), 2),
            **{f"{k}_cold": v for k, v in other_ms.items()},
        },
        "decode": {
            "num_seqs": args.num_seqs,
            "fill_threads": compiler.num_threads,
            "steps": args.steps,
            "restarts": restarts,
            "bitmask_bytes_per_step": int(batched.nbytes),
            "per_seq_per_step_us": {
                "fill_batched": fill,
                "fill_one_by_one": fill_seq,
                "accept": accept,
                "host_total_mean": round(fill["mean"] + accept["mean"], 2),
            },
            "per_step_ms_mean": round(1e-3 * args.num_seqs * (fill["mean"] + accept["mean"]), 3),
        },
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import llguidance

    sizes = [None] if args.tokenizer else args.vocab_sizes
    report = {
        "command": "python scripts/bench_structured.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "backend": {"name": "llguidance", "version": llguidance.__version__},
        "machine": {
            "cpus": len(os.sched_getaffinity(0)),
            "load_average_1min": round(os.getloadavg()[0], 2),
            "python": platform.python_version(),
        },
        "runs": [run_one(args, size) for size in sizes],
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        out = pathlib.Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
