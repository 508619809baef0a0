"""Tensor parallelism on a 1-D jax Mesh: sharded weights and KV caches, per-shard kernels.

    devices 0..N-1 on one mesh axis "tp"
    weights   split by the family's partition rules (paged_jax.models.partitioning);
              XLA's SPMD partitioner inserts the all-reduces of the dense layers
    experts   MoE layers' stacked experts split whole over "tp"; each device runs its
              experts on the replicated tokens inside shard_map, then one psum
              (paged_jax.models.moe)
    KV caches f[num_blocks, num_kv_heads, block_size, head_dim], split on num_kv_heads
    kernels   write_kv / ragged attention run per device inside shard_map on its heads;
              slot mapping, block tables and lengths are replicated: one block table
              (the host's) serves every shard
    logits    the vocab-parallel LM head's f32[S, V/N] pieces are gathered before
              sampling, so the sampler sees the same full rows as on one device

The host side (block pool, scheduler, input batch) is unchanged; the Runner asks this
module for the mesh, the sharded model, the caches and the ops.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import pallas_kernels
from paged_jax.models.moe import set_expert_mesh
from paged_jax.models.partitioning import (
    TP_AXIS,
    kv_repeat_transform,
    param_shardings,
    tensor_parallel_config,
)

# f[num_blocks, num_kv_heads, block_size, head_dim]: heads split, blocks whole.
KV_CACHE_SPEC = PartitionSpec(None, TP_AXIS, None, None)
# f[num_tokens, heads, head_dim] activations entering and leaving the kernels.
HEADS_SPEC = PartitionSpec(None, TP_AXIS, None)
REPLICATED = PartitionSpec()


def make_mesh(tensor_parallel_size: int) -> Mesh:
    """A 1-D mesh named "tp" over the first `tensor_parallel_size` devices of jax.devices().

    With several processes (paged_jax.distributed) the mesh takes the same number of
    devices from every process, so each process holds shards of every array it steps.

    Raises:
        ValueError: fewer devices than asked for (the message says how to fake them on CPU),
            or a size the processes cannot share evenly.
    """
    devices = jax.devices()
    processes = jax.process_count()
    if processes > 1:
        per_process, left = divmod(tensor_parallel_size, processes)
        if left or per_process > jax.local_device_count():
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size} must be a multiple of the "
                f"{processes} processes and at most {jax.device_count()} (every process "
                f"gives the mesh the same number of its {jax.local_device_count()} devices)"
            )
        by_process: dict[int, list] = {}
        for d in devices:
            by_process.setdefault(d.process_index, []).append(d)
        devices = [d for p in sorted(by_process) for d in by_process[p][:per_process]]
    if tensor_parallel_size > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} must be <= the number of devices "
            f"({len(devices)} {jax.default_backend()}); on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={tensor_parallel_size} "
            "before jax starts"
        )
    return Mesh(np.array(devices[:tensor_parallel_size]), (TP_AXIS,))


def shard_model(model: Any, mesh: Mesh) -> tuple[Any, list[str]]:
    """The model with every param placed by its family's partition rules on `mesh`.

    A model loaded with ``load_model(..., mesh=mesh)`` is already placed (this is then a
    no-op device_put). A model built in memory is copied: KV heads repeated when fewer
    than devices, each param moved to its shards.

    Returns:
        (sharded model, names of params replicated because tp does not divide them).

    Raises:
        ValueError: the model has no partition rules, or its heads do not split.
    """
    from paged_jax.models.loader import abstract_model
    from paged_jax.models.quantized_model import model_partition_rules

    rules = model_partition_rules(model)
    if rules is None or not isinstance(model, nnx.Module):
        raise ValueError(
            f"model={type(model).__name__} declares no partition_rules, so "
            "tensor_parallel_size must be 1 (paged_jax.models families support it)"
        )
    tp = mesh.size
    config = model.config
    tp_config = tensor_parallel_config(config, tp)
    graphdef, state = nnx.split(model)
    if tp_config != config:  # KV heads to repeat: rebuild at the new head count
        graphdef, new_state = abstract_model(type(model), tp_config, model.attention_backend)
    else:
        new_state = state
    shardings, fallbacks = param_shardings(rules, new_state, mesh)
    old = {tuple(path): var for path, var in nnx.to_flat_state(state)}
    pure: dict[Any, Any] = {}
    for path, _ in nnx.to_flat_state(new_state):
        path = tuple(path)
        value = old[path].get_value()
        repeat = kv_repeat_transform(rules, path, config, tp)
        if repeat is not None:
            value = repeat(np.asarray(jax.device_get(value)))
        node = pure
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = jax.device_put(value, shardings[path])
    nnx.replace_by_pure_dict(new_state, pure)
    sharded = nnx.merge(graphdef, new_state)
    set_expert_mesh(sharded, mesh)  # MoE layers run their experts per device
    return sharded, fallbacks


def sharded_attention_ops(ops: pallas_kernels.AttentionOps, mesh: Mesh) -> Any:
    """`ops` with every paged op run per device on its own KV heads inside shard_map.

    Each device sees q f[T, H/N, D], caches f[num_blocks, KV/N, bs, D] and the full
    (replicated) slot mapping, block tables and lengths; no collective is needed because
    attention never mixes heads.
    """
    cache, heads, rep = KV_CACHE_SPEC, HEADS_SPEC, REPLICATED

    def per_shard(fn, in_specs, out_specs, **static):
        body = functools.partial(fn, **static)
        return jax.shard_map(
            body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )

    def write_kv(k_cache, v_cache, k, v, slot_mapping, **kw):
        f = per_shard(ops.write_kv, (cache, cache, heads, heads, rep), (cache, cache), **kw)
        return f(k_cache, v_cache, k, v, slot_mapping)

    def with_plan(fn, plan):
        """`fn` taking the step's plan (replicated) as its last positional argument."""
        if plan is None:
            return fn, ()

        def call(*args, **kw):
            *args, plan_arg = args
            return fn(*args, plan=plan_arg, **kw)

        return call, (plan,)

    def ragged_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl, plan=None, **kw):
        fn, extra = with_plan(ops.ragged_paged_attention, plan)
        specs = (heads, cache, cache, rep, rep, rep) + (rep,) * len(extra)
        f = per_shard(fn, specs, heads, **kw)
        return f(q, k_cache, v_cache, block_tables, seq_lens, qsl, *extra)

    def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, plan=None, **kw):
        fn, extra = with_plan(ops.paged_attention, plan)
        specs = (heads, cache, cache, rep, rep) + (rep,) * len(extra)
        f = per_shard(fn, specs, heads, **kw)
        return f(q, k_cache, v_cache, block_tables, seq_lens, *extra)

    def copy_blocks(k_cache, v_cache, src_block_ids, dst_block_ids, **kw):
        f = per_shard(ops.copy_blocks, (cache, cache, rep, rep), (cache, cache), **kw)
        return f(k_cache, v_cache, src_block_ids, dst_block_ids)

    return pallas_kernels.AttentionOps(
        write_kv=write_kv,
        ragged_paged_attention=ragged_paged_attention,
        paged_attention=paged_attention,
        copy_blocks=copy_blocks,
        takes_plan=ops.takes_plan,
    )


