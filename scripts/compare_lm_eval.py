"""Per-document differences between lm-eval's `paged-jax` and `hf` backends on the local
tasks (tests/lm_eval/tasks), for the tiny random checkpoints the parity tests use.

    python scripts/compare_lm_eval.py --families llama,gemma2

Prints one JSON line per family: the largest |hf - paged-jax| of the multiple-choice and
rolling loglikelihoods, whether the greedy generations are identical, both accuracies and
paged-jax's prefix-cache hit rate.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile

MAX_LENGTH = 64
ENGINE_ARGS = dict(
    block_size=4, max_num_seqs=8, max_num_batched_tokens=64, attention_backend="reference"
)


def compare(family: str, tasks_dir: pathlib.Path) -> dict:
    from paged_jax.lm_eval import PagedJaxLM
    from paged_jax.testing.lm_eval_tasks import (
        evaluate_local_tasks,
        per_document,
        save_byte_tokenizer,
    )
    from paged_jax.testing.tiny_models import build_tiny_hf_checkpoint

    path = pathlib.Path(tempfile.mkdtemp(prefix=f"compare_lm_eval_{family}_"))
    build_tiny_hf_checkpoint(family, path, vocab_size=259)
    save_byte_tokenizer(path)

    def run(model, model_args=None):
        return evaluate_local_tasks(model, tasks_dir, model_args=model_args, batch_size=8)

    hf = run("hf", {"pretrained": str(path), "dtype": "float32", "max_length": MAX_LENGTH})
    lm = PagedJaxLM(pretrained=str(path), dtype="float32", max_model_len=MAX_LENGTH, **ENGINE_ARGS)
    ours = run(lm)

    mc = max(
        abs(a[0] - b[0])
        for x, y in zip(per_document(hf, "pj_mc"), per_document(ours, "pj_mc"), strict=True)
        for a, b in zip(x, y, strict=True)
    )
    rolling = max(
        abs(x[0] - y[0])
        for x, y in zip(
            per_document(hf, "pj_rolling"), per_document(ours, "pj_rolling"), strict=True
        )
    )
    return {
        "family": family,
        "max_abs_diff_mc": mc,
        "max_abs_diff_rolling": rolling,
        "generations_identical": per_document(hf, "pj_gen") == per_document(ours, "pj_gen"),
        "acc_hf": hf["results"]["pj_mc"]["acc,none"],
        "acc_paged_jax": ours["results"]["pj_mc"]["acc,none"],
        "prefix_cache_hit_rate": lm.llm.get_stats()["prefix_cache_hit_rate"],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--families", default="llama,gemma2")
    p.add_argument("--tasks-dir", type=pathlib.Path, default=pathlib.Path("tests/lm_eval/tasks"))
    args = p.parse_args(argv)
    for family in args.families.split(","):
        print(json.dumps(compare(family, args.tasks_dir)), flush=True)


if __name__ == "__main__":
    main()
