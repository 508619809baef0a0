"""OPT (the PagedAttention paper's family): learned positions offset by 2, ReLU MLP,
pre- or post-LayerNorm (do_layer_norm_before), optional project_in/out.

| Hugging Face tensor                                 | param path                           |
|-----------------------------------------------------|--------------------------------------|
| model.decoder.embed_tokens.weight [V, E]            | embed_tokens.embedding               |
| model.decoder.embed_positions.weight [P + 2, D]     | embed_positions.embedding            |
| model.decoder.project_in.weight^T (E != D)          | project_in.kernel                    |
| model.decoder.project_out.weight^T (E != D)         | project_out.kernel                   |
| model.decoder.layers.i.self_attn_layer_norm.*       | layers.i.attn_norm.{scale,bias}      |
| model.decoder.layers.i.self_attn.{q,k,v}_proj.*     | layers.i.attn.{q,k,v}_proj.*         |
| model.decoder.layers.i.self_attn.out_proj.*         | layers.i.attn.o_proj.*               |
| model.decoder.layers.i.final_layer_norm.*           | layers.i.mlp_norm.{scale,bias}       |
| model.decoder.layers.i.fc{1,2}.*                    | layers.i.mlp.fc_{in,out}.*           |
| model.decoder.final_layer_norm.* (pre-norm only)    | final_norm.{scale,bias}              |
| lm_head.weight^T (untied only)                      | lm_head.kernel                       |
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from paged_jax.models.config import HIDDEN_ACTS, ConfigReader, ModelConfig, common_fields
from paged_jax.models.decoder import CausalLM
from paged_jax.models.layers import MLP, LayerNorm
from paged_jax.models.partitioning import (
    ATTENTION_RULES,
    PLAIN_MLP_RULES,
    VOCAB_RULES,
    PartitionRules,
)
from paged_jax.models.weights import WeightRule, embedding, norm, torch_linear

OPT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=50272,
    hidden_size=768,
    num_hidden_layers=12,
    ffn_dim=3072,
    max_position_embeddings=2048,
    do_layer_norm_before=True,
    _remove_final_layer_norm=False,
    word_embed_proj_dim=None,
    num_attention_heads=12,
    activation_function="relu",
    enable_bias=True,
    layer_norm_elementwise_affine=True,
    tie_word_embeddings=True,
)

# Tensor-parallel split; the learned positions and OPT-350m's small project_in/out
# (f[E, D] with E < D) stay replicated.
OPT_PARTITION_RULES: PartitionRules = (
    VOCAB_RULES
    + (
        (r"^embed_positions/embedding$", (None, None)),
        (r"^project_(in|out)/kernel$", (None, None)),
    )
    + ATTENTION_RULES
    + PLAIN_MLP_RULES
)


class OPTForCausalLM(CausalLM):
    """OPT decoder (OPTForCausalLM checkpoints, or OPTModel ones without the model. prefix)."""

    model_type = "opt"
    architectures = ("OPTForCausalLM",)
    partition_rules = OPT_PARTITION_RULES
    norm_cls = LayerNorm
    mlp_cls = MLP
    use_rope = False
    position_offset = 2  # OPT's learned position table reserves its first two rows
    hf_base_prefix = "model."
    hf_ignored_keys = ()

    @classmethod
    def config_from_hf(
        cls, hf: Mapping[str, Any], generation: Mapping[str, Any], dtype: str
    ) -> ModelConfig:
        r = ConfigReader(hf, OPT_DEFAULTS)
        if not r.boolean("layer_norm_elementwise_affine"):
            raise ValueError("opt config layer_norm_elementwise_affine=False is not supported")
        hidden, heads = r.integer("hidden_size"), r.integer("num_attention_heads")
        if hidden % heads:
            raise r.fail("hidden_size", hidden, f"a multiple of num_attention_heads={heads}")
        embed_dim = r.optional_integer("word_embed_proj_dim") or hidden
        pre_norm = r.boolean("do_layer_norm_before")
        bias = r.boolean("enable_bias")
        return ModelConfig(
            model_type="opt",
            vocab_size=r.integer("vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=r.num_layers(),
            num_attention_heads=heads,
            num_key_value_heads=heads,
            head_dim=hidden // heads,
            intermediate_size=r.integer("ffn_dim"),
            max_position_embeddings=r.integer("max_position_embeddings"),
            norm_eps=1e-5,  # torch.nn.LayerNorm's default, which OPT uses
            hidden_act=r.choice("activation_function", HIDDEN_ACTS),
            qkv_bias=bias,
            out_bias=bias,
            mlp_bias=bias,
            pre_norm=pre_norm,
            final_norm=pre_norm and not r.boolean("_remove_final_layer_norm"),
            word_embed_proj_dim=embed_dim if embed_dim != hidden else None,
            tie_word_embeddings=r.boolean("tie_word_embeddings"),
            **common_fields(hf, generation, dtype),
        )

    @classmethod
    def weight_rules(cls, config: ModelConfig) -> list[WeightRule]:
        d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
        e = config.word_embed_proj_dim or d
        bias = config.qkv_bias
        dec = "model.decoder"
        rules = embedding(f"{dec}.embed_tokens.weight", ("embed_tokens",), v, e)
        rules += embedding(
            f"{dec}.embed_positions.weight",
            ("embed_positions",),
            config.max_position_embeddings + cls.position_offset,
            d,
        )
        if config.word_embed_proj_dim is not None:
            rules += torch_linear(f"{dec}.project_in", ("project_in",), e, d, bias=False)
            rules += torch_linear(f"{dec}.project_out", ("project_out",), d, e, bias=False)
        for i in range(config.num_hidden_layers):
            hf, path = f"{dec}.layers.{i}", ("layers", i)
            attn = (*path, "attn")
            rules += norm(f"{hf}.self_attn_layer_norm", (*path, "attn_norm"), d, bias=True)
            for name in ("q_proj", "k_proj", "v_proj"):
                rules += torch_linear(f"{hf}.self_attn.{name}", (*attn, name), d, d, bias=bias)
            rules += torch_linear(f"{hf}.self_attn.out_proj", (*attn, "o_proj"), d, d, bias=bias)
            rules += norm(f"{hf}.final_layer_norm", (*path, "mlp_norm"), d, bias=True)
            rules += torch_linear(f"{hf}.fc1", (*path, "mlp", "fc_in"), d, f, bias=bias)
            rules += torch_linear(f"{hf}.fc2", (*path, "mlp", "fc_out"), f, d, bias=bias)
        if config.final_norm:
            rules += norm(f"{dec}.final_layer_norm", ("final_norm",), d, bias=True)
        if not config.tie_word_embeddings:
            rules += torch_linear("lm_head", ("lm_head",), e, v, bias=False)
        return rules
