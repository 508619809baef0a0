"""The paged forward's layers as one lax.scan: one compiled layer body, weights stacked by layer.

An unrolled forward puts every layer's ops into the step program, so its size and
compile time grow with depth. Here layers that repeat run as a scan:

    layers    0 1 2 3 4 5 6 7 8 9          period p = 2 (Gemma-2: window, full, ...)
    scanned   [0 1][2 3][4 5][6 7]         num_steps n = 4: one body of p layers
    unrolled                       8 9     the tail when p does not divide the depth

The period is the smallest p for which layer i and layer i + p have the same graph (norms,
window, rope, KV-cache group: everything static), so uniform models scan one layer per
step, Gemma-2 two and Gemma-3 six. A model whose layers never repeat runs unrolled.

Weights: position j of the period has its own stacked state (every parameter with a
leading axis of n); the step program takes them as arguments, so they are built once
(`StackedLayers.from_model`) and never copied per step.

KV caches: the scan body indexes one cache array by a traced layer, so the model's KV
tensors (kv_layout: tensor t serves layer t of each group) live in one K and one V array
of ``num_tensors * num_blocks`` blocks, tensor t's blocks at rows ``[t * num_blocks, (t + 1)
* num_blocks)``. A layer's block table and slot mapping are shifted to its tensor's rows
(`shift_to_tensor`), so the kernels see a bigger pool and need no layer argument; copies
and swaps move a block id in every tensor (`ids_in_every_tensor`). Out-of-pool ids stay
out of the pool (so they stay invisible, and validate still reports them).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from paged_jax.worker.step_input import AttentionMetadata

__all__ = [
    "LayerScanPlan",
    "StackedLayers",
    "ids_in_every_tensor",
    "plan_layer_scan",
    "shift_to_tensor",
    "split_without_layers",
]


@dataclasses.dataclass(frozen=True)
class LayerScanPlan:
    """How a model's layers split into a scan and an unrolled tail.

    Attributes:
        period: layers in one scan step.
        num_steps: scan length; layers [0, period * num_steps) are scanned.
        num_layers: the model's depth.
        tensor_of_layer: per layer, its KV tensor (models.kv_layout).
        num_tensors: KV tensors stacked into the one cache array.
    """

    period: int
    num_steps: int
    num_layers: int
    tensor_of_layer: tuple[int, ...]
    num_tensors: int

    @property
    def num_scanned(self) -> int:
        return self.period * self.num_steps


def plan_layer_scan(model: Any) -> LayerScanPlan | None:
    """The scan plan of a paged_jax.models CausalLM, or None when scanning gains nothing.

    None for a model without an nnx ``layers`` list and KV layout (fakes, custom models),
    for layers that do not repeat at least twice, and for KV tensors of different shapes.
    """
    layers = getattr(model, "layers", None)
    layout = getattr(model, "kv_layout", None)
    if not isinstance(model, nnx.Module) or layers is None or layout is None:
        return None
    num_layers = len(layers)
    if num_layers < 2 or len(layout.tensor_of_layer) != num_layers:
        return None
    graphs = [nnx.graphdef(layer) for layer in layers]
    period = next(
        p
        for p in range(1, num_layers + 1)
        if all(graphs[i] == graphs[i + p] for i in range(num_layers - p))
    )
    num_steps = num_layers // period
    if num_steps < 2:
        return None
    shapes = {
        tuple((x.shape[1:], x.dtype) for x in jax.tree.leaves(caches))
        for caches in jax.eval_shape(lambda: model.init_kv_caches(1, 1))
    }
    if len(shapes) > 1:
        return None
    return LayerScanPlan(
        period, num_steps, num_layers, tuple(layout.tensor_of_layer), layout.num_tensors
    )


def shift_to_tensor(
    meta: AttentionMetadata,
    tensor: jax.Array,  # i32[]: the layer's KV tensor
    *,
    num_blocks: int,
    num_tensors: int,
    block_size: int,
) -> AttentionMetadata:
    """`meta` with every group's block ids and slots moved to KV tensor `tensor`'s rows.

    Block ids outside [0, num_blocks) become ``num_tensors * num_blocks`` (past the stacked
    pool: invisible to the kernels, reported by validate); padding slots (-1) stay -1 and
    other out-of-range slots move past the pool too (dropped by writes, reported by
    validate).
    """
    pool_blocks = num_tensors * num_blocks
    per_tensor = num_blocks * block_size

    def blocks(table: jax.Array) -> jax.Array:
        inside = (table >= 0) & (table < num_blocks)
        return jnp.where(inside, table + tensor * num_blocks, pool_blocks).astype(table.dtype)

    def slots(mapping: jax.Array) -> jax.Array:
        inside = (mapping >= 0) & (mapping < per_tensor)
        moved = jnp.where(inside, mapping + tensor * per_tensor, pool_blocks * block_size)
        return jnp.where(mapping < 0, mapping, moved).astype(mapping.dtype)

    return dataclasses.replace(
        meta,
        slot_mappings=tuple(slots(m) for m in meta.slot_mappings),
        block_tables=tuple(blocks(t) for t in meta.block_tables),
    )


def ids_in_every_tensor(ids: jax.Array, num_blocks: int, num_tensors: int) -> jax.Array:
    """i32[num_tensors * n]: block ids i32[n] in every tensor of the stacked pool, tensor-major.

    Negative ids (padding) stay negative; ids >= num_blocks move past the stacked pool.
    """
    pool_blocks = num_tensors * num_blocks
    offsets = jnp.arange(num_tensors, dtype=ids.dtype)[:, None] * num_blocks
    moved = jnp.where(ids < num_blocks, ids[None, :] + offsets, pool_blocks)
    return jnp.where(ids[None, :] < 0, ids[None, :], moved).reshape(-1).astype(ids.dtype)


def split_without_layers(model: Any) -> tuple[Any, Any]:
    """(graphdef, state) of `model` with an empty ``layers`` list: what a scanned step
    merges (its layers come from a StackedLayers). The model itself is left as it was."""
    layers = model.layers
    try:
        model.layers = nnx.List([])
        return nnx.split(model)
    finally:
        model.layers = layers


@functools.partial(jax.jit, static_argnames="sharding")
def _stack_on_device(*leaves: jax.Array, sharding: Any = None) -> jax.Array:
    """jnp.stack, jitted once per shape and placement (parameters of one shape share it)."""
    out = jnp.stack(leaves)
    return out if sharding is None else jax.lax.with_sharding_constraint(out, sharding)


def _stack_leaves(leaves: Sequence[jax.Array], release: bool) -> jax.Array:
    """One stacked array [n, ...] of same-shaped arrays, placed like them (leading axis whole).

    On CPU the stack is built on the host (no compile); elsewhere by a jitted stack, one
    parameter at a time, so at most one parameter is held twice. ``release`` deletes the
    originals once stacked. Abstract leaves (ShapeDtypeStruct) give an abstract stack.
    """
    first = leaves[0]
    sharding = first.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        sharding = jax.sharding.NamedSharding(
            sharding.mesh, jax.sharding.PartitionSpec(None, *sharding.spec)
        )
    if isinstance(first, jax.ShapeDtypeStruct):  # an abstract model: abstract stacked weights
        return jax.ShapeDtypeStruct((len(leaves), *first.shape), first.dtype, sharding=sharding)
    if isinstance(sharding, jax.sharding.NamedSharding):
        out = _stack_on_device(*leaves, sharding=sharding)
    elif jax.default_backend() == "cpu":
        import numpy as np

        # Uncommitted like a freshly loaded weight, so every step keys one jit cache entry.
        out = jnp.asarray(np.stack([np.asarray(x) for x in leaves]))
    else:
        out = _stack_on_device(*leaves)
    if release:
        for x in leaves:
            x.delete()
    return out


def _stack_indexing_paths(graphdef: Any, stacked: Any) -> tuple[tuple[Any, ...], ...]:
    """Paths of the modules in a stacked layer state that index the layer stack themselves
    (``indexes_layer_stack``, e.g. block-wise QuantizedExperts: their inner loop over row
    tiles slices each tile's expert from the whole stack, so the scan must not slice out
    the layer, which XLA would copy whole to feed that loop)."""
    module = nnx.merge(graphdef, stacked)  # trace-time only: stacked arrays, layer graph
    return tuple(
        path
        for path, node in nnx.iter_graph(module)
        if isinstance(node, nnx.Module) and getattr(node, "indexes_layer_stack", False)
    )


def _under(paths: tuple[tuple[Any, ...], ...]) -> Any:
    """An nnx filter: the state leaves under any of `paths`."""
    return lambda path, _value: any(path[: len(p)] == p for p in paths)


def _bind_layer(layer: Any, paths: tuple[tuple[Any, ...], ...], index: jax.Array) -> None:
    """Replaces each module at `paths` in the (trace-local) `layer` by its ``bind_layer(index)``."""
    for path in paths:
        parent = layer
        for key in path[:-1]:
            parent = parent[key] if isinstance(key, int) else getattr(parent, key)
        module = getattr(parent, path[-1])
        setattr(parent, path[-1], module.bind_layer(index))


@dataclasses.dataclass(frozen=True)
class StackedLayers:
    """A model's layer weights as the scan takes them (a pytree: the states are its leaves).

    Attributes:
        stacked: per position j of the period, the state of layers j, p + j, 2p + j, ...
            with every parameter stacked on a leading axis of num_steps.
        tail: the states of the unrolled layers after the scan.
        plan: the LayerScanPlan (static).
        graphdefs: per position of the period, the layer graph (static).
        tail_graphdefs: the tail layers' graphs (static).
    """

    stacked: tuple[Any, ...]
    tail: tuple[Any, ...]
    plan: LayerScanPlan = dataclasses.field(metadata=dict(static=True))
    graphdefs: tuple[Any, ...] = dataclasses.field(metadata=dict(static=True))
    tail_graphdefs: tuple[Any, ...] = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def from_model(cls, model: Any, plan: LayerScanPlan, *, release: bool = False) -> StackedLayers:
        """Stacks `model.layers` by `plan` (their placement and sharding kept).

        Args:
            release: delete the model's own per-layer arrays once stacked (the caller owns
                the model and will not run its layers again), so the weights are not held
                twice. The model's other weights are untouched.
        """
        p, n = plan.period, plan.num_steps
        layers = list(model.layers)
        states = [nnx.state(layer) for layer in layers]
        stacked = tuple(
            jax.tree.map(
                lambda *xs: _stack_leaves(xs, release),
                *[states[s * p + j] for s in range(n)],
            )
            for j in range(p)
        )
        return cls(
            stacked=stacked,
            tail=tuple(states[plan.num_scanned :]),
            plan=plan,
            graphdefs=tuple(nnx.graphdef(layers[j]) for j in range(p)),
            tail_graphdefs=tuple(nnx.graphdef(layer) for layer in layers[plan.num_scanned :]),
        )

    def init_kv_caches(self, model: Any, num_blocks: int, block_size: int, dtype: Any = None):
        """[(K, V)]: zeroed caches of every KV tensor in one pair of arrays (module docstring)."""
        # The shapes of one block of one tensor, read abstractly (nothing allocated).
        caches = jax.eval_shape(lambda: model.init_kv_caches(1, block_size, dtype))
        return [
            tuple(
                jnp.zeros((self.plan.num_tensors * num_blocks, *x.shape[1:]), x.dtype)
                for x in caches[0]
            )
        ]

    def run(
        self,
        x: jax.Array,  # f[num_tokens, hidden]
        positions: jax.Array,  # i32[num_tokens]
        kv_caches: Sequence[tuple[jax.Array, jax.Array]],  # [(K, V)] stacked (init_kv_caches)
        attn_metadata: AttentionMetadata,
        ops: Any,  # pallas_kernels.AttentionOps
        kv_scales: jax.Array | None,  # f32[num_layers, 2]; fp8 caches only
        lora: Any = None,  # a models.lora.LoRAStep: per-row adapters, stacks by layer
        hook: Any = None,  # models.activation_hooks: after_layer(state, layer, x)
        hook_state: Any = None,
    ) -> tuple[jax.Array, list[tuple[jax.Array, jax.Array]], Any]:
        """Every layer's paged forward: the scan, then the tail; returns x, the caches and
        the hook's state (carried through the scan; None without a hook)."""
        plan = self.plan
        if len(kv_caches) != 1:
            raise ValueError(
                f"len(kv_caches)={len(kv_caches)} must be 1: a scanned model keeps every KV "
                "tensor in one stacked (K, V) pair (StackedLayers.init_kv_caches)"
            )
        k_cache, v_cache = kv_caches[0]
        num_blocks = k_cache.shape[0] // plan.num_tensors
        block_size = k_cache.shape[2]
        p, n = plan.period, plan.num_steps
        tensors = jnp.asarray(plan.tensor_of_layer, jnp.int32)

        def layer_step(layer, x, k_cache, v_cache, layer_ops, tensor, kv_scale):
            meta = shift_to_tensor(
                attn_metadata,
                tensor,
                num_blocks=num_blocks,
                num_tensors=plan.num_tensors,
                block_size=block_size,
            )
            x, (k_cache, v_cache) = layer.forward_paged(
                x, positions, (k_cache, v_cache), meta, layer_ops, kv_scale
            )
            return x, k_cache, v_cache

        # Modules that index the layer stack themselves (block-wise experts) get their
        # stacks whole, outside the scan's inputs; the others' weights are sliced per step.
        whole_paths = [_stack_indexing_paths(g, st) for g, st in zip(self.graphdefs, self.stacked)]
        whole, sliced = zip(
            *(
                nnx.split_state(st, _under(paths), ...)
                for st, paths in zip(self.stacked, whole_paths)
            )
        )

        def body(carry, xs):
            x, k_cache, v_cache, hook_state = carry
            states, step_tensors, step_scales, step_lora, step = xs
            # A fresh plan cache per traced body: a plan traced here must not leak out.
            body_ops = ops.for_step()
            for j in range(p):
                layer = nnx.merge(self.graphdefs[j], nnx.merge_state(whole[j], states[j]))
                _bind_layer(layer, whole_paths[j], step)
                if lora is not None:
                    layer = lora.wrap(layer, {m: (a[j], b[j]) for m, (a, b) in step_lora.items()})
                scale = None if step_scales is None else step_scales[j]
                x, k_cache, v_cache = layer_step(
                    layer, x, k_cache, v_cache, body_ops, step_tensors[j], scale
                )
                if hook is not None:
                    hook_state, x = hook.after_layer(hook_state, step * p + j, x)
            return (x, k_cache, v_cache, hook_state), None

        scanned_scales = (
            None if kv_scales is None else kv_scales[: p * n].reshape(n, p, *kv_scales.shape[1:])
        )
        (x, k_cache, v_cache, hook_state), _ = jax.lax.scan(
            body,
            (x, k_cache, v_cache, hook_state),
            (
                sliced,
                tensors[: p * n].reshape(n, p),
                scanned_scales,
                None if lora is None else lora.scanned(p, n),
                jnp.arange(n, dtype=jnp.int32),
            ),
        )
        tail_ops = ops.for_step()
        for i, (graphdef, state) in enumerate(zip(self.tail_graphdefs, self.tail)):
            layer_idx = plan.num_scanned + i
            scale = None if kv_scales is None else kv_scales[layer_idx]
            layer = nnx.merge(graphdef, state)
            if lora is not None:
                layer = lora.wrap(layer, lora.layer_stacks(layer_idx))
            x, k_cache, v_cache = layer_step(
                layer,
                x,
                k_cache,
                v_cache,
                tail_ops,
                tensors[layer_idx],
                scale,
            )
            if hook is not None:
                hook_state, x = hook.after_layer(hook_state, layer_idx, x)
        return x, [(k_cache, v_cache)], hook_state


jax.tree_util.register_dataclass(StackedLayers)
