"""FP8 KV cache accuracy: logits and greedy tokens vs the unquantized cache and transformers.

    python scripts/kv_fp8_accuracy.py --output docs/fp8_kv_accuracy.json      # tiny families
    python scripts/kv_fp8_accuracy.py --model PATH [--model PATH ...] --dtype bfloat16

For each checkpoint (default: seeded tiny random llama, qwen2, mistral, gpt2, opt built with
transformers, as tests/conftest.py builds them) and each KV cache (the model dtype, e4m3,
e5m2, and e4m3 with calibrated scales), on a fixed prompt set:
  * teacher-forced logits along transformers' greedy path: max |logit diff| and top-1
    agreement vs the unquantized paged cache and vs transformers;
  * free greedy decoding: prompts whose first token / all tokens equal the unquantized
    cache's and transformers' continuations, and the matched-prefix token count.
Prints a table and writes JSON. Needs torch + transformers (the test extra).
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import sys
import tempfile
import time

import jax
import numpy as np

from paged_jax.baselines.json_report import write_json_atomic
from paged_jax.models import calibrate_kv_scales, load_model
from paged_jax.models.simple_paged import greedy_generate_paged
from paged_jax.testing.tiny_models import build_tiny_hf_checkpoint

DEFAULT_FAMILIES = ("llama", "qwen2", "mistral", "gpt2", "opt")
KV_CACHES = ("auto", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3+calibrated")
_FP8 = {"fp8_e4m3": jax.numpy.float8_e4m3fn, "fp8_e5m2": jax.numpy.float8_e5m2}


def make_prompts(vocab_size: int, count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab_size, size=8 + 7 * i).tolist() for i in range(count)]


def hf_greedy_and_logits(path: pathlib.Path, prompts, steps: int, dtype: str):
    """transformers' greedy continuation per prompt and its logits f32[steps, V] on that path."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype), attn_implementation="eager"
    ).eval()
    tokens, logits = [], []
    with torch.no_grad():
        for prompt in prompts:
            seq = list(prompt)
            for _ in range(steps):  # full recompute: no cache API differences
                out = model(torch.tensor([seq])).logits[0, -1].float().numpy()
                seq.append(int(np.argmax(out)))
            full = model(torch.tensor([seq[:-1]])).logits[0].float().numpy()
            tokens.append(seq[len(prompt) :])
            logits.append(full[len(prompt) - 1 :])
    return tokens, logits


def _prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def evaluate(path: pathlib.Path, args) -> dict:
    model = load_model(path, args.dtype, attention_backend=args.attention_backend)
    prompts = make_prompts(model.config.vocab_size, args.num_prompts, args.seed)
    hf_tokens, hf_logits = hf_greedy_and_logits(path, prompts, args.max_new_tokens, args.dtype)
    calibrated = calibrate_kv_scales(model, prompts)
    kw = dict(block_size=args.block_size)
    runs = {}
    for cache in KV_CACHES:
        name = cache.split("+")[0]
        dtype = _FP8.get(name)
        scales = calibrated if cache.endswith("calibrated") else None
        if dtype is not None and scales is None:
            scales = np.ones((model.config.num_hidden_layers, 2), np.float32)
        forced = greedy_generate_paged(
            model,
            prompts,
            args.max_new_tokens,
            kv_cache_dtype=dtype,
            kv_scales=scales,
            forced_tokens=hf_tokens,
            **kw,
        )[1]
        free = greedy_generate_paged(
            model, prompts, args.max_new_tokens, kv_cache_dtype=dtype, kv_scales=scales, **kw
        )[0]
        runs[cache] = (forced, free)
    base_forced, base_free = runs["auto"]
    total = args.max_new_tokens * len(prompts)
    rows = {}
    for cache, (forced, free) in runs.items():
        row = {}
        for ref_name, ref_logits, ref_tokens in (
            ("unquantized", base_forced, base_free),
            ("transformers", hf_logits, hf_tokens),
        ):
            diff = max(float(np.abs(a - b).max()) for a, b in zip(forced, ref_logits))
            top1 = sum(
                int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(forced, ref_logits)
            )
            row[f"vs_{ref_name}"] = {
                "max_abs_logit_diff": diff,
                "top1_agreement": top1 / total,
                "greedy_first_token_match": sum(a[0] == b[0] for a, b in zip(free, ref_tokens))
                / len(prompts),
                "greedy_all_tokens_match": sum(a == b for a, b in zip(free, ref_tokens))
                / len(prompts),
                "greedy_matched_prefix_tokens": sum(_prefix(a, b) for a, b in zip(free, ref_tokens))
                / total,
            }
        rows[cache] = row
    return {
        "model_type": model.config.model_type,
        "num_layers": model.config.num_hidden_layers,
        "calibrated_scales": calibrated.tolist(),
        "prompt_lengths": [len(p) for p in prompts],
        "results": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", type=pathlib.Path, help="HF checkpoint dir(s)")
    p.add_argument(
        "--families", default=",".join(DEFAULT_FAMILIES), help="tiny families (no --model)"
    )
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attention-backend", default="reference")
    p.add_argument("--output", type=pathlib.Path, default=pathlib.Path("fp8_kv_accuracy.json"))
    args = p.parse_args(argv)
    start = time.time()
    report = {
        "command": "python scripts/kv_fp8_accuracy.py " + " ".join(sys.argv[1:] or []),
        "settings": {k: str(v) for k, v in vars(args).items()},
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "machine": platform.machine(),
        "models": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        paths = args.model or [
            build_tiny_hf_checkpoint(f, pathlib.Path(tmp) / f) for f in args.families.split(",")
        ]
        for path in paths:
            result = evaluate(path, args)
            report["models"][result["model_type"] if not args.model else str(path)] = result
            print(f"\n{path} ({result['model_type']}, {args.dtype})")
            print(
                f"{'kv cache':22s} {'ref':12s} {'max|dlogit|':>11s} {'top1':>6s} "
                f"{'first':>6s} {'all':>6s} {'prefix':>6s}"
            )
            for cache, row in result["results"].items():
                for ref, m in row.items():
                    print(
                        f"{cache:22s} {ref[3:]:12s} {m['max_abs_logit_diff']:11.3e} "
                        f"{m['top1_agreement']:6.1%} {m['greedy_first_token_match']:6.1%} "
                        f"{m['greedy_all_tokens_match']:6.1%} "
                        f"{m['greedy_matched_prefix_tokens']:6.1%}"
                    )
    report["seconds"] = round(time.time() - start, 1)
    write_json_atomic(args.output, report)
    print(f"\nwrote {args.output} ({report['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
