"""random_model: a model from a config dict, its weights drawn on the device (no checkpoint).

    model = random_model(LLAMA3_8B_CONFIG, dtype="bfloat16", seed=0)   # 16 GB, on the GPU
    engine = Engine(model, EngineConfig(...), owns_model=True)

Benchmarks of a realistic shape need no checkpoint and must not build one on the host: a
Llama-3-8B's 16 GB would be drawn by numpy, held in host memory and copied over. Here one
jitted function of a PRNG key draws every weight where it will live (its lowering holds
no array constant; tests check it), as transformers initializes a fresh model: matrices
N(0, std^2), norm scales 1, biases 0.

Its compile time does not grow with depth: params of one shape and kind (every layer's
q_proj, ...) are drawn as one stacked array, then handed out a row at a time by a jitted
gather whose row index is the only thing the host sends. Drawing each param on its own
(the model's own initializers) costs XLA one RNG kernel per param, and slicing the
stacked arrays inside the init one kernel per slice: both grow with depth.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax.models.config import ModelConfig, canonical_dtype
from paged_jax.models.decoder import CausalLM
from paged_jax.models.loader import abstract_model
from paged_jax.models.registry import model_class_for

# Meta-Llama-3-8B's config.json fields that shape the model (32 layers, hidden 4096,
# 32 query / 8 KV heads of 128, SwiGLU 14336, vocabulary 128,256: 8.03B parameters).
LLAMA3_8B_CONFIG: dict[str, Any] = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    hidden_act="silu",
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    bos_token_id=128000,
    eos_token_id=128001,
    tie_word_embeddings=False,
)

# transformers' initializer_range: the std of every random matrix.
INIT_STD = 0.02


@dataclasses.dataclass(frozen=True)
class InitGroup:
    """Params drawn together: one kind ("normal", "ones", "zeros"), shape and dtype.

    Attributes:
        paths: each param's path in the model state, in stacking order.
    """

    kind: str
    shape: tuple[int, ...]
    dtype: str
    paths: tuple[tuple[Any, ...], ...]

    @property
    def stacked_shape(self) -> tuple[int, ...]:
        """The drawn array: the param shape, with a leading axis when several share it."""
        return self.shape if len(self.paths) == 1 else (len(self.paths), *self.shape)


def init_groups(state: nnx.State) -> list[InitGroup]:
    """The params of an abstract model state grouped by (kind, shape, dtype).

    Float matrices (and higher ranks: stacked experts) are "normal"; a vector named bias
    is "zeros"; other vectors (norm scales) are "ones"; non-float leaves are "zeros".
    """
    grouped: dict[tuple[str, tuple[int, ...], str], list[tuple[Any, ...]]] = {}
    for path, var in nnx.to_flat_state(state):
        leaf = var.get_value()
        dtype = jnp.dtype(leaf.dtype)
        if not jnp.issubdtype(dtype, jnp.floating) or path[-1] == "bias":
            kind = "zeros"
        else:
            kind = "normal" if leaf.ndim >= 2 else "ones"
        grouped.setdefault((kind, tuple(leaf.shape), dtype.name), []).append(tuple(path))
    return [InitGroup(k, s, d, tuple(p)) for (k, s, d), p in grouped.items()]


def random_init_fn(
    groups: list[InitGroup], std: float = INIT_STD
) -> Callable[[jax.Array], list[jax.Array]]:
    """The jitted init: a PRNG key -> one array per group (InitGroup.stacked_shape).

    Nothing concrete is captured: the key is the only input, and every value is drawn
    or filled by device code.
    """

    def init(key: jax.Array) -> list[jax.Array]:
        keys = jax.random.split(key, len(groups))
        out = []
        for k, group in zip(keys, groups):
            dtype = jnp.dtype(group.dtype)
            if group.kind == "normal":
                out.append(jax.random.normal(k, group.stacked_shape, dtype) * std)
            else:
                fill = 1 if group.kind == "ones" else 0
                out.append(jnp.full(group.stacked_shape, fill, dtype))
        return out

    return jax.jit(init)


@jax.jit
def _row(stacked: jax.Array, index: jax.Array) -> jax.Array:  # [n, *s], i32[] -> [*s]
    return jax.lax.dynamic_index_in_dim(stacked, index, axis=0, keepdims=False)


def config_from_dict(
    hf_config: Mapping[str, Any], dtype: str = "float32"
) -> tuple[type[CausalLM], ModelConfig]:
    """(model class, ModelConfig) of a Hugging Face config dict (config.json's fields).

    Raises:
        ValueError: unsupported architecture or dtype, or a field out of its domain.
    """
    cls = model_class_for(hf_config)
    return cls, cls.config_from_hf(hf_config, {}, canonical_dtype(dtype))


def random_model(
    hf_config: Mapping[str, Any],
    *,
    dtype: str = "float32",
    seed: int | jax.Array = 0,
    attention_backend: str = "auto",
    std: float = INIT_STD,
) -> CausalLM:
    """A model of `hf_config`'s shape with random weights drawn on the default device.

    Args:
        hf_config: config.json's fields (e.g. LLAMA3_8B_CONFIG), any supported family.
        dtype: "float32", "bfloat16" or "float16": params and activations.
        seed: an int, or a PRNG key (jax.random.key) already on the device.
        attention_backend: pallas_kernels backend of the paged forward.
        std: standard deviation of every random matrix.

    Returns:
        The model, as load_model returns one (an engine may take it over: owns_model).

    Raises:
        ValueError: as config_from_dict.
    """
    cls, config = config_from_dict(hf_config, dtype)
    graphdef, state = abstract_model(cls, config, attention_backend)
    groups = init_groups(state)
    key = jax.random.key(seed) if isinstance(seed, int) else seed
    pure: dict[Any, Any] = {}
    drawn_groups = random_init_fn(groups, std)(key)
    for group in groups:
        drawn = drawn_groups.pop(0)
        for i, path in enumerate(group.paths):
            # Several params of a group: each copies its row out (the host sends the
            # index), and the stacked array is dropped once every row is out.
            value = drawn if len(group.paths) == 1 else _row(drawn, jax.device_put(np.int32(i)))
            node = pure
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = value
        del drawn
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


__all__ = [
    "INIT_STD",
    "LLAMA3_8B_CONFIG",
    "InitGroup",
    "config_from_dict",
    "init_groups",
    "random_init_fn",
    "random_model",
]
