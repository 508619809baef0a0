"""Run in a subprocess with forced CPU devices by tests/lora/test_lora_tensor_parallel.py:
greedy tokens of a LoRA engine at tensor_parallel_size N and its stacks' shardings, as JSON.

    python tests/lora/tp_lora_run.py N BASE_DIR ADAPTER_DIR [ADAPTER_DIR ...] -- PROMPTS_JSON
"""

from __future__ import annotations

import json
import sys


def split_axes(array) -> list[int]:
    """The axes of ``array`` its sharding splits over the mesh."""
    return [i for i, axis in enumerate(array.sharding.spec) if axis is not None]


def main() -> None:
    n, base, *rest = sys.argv[1:]
    split = rest.index("--")
    adapter_dirs, prompts = rest[:split], json.loads(rest[split + 1])
    from paged_jax import LLM, LoRARequest, SamplingParams

    llm = LLM(
        base,
        tensor_parallel_size=int(n),
        enable_lora=True,
        max_loras=len(adapter_dirs),
        max_lora_rank=8,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=64,
        attention_backend="reference",
    )
    loras = [None] + [LoRARequest(f"a{i}", i + 1, d) for i, d in enumerate(adapter_dirs)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    stacks = llm.engine.runner.lora.stacks
    print(
        json.dumps(
            dict(
                tokens=[o.outputs[0].token_ids for o in outs],
                split_axes={m: [split_axes(a), split_axes(b)] for m, (a, b) in stacks.items()},
                compiles_after_warmup=llm.engine.get_stats()["num_compiles_after_warmup"],
            )
        )
    )


if __name__ == "__main__":
    main()
