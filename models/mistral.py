"""Mistral: the Llama layout with a sliding attention window on every layer (if configured).

Weight table: identical to Llama's (see paged_jax.models.llama).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from paged_jax.models.config import ConfigReader, ModelConfig
from paged_jax.models.decoder import CausalLM
from paged_jax.models.llama import (
    LLAMA_DEFAULTS,
    LLAMA_PARTITION_RULES,
    llama_config,
    llama_weight_rules,
)
from paged_jax.models.weights import WeightRule

MISTRAL_DEFAULTS: dict[str, Any] = dict(
    LLAMA_DEFAULTS,
    model_type="mistral",
    intermediate_size=14336,
    num_key_value_heads=8,
    max_position_embeddings=131072,
)


class MistralForCausalLM(CausalLM):
    """Mistral decoder (MistralForCausalLM checkpoints); `sliding_window: null` disables it."""

    model_type = "mistral"
    architectures = ("MistralForCausalLM",)
    partition_rules = LLAMA_PARTITION_RULES

    @classmethod
    def config_from_hf(
        cls, hf: Mapping[str, Any], generation: Mapping[str, Any], dtype: str
    ) -> ModelConfig:
        # HF MistralConfig defaults sliding_window to 4096 when the key is absent; an
        # explicit null means full attention (Mistral 7B v0.2 and later).
        reader = ConfigReader(hf)
        window = reader.optional_integer("sliding_window", default=4096, null_is_none=True)
        return llama_config(
            hf,
            generation,
            dtype,
            defaults=MISTRAL_DEFAULTS,
            qkv_bias=False,
            out_bias=False,
            mlp_bias=False,
            sliding_window=window,
            layer_types=(),
        )

    @classmethod
    def weight_rules(cls, config: ModelConfig) -> list[WeightRule]:
        return llama_weight_rules(config)
