"""Gemma 2 and Gemma 3 (text): sandwich norms, (1 + w) RMSNorm, scaled embeddings, soft caps.

Per layer: input_layernorm -> attention -> post_attention_layernorm -> + residual ->
pre_feedforward_layernorm -> GeGLU MLP -> post_feedforward_layernorm -> + residual.
Embeddings are multiplied by sqrt(hidden_size) cast to the activation dtype; attention
scale is query_pre_attn_scalar ** -0.5. Gemma 2: attention and final-logit soft caps,
windows on even layers. Gemma 3: per-head q/k norms before rotary, 5 window layers per
global one (layer_types), and a separate rotary base on window layers.

| Hugging Face tensor                                  | param path                        |
|------------------------------------------------------|-----------------------------------|
| model.embed_tokens.weight [V, D] (tied head)         | embed_tokens.embedding            |
| model.layers.i.input_layernorm.weight                | layers.i.attn_norm.scale          |
| model.layers.i.self_attn.{q,k,v,o}_proj.weight^T     | layers.i.attn.{q,k,v,o}_proj.kernel |
| model.layers.i.self_attn.{q,k}_norm.weight (Gemma 3) | layers.i.attn.{q,k}_norm.scale    |
| model.layers.i.post_attention_layernorm.weight       | layers.i.post_attn_norm.scale     |
| model.layers.i.pre_feedforward_layernorm.weight      | layers.i.mlp_norm.scale           |
| model.layers.i.mlp.{gate,up,down}_proj.weight^T      | layers.i.mlp.{gate,up,down}_proj.kernel |
| model.layers.i.post_feedforward_layernorm.weight     | layers.i.post_mlp_norm.scale      |
| model.norm.weight                                    | final_norm.scale                  |
| lm_head.weight^T (untied only)                       | lm_head.kernel                    |
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from paged_jax.models.config import (
    HIDDEN_ACTS,
    LAYER_TYPES,
    ConfigReader,
    ModelConfig,
    RopeConfig,
    common_fields,
    read_rope,
    rope_from_hf,
)
from paged_jax.models.decoder import CausalLM, DecoderLayer
from paged_jax.models.layers import RowNorm
from paged_jax.models.llama import LLAMA_PARTITION_RULES
from paged_jax.models.qwen3 import qk_norm_rules
from paged_jax.models.weights import WeightRule, embedding, norm, torch_linear


class GemmaRMSNorm(RowNorm):
    """RMSNorm with a zero-centred weight: norm(x) * (1 + w), all in float32, then cast.

    Params: scale f[dim] (the checkpoint's weight w, initialised to 0).
    """

    def __init__(self, dim: int, *, eps: float, dtype: str):
        self.eps = eps
        self.scale = nnx.Param(jnp.zeros((dim,), dtype=dtype))

    def normalize(self, x: jax.Array) -> jax.Array:  # f[..., dim] -> f[..., dim]
        x32 = x.astype(jnp.float32)
        variance = jnp.mean(x32 * x32, axis=-1, keepdims=True)
        normed = x32 * jax.lax.rsqrt(variance + self.eps)
        return (normed * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)


class GemmaDecoderLayer(DecoderLayer):
    """A DecoderLayer with Gemma's extra post-attention and post-MLP norms."""

    def __init__(self, config: ModelConfig, layer_idx: int, **kwargs: Any):
        super().__init__(config, layer_idx, **kwargs)
        norm_cls = kwargs["norm_cls"]
        self.post_attn_norm = norm_cls(config.hidden_size, eps=config.norm_eps, dtype=config.dtype)
        self.post_mlp_norm = norm_cls(config.hidden_size, eps=config.norm_eps, dtype=config.dtype)

    def apply(
        self, x: jax.Array, attend: Callable[[jax.Array], tuple[jax.Array, Any]]
    ) -> tuple[jax.Array, Any]:
        h, extra = attend(self.attn_norm(x))
        x = x + self.post_attn_norm(h)
        x = x + self.post_mlp_norm(self.mlp(self.mlp_norm(x)))
        return x, extra


GEMMA2_DEFAULTS: dict[str, Any] = dict(
    vocab_size=256000,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    attention_bias=False,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    final_logit_softcapping=30.0,
    attn_logit_softcapping=50.0,
)
GEMMA3_DEFAULTS: dict[str, Any] = dict(
    GEMMA2_DEFAULTS,
    vocab_size=262208,
    max_position_embeddings=131072,
    final_logit_softcapping=None,
    attn_logit_softcapping=None,
    sliding_window_pattern=6,
)


def gemma_config(
    hf: Mapping[str, Any],
    generation: Mapping[str, Any],
    dtype: str,
    *,
    model_type: str,
    defaults: Mapping[str, Any],
    default_layer_types: Callable[[int], list[str]],
    rope: RopeConfig,
    local_rope: RopeConfig | None,
) -> ModelConfig:
    """Reads a Gemma 2 / Gemma 3 text config.json (explicit nulls keep their meaning).

    Raises:
        ConfigFileError: naming the field of a value of the wrong type or out of range.
    """
    r = ConfigReader(hf, defaults)
    num_layers = r.num_layers()
    window = r.optional_integer("sliding_window", null_is_none=True)
    layer_types = r.str_list("layer_types", LAYER_TYPES) or tuple(default_layer_types(num_layers))
    if window is None:
        layer_types = ("full_attention",) * num_layers
    bias = r.boolean("attention_bias")
    act_name = "hidden_activation" if r.raw("hidden_activation") is not None else "hidden_act"
    return ModelConfig(
        model_type=model_type,
        vocab_size=r.integer("vocab_size"),
        hidden_size=r.integer("hidden_size"),
        num_hidden_layers=num_layers,
        num_attention_heads=r.integer("num_attention_heads"),
        num_key_value_heads=r.integer("num_key_value_heads"),
        head_dim=r.integer("head_dim"),
        intermediate_size=r.integer("intermediate_size"),
        max_position_embeddings=r.integer("max_position_embeddings"),
        sliding_window=window,
        layer_types=layer_types,
        rope=rope,
        local_rope=local_rope,
        norm_eps=r.number("rms_norm_eps"),
        hidden_act=r.choice(act_name, HIDDEN_ACTS),
        qkv_bias=bias,
        out_bias=bias,
        tie_word_embeddings=r.boolean("tie_word_embeddings"),
        query_pre_attn_scalar=r.number("query_pre_attn_scalar"),
        attn_logit_softcapping=r.optional_number("attn_logit_softcapping", null_is_none=True),
        final_logit_softcapping=r.optional_number("final_logit_softcapping", null_is_none=True),
        **common_fields(hf, generation, dtype),
    )


def gemma_weight_rules(config: ModelConfig) -> list[WeightRule]:
    """The HF-name -> param-path table of a Gemma 2/3 checkpoint (see the module table)."""
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    bias = config.qkv_bias
    rules = embedding("model.embed_tokens.weight", ("embed_tokens",), v, d)
    for i in range(config.num_hidden_layers):
        hf, path = f"model.layers.{i}", ("layers", i)
        attn, mlp = f"{hf}.self_attn", (*path, "mlp")
        rules += norm(f"{hf}.input_layernorm", (*path, "attn_norm"), d, bias=False)
        rules += torch_linear(f"{attn}.q_proj", (*path, "attn", "q_proj"), d, q_dim, bias=bias)
        rules += torch_linear(f"{attn}.k_proj", (*path, "attn", "k_proj"), d, kv_dim, bias=bias)
        rules += torch_linear(f"{attn}.v_proj", (*path, "attn", "v_proj"), d, kv_dim, bias=bias)
        rules += torch_linear(f"{attn}.o_proj", (*path, "attn", "o_proj"), q_dim, d, bias=bias)
        rules += norm(f"{hf}.post_attention_layernorm", (*path, "post_attn_norm"), d, bias=False)
        rules += norm(f"{hf}.pre_feedforward_layernorm", (*path, "mlp_norm"), d, bias=False)
        rules += torch_linear(f"{hf}.mlp.gate_proj", (*mlp, "gate_proj"), d, f, bias=False)
        rules += torch_linear(f"{hf}.mlp.up_proj", (*mlp, "up_proj"), d, f, bias=False)
        rules += torch_linear(f"{hf}.mlp.down_proj", (*mlp, "down_proj"), f, d, bias=False)
        rules += norm(f"{hf}.post_feedforward_layernorm", (*path, "post_mlp_norm"), d, bias=False)
    rules += norm("model.norm", ("final_norm",), d, bias=False)
    if not config.tie_word_embeddings:
        rules += torch_linear("lm_head", ("lm_head",), d, v, bias=False)
    return rules


class _GemmaBase(CausalLM):
    norm_cls = GemmaRMSNorm
    layer_cls = GemmaDecoderLayer
    # Llama's layout: the four sandwich norms and the q/k norms match the replicated
    # "norm/" rule; soft caps and the embedding scale are elementwise.
    partition_rules = LLAMA_PARTITION_RULES

    def lookup(self, token_ids: jax.Array) -> jax.Array:
        x = self.embed_tokens(token_ids)
        # transformers casts sqrt(hidden) to the weight dtype before multiplying.
        return x * jnp.asarray(self.config.hidden_size**0.5, dtype=x.dtype)

    def logits(self, x: jax.Array) -> jax.Array:
        logits = super().logits(x)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = cap * jnp.tanh(logits / cap)
        return logits

    @classmethod
    def weight_rules(cls, config: ModelConfig) -> list[WeightRule]:
        rules = gemma_weight_rules(config)
        return rules + qk_norm_rules(config) if cls.qk_norm_cls is not None else rules


class Gemma2ForCausalLM(_GemmaBase):
    """Gemma 2 (Gemma2ForCausalLM checkpoints): window on even layers, soft caps."""

    model_type = "gemma2"
    architectures = ("Gemma2ForCausalLM",)

    @classmethod
    def config_from_hf(
        cls, hf: Mapping[str, Any], generation: Mapping[str, Any], dtype: str
    ) -> ModelConfig:
        return gemma_config(
            hf,
            generation,
            dtype,
            model_type=cls.model_type,
            defaults=GEMMA2_DEFAULTS,
            default_layer_types=lambda n: [
                "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)
            ],
            rope=rope_from_hf(hf),
            local_rope=None,
        )


def gemma3_ropes(hf: Mapping[str, Any]) -> tuple[RopeConfig, RopeConfig]:
    """(global, local) rotary parameters from either config.json form.

    transformers >= 5 writes ``rope_parameters: {full_attention: {...}, sliding_attention:
    {...}}``; released checkpoints carry rope_theta (global, default 1e6),
    rope_local_base_freq (local, default 1e4) and rope_scaling (global layers only).
    """
    top = ConfigReader(hf)
    params = top.section("rope_parameters")
    if params.has("full_attention") or params.has("sliding_attention"):
        full = read_rope([params.section("full_attention")], None, 1_000_000.0)
        local = read_rope([params.section("sliding_attention")], None, 10_000.0)
        return full, local
    global_rope = read_rope([top.section("rope_scaling")], top, 1_000_000.0)
    return global_rope, RopeConfig(theta=top.number("rope_local_base_freq", default=10_000.0))


class Gemma3ForCausalLM(_GemmaBase):
    """Gemma 3 text (Gemma3ForCausalLM, model_type gemma3_text): q/k norms, 5:1 windows."""

    model_type = "gemma3_text"
    architectures = ("Gemma3ForCausalLM",)
    qk_norm_cls = GemmaRMSNorm

    @classmethod
    def config_from_hf(
        cls, hf: Mapping[str, Any], generation: Mapping[str, Any], dtype: str
    ) -> ModelConfig:
        pattern = ConfigReader(hf, GEMMA3_DEFAULTS).integer("sliding_window_pattern")
        rope, local_rope = gemma3_ropes(hf)
        return gemma_config(
            hf,
            generation,
            dtype,
            model_type=cls.model_type,
            defaults=GEMMA3_DEFAULTS,
            default_layer_types=lambda n: [
                "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)
            ],
            rope=rope,
            local_rope=local_rope,
        )
