"""8-bit weights (W8A16): the quantization rule, the quantized linear layer and its product.

The rule (``quantization="int8" | "fp8"``, quantized on load from a float checkpoint):
symmetric, one scale per output channel (a row of transformers' ``[out, in]`` weight, a
column of our ``[in, out]`` kernel), computed in float32 from the stored values:

    int8: scale = max|w| / 127,  q = clip(rint(w / scale), -127, 127)
    fp8:  scale = max|w| / 448,  q = float8_e4m3fn(w / scale)   (round to nearest even)
    a row of zeros gets scale 1

Pre-quantized block-wise fp8 checkpoints (transformers' fine-grained fp8) keep their own
scales, one per [block, block] tile (``weight_scale_inv``); they are read by
models/fp8_checkpoint.py into the same layer with a block scale.

The product keeps the weight 8-bit on the device. Per output channel the scale commutes
with the contraction, so it multiplies the product's output::

    y[t, o] = sum_i x[t, i] * (q[i, o] * s[o]) = (x @ q)[t, o] * s[o]

``x @ q.astype(compute dtype)``: the convert is exact (int8 and e4m3 fit in bf16) and is
the only dequantization; XLA fuses it into the dot's operand or, where it does not,
materializes one converted matrix at a time. A block scale varies along the contraction,
so the block-wise layer dequantizes its one matrix (q * s per tile) before the dot, and
block-wise MoE experts are multiplied one row tile (one expert matrix) at a time; a step
still holds at most one dequantized matrix at a time (scripts/bench_quantization.py reads
it from the compiled memory analysis).

The token embedding and the LM head are quantized only when asked
(``quantize_embeddings``), by the same rule over the rows of the [vocab, embed] table: a
row is a token's embedding and an output channel of the head, so one table with one scale
per row serves the lookup (rows gathered, times their scales) and a tied head (the
product's output times the per-vocab scale). MoE routers and Qwen2-MoE's shared-expert
gate stay in the model dtype. qwix (Google's JAX quantization library) was read and not used: its symmetric int8
bound is 127.5 (not 127), its scales take the weight's dtype and its PTQ provider rewrites
the model's dot_generals by interception, which does not reach our scanned layer stacks
(docs/quantization.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from paged_jax.constants import QUANTIZATIONS, cdiv
from paged_jax.models.layers import matmul_precision

__all__ = [
    "QUANTIZATIONS",
    "QUANTIZED_DTYPES",
    "ExpertStackLayer",
    "QuantizedExpertWeight",
    "QuantizedEmbed",
    "QuantizedExperts",
    "QuantizedLinear",
    "batched_matmul",
    "dequantize",
    "grouped_ragged_dot",
    "quantize_columns",
    "quantize_rows",
    "quantized_matmul",
    "tile_matmul",
]

# The largest magnitude of each 8-bit format: the row maximum maps onto it.
QUANT_MAX = {"int8": 127.0, "fp8": 448.0}
QUANTIZED_DTYPES = {"int8": np.dtype(np.int8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn)}


def check_quantization(quantization: Any) -> str | None:
    """``quantization`` if it is None or one of QUANTIZATIONS; else a ValueError."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r} must be None or one of {QUANTIZATIONS}")
    return quantization


