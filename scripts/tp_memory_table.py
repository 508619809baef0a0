"""Per-device weight and KV bytes vs tensor_parallel_size for published model shapes.

    python scripts/tp_memory_table.py --output docs/tensor_parallel_memory.json

No weights are read or allocated: each model is built abstractly (nnx.eval_shape) from
its config.json fields, and every param is split by its family's partition rules exactly
as the loader places it. Compares the chosen vocab-parallel embedding/LM head with
replicating them. Prints a markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import math
import sys

from paged_jax.baselines.json_report import write_json_atomic

# config.json fields of published checkpoints (as released on the Hugging Face hub).
TP_TABLE_MODELS = {
    "Llama-3.1-8B": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
    ),
    "Llama-3.1-70B": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        max_position_embeddings=131072,
    ),
    "Qwen2.5-3B": dict(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    ),
    "GPT-2 (124M)": dict(model_type="gpt2", vocab_size=50257, n_embd=768, n_layer=12, n_head=12),
}


def measure(name: str, hf: dict, sizes: list[int], dtype: str) -> list[dict]:
    """One row per N: per-device weight bytes (vocab-parallel and replicated), KV per token."""
    from flax import nnx

    from paged_jax.models import model_class_for
    from paged_jax.models.loader import abstract_model
    from paged_jax.models.partitioning import (
        VOCAB_RULES,
        per_device_param_bytes,
        tensor_parallel_config,
    )

    cls = model_class_for(hf)
    config = cls.config_from_hf(hf, {}, dtype)
    replicated_vocab = tuple((pattern, (None, None)) for pattern, _ in VOCAB_RULES)
    rows = []
    for n in sizes:
        try:
            tp_config = tensor_parallel_config(config, n)
        except ValueError as err:  # heads that do not split whole: not servable at this N
            print(f"{name}: N={n} skipped: {err}", file=sys.stderr)
            continue
        _, state = abstract_model(cls, tp_config, "reference")
        shapes = [
            (path, tuple(v.get_value().shape), v.get_value().dtype.itemsize)
            for path, v in nnx.to_flat_state(state)
        ]
        chosen = per_device_param_bytes(shapes, cls.partition_rules, n)
        replicated = per_device_param_bytes(shapes, replicated_vocab + cls.partition_rules, n)
        itemsize = shapes[0][2]
        kv_heads = tp_config.num_key_value_heads // n
        kv_per_token = 2 * config.num_hidden_layers * kv_heads * config.head_dim * itemsize
        rows.append(
            dict(
                model=name,
                tensor_parallel_size=n,
                num_params=sum(math.prod(s) for _, s, _ in shapes),
                kv_heads_per_device=kv_heads,
                kv_head_copies=tp_config.num_key_value_heads // config.num_key_value_heads,
                weight_bytes_per_device=chosen,
                weight_bytes_per_device_replicated_vocab=replicated,
                kv_bytes_per_token_per_device=kv_per_token,
                vocab_split=config.vocab_size % n == 0,
            )
        )
    return rows


def markdown(rows: list[dict]) -> str:
    gib = 1024**3
    lines = [
        "| model | N | weights GiB/device | (vocab replicated) | KV heads/device (copies) "
        "| KV KiB/token/device |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        vocab = "" if r["vocab_split"] else " (vocab not divisible: replicated)"
        lines.append(
            f"| {r['model']} | {r['tensor_parallel_size']} "
            f"| {r['weight_bytes_per_device'] / gib:.2f}{vocab} "
            f"| {r['weight_bytes_per_device_replicated_vocab'] / gib:.2f} "
            f"| {r['kv_heads_per_device']} ({r['kv_head_copies']}x) "
            f"| {r['kv_bytes_per_token_per_device'] / 1024:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1,2,4,8", help="comma list of tensor_parallel_size")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--output", default="bench_results/tp_memory_table.json")
    args = p.parse_args(argv)
    sizes = [int(n) for n in args.sizes.split(",")]
    rows = [
        row for name, hf in TP_TABLE_MODELS.items() for row in measure(name, hf, sizes, args.dtype)
    ]
    table = markdown(rows)
    print(table)
    command = " ".join(["python", "scripts/tp_memory_table.py", *sys.argv[1:]])
    out = write_json_atomic(args.output, {"command": command, "rows": rows, "table": table})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
