"""The uniform model configuration every family translates its Hugging Face config.json into.

Host-side module: no jax import, so the engine can read a checkpoint's config cheaply.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
LAYER_TYPES = ("full_attention", "sliding_attention")


def canonical_dtype(dtype: Any) -> str:
    """Maps "float32"/"bfloat16"/"float16" (or a numpy/jax dtype of those) to its name.

    Raises:
        ValueError: for any other dtype.
    """
    name = dtype if isinstance(dtype, str) else getattr(dtype, "name", str(dtype))
    aliases = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "fp32": "float32"}
    name = aliases.get(name, name)
    if name not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {SUPPORTED_DTYPES}")
    return name


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding parameters (Llama-style, rotate-half layout).

    Attributes:
        theta: base of the inverse frequencies.
        rope_type: "default", "linear" (positions divided by factor) or "llama3".
        factor: scaling factor for "linear" and "llama3".
        low_freq_factor: llama3 only.
        high_freq_factor: llama3 only.
        original_max_position_embeddings: llama3 only: context the model was trained on.
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None

    def __post_init__(self):
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_type={self.rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
            )
        if self.rope_type == "llama3" and self.original_max_position_embeddings is None:
            raise ValueError("rope_type='llama3' needs original_max_position_embeddings")

    def inv_freq(self, head_dim: int) -> np.ndarray:  # f32[head_dim // 2]
        """The per-pair inverse frequencies, with the scaling of rope_type applied."""
        exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
        inv_freq = 1.0 / (self.theta**exponents)
        if self.rope_type == "linear":
            inv_freq = inv_freq / self.factor
        elif self.rope_type == "llama3":
            # Long wavelengths are slowed by `factor`, short ones kept, and the band
            # in between interpolated linearly in 1/wavelength (Llama 3.1 report).
            old_context = self.original_max_position_embeddings
            low_freq_wavelen = old_context / self.low_freq_factor
            high_freq_wavelen = old_context / self.high_freq_factor
            wavelen = 2 * math.pi / inv_freq
            smooth = (old_context / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            interpolated = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
            inv_freq = np.where(
                wavelen > low_freq_wavelen,
                inv_freq / self.factor,
                np.where(wavelen < high_freq_wavelen, inv_freq, interpolated),
            )
        return inv_freq.astype(np.float32)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Family-independent description of a decoder-only checkpoint.

    Frozen and hashable (tuples, not lists) so that it can sit in an NNX graphdef that
    jax uses as a static value; `generation_config` is kept raw and out of the hash.

    Attributes:
        model_type: the family, as in config.json ("llama", "qwen2", "mistral", "gpt2", "opt").
        vocab_size: number of rows of the token embedding and of the logits.
        hidden_size: residual stream width.
        num_hidden_layers: number of decoder layers.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (GQA when fewer than query heads).
        head_dim: width of one head.
        intermediate_size: MLP hidden width.
        max_position_embeddings: longest position the checkpoint supports.
        sliding_window: attention window in tokens (a query sees keys with
            q_pos - k_pos < sliding_window) on layers whose layer type is
            "sliding_attention"; None if the model has no window.
        layer_types: per layer, "full_attention" or "sliding_attention".
        rope: rotary parameters; None for families with learned positions.
        norm_eps: epsilon of RMSNorm / LayerNorm.
        hidden_act: MLP activation ("silu", "gelu_new", "relu", ...).
        qkv_bias: q/k/v projections have biases.
        out_bias: attention output projection has a bias.
        mlp_bias: MLP projections have biases.
        pre_norm: LayerNorm before attention/MLP (False: OPT-350m-style post-norm).
        final_norm: a norm after the last layer.
        word_embed_proj_dim: OPT: embedding width when it differs from hidden_size.
        eos_token_ids: end-of-sequence ids merged from config.json and generation_config.json.
        bos_token_id: beginning-of-sequence id, if any.
        pad_token_id: padding id, if any.
        dtype: parameter and activation dtype name.
        tie_word_embeddings: the output projection is the token embedding.
        query_pre_attn_scalar: attention scale is query_pre_attn_scalar ** -0.5 (Gemma);
            None means head_dim ** -0.5.
        attn_logit_softcapping: cap * tanh(scores / cap) on scaled attention scores
            before masking (Gemma 2); None: no cap.
        final_logit_softcapping: the same transform on the output logits (Gemma 2).
        local_rope: rotary parameters of sliding-window layers when they differ from
            `rope` (Gemma 3's rope_local_base_freq); None: every layer uses `rope`.
        generation_config: generation_config.json as read (not hashed or compared).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    rope: RopeConfig | None = None
    norm_eps: float = 1e-6
    hidden_act: str = "silu"
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    pre_norm: bool = True
    final_norm: bool = True
    word_embed_proj_dim: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    dtype: str = "float32"
    tie_word_embeddings: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    local_rope: RopeConfig | None = None
    generation_config: Mapping[str, Any] = dataclasses.field(
        default_factory=dict, compare=False, hash=False
    )

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        if not self.layer_types:
            kind = "full_attention" if self.sliding_window is None else "sliding_attention"
            object.__setattr__(self, "layer_types", (kind,) * self.num_hidden_layers)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(
            LAYER_TYPES
        ):
            raise ValueError(
                f"layer_types={self.layer_types!r} must hold num_hidden_layers="
                f"{self.num_hidden_layers} entries from {LAYER_TYPES}"
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window={self.sliding_window!r} must be positive or None")

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The window of layer `layer_idx`, or None when it attends to the full context."""
        if self.layer_types[layer_idx] == "sliding_attention":
            return self.sliding_window
        return None

    def layer_rope(self, layer_idx: int) -> RopeConfig | None:
        """The rotary parameters of layer `layer_idx` (local_rope on window layers if set)."""
        if self.local_rope is not None and self.layer_types[layer_idx] == "sliding_attention":
            return self.local_rope
        return self.rope

    @property
    def attention_scale(self) -> float:
        """Softmax scale: query_pre_attn_scalar ** -0.5 if set, else head_dim ** -0.5."""
        base = self.query_pre_attn_scalar if self.query_pre_attn_scalar else self.head_dim
        return float(base) ** -0.5

    def to_json_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict; `from_json_dict` inverts it."""
        out = dataclasses.asdict(self)
        out["generation_config"] = dict(self.generation_config)
        return out

    @classmethod
    def from_json_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        """Rebuilds a config written by `to_json_dict`."""
        data = dict(data)
        for name in ("rope", "local_rope"):
            if data.get(name) is not None:
                data[name] = RopeConfig(**data[name])
        for name in ("layer_types", "eos_token_ids"):
            data[name] = tuple(data.get(name) or ())
        return cls(**data)


def rope_from_hf(hf: Mapping[str, Any], default_theta: float = 10000.0) -> RopeConfig:
    """Reads rotary parameters from either config.json form.

    transformers >= 5 writes `rope_parameters: {rope_type, rope_theta, ...}`; published
    checkpoints mostly carry the older `rope_theta` plus `rope_scaling: {type|rope_type, ...}`.
    """
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    params = {**scaling, **params}
    theta = params.get("rope_theta", hf.get("rope_theta", default_theta))
    rope_type = params.get("rope_type", params.get("type", "default"))
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
    )


def merge_eos_token_ids(*sources: int | Sequence[int] | None) -> tuple[int, ...]:
    """Merges eos ids from several config dicts' `eos_token_id` values, keeping first-seen order."""
    merged: list[int] = []
    for source in sources:
        if source is None:
            continue
        for token_id in [source] if isinstance(source, int) else source:
            if int(token_id) not in merged:
                merged.append(int(token_id))
    return tuple(merged)


def common_fields(
    hf: Mapping[str, Any], generation: Mapping[str, Any], dtype: str
) -> dict[str, Any]:
    """Fields every family reads the same way: special token ids, dtype, generation config."""
    bos = generation.get("bos_token_id", hf.get("bos_token_id"))
    pad = generation.get("pad_token_id", hf.get("pad_token_id"))
    return dict(
        eos_token_ids=merge_eos_token_ids(hf.get("eos_token_id"), generation.get("eos_token_id")),
        bos_token_id=bos if isinstance(bos, int) else None,
        pad_token_id=pad if isinstance(pad, int) else None,
        dtype=canonical_dtype(dtype),
        generation_config=dict(generation),
    )
