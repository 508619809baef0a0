"""The uniform model configuration every family translates its Hugging Face config.json into.

Host-side module: no jax import, so the engine can read a checkpoint's config cheaply.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from paged_jax.constants import fail, is_int, is_number

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
LAYER_TYPES = ("full_attention", "sliding_attention")
# Activation names (config.json "hidden_act") that paged_jax.models.layers.activation knows.
HIDDEN_ACTS = ("silu", "swish", "relu", "gelu", "gelu_new", "gelu_pytorch_tanh")
# More layers than any decoder has; a bigger count is garbage, refused before a per-layer
# tuple of that length is built.
MAX_NUM_LAYERS = 1 << 16
# The longest repr of a bad value an error message quotes (a garbage value may be huge).
_MAX_QUOTED_CHARS = 120


def short_repr(value: Any) -> str:
    """repr(value), cut to a readable length for error messages."""
    text = repr(value)
    if len(text) > _MAX_QUOTED_CHARS:
        text = text[: _MAX_QUOTED_CHARS - 3] + "..."
    return text


def is_positive_finite(value: Any) -> bool:
    """True for an int or float (not a bool) that is finite and > 0."""
    return is_number(value) and math.isfinite(value) and value > 0


class ConfigFileError(ValueError):
    """A value in a checkpoint's config file that cannot be used.

    ``str(err)`` is ``"{file}: {message}"``; the loader re-raises with the full path of
    the file (`file` is then that path).

    Args:
        file: the file name ("config.json", "generation_config.json") or its path.
        message: what is wrong, as "field=value must be expected".
    """

    def __init__(self, file: Any, message: str):
        super().__init__(f"{file}: {message}")
        self.file = file
        self.message = message


class ConfigReader:
    """Typed reads of one Hugging Face config dict, each checked where it is read.

    A key present with a non-null value wins; an absent or null key takes the family's
    default. Every bad value is a ConfigFileError naming the file, the field (dotted for
    nested objects: ``rope_scaling.factor``), the value and what was expected, so that
    ``"false"`` is never read as True and ``"16"`` never reaches a comparison.

    Args:
        values: the parsed JSON object.
        defaults: the family's values for keys a config may leave out.
        file: the file name quoted in errors.
        prefix: the dotted path of `values` inside the file ("" at the top level).
    """

    def __init__(
        self,
        values: Mapping[str, Any],
        defaults: Mapping[str, Any] | None = None,
        *,
        file: str = "config.json",
        prefix: str = "",
    ):
        if not isinstance(values, Mapping):
            raise ConfigFileError(file, f"{prefix.rstrip('.') or 'the file'} must be a JSON object")
        self.values = values
        self.defaults = dict(defaults or {})
        self.file = file
        self.prefix = prefix

    def fail(self, name: str, value: Any, expected: str) -> ConfigFileError:
        """The error for `name`: raise the returned ConfigFileError."""
        return ConfigFileError(
            self.file, f"{self.prefix}{name}={short_repr(value)} must be {expected}"
        )

    def has(self, name: str) -> bool:
        """True when the file itself sets `name` (to any value, null included)."""
        return name in self.values

    def raw(self, name: str, default: Any = None, *, null_is_none: bool = False) -> Any:
        """The value as read: the file's non-null value, else the family default, else `default`.

        With `null_is_none`, an explicit null in the file is None (Gemma's
        ``sliding_window: null`` turns the window off rather than taking the default).
        """
        value = self.values.get(name)
        if value is None and not (null_is_none and name in self.values):
            value = self.defaults.get(name, default)
        return value

    def integer(
        self, name: str, *, minimum: int = 1, maximum: int | None = None, default: Any = None
    ) -> int:
        """A required int in [minimum, maximum] (a bool, float or string is an error)."""
        value = self.raw(name, default)
        if not is_int(value) or value < minimum or (maximum is not None and value > maximum):
            bound = (
                f"an int >= {minimum}" if maximum is None else f"an int in [{minimum}, {maximum}]"
            )
            raise self.fail(name, value, bound)
        return value

    def num_layers(self, name: str = "num_hidden_layers") -> int:
        """The layer count: an int in [1, MAX_NUM_LAYERS]."""
        return self.integer(name, maximum=MAX_NUM_LAYERS)

    def optional_integer(
        self, name: str, *, minimum: int = 1, default: Any = None, null_is_none: bool = False
    ) -> int | None:
        """An int >= minimum, or None when it reads as None (see `raw`)."""
        value = self.raw(name, default, null_is_none=null_is_none)
        if value is not None and (not is_int(value) or value < minimum):
            raise self.fail(name, value, f"an int >= {minimum} or null")
        return value

    def number(self, name: str, *, default: Any = None) -> float:
        """A required finite number > 0 (eps, rotary base, scaling factor, soft cap)."""
        value = self.raw(name, default)
        if not is_positive_finite(value):
            raise self.fail(name, value, "a finite number > 0")
        return float(value)

    def optional_number(
        self, name: str, *, default: Any = None, null_is_none: bool = False
    ) -> float | None:
        """A finite number > 0, or None when it reads as None (see `raw`)."""
        value = self.raw(name, default, null_is_none=null_is_none)
        if value is not None and not is_positive_finite(value):
            raise self.fail(name, value, "a finite number > 0 or null")
        return None if value is None else float(value)

    def boolean(self, name: str, *, default: Any = None) -> bool:
        """A JSON true or false (the string "false" is an error, not True)."""
        value = self.raw(name, default)
        if not isinstance(value, bool):
            raise self.fail(name, value, "true or false (a JSON boolean)")
        return value

    def choice(self, name: str, choices: Sequence[str], *, default: Any = None) -> str:
        """A string from `choices`."""
        value = self.raw(name, default)
        if not isinstance(value, str) or value not in choices:
            raise self.fail(name, value, f"one of {tuple(choices)}")
        return value

    def optional_str(self, name: str, *, default: Any = None) -> str | None:
        """A string, or None when absent or null."""
        value = self.raw(name, default)
        if value is not None and not isinstance(value, str):
            raise self.fail(name, value, "a string")
        return value

    def str_list(self, name: str, choices: Sequence[str]) -> tuple[str, ...] | None:
        """A list of strings from `choices`, or None when absent, null or empty."""
        value = self.raw(name)
        if value is None or value == []:
            return None
        if not isinstance(value, list) or not all(
            isinstance(item, str) and item in choices for item in value
        ):
            raise self.fail(name, value, f"a list of strings from {tuple(choices)}")
        return tuple(value)

    def section(self, name: str) -> ConfigReader:
        """The reader of the nested object `name` (absent or null: empty)."""
        value = self.raw(name)
        if value is None:
            value = {}
        if not isinstance(value, Mapping):
            raise self.fail(name, value, "a JSON object")
        return ConfigReader(value, file=self.file, prefix=f"{self.prefix}{name}.")

    def token_ids(self, name: str) -> tuple[int, ...]:
        """An id or a list of ids (ints >= 0); () when absent or null."""
        value = self.raw(name)
        if value is None:
            return ()
        items = [value] if not isinstance(value, list) else value
        if not items and isinstance(value, list):
            return ()
        if not all(is_int(item) and item >= 0 for item in items):
            raise self.fail(name, value, "a token id (an int >= 0) or a list of them")
        return tuple(items)

    def optional_token_id(self, name: str) -> int | None:
        """An id (int >= 0); None when absent, null or a list (which the engine ignores)."""
        value = self.raw(name)
        if value is None or isinstance(value, list):
            return None
        if not is_int(value):
            raise self.fail(name, value, "a token id (an int) or null")
        return value


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
        # A zero, negative or NaN base or factor gives NaN angles: every logit NaN.
        for name in ("theta", "factor", "low_freq_factor", "high_freq_factor"):
            if not is_positive_finite(getattr(self, name)):
                fail(self, name, "a finite number > 0")
        original = self.original_max_position_embeddings
        if original is not None and (not is_int(original) or original < 1):
            fail(self, "original_max_position_embeddings", "an int >= 1 or None")
        if self.rope_type == "llama3":
            if original is None:
                raise ValueError("rope_type='llama3' needs original_max_position_embeddings")
            if self.high_freq_factor <= self.low_freq_factor:  # the band between is divided by
                fail(self, "high_freq_factor", f"> low_freq_factor={self.low_freq_factor}")

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


# How a family's router turns its top-k probabilities into combine weights.
ROUTER_WEIGHT_DTYPES = ("model", "float32")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP: which layers have one, its router and its experts.

    Attributes:
        num_experts: routed experts per MoE layer (E).
        num_experts_per_tok: experts each token is sent to (top-k).
        moe_intermediate_size: hidden width of one routed expert.
        norm_topk_prob: renormalise the top-k probabilities to sum to 1.
        sparse_layers: per layer, True where the MLP is a MoE block (Qwen2-MoE and
            Qwen3-MoE keep dense MLPs on ``mlp_only_layers`` and off ``decoder_sparse_step``).
        shared_expert_intermediate_size: width of the always-on shared expert, gated by
            sigmoid(x @ w) (Qwen2-MoE); None: no shared expert.
        router_weight_dtype: "model": the top-k weights are cast to the model dtype
            before they scale expert outputs (Qwen); "float32": they stay float32 and the
            product is cast back (Mixtral).
    """

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]
    shared_expert_intermediate_size: int | None = None
    router_weight_dtype: str = "model"

    def __post_init__(self):
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                fail(self, name, "an int >= 1")
        if self.num_experts_per_tok > self.num_experts:
            fail(self, "num_experts_per_tok", f"<= num_experts={self.num_experts}")
        shared = self.shared_expert_intermediate_size
        if shared is not None and (not is_int(shared) or shared < 1):
            fail(self, "shared_expert_intermediate_size", "an int >= 1 or None")
        if not isinstance(self.norm_topk_prob, bool):
            fail(self, "norm_topk_prob", "a bool")
        object.__setattr__(self, "sparse_layers", tuple(self.sparse_layers))
        if not all(isinstance(s, bool) for s in self.sparse_layers):
            fail(self, "sparse_layers", "a tuple of bools, one per layer")
        if self.router_weight_dtype not in ROUTER_WEIGHT_DTYPES:
            fail(self, "router_weight_dtype", f"one of {ROUTER_WEIGHT_DTYPES}")


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
        moe: the mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE); None: dense.
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
    moe: MoEConfig | None = None
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
            if not is_int(value) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.num_hidden_layers > MAX_NUM_LAYERS:
            fail(self, "num_hidden_layers", f"<= {MAX_NUM_LAYERS}")
        self.check_domains()
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
        eos = tuple(self.eos_token_ids)
        if not all(
            isinstance(i, numbers.Integral) and not isinstance(i, bool) and i >= 0 for i in eos
        ):
            fail(self, "eos_token_ids", "a tuple of token ids (ints >= 0)")
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in eos))
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(
            LAYER_TYPES
        ):
            raise ValueError(
                f"layer_types={self.layer_types!r} must hold num_hidden_layers="
                f"{self.num_hidden_layers} entries from {LAYER_TYPES}"
            )
        window = self.sliding_window
        if window is not None and (not is_int(window) or window <= 0):
            raise ValueError(f"sliding_window={window!r} must be positive or None")
        if self.moe is not None:
            if not isinstance(self.moe, MoEConfig):
                fail(self, "moe", "a MoEConfig or None")
            if len(self.moe.sparse_layers) != self.num_hidden_layers:
                raise ValueError(
                    f"moe.sparse_layers has {len(self.moe.sparse_layers)} entries; it must "
                    f"have num_hidden_layers={self.num_hidden_layers}"
                )

    def check_domains(self) -> None:
        """Rejects values that would run but compute NaN or nonsense (eps <= 0, NaN caps)."""
        # A non-positive or NaN eps makes rsqrt(mean(x^2) + eps) NaN or inf on some row.
        if not is_positive_finite(self.norm_eps):
            fail(self, "norm_eps", "a finite number > 0")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not is_positive_finite(value):
                fail(self, name, "a finite number > 0 or None")
        for name in ("rope", "local_rope"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), RopeConfig):
                fail(self, name, "a RopeConfig or None")
        for name in ("qkv_bias", "out_bias", "mlp_bias", "pre_norm", "final_norm"):
            if not isinstance(getattr(self, name), bool):
                fail(self, name, "a bool")
        if not isinstance(self.tie_word_embeddings, bool):
            fail(self, "tie_word_embeddings", "a bool")
        if self.word_embed_proj_dim is not None and (
            not is_int(self.word_embed_proj_dim) or self.word_embed_proj_dim <= 0
        ):
            fail(self, "word_embed_proj_dim", "a positive int or None")
        for name in ("bos_token_id", "pad_token_id"):
            if getattr(self, name) is not None and not is_int(getattr(self, name)):
                fail(self, name, "an int or None")

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
        if data.get("moe") is not None:
            data["moe"] = MoEConfig(**data["moe"])
        return cls(**data)

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """True when layer `layer_idx`'s MLP is a mixture of experts."""
        return self.moe is not None and self.moe.sparse_layers[layer_idx]


