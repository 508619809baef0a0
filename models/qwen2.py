"""Qwen2: the Llama layout with q/k/v biases (no output bias) and optional per-layer windows.

Weight table: as Llama's (see paged_jax.models.llama), plus
self_attn.{q,k,v}_proj.bias -> layers.i.attn.{q,k,v}_proj.bias.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from paged_jax.models.config import LAYER_TYPES, ConfigReader, ModelConfig
from paged_jax.models.decoder import CausalLM
from paged_jax.models.llama import (
    LLAMA_DEFAULTS,
    LLAMA_PARTITION_RULES,
    llama_config,
    llama_weight_rules,
)
from paged_jax.models.weights import WeightRule

QWEN2_DEFAULTS: dict[str, Any] = dict(
    LLAMA_DEFAULTS,
    model_type="qwen2",
    vocab_size=151936,
    intermediate_size=22016,
    max_position_embeddings=32768,
    use_sliding_window=False,
    sliding_window=4096,
    max_window_layers=28,
)


def qwen2_layer_types(hf: Mapping[str, Any], num_layers: int) -> tuple[tuple[str, ...], int | None]:
    """(layer_types, sliding_window): windows only with use_sliding_window, on layers >= max_window_layers."""
    r = ConfigReader(hf, QWEN2_DEFAULTS)
    window = r.integer("sliding_window") if r.boolean("use_sliding_window") else None
    layer_types = r.str_list("layer_types", LAYER_TYPES)
    if layer_types is None:
        first_window_layer = r.integer("max_window_layers", minimum=0)
        layer_types = tuple(
            "sliding_attention"
            if window is not None and i >= first_window_layer
            else "full_attention"
            for i in range(num_layers)
        )
    if "sliding_attention" not in layer_types:
        window = None
    return layer_types, window


class Qwen2ForCausalLM(CausalLM):
    """Qwen2 / Qwen2.5 decoder (Qwen2ForCausalLM checkpoints)."""

    model_type = "qwen2"
    architectures = ("Qwen2ForCausalLM",)
    partition_rules = LLAMA_PARTITION_RULES

    @classmethod
    def config_from_hf(
        cls, hf: Mapping[str, Any], generation: Mapping[str, Any], dtype: str
    ) -> ModelConfig:
        num_layers = ConfigReader(hf, QWEN2_DEFAULTS).num_layers()
        layer_types, window = qwen2_layer_types(hf, num_layers)
        return llama_config(
            hf,
            generation,
            dtype,
            defaults=QWEN2_DEFAULTS,
            qkv_bias=True,
            out_bias=False,
            mlp_bias=False,
            sliding_window=window,
            layer_types=layer_types,
        )

    @classmethod
    def weight_rules(cls, config: ModelConfig) -> list[WeightRule]:
        return llama_weight_rules(config)
