"""Llama 2/3 (RMSNorm, rotary incl. llama3 scaling, GQA, SwiGLU, tied or untied head).

Qwen2 and Mistral reuse `llama_config` and `llama_weight_rules` with their own defaults.

| Hugging Face tensor                              | param path                          |
|--------------------------------------------------|-------------------------------------|
| model.embed_tokens.weight [V, D]                 | embed_tokens.embedding              |
| model.layers.i.input_layernorm.weight            | layers.i.attn_norm.scale            |
| model.layers.i.self_attn.{q,k,v,o}_proj.weight^T | layers.i.attn.{q,k,v,o}_proj.kernel |
| model.layers.i.self_attn.{q,k,v,o}_proj.bias     | layers.i.attn.{q,k,v,o}_proj.bias   |
| model.layers.i.post_attention_layernorm.weight   | layers.i.mlp_norm.scale             |
| model.layers.i.mlp.{gate,up,down}_proj.weight^T  | layers.i.mlp.{gate,up,down}_proj.kernel |
| model.norm.weight                                | final_norm.scale                    |
| lm_head.weight^T (untied only)                   | lm_head.kernel                      |
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from paged_jax.models.config import (
    HIDDEN_ACTS,
    ConfigReader,
    ModelConfig,
    common_fields,
    rope_from_hf,
)
from paged_jax.models.decoder import CausalLM
from paged_jax.models.partitioning import (
    ATTENTION_RULES,
    GATED_MLP_RULES,
    VOCAB_RULES,
    PartitionRules,
)
from paged_jax.models.weights import WeightRule, embedding, norm, torch_linear

# Hugging Face LlamaConfig defaults for keys an older config.json may leave out.
LLAMA_DEFAULTS: dict[str, Any] = dict(
    model_type="llama",
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    hidden_act="silu",
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    attention_bias=False,
    mlp_bias=False,
)


# Tensor-parallel split of every param (Qwen2 and Mistral share it; qkv biases included).
LLAMA_PARTITION_RULES: PartitionRules = VOCAB_RULES + ATTENTION_RULES + GATED_MLP_RULES


def llama_config(
    hf: Mapping[str, Any],
    generation: Mapping[str, Any],
    dtype: str,
    *,
    defaults: Mapping[str, Any],
    **overrides: Any,
) -> ModelConfig:
    """Reads a Llama-style config.json; `overrides` set ModelConfig fields directly.

    Raises:
        ConfigFileError: naming the field of a value of the wrong type or out of range.
    """
    r = ConfigReader(hf, defaults)
    hidden, num_heads = r.integer("hidden_size"), r.integer("num_attention_heads")
    attention_bias = r.boolean("attention_bias")
    fields = dict(
        model_type=defaults["model_type"],
        vocab_size=r.integer("vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=r.num_layers(),
        num_attention_heads=num_heads,
        num_key_value_heads=r.integer("num_key_value_heads", default=num_heads),
        head_dim=r.integer("head_dim", default=hidden // num_heads),
        intermediate_size=r.integer("intermediate_size"),
        max_position_embeddings=r.integer("max_position_embeddings"),
        rope=rope_from_hf(hf),
        norm_eps=r.number("rms_norm_eps"),
        hidden_act=r.choice("hidden_act", HIDDEN_ACTS),
        qkv_bias=attention_bias,
        out_bias=attention_bias,
        mlp_bias=r.boolean("mlp_bias"),
        tie_word_embeddings=r.boolean("tie_word_embeddings"),
        **common_fields(hf, generation, dtype),
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def llama_weight_rules(config: ModelConfig) -> list[WeightRule]:
    """The HF-name -> param-path table of a Llama-style checkpoint (see the module table)."""
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    rules = embedding("model.embed_tokens.weight", ("embed_tokens",), v, d)
    for i in range(config.num_hidden_layers):
        hf, path = f"model.layers.{i}", ("layers", i)
        attn, mlp = f"{hf}.self_attn", (*path, "mlp")
        qkv_bias, out_bias, mlp_bias = config.qkv_bias, config.out_bias, config.mlp_bias
        rules += norm(f"{hf}.input_layernorm", (*path, "attn_norm"), d, bias=False)
        rules += torch_linear(f"{attn}.q_proj", (*path, "attn", "q_proj"), d, q_dim, bias=qkv_bias)
        rules += torch_linear(f"{attn}.k_proj", (*path, "attn", "k_proj"), d, kv_dim, bias=qkv_bias)
        rules += torch_linear(f"{attn}.v_proj", (*path, "attn", "v_proj"), d, kv_dim, bias=qkv_bias)
        rules += torch_linear(f"{attn}.o_proj", (*path, "attn", "o_proj"), q_dim, d, bias=out_bias)
        rules += norm(f"{hf}.post_attention_layernorm", (*path, "mlp_norm"), d, bias=False)
        rules += torch_linear(f"{hf}.mlp.gate_proj", (*mlp, "gate_proj"), d, f, bias=mlp_bias)
        rules += torch_linear(f"{hf}.mlp.up_proj", (*mlp, "up_proj"), d, f, bias=mlp_bias)
        rules += torch_linear(f"{hf}.mlp.down_proj", (*mlp, "down_proj"), f, d, bias=mlp_bias)
    rules += norm("model.norm", ("final_norm",), d, bias=False)
    if not config.tie_word_embeddings:
        rules += torch_linear("lm_head", ("lm_head",), d, v, bias=False)
    return rules


class LlamaForCausalLM(CausalLM):
    """Llama 2/3 decoder (LlamaForCausalLM checkpoints)."""

    model_type = "llama"
    architectures = ("LlamaForCausalLM",)
    partition_rules = LLAMA_PARTITION_RULES

    @classmethod
    def config_from_hf(
        cls, hf: Mapping[str, Any], generation: Mapping[str, Any], dtype: str
    ) -> ModelConfig:
        return llama_config(hf, generation, dtype, defaults=LLAMA_DEFAULTS)

    @classmethod
    def weight_rules(cls, config: ModelConfig) -> list[WeightRule]:
        return llama_weight_rules(config)
