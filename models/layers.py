"""Building blocks shared by every family: norms, rotary embedding, MLPs, linear layers.

Norms and the rotary angles run in float32 and cast back to the activation dtype, which is
how the Hugging Face implementations behave in bf16/f16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from paged_jax.constants import cdiv
from paged_jax.models.config import ModelConfig, RopeConfig


def matmul_precision(dtype: str) -> jax.lax.Precision:
    """The precision of every matmul of a model in `dtype`.

    float32 models run their matmuls at HIGHEST: true f32 on every backend. XLA's GPU
    default for f32 is TF32 (10-bit mantissa), which would make GPU logits drift from
    CPU / Hugging Face f32 ones by ~1e-3 and break exact greedy parity. 16-bit models use
    DEFAULT (native bf16/f16 tensor-core dots with f32 accumulation).
    """
    return jax.lax.Precision.HIGHEST if dtype == "float32" else jax.lax.Precision.DEFAULT


def linear(
    in_features: int, out_features: int, *, bias: bool, config: ModelConfig, rngs: nnx.Rngs
) -> nnx.Linear:
    """An nnx.Linear (kernel f[in, out]) in the config's dtype and matmul precision."""
    return nnx.Linear(
        in_features,
        out_features,
        use_bias=bias,
        dtype=config.dtype,
        param_dtype=config.dtype,
        precision=matmul_precision(config.dtype),
        rngs=rngs,
    )


# Rows per tile of a batch-invariant model's row-wise reductions and matmuls
# (paged_jax.models.batch_invariant).
ROW_TILE = 32


def map_row_tiles(fn, x: jax.Array) -> jax.Array:  # f[..., d] -> f[..., d_out]
    """``fn`` over the rows of x in tiles of ROW_TILE rows, one ``lax.map`` step each.

    Every call of fn sees the same f[ROW_TILE, d] shape (the last tile zero-padded), so
    XLA compiles one program for it and a row's result cannot depend on how many rows
    surround it: XLA's CPU backend reduces a row differently in a [16, 64] array and in a
    [64, 64] one, and picks GEMM blockings by the whole product's shape.
    """
    lead, width = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, width)
    num_rows = rows.shape[0]
    num_tiles = cdiv(num_rows, ROW_TILE)
    rows = jnp.pad(rows, ((0, num_tiles * ROW_TILE - num_rows), (0, 0)))
    out = jax.lax.map(fn, rows.reshape(num_tiles, ROW_TILE, width))
    out = out.reshape(num_tiles * ROW_TILE, out.shape[-1])[:num_rows]
    return out.reshape(*lead, out.shape[-1])


class RowNorm(nnx.Module):
    """A norm over each row's last axis (``normalize``); with ``row_tiled`` set (a
    batch-invariant engine sets it) the rows go through ``map_row_tiles``."""

    row_tiled: bool = False

    def normalize(self, x: jax.Array) -> jax.Array:  # f[..., dim] -> f[..., dim]
        raise NotImplementedError

    def __call__(self, x: jax.Array) -> jax.Array:  # f[..., dim] -> f[..., dim]
        return map_row_tiles(self.normalize, x) if self.row_tiled else self.normalize(x)


class RMSNorm(RowNorm):
    """Root-mean-square norm: x / rms(x) * scale, the statistics in float32.

    Params: scale f[dim].
    """

    def __init__(self, dim: int, *, eps: float, dtype: str):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), dtype=dtype))

    def normalize(self, x: jax.Array) -> jax.Array:  # f[..., dim] -> f[..., dim]
        x32 = x.astype(jnp.float32)
        variance = jnp.mean(x32 * x32, axis=-1, keepdims=True)
        normed = (x32 * jax.lax.rsqrt(variance + self.eps)).astype(x.dtype)
        return self.scale[...] * normed


class LayerNorm(RowNorm):
    """Mean/variance LayerNorm with affine scale and bias, the statistics in float32.

    Params: scale f[dim], bias f[dim].
    """

    def __init__(self, dim: int, *, eps: float, dtype: str):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), dtype=dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype=dtype))

    def normalize(self, x: jax.Array) -> jax.Array:  # f[..., dim] -> f[..., dim]
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        variance = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        normed = (x32 - mean) * jax.lax.rsqrt(variance + self.eps)
        out = normed * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return out.astype(x.dtype)


def apply_rotary(
    x: jax.Array,  # f[..., num_tokens, num_heads, head_dim]
    positions: jax.Array,  # i32[..., num_tokens]
    rope: RopeConfig,
) -> jax.Array:  # f[..., num_tokens, num_heads, head_dim]
    """Rotates (first half, second half) pairs of each head by position * inv_freq.

    This is the "rotate half" layout that Hugging Face Llama-style checkpoints are stored in.
    """
    head_dim = x.shape[-1]
    inv_freq = jnp.asarray(rope.inv_freq(head_dim))  # f32[head_dim // 2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # f32[..., num_tokens, half]
    angles = jnp.concatenate([angles, angles], axis=-1)[..., None, :]  # [..., T, 1, head_dim]
    cos = jnp.cos(angles).astype(x.dtype)
    sin = jnp.sin(angles).astype(x.dtype)
    first, second = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-second, first], axis=-1)
    return x * cos + rotated * sin


def activation(name: str):
    """The elementwise activation called `name` in Hugging Face configs."""
    table = {
        "silu": jax.nn.silu,
        "swish": jax.nn.silu,
        "relu": jax.nn.relu,
        "gelu": lambda x: jax.nn.gelu(x, approximate=False),
        "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
        "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    }
    if name not in table:
        raise ValueError(f"hidden_act={name!r} is not supported; supported: {sorted(table)}")
    return table[name]


class GatedMLP(nnx.Module):
    """down(act(gate(x)) * up(x)): the Llama/Qwen2/Mistral feed-forward."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.hidden_act = config.hidden_act
        activation(self.hidden_act)  # fail at construction, not at the first trace
        self.gate_proj = linear(d, f, bias=bias, config=config, rngs=rngs)
        self.up_proj = linear(d, f, bias=bias, config=config, rngs=rngs)
        self.down_proj = linear(f, d, bias=bias, config=config, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:  # f[..., hidden] -> f[..., hidden]
        act = activation(self.hidden_act)
        return self.down_proj(act(self.gate_proj(x)) * self.up_proj(x))


class MLP(nnx.Module):
    """fc_out(act(fc_in(x))): the GPT-2/OPT feed-forward."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.hidden_act = config.hidden_act
        activation(self.hidden_act)  # fail at construction, not at the first trace
        self.fc_in = linear(d, f, bias=bias, config=config, rngs=rngs)
        self.fc_out = linear(f, d, bias=bias, config=config, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:  # f[..., hidden] -> f[..., hidden]
        return self.fc_out(activation(self.hidden_act)(self.fc_in(x)))
