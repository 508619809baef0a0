"""Qwen2-MoE (Qwen1.5-MoE): the Qwen2 decoder with MoE MLPs and a sigmoid-gated shared expert.

| Hugging Face tensor                                      | param path                                    |
|----------------------------------------------------------|-----------------------------------------------|
| (attention with q/k/v biases, norms, embeddings, head as Qwen2: paged_jax.models.qwen2)                      |
| model.layers.i.mlp.gate.weight^T [D, E]                  | layers.i.mlp.router.kernel                    |
| model.layers.i.mlp.experts.e.{gate,up,down}_proj.weight^T | layers.i.mlp.experts.{gate,up,down}_proj [E, ...] |
| model.layers.i.mlp.shared_expert.{gate,up,down}_proj.weight^T | layers.i.mlp.shared_expert.{...}.kernel  |
| model.layers.i.mlp.shared_expert_gate.weight^T [D, 1]    | layers.i.mlp.shared_expert_gate.kernel        |
| model.layers.i.mlp.{gate,up,down}_proj.weight^T (dense layers) | layers.i.mlp.{...}.kernel               |

A layer is sparse when it is not in ``mlp_only_layers`` and ``(i + 1) %
decoder_sparse_step == 0``; its experts are ``moe_intermediate_size`` wide, the dense
layers' MLP ``intermediate_size`` and the shared expert ``shared_expert_intermediate_size``.
Router (transformers Qwen2MoeTopKRouter): softmax in float32, top-k, divided by their sum
only with ``norm_topk_prob``, cast to the model dtype. Output: experts + sigmoid(x @ g) *
shared_expert(x).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from paged_jax.models.config import LAYER_TYPES, ConfigReader, ModelConfig, MoEConfig
from paged_jax.models.decoder import CausalLM
from paged_jax.models.llama import llama_config, llama_weight_rules
from paged_jax.models.moe import MoEDecoderLayer, moe_weight_rules
from paged_jax.models.partitioning import (
    ATTENTION_RULES,
    GATED_MLP_RULES,
    MOE_RULES,
    VOCAB_RULES,
    PartitionRules,
)
from paged_jax.models.qwen2 import QWEN2_DEFAULTS
from paged_jax.models.weights import WeightRule

QWEN2_MOE_DEFAULTS: dict[str, Any] = dict(
    QWEN2_DEFAULTS,
    model_type="qwen2_moe",
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=24,
    num_attention_heads=16,
    decoder_sparse_step=1,
    moe_intermediate_size=1408,
    shared_expert_intermediate_size=5632,
    num_experts_per_tok=4,
    num_experts=60,
    norm_topk_prob=False,
    qkv_bias=True,
)
# Dense layers (mlp_only_layers, decoder_sparse_step) keep the dense MLP rules.
QWEN_MOE_PARTITION_RULES: PartitionRules = (
    VOCAB_RULES + ATTENTION_RULES + MOE_RULES + GATED_MLP_RULES
)


def qwen_moe_config(
    hf: Mapping[str, Any], defaults: Mapping[str, Any], *, shared_expert: bool
) -> MoEConfig | None:
    """The MoEConfig of a Qwen2-MoE / Qwen3-MoE config.json; None when no layer is sparse.

    Raises:
        ConfigFileError: a bad mlp_only_layers (not a list of layer indices) or count.
    """
    r = ConfigReader(hf, defaults)
    num_layers = r.num_layers()
    # Released configs say num_experts; transformers 5 writes Qwen3-MoE's as
    # num_local_experts (its attribute map), so either key is read.
    local = hf.get("num_experts") is None and hf.get("num_local_experts") is not None
    key = "num_local_experts" if local else "num_experts"
    num_experts = r.integer(key, minimum=0)
    step = r.integer("decoder_sparse_step")
    mlp_only = r.raw("mlp_only_layers")
    mlp_only = [] if mlp_only is None else mlp_only
    if not isinstance(mlp_only, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in mlp_only
    ):
        raise r.fail("mlp_only_layers", mlp_only, "a list of layer indices (ints >= 0)")
    sparse = tuple(
        i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)
    )
    if not any(sparse):
        return None
    return MoEConfig(
        num_experts=num_experts,
        num_experts_per_tok=r.integer("num_experts_per_tok", maximum=num_experts),
        moe_intermediate_size=r.integer("moe_intermediate_size"),
        norm_topk_prob=r.boolean("norm_topk_prob"),
        sparse_layers=sparse,
        shared_expert_intermediate_size=(
            r.integer("shared_expert_intermediate_size") if shared_expert else None
        ),
        router_weight_dtype="model",
    )


def qwen2_moe_layer_types(
    hf: Mapping[str, Any], num_layers: int
) -> tuple[tuple[str, ...], int | None]:
    """(layer_types, sliding_window): with use_sliding_window, the window sits on even
    layers below max_window_layers (transformers' Qwen2MoeConfig rule) unless
    layer_types is given."""
    r = ConfigReader(hf, QWEN2_MOE_DEFAULTS)
    use_window = r.boolean("use_sliding_window")
    window = r.integer("sliding_window") if use_window else None
    layer_types = r.str_list("layer_types", LAYER_TYPES)
    if layer_types is None:
        first_full = r.integer("max_window_layers", minimum=0)
        layer_types = tuple(
            "sliding_attention"
            if use_window and (i + 1) % 2 and i < first_full
            else "full_attention"
            for i in range(num_layers)
        )
    if "sliding_attention" not in layer_types:
        window = None
    return layer_types, window


def qwen_moe_weight_rules(config: ModelConfig, dense_rules: list[WeightRule]) -> list[WeightRule]:
    """The dense table with each sparse layer's ``mlp`` read as a Qwen MoE block."""
    if config.moe is None:
        return dense_rules
    return moe_weight_rules(
        config,
        dense_rules,
        block="mlp",
        router="gate",
        expert_names=("gate_proj", "up_proj", "down_proj"),
    )


class Qwen2MoeForCausalLM(CausalLM):
    """Qwen2-MoE / Qwen1.5-MoE decoder (Qwen2MoeForCausalLM checkpoints)."""

    model_type = "qwen2_moe"
    architectures = ("Qwen2MoeForCausalLM",)
    layer_cls = MoEDecoderLayer
    partition_rules = QWEN_MOE_PARTITION_RULES

    @classmethod
    def config_from_hf(
        cls, hf: Mapping[str, Any], generation: Mapping[str, Any], dtype: str
    ) -> ModelConfig:
        r = ConfigReader(hf, QWEN2_MOE_DEFAULTS)
        layer_types, window = qwen2_moe_layer_types(hf, r.num_layers())
        return llama_config(
            hf,
            generation,
            dtype,
            defaults=QWEN2_MOE_DEFAULTS,
            qkv_bias=r.boolean("qkv_bias"),
            out_bias=False,
            mlp_bias=False,
            sliding_window=window,
            layer_types=layer_types,
            moe=qwen_moe_config(hf, QWEN2_MOE_DEFAULTS, shared_expert=True),
        )

    @classmethod
    def weight_rules(cls, config: ModelConfig) -> list[WeightRule]:
        return qwen_moe_weight_rules(config, llama_weight_rules(config))
