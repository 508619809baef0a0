"""Qwen3: the Llama layout with per-head q/k RMSNorm before rotary, no QKV bias by default.

Weight table: as Llama's (see paged_jax.models.llama), plus
self_attn.q_norm.weight / self_attn.k_norm.weight [head_dim] -> layers.i.attn.{q,k}_norm.scale.
Windows (use_sliding_window, max_window_layers, layer_types) are read as for Qwen2.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from paged_jax.models.config import ConfigReader, ModelConfig
from paged_jax.models.decoder import CausalLM
from paged_jax.models.layers import RMSNorm
from paged_jax.models.llama import (
    LLAMA_DEFAULTS,
    LLAMA_PARTITION_RULES,
    llama_config,
    llama_weight_rules,
)
from paged_jax.models.qwen2 import qwen2_layer_types
from paged_jax.models.weights import WeightRule, norm

QWEN3_DEFAULTS: dict[str, Any] = dict(
    LLAMA_DEFAULTS,
    model_type="qwen3",
    vocab_size=151936,
    intermediate_size=22016,
    max_position_embeddings=32768,
    head_dim=128,
)


def qk_norm_rules(config: ModelConfig) -> list[WeightRule]:
    """q_norm / k_norm weights of every layer (Qwen3, Gemma 3)."""
    rules = []
    for i in range(config.num_hidden_layers):
        attn = f"model.layers.{i}.self_attn"
        for name in ("q_norm", "k_norm"):
            rules += norm(
                f"{attn}.{name}", ("layers", i, "attn", name), config.head_dim, bias=False
            )
    return rules


class Qwen3ForCausalLM(CausalLM):
    """Qwen3 dense decoder (Qwen3ForCausalLM checkpoints)."""

    model_type = "qwen3"
    architectures = ("Qwen3ForCausalLM",)
    qk_norm_cls = RMSNorm
    partition_rules = LLAMA_PARTITION_RULES  # the per-head q/k norms are replicated

    @classmethod
    def config_from_hf(
        cls, hf: Mapping[str, Any], generation: Mapping[str, Any], dtype: str
    ) -> ModelConfig:
        num_layers = ConfigReader(hf, QWEN3_DEFAULTS).num_layers()
        layer_types, window = qwen2_layer_types(hf, num_layers)
        return llama_config(
            hf,
            generation,
            dtype,
            defaults=QWEN3_DEFAULTS,
            sliding_window=window,
            layer_types=layer_types,
        )

    @classmethod
    def weight_rules(cls, config: ModelConfig) -> list[WeightRule]:
        return llama_weight_rules(config) + qk_norm_rules(config)