def per_device_bytes(tree: Any) -> dict[Any, int]:
    """Bytes each device holds of the arrays in `tree` (its own shards only)."""
    out: dict[Any, int] = {}
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            for shard in leaf.addressable_shards:
                out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


def expert_bytes_per_device(weights: Any) -> int:
    """The most bytes of MoE expert weights (params under an ``experts`` path) one device holds.

    Args:
        weights: a model's nnx.State, or a Runner's weights (stacked layers included).
    """
    leaves = [
        leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(weights)
        if "experts" in jax.tree_util.keystr(path)
    ]
    return max(per_device_bytes(leaves).values(), default=0)


class TensorParallel:
    """What the Runner needs for tensor_parallel_size > 1: mesh, sharded model, caches, ops.

    Args:
        model: a paged_jax.models CausalLM (built in memory or loaded with the mesh).
        tensor_parallel_size: devices on the mesh.
    """

    def __init__(self, model: Any, tensor_parallel_size: int):
        self.mesh = make_mesh(tensor_parallel_size)
        self.size = tensor_parallel_size
        self.model, self.replicated_fallbacks = shard_model(model, self.mesh)
        self.kv_sharding = NamedSharding(self.mesh, KV_CACHE_SPEC)
        self.replicated = NamedSharding(self.mesh, REPLICATED)

    def init_kv_caches(self, num_blocks: int, block_size: int, init: Any = None) -> list[Any]:
        """Zeroed caches allocated already split by KV head (never whole on one device).

        init: a function returning the caches (the stacked pair of a scanned model);
            default: the model's init_kv_caches.
        """
        model = self.model
        init = init or (lambda: model.init_kv_caches(num_blocks, block_size))
        return jax.jit(init, out_shardings=self.kv_sharding)()

    def attention_ops(self, backend: str) -> pallas_kernels.AttentionOps:
        """The backend's paged ops, run per shard."""
        return sharded_attention_ops(pallas_kernels.get_attention_ops(backend), self.mesh)

    def gather(self, logits: jax.Array) -> jax.Array:
        """Inside jit: f32[S, V] logits of the vocab-parallel head, replicated on every device.

        The logits are pinned vocab-split first: left free, XLA all-gathers the [D, V]
        LM head weight instead of the much smaller [S, V] logits (seen in the HLO).
        """
        if logits.shape[-1] % self.size == 0:
            split = NamedSharding(self.mesh, PartitionSpec(None, TP_AXIS))
            logits = jax.lax.with_sharding_constraint(logits, split)
        return jax.lax.with_sharding_constraint(logits, self.replicated)
