"""Mixtral: the Mistral decoder with every MLP a mixture of experts (softmax, top-k, renormalised).

| Hugging Face tensor                                             | param path                              |
|-----------------------------------------------------------------|-----------------------------------------|
| (attention, norms, embeddings, head as Llama: paged_jax.models.llama)                                     |
| model.layers.i.block_sparse_moe.gate.weight^T [D, E]           | layers.i.mlp.router.kernel              |
| model.layers.i.block_sparse_moe.experts.e.w1.weight^T, e < E   | layers.i.mlp.experts.gate_proj [E, D, F]|
| model.layers.i.block_sparse_moe.experts.e.w3.weight^T          | layers.i.mlp.experts.up_proj [E, D, F]  |
| model.layers.i.block_sparse_moe.experts.e.w2.weight^T          | layers.i.mlp.experts.down_proj [E, F, D]|

Router (transformers MixtralTopKRouter): logits in the model dtype, softmax in float32,
top-k, always divided by their sum, and kept float32 when they scale the expert outputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from paged_jax.models.config import ConfigReader, ModelConfig, MoEConfig
from paged_jax.models.decoder import CausalLM
from paged_jax.models.llama import LLAMA_DEFAULTS, llama_config, llama_weight_rules
from paged_jax.models.moe import MoEDecoderLayer, moe_weight_rules
from paged_jax.models.partitioning import (
    ATTENTION_RULES,
    MOE_RULES,
    VOCAB_RULES,
    PartitionRules,
)
from paged_jax.models.weights import WeightRule

MIXTRAL_DEFAULTS: dict[str, Any] = dict(
    LLAMA_DEFAULTS,
    model_type="mixtral",
    intermediate_size=14336,
    num_key_value_heads=8,
    max_position_embeddings=4096 * 32,
    rms_norm_eps=1e-5,
    num_local_experts=8,
    num_experts_per_tok=2,
)
MIXTRAL_PARTITION_RULES: PartitionRules = VOCAB_RULES + ATTENTION_RULES + MOE_RULES


class MixtralForCausalLM(CausalLM):
    """Mixtral sparse decoder (MixtralForCausalLM checkpoints); `sliding_window` on every layer."""

    model_type = "mixtral"
    architectures = ("MixtralForCausalLM",)
    layer_cls = MoEDecoderLayer
    partition_rules = MIXTRAL_PARTITION_RULES

    @classmethod
    def config_from_hf(
        cls, hf: Mapping[str, Any], generation: Mapping[str, Any], dtype: str
    ) -> ModelConfig:
        r = ConfigReader(hf, MIXTRAL_DEFAULTS)
        num_layers = r.num_layers()
        moe = MoEConfig(
            num_experts=r.integer("num_local_experts"),
            num_experts_per_tok=r.integer("num_experts_per_tok"),
            moe_intermediate_size=r.integer("intermediate_size"),
            norm_topk_prob=True,
            sparse_layers=(True,) * num_layers,
            router_weight_dtype="float32",
        )
        return llama_config(
            hf,
            generation,
            dtype,
            defaults=MIXTRAL_DEFAULTS,
            qkv_bias=False,
            out_bias=False,
            mlp_bias=False,
            sliding_window=r.optional_integer("sliding_window", null_is_none=True),
            layer_types=(),
            moe=moe,
        )

    @classmethod
    def weight_rules(cls, config: ModelConfig) -> list[WeightRule]:
        return moe_weight_rules(
            config,
            llama_weight_rules(config),
            block="block_sparse_moe",
            router="gate",
            expert_names=("w1", "w3", "w2"),
        )