def read_rope(
    sections: Sequence[ConfigReader], top: ConfigReader | None, default_theta: float
) -> RopeConfig:
    """Rotary parameters: each key from the first of `sections` that sets it.

    Args:
        sections: nested objects in priority order (``rope_parameters``, ``rope_scaling``).
        top: the config's top level, consulted for ``rope_theta`` last; None to skip.
        default_theta: the family's rotary base when no section sets one.
    """

    def source(name: str) -> ConfigReader | None:
        return next((r for r in sections if r.raw(name) is not None), None)

    theta_source = source("rope_theta")
    if theta_source is None and top is not None and top.raw("rope_theta") is not None:
        theta_source = top
    type_name = "rope_type" if source("rope_type") is not None else "type"
    type_source = source(type_name)

    def number(name: str, default: float) -> float:
        reader = source(name)
        return default if reader is None else reader.number(name)

    original = source("original_max_position_embeddings")
    return RopeConfig(
        theta=float(default_theta) if theta_source is None else theta_source.number("rope_theta"),
        rope_type="default" if type_source is None else type_source.optional_str(type_name),
        factor=number("factor", 1.0),
        low_freq_factor=number("low_freq_factor", 1.0),
        high_freq_factor=number("high_freq_factor", 4.0),
        original_max_position_embeddings=None
        if original is None
        else original.integer("original_max_position_embeddings"),
    )


