"""Compare paged-jax with transformers on one Hugging Face checkpoint directory.

    python scripts/compare_hf.py --model PATH [--prompts FILE] [--dtype float32]
        [--max-new-tokens 8] [--atol 1e-4]

Prints the max |logit diff| of the dense forward over every prompt position, top-1
agreement, the paged-forward (prefill then decode) logit diff against transformers'
incremental decode, and how many greedy tokens agree, both for the paged forward and
for the full engine (scheduler, block manager, bucketed jitted step, device sampler).
Exits 1 when a logit diff exceeds --atol. Needs torch + transformers (the test extra); paged-jax itself does not.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np

from paged_jax.models import load_model
from paged_jax.models.simple_paged import greedy_generate_paged

DEFAULT_ATOL = {"float32": 1e-4, "bfloat16": 0.08, "float16": 0.02}


def read_prompts(
    path: pathlib.Path | None, model_dir: pathlib.Path, vocab_size: int, seed: int, count: int
) -> list[list[int]]:
    """Token-id prompts: from a file (ids or text lines) or from a seeded generator."""
    if path is None:
        rng = np.random.default_rng(seed)
        lengths = [min(4 + 7 * i, 64) for i in range(count)]
        return [rng.integers(0, vocab_size, size=n).tolist() for n in lengths]
    lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if all(token.isdigit() for line in lines for token in line.split()):
        return [[int(token) for token in line.split()] for line in lines]
    tokenizer_file = model_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise SystemExit(f"{path} holds text but {model_dir} has no tokenizer.json")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    return [tokenizer.encode(line).ids for line in lines]


def hf_reference(model_dir: pathlib.Path, prompts: list[list[int]], dtype: str, steps: int):
    """Per prompt: transformers' prompt logits f32[L, V], greedy tokens, and step logits."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="eager"
    ).eval()
    results = []
    with torch.no_grad():
        for prompt in prompts:
            # Full recompute per step: no cache API, which differs across transformers versions.
            prompt_logits = model(torch.tensor([prompt])).logits[0].float().numpy()
            tokens, step_logits = [], [prompt_logits[-1]]
            while True:
                tokens.append(int(np.argmax(step_logits[-1])))
                if len(tokens) == steps:
                    break
                out = model(torch.tensor([prompt + tokens])).logits[0, -1]
                step_logits.append(out.float().numpy())
            results.append((prompt_logits, tokens, np.stack(step_logits)))
    return results


def engine_greedy(
    model, prompts: list[list[int]], max_new: int, block_size: int
) -> list[list[int]]:
    """Greedy continuations through the paged-jax engine (EOS ignored, like the reference)."""
    from paged_jax.config import EngineConfig
    from paged_jax.engine import Engine
    from paged_jax.sampling_params import SamplingParams

    max_len = min(model.config.max_position_embeddings, max(map(len, prompts)) + max_new + 1)
    config = EngineConfig(
        block_size=block_size,
        max_model_len=max_len,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        attention_backend=model.attention_backend,
    )
    engine = Engine(model, config)
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o.token_ids for o in engine.step()})
    return [outs[str(i)] for i in range(len(prompts))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=pathlib.Path, required=True, help="HF checkpoint dir")
    parser.add_argument("--prompts", type=pathlib.Path, help="lines of token ids or text")
    parser.add_argument("--dtype", default="float32", choices=sorted(DEFAULT_ATOL))
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--atol", type=float, help="max |logit diff| allowed (default by dtype)")
    parser.add_argument("--num-prompts", type=int, default=4, help="generated prompts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--attention-backend", default="auto")
    args = parser.parse_args(argv)
    atol = args.atol if args.atol is not None else DEFAULT_ATOL[args.dtype]

    model = load_model(args.model, args.dtype, attention_backend=args.attention_backend)
    prompts = read_prompts(
        args.prompts, args.model, model.config.vocab_size, args.seed, args.num_prompts
    )
    reference = hf_reference(args.model, prompts, args.dtype, args.max_new_tokens)
    generated, paged_logits = greedy_generate_paged(
        model, prompts, args.max_new_tokens, block_size=args.block_size
    )

    from_engine = engine_greedy(model, prompts, args.max_new_tokens, args.block_size)

    dense_diff, paged_diff, top1, positions, matched, engine_matched = 0.0, 0.0, 0, 0, 0, 0
    print(f"model: {args.model} ({model.config.model_type}, {args.dtype})")
    print("prompt  len  dense_diff  top1   paged_diff  greedy_match  engine_match")
    for i, prompt in enumerate(prompts):
        hf_logits, hf_tokens, hf_steps = reference[i]
        ours = np.asarray(model(np.asarray([prompt], np.int32)))[0]
        diff = float(np.abs(ours - hf_logits).max())
        agree = int((ours.argmax(-1) == hf_logits.argmax(-1)).sum())
        # Step logits are comparable while both continuations still share their prefix.
        same = next(
            (j for j, (a, b) in enumerate(zip(generated[i], hf_tokens)) if a != b),
            args.max_new_tokens,
        )
        step_diff = float(np.abs(paged_logits[i][: same + 1] - hf_steps[: same + 1]).max())
        engine_same = next(
            (j for j, (a, b) in enumerate(zip(from_engine[i], hf_tokens)) if a != b),
            args.max_new_tokens,
        )
        engine_matched += engine_same
        print(
            f"{i:6d} {len(prompt):4d}  {diff:10.3e}  {agree:2d}/{len(prompt):<2d}  "
            f"{step_diff:10.3e}  {same:>5d}/{args.max_new_tokens:<6d} "
            f"{engine_same:>5d}/{args.max_new_tokens}"
        )
        dense_diff, paged_diff = max(dense_diff, diff), max(paged_diff, step_diff)
        top1, positions, matched = top1 + agree, positions + len(prompt), matched + same
    total = args.max_new_tokens * len(prompts)
    print(f"max |logit diff| dense: {dense_diff:.3e}")
    print(f"max |logit diff| paged: {paged_diff:.3e}")
    print(f"top-1 agreement: {top1}/{positions} ({top1 / positions:.2%})")
    print(f"greedy continuation match: {matched}/{total} tokens")
    print(f"engine greedy continuation match: {engine_matched}/{total} tokens")
    worst = max(dense_diff, paged_diff)
    if worst > atol:
        print(f"FAIL: max |logit diff| {worst:.3e} > atol {atol:g}")
        return 1
    print(f"OK: max |logit diff| {worst:.3e} <= atol {atol:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
