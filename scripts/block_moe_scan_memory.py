"""CPU compiled temporaries of a block-wise fp8 MoE decode step, layers scanned vs unrolled.

    JAX_PLATFORMS=cpu python scripts/block_moe_scan_memory.py

A small Qwen3-MoE-shaped model (4 layers, 32 experts of 512 x 256, top 4, f32
activations) with block-wise fp8 weights (128 x 128 tiles), built abstractly (nothing
allocated); the engine's decode step at batch 16 compiled for CPU, its memory_analysis
temporaries printed for scan_layers "on" and "off". XLA's CPU backend computes fp8 in
f16, so both hold f16 copies of the fp8 expert stacks (docs/quantization.md); the
scanned step must not add one layer's expert stack on top (the cause that
models/layer_scan.py's whole-stack experts remove, seen on the H200 compile).
"""

from __future__ import annotations

import jax
from flax import nnx

from paged_jax.config import EngineConfig
from paged_jax.models.quantized_model import replace_linears
from paged_jax.models.qwen3_moe import Qwen3MoeForCausalLM
from paged_jax.worker.input_batch import InputBatch
from paged_jax.worker.runner import Runner

HF = dict(
    hidden_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=128,
    intermediate_size=1024,
    moe_intermediate_size=256,
    num_experts=32,
    num_experts_per_tok=4,
    norm_topk_prob=True,
    vocab_size=1024,
    num_hidden_layers=4,
    max_position_embeddings=4096,
)


def step_temporaries(scan_layers: str) -> int:
    """Temporaries (bytes) of the compiled decode step with `scan_layers`."""
    config = Qwen3MoeForCausalLM.config_from_hf(HF, {}, "float32")
    model = nnx.eval_shape(
        lambda: Qwen3MoeForCausalLM(config, rngs=nnx.Rngs(0), attention_backend="reference")
    )
    replace_linears(model, "fp8", block_size=128)
    engine_config = EngineConfig(
        block_size=16,
        num_kv_blocks=64,
        max_num_seqs=16,
        max_num_batched_tokens=16,
        max_model_len=512,
        attention_backend="reference",
        dtype="float32",
        scan_layers=scan_layers,
        quantization="fp8",
    )
    runner = Runner(model, engine_config)
    step = InputBatch(engine_config).dummy_step_input(16, 16, decode_only=True)
    args = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(tuple(getattr(x, "shape", ())), x.dtype),
        runner.step_args(step),
    )
    return runner.jitted_step.lower(*args).compile().memory_analysis().temp_size_in_bytes


def main() -> None:
    layers, experts = HF["num_hidden_layers"], HF["num_experts"]
    stack = experts * 3 * HF["hidden_size"] * HF["moe_intermediate_size"]  # one layer, fp8
    print(f"one layer's fp8 expert stacks: {stack / 2**20:.1f} MiB; as f16, all {layers} "
          f"layers: {2 * layers * stack / 2**20:.1f} MiB")  # fmt: skip
    print("| layers | temporaries |\n|---|---|")
    for scan, name in (("on", "scanned"), ("off", "unrolled")):
        print(f"| {name} | {step_temporaries(scan) / 2**20:.1f} MiB |", flush=True)


if __name__ == "__main__":
    main()
