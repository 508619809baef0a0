"""Tiny seeded random-weight Hugging Face checkpoints, one per supported family.

The test suite's fixtures and the accuracy scripts build their models here, so a shape
or an initialisation is written once. transformers and torch are imported only when a
checkpoint is built.
"""

from __future__ import annotations

import pathlib
from typing import Any

FAMILIES = (
    "llama",
    "qwen2",
    "mistral",
    "gpt2",
    "opt",
    "qwen3",
    "gemma2",
    "gemma3_text",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
)
# The mixture-of-experts families (a subset of FAMILIES).
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")

# Tiny shapes: hidden 64, 2 layers, 4 query heads / 2 KV heads where the family has GQA.
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "gpt2": dict(
        vocab_size=128,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=256,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "opt": dict(
        vocab_size=128,
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        word_embed_proj_dim=64,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=2,
    ),
}
TINY_CONFIGS["qwen2"] = dict(TINY_CONFIGS["llama"], bos_token_id=None, eos_token_id=2)
TINY_CONFIGS["mistral"] = dict(TINY_CONFIGS["llama"], sliding_window=16)
# head_dim 32 != hidden / heads, so the q/k norms and projections see the explicit width.
TINY_CONFIGS["qwen3"] = dict(TINY_CONFIGS["llama"], head_dim=32, bos_token_id=None)
# Gemma 2: 4 layers (window on 0 and 2), a scale that is not head_dim ** -0.5 and soft
# caps small enough to bend the tiny model's scores and logits.
TINY_CONFIGS["gemma2"] = dict(
    TINY_CONFIGS["llama"],
    num_hidden_layers=4,
    head_dim=16,
    query_pre_attn_scalar=24,
    sliding_window=8,
    attn_logit_softcapping=5.0,
    final_logit_softcapping=10.0,
    pad_token_id=0,
)
# Gemma 3 text: 6 layers (5 windowed, layer 5 global) and distinct global/local rope bases.
TINY_CONFIGS["gemma3_text"] = dict(
    TINY_CONFIGS["gemma2"],
    num_hidden_layers=6,
    attn_logit_softcapping=None,
    final_logit_softcapping=None,
    rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
    },
)

# Mixture of experts: 8 experts, top-2, expert width 32 (the dense tiny MLP's 128 split
# four ways); hidden 64, 2 layers, 4 heads / 2 KV heads as the dense tiny models.
TINY_CONFIGS["mixtral"] = dict(
    TINY_CONFIGS["llama"], intermediate_size=32, num_local_experts=8, num_experts_per_tok=2
)
# Qwen2-MoE: the shared expert (width 48, sigmoid-gated), q/k/v biases, renormalised top-k.
TINY_CONFIGS["qwen2_moe"] = dict(
    TINY_CONFIGS["llama"],
    bos_token_id=None,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
)
# Qwen3-MoE: q/k norms, head_dim 32 != hidden / heads, raw (unnormalised) top-k weights.
TINY_CONFIGS["qwen3_moe"] = dict(
    TINY_CONFIGS["llama"],
    head_dim=32,
    bos_token_id=None,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=False,
)


def config_class(family: str):
    import transformers

    return {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,
        "gpt2": transformers.GPT2Config,
        "opt": transformers.OPTConfig,
        "qwen3": transformers.Qwen3Config,
        "gemma2": transformers.Gemma2Config,
        "gemma3_text": transformers.Gemma3TextConfig,
        "mixtral": transformers.MixtralConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
    }[family]


def randomize(model, seed: int) -> None:
    """Replaces HF's tiny-std init so every weight (norm scales and biases too) matters."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param.ndim == 1:
                is_scale = name.endswith("weight")  # RMSNorm / LayerNorm scale
                param.copy_((1.0 if is_scale else 0.0) + 0.1 * noise)
            else:
                param.copy_(0.1 * noise)


def build_tiny_hf_checkpoint(
    family: str,
    directory: pathlib.Path,
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    **config_overrides: Any,
) -> pathlib.Path:
    """Builds a seeded tiny `family` model with transformers and save_pretrained()s it."""
    import torch
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"family={family!r} must be one of {FAMILIES}")
    torch.manual_seed(seed)
    config = config_class(family)(**{**TINY_CONFIGS[family], **config_overrides})
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    randomize(model, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return directory
