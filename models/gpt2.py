"""GPT-2: learned positions, LayerNorm, GELU (tanh) MLP, Conv1D weights, tied head.

GPT-2's Conv1D stores weights as f[in, out] (x @ W), so they load without a transpose;
the fused c_attn f[D, 3D] is split by columns into q, k, v.

| Hugging Face tensor                      | param path                               |
|------------------------------------------|------------------------------------------|
| transformer.wte.weight [V, D]            | embed_tokens.embedding                   |
| transformer.wpe.weight [P, D]            | embed_positions.embedding                |
| transformer.h.i.ln_1.{weight,bias}       | layers.i.attn_norm.{scale,bias}          |
| transformer.h.i.attn.c_attn.{weight,bias}| layers.i.attn.{q,k,v}_proj.{kernel,bias} (column thirds) |
| transformer.h.i.attn.c_proj.{weight,bias}| layers.i.attn.o_proj.{kernel,bias}       |
| transformer.h.i.ln_2.{weight,bias}       | layers.i.mlp_norm.{scale,bias}           |
| transformer.h.i.mlp.c_fc.{weight,bias}   | layers.i.mlp.fc_in.{kernel,bias}         |
| transformer.h.i.mlp.c_proj.{weight,bias} | layers.i.mlp.fc_out.{kernel,bias}        |
| transformer.ln_f.{weight,bias}           | final_norm.{scale,bias}                  |
| lm_head.weight^T (untied only)           | lm_head.kernel                           |
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
from paged_jax.models.weights import WeightRule, conv1d_columns, embedding, norm, torch_linear

GPT2_DEFAULTS: dict[str, Any] = dict(
    vocab_size=50257,
    n_positions=1024,
    n_embd=768,
    n_layer=12,
    n_head=12,
    n_inner=None,
    activation_function="gelu_new",
    layer_norm_epsilon=1e-5,
    scale_attn_weights=True,
    scale_attn_by_inverse_layer_idx=False,
    add_cross_attention=False,
    tie_word_embeddings=True,
)

# Tensor-parallel split. The fused c_attn is cut into q/k/v at load (column thirds), so
# each third is column-parallel on its own and every device gets whole heads of each.
GPT2_PARTITION_RULES: PartitionRules = (
    VOCAB_RULES
    + ((r"^embed_positions/embedding$", (None, None)),)
    + ATTENTION_RULES
    + PLAIN_MLP_RULES
)


class GPT2LMHeadModel(CausalLM):
    """GPT-2 decoder (GPT2LMHeadModel checkpoints, with or without the transformer. prefix)."""

    model_type = "gpt2"
    architectures = ("GPT2LMHeadModel",)
    partition_rules = GPT2_PARTITION_RULES
    norm_cls = LayerNorm
    mlp_cls = MLP
    use_rope = False
    position_offset = 0
    hf_base_prefix = "transformer."
    # The causal-mask buffers older checkpoints saved next to the weights.
    hf_ignored_keys = (r"\.attn\.(masked_)?bias$",)

    @classmethod
    def config_from_hf(
        cls, hf: Mapping[str, Any], generation: Mapping[str, Any], dtype: str
    ) -> ModelConfig:
        r = ConfigReader(hf, GPT2_DEFAULTS)
        unsupported = dict(
            scale_attn_weights=False, scale_attn_by_inverse_layer_idx=True, add_cross_attention=True
        )
        for name, bad in unsupported.items():
            if r.boolean(name) == bad:
                raise ValueError(f"gpt2 config {name}={r.raw(name)!r} is not supported")
        hidden, heads = r.integer("n_embd"), r.integer("n_head")
        if hidden % heads:
            raise r.fail("n_embd", hidden, f"a multiple of n_head={heads}")
        return ModelConfig(
            model_type="gpt2",
            vocab_size=r.integer("vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=r.num_layers("n_layer"),
            num_attention_heads=heads,
            num_key_value_heads=heads,
            head_dim=hidden // heads,
            intermediate_size=r.optional_integer("n_inner") or 4 * hidden,
            max_position_embeddings=r.integer("n_positions"),
            norm_eps=r.number("layer_norm_epsilon"),
            hidden_act=r.choice("activation_function", HIDDEN_ACTS),
            qkv_bias=True,
            out_bias=True,
            mlp_bias=True,
            tie_word_embeddings=r.boolean("tie_word_embeddings"),
            **common_fields(hf, generation, dtype),
        )

    @classmethod
    def weight_rules(cls, config: ModelConfig) -> list[WeightRule]:
        d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
        rules = embedding("transformer.wte.weight", ("embed_tokens",), v, d)
        rules += embedding(
            "transformer.wpe.weight", ("embed_positions",), config.max_position_embeddings, d
        )
        for i in range(config.num_hidden_layers):
            hf, path = f"transformer.h.{i}", ("layers", i)
            attn = (*path, "attn")
            rules += norm(f"{hf}.ln_1", (*path, "attn_norm"), d, bias=True)
            for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
                rules += conv1d_columns(
                    f"{hf}.attn.c_attn", (*attn, name), d, 3 * d, j * d, (j + 1) * d
                )
            rules += conv1d_columns(f"{hf}.attn.c_proj", (*attn, "o_proj"), d, d, 0, d)
            rules += norm(f"{hf}.ln_2", (*path, "mlp_norm"), d, bias=True)
            rules += conv1d_columns(f"{hf}.mlp.c_fc", (*path, "mlp", "fc_in"), d, f, 0, f)
            rules += conv1d_columns(f"{hf}.mlp.c_proj", (*path, "mlp", "fc_out"), f, d, 0, d)
        rules += norm("transformer.ln_f", ("final_norm",), d, bias=True)
        if not config.tie_word_embeddings:
            rules += torch_linear("lm_head", ("lm_head",), d, v, bias=False)
        return rules