def rope_from_hf(hf: Mapping[str, Any], default_theta: float = 10000.0) -> RopeConfig:
    """Reads rotary parameters from either config.json form.

    transformers >= 5 writes `rope_parameters: {rope_type, rope_theta, ...}`; published
    checkpoints mostly carry the older `rope_theta` plus `rope_scaling: {type|rope_type, ...}`.

    Raises:
        ConfigFileError: naming the field (``rope_scaling.factor``) of a bad value.
    """
    top = ConfigReader(hf)
    sections = [top.section("rope_parameters"), top.section("rope_scaling")]
    return read_rope(sections, top, default_theta)


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
    """Fields every family reads the same way: special token ids, dtype, generation config.

    generation_config.json's bos/pad ids win over config.json's; eos ids of both merge.

    Raises:
        ConfigFileError: naming the file and the field of an id that is not an int.
    """
    config = ConfigReader(hf)
    gen = ConfigReader(generation, file="generation_config.json")

    def special(name: str) -> int | None:
        return gen.optional_token_id(name) if gen.has(name) else config.optional_token_id(name)

    return dict(
        eos_token_ids=merge_eos_token_ids(
            config.token_ids("eos_token_id"), gen.token_ids("eos_token_id")
        ),
        bos_token_id=special("bos_token_id"),
        pad_token_id=special("pad_token_id"),
        dtype=canonical_dtype(dtype),
        generation_config=dict(generation),
    )
