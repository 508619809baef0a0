"""Mixture-of-experts MLP: a softmax top-k router and dropless experts by grouped matmul.

Every token goes to its top-k experts; nothing is dropped and no capacity is reserved.
The T*k (token, expert) assignments are sorted by expert so each expert's rows are
contiguous, and one `jax.lax.ragged_dot` per projection multiplies each run of rows by
its expert's weights:

    x f[T, D] --router--> experts i32[T, k], weights f[T, k]
    assignments (t, j) sorted by expert        order i32[T*k], group_sizes i32[E]
      rows  = x[order // k]                    f[T*k, D]   gather
      h     = act(rows @ gate[e]) * (rows @ up[e])           ragged_dot x2
      y     = h @ down[e] * weight             f[T*k, D]   ragged_dot
      out   = zeros[T, D].at[order // k].add(y)              scatter-add

Shapes depend only on T (the step's bucket) and k, so a new routing never recompiles;
padding tokens are routed like any other row and never touch a real token's row.

Expert parallelism: the stacked expert weights f[E, ...] are split on E over the mesh's
"tp" axis. Tokens arrive replicated (attention's output is all-reduced), so each device
runs the same sort keeping only the assignments to its E/N experts (the rest sort past
its groups and produce zeros), then one psum sums the partial outputs: one all-reduce
per MoE layer, the same collective as a tensor-parallel dense MLP, and no all-to-all
because no token has to move.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from paged_jax.models.config import ModelConfig
from paged_jax.models.decoder import DecoderLayer
from paged_jax.models.layers import GatedMLP, activation, linear, matmul_precision
from paged_jax.models.partitioning import TP_AXIS
from paged_jax.models.weights import WeightRule, stacked_torch_linears, torch_linear

__all__ = [
    "Experts",
    "MoEDecoderLayer",
    "RoutingPlan",
    "SparseMoeBlock",
    "combine_expert_outputs",
    "expert_forward",
    "expert_parallel_forward",
    "moe_weight_rules",
    "route",
    "set_expert_mesh",
    "sort_by_expert",
]


def route(
    router_logits: jax.Array,  # f[T, E], in the model dtype
    top_k: int,
    *,
    norm_topk_prob: bool,
    weight_dtype: str,
) -> tuple[jax.Array, jax.Array]:  # f[T, k] combine weights, i32[T, k] expert ids
    """Softmax over all experts in float32, then the top k; as transformers' routers.

    Args:
        router_logits: x @ router, computed in the model dtype.
        top_k: experts per token.
        norm_topk_prob: divide the k probabilities by their sum (Mixtral always does).
        weight_dtype: "model": the weights come back in the logits' dtype (Qwen);
            "float32": they stay float32 (Mixtral).
    """
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if weight_dtype == "model":
        weights = weights.astype(router_logits.dtype)
    return weights, experts.astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class RoutingPlan:
    """The T*k assignments sorted by local expert (a pytree of arrays).

    Attributes:
        order: i32[T*k]: flat assignment index (token * k + slot) of each sorted row.
        tokens: i32[T*k]: the token of each sorted row (order // k).
        group_sizes: i32[G]: rows per local expert; rows past their sum belong to experts
            of other devices and come out of the grouped matmul as zeros.
    """

    order: jax.Array
    tokens: jax.Array
    group_sizes: jax.Array


jax.tree_util.register_dataclass(RoutingPlan)


def sort_by_expert(
    experts: jax.Array,  # i32[T, k]
    num_local: int,
    first_expert: jax.Array | int = 0,
) -> RoutingPlan:
    """Sorts the assignments by expert, keeping experts [first, first + num_local) in front.

    Assignments to other experts (another device's) get the key num_local, sort after
    every local group and are left out of group_sizes. The sort is stable, so rows of one
    expert keep token order.
    """
    top_k = experts.shape[-1]
    local = experts.reshape(-1) - first_expert  # i32[T*k]
    key = jnp.where((local >= 0) & (local < num_local), local, num_local)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
    return RoutingPlan(order=order, tokens=order // top_k, group_sizes=group_sizes)


def combine_expert_outputs(
    y: jax.Array,  # f[T*k, D]: sorted rows' expert outputs
    weights: jax.Array,  # f[T, k]
    plan: RoutingPlan,
    num_tokens: int,
) -> jax.Array:  # f[T, D]
    """Scales each row by its combine weight and adds it into its token's output.

    float32 weights (Mixtral) scale in float32 and cast back, as torch's type promotion
    does there; model-dtype weights (Qwen) scale in the model dtype.
    """
    w = weights.reshape(-1)[plan.order][:, None]
    scaled = (y.astype(w.dtype) * w).astype(y.dtype)
    return jnp.zeros((num_tokens, y.shape[-1]), y.dtype).at[plan.tokens].add(scaled)


def expert_forward(
    x: jax.Array,  # f[T, D], replicated
    weights: jax.Array,  # f[T, k]
    experts: jax.Array,  # i32[T, k]
    gate: jax.Array,  # f[E_local, D, F]
    up: jax.Array,  # f[E_local, D, F]
    down: jax.Array,  # f[E_local, F, D]
    *,
    hidden_act: str,
    precision: Any,
    first_expert: jax.Array | int = 0,
) -> jax.Array:  # f[T, D]
    """The summed output of experts [first_expert, first_expert + E_local) for every token.

    With every expert local (first_expert 0) this is the whole routed MLP; a device of an
    expert-parallel mesh passes its first expert and the psum adds the devices' parts.
    """
    plan = sort_by_expert(experts, gate.shape[0], first_expert)
    rows = x[plan.tokens]  # f[T*k, D]
    dot = dict(precision=precision, preferred_element_type=x.dtype)
    act = activation(hidden_act)
    h = act(jax.lax.ragged_dot(rows, gate, plan.group_sizes, **dot)) * jax.lax.ragged_dot(
        rows, up, plan.group_sizes, **dot
    )
    y = jax.lax.ragged_dot(h, down, plan.group_sizes, **dot)  # f[T*k, D]
    return combine_expert_outputs(y, weights, plan, x.shape[0])


def expert_parallel_forward(
    mesh: Mesh, x: jax.Array, weights: jax.Array, experts: jax.Array, *params: jax.Array, **static
) -> jax.Array:  # f[T, D], replicated
    """expert_forward with the stacked experts split on the mesh's "tp" axis.

    Each device runs its E/N experts on the (replicated) tokens; one psum over "tp" adds
    the partial outputs.
    """

    def per_device(x, weights, experts, gate, up, down):
        first = jax.lax.axis_index(TP_AXIS) * gate.shape[0]
        out = expert_forward(x, weights, experts, gate, up, down, first_expert=first, **static)
        return jax.lax.psum(out, TP_AXIS)

    rep, split = PartitionSpec(), PartitionSpec(TP_AXIS, None, None)
    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(rep, rep, rep, split, split, split),
        out_specs=rep,
        check_vma=False,
    )(x, weights, experts, *params)


class Experts(nnx.Module):
    """E gated experts as stacked weights: gate/up f[E, D, F], down f[E, F, D]."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        moe, d, dtype = config.moe, config.hidden_size, config.dtype
        e, f = moe.num_experts, moe.moe_intermediate_size
        init = nnx.initializers.normal(0.02)
        self.gate_proj = nnx.Param(init(rngs.params(), (e, d, f), dtype))
        self.up_proj = nnx.Param(init(rngs.params(), (e, d, f), dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (e, f, d), dtype))


class SparseMoeBlock(nnx.Module):
    """Router, routed experts and (Qwen2-MoE) a sigmoid-gated shared expert.

    Attributes:
        expert_mesh: the mesh whose "tp" axis splits the experts (set by
            `set_expert_mesh` when the model is sharded); None: one device.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        moe = config.moe
        assert moe is not None, "SparseMoeBlock built for a dense config: a bug in the layer"
        activation(config.hidden_act)  # fail at construction, not at the first trace
        self.hidden_act = config.hidden_act
        self.top_k = moe.num_experts_per_tok
        self.norm_topk_prob = moe.norm_topk_prob
        self.router_weight_dtype = moe.router_weight_dtype
        self.precision = matmul_precision(config.dtype)
        self.router = linear(
            config.hidden_size, moe.num_experts, bias=False, config=config, rngs=rngs
        )
        self.experts = Experts(config, rngs=rngs)
        shared = moe.shared_expert_intermediate_size
        self.shared_expert = (
            None
            if shared is None
            else GatedMLP(dataclasses.replace(config, intermediate_size=shared), rngs=rngs)
        )
        self.shared_expert_gate = (
            None
            if shared is None
            else linear(config.hidden_size, 1, bias=False, config=config, rngs=rngs)
        )
        self.expert_mesh: Mesh | None = None

    def __call__(self, x: jax.Array) -> jax.Array:  # f[..., D] -> f[..., D]
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts = route(
            self.router(x),
            self.top_k,
            norm_topk_prob=self.norm_topk_prob,
            weight_dtype=self.router_weight_dtype,
        )
        params = (
            self.experts.gate_proj[...],
            self.experts.up_proj[...],
            self.experts.down_proj[...],
        )
        static = dict(hidden_act=self.hidden_act, precision=self.precision)
        if self.expert_mesh is None:
            out = expert_forward(x, weights, experts, *params, **static)
        else:
            out = expert_parallel_forward(self.expert_mesh, x, weights, experts, *params, **static)
        if self.shared_expert is not None:
            gate = jax.nn.sigmoid(self.shared_expert_gate(x))
            out = out + gate * self.shared_expert(x)
        return out.reshape(shape)


class MoEDecoderLayer(DecoderLayer):
    """A decoder layer whose MLP is a SparseMoeBlock where config.moe.sparse_layers says."""

    def __init__(self, config: ModelConfig, layer_idx: int, *, mlp_cls: type[nnx.Module], **kw):
        if config.is_sparse_layer(layer_idx):
            mlp_cls = SparseMoeBlock
        super().__init__(config, layer_idx, mlp_cls=mlp_cls, **kw)


def set_expert_mesh(model: Any, mesh: Mesh | None) -> None:
    """Points every SparseMoeBlock of `model` at `mesh` (its experts split on "tp")."""
    for _, module in nnx.iter_graph(model):
        if isinstance(module, SparseMoeBlock):
            module.expert_mesh = mesh


def moe_weight_rules(
    config: ModelConfig,
    dense_rules: list[WeightRule],
    *,
    block: str,
    router: str,
    expert_names: tuple[str, str, str],
) -> list[WeightRule]:
    """A dense family's table with each sparse layer's MLP rules replaced by its MoE block's.

    Args:
        dense_rules: the table as if every layer had a dense MLP of intermediate_size.
        block: the MoE block's name under model.layers.i ("block_sparse_moe", "mlp").
        router: the router's name in the block ("gate").
        expert_names: per-expert (gate, up, down) linears ("w1", "w3", "w2").
    """
    moe = config.moe
    d, e, f = config.hidden_size, moe.num_experts, moe.moe_intermediate_size

    def in_sparse_mlp(rule: WeightRule) -> bool:
        path = rule.param_path
        return path[0] == "layers" and path[2] == "mlp" and config.is_sparse_layer(path[1])

    rules = [rule for rule in dense_rules if not in_sparse_mlp(rule)]
    gate_name, up_name, down_name = expert_names
    for i in range(config.num_hidden_layers):
        if not config.is_sparse_layer(i):
            continue
        hf, path = f"model.layers.{i}.{block}", ("layers", i, "mlp")
        rules += torch_linear(f"{hf}.{router}", (*path, "router"), d, e, bias=False)
        experts = (*path, "experts")
        for name, param, (in_dim, out_dim) in (
            (gate_name, "gate_proj", (d, f)),
            (up_name, "up_proj", (d, f)),
            (down_name, "down_proj", (f, d)),
        ):
            prefixes = [f"{hf}.experts.{j}.{name}" for j in range(e)]
            rules += stacked_torch_linears(prefixes, (*experts, param), in_dim, out_dim)
        shared = moe.shared_expert_intermediate_size
        if shared is not None:
            for name, (in_dim, out_dim) in (
                ("gate_proj", (d, shared)),
                ("up_proj", (d, shared)),
                ("down_proj", (shared, d)),
            ):
                rules += torch_linear(
                    f"{hf}.shared_expert.{name}",
                    (*path, "shared_expert", name),
                    in_dim,
                    out_dim,
                    bias=False,
                )
            rules += torch_linear(
                f"{hf}.shared_expert_gate", (*path, "shared_expert_gate"), d, 1, bias=False
            )
    return rules
