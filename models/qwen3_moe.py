"""Qwen3-MoE: the Qwen3 decoder (per-head q/k RMSNorm) with MoE MLPs and no shared expert.

Weight table: attention as Qwen3's (paged_jax.models.qwen3: q_norm / k_norm), MoE blocks
as Qwen2-MoE's without the shared expert (paged_jax.models.qwen2_moe). Sparse layers:
not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``. Router
(transformers Qwen3MoeTopKRouter): softmax in float32, top-k, divided by their sum with
``norm_topk_prob`` (true in the released checkpoints), cast to the model dtype. With
use_sliding_window, the window is on every layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from paged_jax.models.config import ConfigReader, ModelConfig
from paged_jax.models.decoder import CausalLM
from paged_jax.models.layers import RMSNorm
from paged_jax.models.llama import LLAMA_DEFAULTS, llama_config, llama_weight_rules
from paged_jax.models.moe import MoEDecoderLayer
from paged_jax.models.qwen2_moe import (
    QWEN_MOE_PARTITION_RULES,
    qwen_moe_config,
    qwen_moe_weight_rules,
)
from paged_jax.models.qwen3 import qk_norm_rules
from paged_jax.models.weights import WeightRule

QWEN3_MOE_DEFAULTS: dict[str, Any] = dict(
    LLAMA_DEFAULTS,
    model_type="qwen3_moe",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=24,
    num_attention_heads=32,
    num_key_value_heads=4,
    max_position_embeddings=32768,
    use_sliding_window=False,
    sliding_window=4096,
    decoder_sparse_step=1,
    moe_intermediate_size=768,
    num_experts_per_tok=8,
    num_experts=128,
    norm_topk_prob=False,
)


class Qwen3MoeForCausalLM(CausalLM):
    """Qwen3-MoE decoder (Qwen3MoeForCausalLM checkpoints)."""

    model_type = "qwen3_moe"
    architectures = ("Qwen3MoeForCausalLM",)
    layer_cls = MoEDecoderLayer
    qk_norm_cls = RMSNorm
    partition_rules = QWEN_MOE_PARTITION_RULES  # the per-head q/k norms are replicated

    @classmethod
    def config_from_hf(
        cls, hf: Mapping[str, Any], generation: Mapping[str, Any], dtype: str
    ) -> ModelConfig:
        r = ConfigReader(hf, QWEN3_MOE_DEFAULTS)
        window = r.integer("sliding_window") if r.boolean("use_sliding_window") else None
        return llama_config(
            hf,
            generation,
            dtype,
            defaults=QWEN3_MOE_DEFAULTS,
            sliding_window=window,
            layer_types=(),
            moe=qwen_moe_config(hf, QWEN3_MOE_DEFAULTS, shared_expert=False),
        )

    @classmethod
    def weight_rules(cls, config: ModelConfig) -> list[WeightRule]:
        return qwen_moe_weight_rules(config, llama_weight_rules(config) + qk_norm_rules(config))