def _quantize(w: np.ndarray, method: str, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """The rule over `axis` of w: one scale per slice along the other axes."""
    check_quantization(method)
    w = np.asarray(w, dtype=np.float32)
    absmax = np.max(np.abs(w), axis=axis, keepdims=True)
    scale = np.where(absmax > 0, absmax / np.float32(QUANT_MAX[method]), np.float32(1.0))
    scale = scale.astype(np.float32)
    scaled = w / scale
    if method == "int8":
        q = np.clip(np.rint(scaled), -127, 127).astype(np.int8)
    else:
        q = scaled.astype(ml_dtypes.float8_e4m3fn)
    return q, np.squeeze(scale, axis)


def quantize_columns(kernel: np.ndarray, method: str) -> tuple[np.ndarray, np.ndarray]:
    """The rule (module docstring) on a kernel f[..., in, out]: one scale per column.

    Returns:
        (q int8 / float8_e4m3fn [..., in, out], scale f32[..., out]).
    """
    return _quantize(kernel, method, -2)


def quantize_rows(table: np.ndarray, method: str) -> tuple[np.ndarray, np.ndarray]:
    """The rule on an embedding table f[vocab, embed]: one scale per row (per token).

    Returns:
        (q int8 / float8_e4m3fn [vocab, embed], scale f32[vocab]).
    """
    return _quantize(table, method, -1)


def dequantize(q: Any, scale: Any, block_size: int | None = None) -> Any:
    """f32[..., in, out]: the weight the quantized layer multiplies by (numpy or jax).

    ``scale`` is f32[..., out] per channel, or f32[ceil(in/b), ceil(out/b)] per b x b tile
    when ``block_size`` is b.
    """
    xp = np if isinstance(q, np.ndarray) else jnp
    w = q.astype(xp.float32)
    if block_size is None:
        return w * scale[..., None, :]
    rows, cols = q.shape[-2:]
    expanded = xp.repeat(xp.repeat(scale, block_size, axis=-2), block_size, axis=-1)
    return w * expanded[..., :rows, :cols]


def quantized_matmul(
    x: jax.Array,  # f[..., in]
    q: jax.Array,  # int8 / f8[in, out]
    scale: jax.Array,  # f32[out], or f32[ceil(in/b), ceil(out/b)] with block_size b
    *,
    block_size: int | None = None,
    precision: Any = None,
) -> jax.Array:  # f[..., out] in x's dtype
    """x @ dequantize(q, scale), without a dequantized weight beyond one matrix.

    Per channel: (x @ q) * scale, the convert of q the only dequantization (module
    docstring). The product accumulates in float32 and is scaled in float32.
    """
    if block_size is None:
        y = jnp.dot(x, q.astype(x.dtype), precision=precision, preferred_element_type=jnp.float32)
        return (y * scale).astype(x.dtype)
    w = dequantize(q, scale, block_size).astype(x.dtype)
    return jnp.dot(x, w, precision=precision, preferred_element_type=jnp.float32).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class QuantizedExpertWeight:
    """One stacked expert projection kept 8-bit: q int8 / f8[G, in, out] with scale f32[G,
    out] (per channel) or f32[G, ceil(in/b), ceil(out/b)] (block-wise fp8, block_size b).

    A pytree, so the grouped matmul gathers a tile's expert (``jax.tree.map(take)``) and
    shard_map splits the experts axis of both leaves alike.

    ``layer`` (block-wise only; i32[]): q and scale are a layer scan's whole stacks, q
    [L, G, in, out] and scale [L, G, ...], and this weight is layer ``layer`` of them. The
    tile loop then slices each tile's expert straight out of the stack: a per-layer slice
    [G, in, out] fed to the loop would be copied whole (ExpertStackLayer).
    """

    q: jax.Array
    scale: jax.Array
    block_size: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    layer: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """[G, in, out] (one layer's, also when q holds the layer stack)."""
        return self.q.shape if self.layer is None else self.q.shape[1:]

    def expert(self, g: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(q [in, out], scale) of expert g (of layer ``layer`` when set)."""
        if self.layer is None:
            return self.q[g], self.scale[g]
        return self.q[self.layer, g], self.scale[self.layer, g]


jax.tree_util.register_dataclass(
    QuantizedExpertWeight, data_fields=["q", "scale", "layer"], meta_fields=["block_size"]
)


def batched_matmul(x: jax.Array, w: Any, **dot: Any) -> jax.Array:
    """x f[t, m, d] @ w f[t, d, f] per t; w may be a per-channel QuantizedExpertWeight
    (scale [t, f]; block-wise ones go through tile_matmul)."""
    if not isinstance(w, QuantizedExpertWeight):
        return jnp.einsum("tmd,tdf->tmf", x, w, **dot)
    assert w.block_size is None, "block-wise expert weights take tile_matmul (a bug in the caller)"
    dtype = dot.pop("preferred_element_type", x.dtype)
    y = jnp.einsum(
        "tmd,tdf->tmf", x, w.q.astype(x.dtype), preferred_element_type=jnp.float32, **dot
    )
    return (y * w.scale[:, None, :]).astype(dtype)


def grouped_ragged_dot(rows: jax.Array, w: Any, group_sizes: jax.Array, **dot: Any) -> jax.Array:
    """jax.lax.ragged_dot of rows f[n, d] sorted by group with w f[G, d, f] (or quantized per
    channel: the product of q, then each row times its group's scale; rows past the groups
    are 0)."""
    if not isinstance(w, QuantizedExpertWeight):
        return jax.lax.ragged_dot(rows, w, group_sizes, **dot)
    assert w.block_size is None, (
        "block-wise expert weights take the tiled grouped matmul (ragged_dot would need every "
        "expert dequantized at once): a bug in the caller"
    )
    dtype = dot.pop("preferred_element_type", rows.dtype)
    y = jax.lax.ragged_dot(
        rows, w.q.astype(rows.dtype), group_sizes, preferred_element_type=jnp.float32, **dot
    )
    groups = w.scale.shape[0]
    group_of_row = jnp.repeat(
        jnp.arange(groups), group_sizes, total_repeat_length=rows.shape[0]
    )  # rows past sum(group_sizes) repeat the last group; their product is 0 anyway
    return (y * w.scale[group_of_row]).astype(dtype)


def is_block_scaled(w: Any) -> bool:
    """Whether w is a block-wise fp8 QuantizedExpertWeight (scales along the contraction)."""
    return isinstance(w, QuantizedExpertWeight) and w.block_size is not None


def tile_matmul(x: jax.Array, w: Any, tile_expert: jax.Array, **dot: Any) -> jax.Array:
    """x f[t, m, d] @ w[tile_expert[t]] per row tile t, w f[G, d, f] or quantized.

    Block-wise weights (scales vary along the contraction, so no scale can leave the
    product) are dequantized one tile's expert at a time inside a loop over the tiles:
    the step never holds more than one dequantized expert matrix. Other weights gather
    each tile's expert and take one batched product.
    """
    if not is_block_scaled(w):
        return batched_matmul(x, jax.tree.map(lambda a: jnp.take(a, tile_expert, axis=0), w), **dot)

    def one_tile(args: tuple[jax.Array, jax.Array]) -> jax.Array:  # f[m, d], i32[] -> f[m, f]
        tile, expert = args
        weight = dequantize(*w.expert(expert), w.block_size).astype(tile.dtype)
        return jnp.dot(tile, weight, **dot)

    return jax.lax.map(one_tile, (x, tile_expert))


EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class QuantizedExperts(nnx.Module):
    """E gated experts kept 8-bit: gate/up q[E, D, F] with scales f32[E, F], down q[E, F, D]
    with f32[E, D] (one scale per output channel of each expert, the rule's)."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        *,
        method: str,
        block_size: int | None = None,
    ):
        check_quantization(method)
        e, d, f = num_experts, hidden, intermediate
        dtype = QUANTIZED_DTYPES[method]
        self.method = method
        self.block_size = block_size
        for name, (rows, cols) in zip(EXPERT_PROJECTIONS, ((d, f), (d, f), (f, d))):
            setattr(self, name, nnx.Param(jnp.zeros((e, rows, cols), dtype)))
            scale = (
                (e, cols)
                if block_size is None
                else (e, cdiv(rows, block_size), cdiv(cols, block_size))
            )
            setattr(self, f"{name}_scale", nnx.Param(jnp.ones(scale, jnp.float32)))

    def weights(self, layer: jax.Array | None = None) -> tuple[QuantizedExpertWeight, ...]:
        """(gate, up, down) as the grouped matmul takes them (``layer``: see
        ExpertStackLayer)."""
        return tuple(
            QuantizedExpertWeight(
                getattr(self, n)[...], getattr(self, f"{n}_scale")[...], self.block_size, layer
            )
            for n in EXPERT_PROJECTIONS
        )

    @property
    def indexes_layer_stack(self) -> bool:
        """Whether a layer scan passes this module's stacks whole (block-wise experts) and
        binds the layer with `bind_layer`, instead of slicing one layer's weights."""
        return self.block_size is not None

    def bind_layer(self, layer: jax.Array) -> ExpertStackLayer:
        """Layer ``layer`` of this module, whose params hold a layer scan's whole stacks."""
        return ExpertStackLayer(self, layer)


class ExpertStackLayer:
    """One layer of block-wise QuantizedExperts whose params hold every scanned layer
    ([L, E, ...], models.layer_scan): what the scanned body calls in the module's place.

    A scan that slices the layer's expert stacks out of its inputs feeds that slice to the
    inner loop over row tiles, and XLA copies it whole per layer (one layer's 8-bit experts,
    576 MiB at Qwen3-30B-A3B's shape); here each tile slices its expert from the stack.
    Plain Python (not an nnx Module): it lives only inside one traced step.
    """

    def __init__(self, experts: QuantizedExperts, layer: jax.Array):
        self.experts, self.layer = experts, layer

    def weights(self) -> tuple[QuantizedExpertWeight, ...]:
        return self.experts.weights(self.layer)


class QuantizedLinear(nnx.Module):
    """A linear layer with an 8-bit kernel: y = x @ dequantize(qweight, scale) + bias.

    Params: qweight int8 / f8_e4m3fn[in, out], scale f32[out] (per channel) or
    f32[ceil(in/b), ceil(out/b)] (block-wise fp8 checkpoints, ``block_size`` b), bias
    f[out] in the model dtype (None without one).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        method: str,
        bias: bool,
        dtype: str,
        block_size: int | None = None,
    ):
        check_quantization(method)
        self.method = method
        self.block_size = block_size
        self.precision = matmul_precision(dtype)
        self.qweight = nnx.Param(jnp.zeros((in_features, out_features), QUANTIZED_DTYPES[method]))
        scale_shape = (
            (out_features,)
            if block_size is None
            else (cdiv(in_features, block_size), cdiv(out_features, block_size))
        )
        self.scale = nnx.Param(jnp.ones(scale_shape, jnp.float32))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:  # f[..., in] -> f[..., out]
        y = quantized_matmul(
            x,
            self.qweight[...],
            self.scale[...],
            block_size=self.block_size,
            precision=self.precision,
        )
        return y if self.bias is None else y + self.bias[...]


class QuantizedEmbed(nnx.Module):
    """A token embedding table kept 8-bit (``quantize_embeddings``): one scale per row.

    Params: qembedding int8 / f8_e4m3fn[vocab, embed], scale f32[vocab]. A row is a
    token's embedding and, for a tied head, an output channel of the head, so one table
    serves both: the lookup gathers rows and multiplies each by its scale; ``attend`` (the
    tied head) scales the product's output per vocab entry, as QuantizedLinear does.
    """

    def __init__(self, num_embeddings: int, features: int, *, method: str, dtype: str):
        check_quantization(method)
        self.method = method
        self.dtype = dtype
        self.precision = matmul_precision(dtype)
        self.qembedding = nnx.Param(jnp.zeros((num_embeddings, features), QUANTIZED_DTYPES[method]))
        self.scale = nnx.Param(jnp.ones((num_embeddings,), jnp.float32))

    def __call__(self, token_ids: jax.Array) -> jax.Array:  # i32[...] -> f[..., embed]
        rows = jnp.take(self.qembedding[...], token_ids, axis=0).astype(jnp.float32)
        scales = jnp.take(self.scale[...], token_ids, axis=0)
        return (rows * scales[..., None]).astype(self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:  # f[..., embed] -> f[..., vocab] in x's dtype
        """x @ dequantized table^T: the tied LM head, (x @ q^T) * scale."""
        y = jnp.einsum(
            "...e,ve->...v",
            x,
            self.qembedding[...].astype(x.dtype),
            precision=self.precision,
            preferred_element_type=jnp.float32,
        )
        return (y * self.scale[...]).astype(x.dtype)
