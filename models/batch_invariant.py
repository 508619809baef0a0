"""Batch-invariant models: a token row's result depends on neither the batch nor its bucket.

XLA picks a GEMM's blocking, and on CPU a row reduction's order, from the whole array's
shape: the same row can round differently among 16 rows and among 512 (measured on the
CPU backend: an f32 [T, 768] x [768, 3072] product and the mean of a [T, 64] array).
``set_row_tiled_matmuls`` makes a model compute every row-wise matmul (its nnx.Linear
layers and a tied head) and every norm in fixed tiles of ``ROW_TILE`` rows, one
``lax.map`` step per tile (a loop XLA does not fold back into one GEMM, as it does a
batched dot): each tile's program has one shape whatever the number of rows. The
engine's ``batch_invariant=True`` mode applies it (docs/research_integration.md,
"Batch invariance").
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from paged_jax.models.layers import ROW_TILE, RowNorm, map_row_tiles
from paged_jax.models.moe import SparseMoeBlock
from paged_jax.models.quantization import QuantizedLinear

__all__ = ["ROW_TILE", "map_row_tiles", "row_tiled_dot_general", "set_row_tiled_matmuls"]


def row_tiled_dot_general(
    lhs: jax.Array,  # f[..., in]
    rhs: jax.Array,  # f[in, out] (or f[out, in] when contracted on its dim 1)
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    out_sharding: Any = None,
) -> jax.Array:  # f[..., out]
    """``lax.dot_general`` of a row-wise product in fixed tiles of ROW_TILE rows.

    Takes the products nnx.Linear and a tied head make: lhs's last dim contracted with one
    dim of a 2-D rhs, no batch dims. Any other product (or an explicit out_sharding) goes
    to ``lax.dot_general`` unchanged.
    """
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    kwargs: dict[str, Any] = dict(
        precision=precision, preferred_element_type=preferred_element_type
    )
    row_wise = (
        rhs.ndim == 2
        and tuple(lhs_contract) == (lhs.ndim - 1,)
        and len(tuple(rhs_contract)) == 1
        and not tuple(lhs_batch)
        and not tuple(rhs_batch)
        and out_sharding is None
    )
    if not row_wise:
        if out_sharding is not None:
            kwargs["out_sharding"] = out_sharding
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, **kwargs)
    dims = (((1,), tuple(rhs_contract)), ((), ()))

    def gemm(tile: jax.Array) -> jax.Array:  # f[ROW_TILE, in] -> f[ROW_TILE, out]
        return jax.lax.dot_general(tile, rhs, dims, **kwargs)

    out = jax.eval_shape(gemm, jax.ShapeDtypeStruct((ROW_TILE, lhs.shape[-1]), lhs.dtype))

    def one_tile(tile: jax.Array) -> jax.Array:
        # An all-zero tile's product is zero: skipped. The engine's padding rows are zero
        # (CausalLM.forward_paged_hidden), so a step pays for its real rows' tiles only,
        # and a tile that is computed is computed the same way whatever is skipped.
        return jax.lax.cond(
            jnp.any(tile != 0), gemm, lambda t: jnp.zeros(out.shape, out.dtype), tile
        )

    return map_row_tiles(one_tile, lhs)


def set_row_tiled_matmuls(model: Any) -> None:
    """Makes every nnx.Linear of `model`, its tied head and its norms work in row tiles.

    Raises:
        ValueError: the model has 8-bit (quantized) linear layers, or it has
            mixture-of-experts layers, which group the step's tokens
            by expert (an expert GEMM tile holds whichever tokens chose that expert), so a
            row's result depends on the batch.
    """
    modules = [module for _, module in nnx.iter_graph(model)]
    if any(isinstance(m, SparseMoeBlock) for m in modules):
        raise ValueError(
            f"batch_invariant=True is not supported for {type(model).__name__}: its "
            "mixture-of-experts layers group the step's tokens by expert, so a token's "
            "expert matmul depends on the other tokens of the batch (a dense model is needed)"
        )
    if any(isinstance(m, QuantizedLinear) for m in modules):
        raise ValueError(
            f"batch_invariant=True is not supported for {type(model).__name__} with 8-bit "
            "weights (quantization, or a quantized checkpoint): its quantized products are "
            "not row-tiled (load the unquantized weights)"
        )
    for module in modules:
        if isinstance(module, nnx.Linear):
            module.dot_general = row_tiled_dot_general
        elif isinstance(module, RowNorm):
            module.row_tiled = True
    if hasattr(model, "head_dot_general"):
        model.head_dot_general = row_tiled_dot_general
