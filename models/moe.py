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

Two implementations of the grouped matmul, chosen per backend (`EXPERT_MATMUL`):

- "ragged_dot": `jax.lax.ragged_dot` on the sorted rows. TPU lowers it to a grouped
  matmul. XLA's CPU backend and its GPU backend (jax 0.12, compiled for an H200 by
  scripts/gpu_compile_check.py) expand it to a dense product of every row with every
  expert's weights under a group mask, so its cost grows with T*k*E.
- "tiled" (`tiled_grouped_matmul`): each expert's sorted rows are padded to a multiple of
  a row tile m, one expert's weights are gathered per tile and a batched matmul
  f[tiles, m, D] x f[tiles, D, F] runs; the number of tiles is a static bound, so the
  cost grows with T*k plus at most m - 1 padding rows per expert, not with E.

Expert parallelism: the stacked expert weights f[E, ...] are split on E over the mesh's
"tp" axis. Tokens arrive replicated (attention's output is all-reduced), so each device
runs the same sort keeping only the assignments to its E/N experts (the rest sort past
its groups and produce zeros), then one psum sums the partial outputs: one all-reduce
per MoE layer, the same collective as a tensor-parallel dense MLP, and no all-to-all
because no token has to move.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from paged_jax.constants import cdiv
from paged_jax.models.config import ModelConfig
from paged_jax.models.decoder import DecoderLayer
from paged_jax.models.layers import GatedMLP, activation, linear, matmul_precision
from paged_jax.models.partitioning import TP_AXIS
from paged_jax.models.quantization import grouped_ragged_dot, is_block_scaled, tile_matmul
from paged_jax.models.weights import WeightRule, stacked_torch_linears, torch_linear

ExpertMatmul = Literal["ragged_dot", "tiled"]
# The grouped matmul per jax platform: ragged_dot where XLA lowers it to a grouped matmul
# (TPU); the tiled batched matmul where ragged_dot is a masked dense product over every
# expert (CPU and GPU: scripts/gpu_compile_check.py records the H200 lowering).
EXPERT_MATMUL: dict[str, ExpertMatmul] = {"tpu": "ragged_dot", "cpu": "tiled", "gpu": "tiled"}
EXPERT_MATMULS: tuple[ExpertMatmul, ...] = ("ragged_dot", "tiled")
# The jax.named_scope of the grouped matmul: its ops' op_name in HLO metadata carries it.
EXPERT_MATMUL_SCOPE = "moe_expert_matmul"

__all__ = [
    "Experts",
    "MoEDecoderLayer",
    "RoutingPlan",
    "EXPERT_MATMUL",
    "EXPERT_MATMULS",
    "EXPERT_MATMUL_SCOPE",
    "ExpertMatmul",
    "SparseMoeBlock",
    "TiledLayout",
    "combine_expert_outputs",
    "default_expert_matmul",
    "expert_forward",
    "expert_parallel_forward",
    "moe_weight_rules",
    "route",
    "set_expert_matmul",
    "set_expert_mesh",
    "sort_by_expert",
    "tiled_grouped_matmul",
    "tiled_layout",
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


def default_expert_matmul(platform: str | None = None) -> ExpertMatmul:
    """EXPERT_MATMUL's choice for `platform` (default: jax's default backend); "cuda" and
    "rocm" devices count as "gpu"; an unknown platform gets "tiled"."""
    platform = platform or jax.default_backend()
    platform = "gpu" if platform in ("cuda", "rocm") else platform
    return EXPERT_MATMUL.get(platform, "tiled")


@dataclasses.dataclass(frozen=True)
class TiledLayout:
    """Where each sorted row sits in the padded, tiled row buffer (a pytree of arrays).

    Attributes:
        slot: i32[T*k]: the padded slot of each sorted row; rows of other devices'
            experts get num_tiles * m (out of range: dropped and never read back).
        source: i32[num_tiles * m]: the sorted row each slot holds (padding slots: 0,
            whose output is never read).
        tile_expert: i32[num_tiles]: the local expert whose weights each tile uses.
    """

    slot: jax.Array
    source: jax.Array
    tile_expert: jax.Array


jax.tree_util.register_dataclass(TiledLayout)


def tile_rows_and_count(num_rows: int, num_groups: int) -> tuple[int, int]:
    """The row tile m and the static tile count for `num_rows` rows in `num_groups` groups.

    m is the power of two nearest above the mean group size (at most 128), so padding
    costs at most m - 1 rows per non-empty group. Each non-empty group of n rows takes
    cdiv(n, m) tiles, and at most min(G, rows) groups are non-empty, so at most
    (rows + min(G, rows) * (m - 1)) // m tiles are ever used, whatever the routing.
    """
    mean = cdiv(num_rows, max(num_groups, 1))
    m = min(128, 1 << max(mean - 1, 0).bit_length())
    busy = min(num_groups, num_rows)
    return m, max(1, (num_rows + busy * (m - 1)) // m)


def tiled_layout(group_sizes: jax.Array, num_rows: int, m: int, num_tiles: int) -> TiledLayout:
    """The padded layout of `num_rows` sorted rows in groups of `group_sizes` (i32[G])."""
    g = group_sizes.shape[0]
    padded = (group_sizes + m - 1) // m * m
    start = jnp.cumsum(group_sizes) - group_sizes
    padded_end = jnp.cumsum(padded)
    padded_start = padded_end - padded
    row = jnp.arange(num_rows, dtype=jnp.int32)
    group = jnp.searchsorted(jnp.cumsum(group_sizes), row, side="right").astype(jnp.int32)
    local = group < g
    safe = jnp.minimum(group, g - 1)
    slot = jnp.where(local, padded_start[safe] + row - start[safe], num_tiles * m)
    source = jnp.zeros(num_tiles * m, jnp.int32).at[slot].set(row, mode="drop")
    tile_start = jnp.arange(num_tiles, dtype=jnp.int32) * m
    tile_expert = jnp.searchsorted(padded_end, tile_start, side="right").astype(jnp.int32)
    return TiledLayout(
        slot=slot.astype(jnp.int32),
        source=source,
        tile_expert=jnp.minimum(tile_expert, g - 1),  # tiles past every group: unused
    )


def tiled_grouped_matmul(
    rows: jax.Array,  # f[T*k, D] sorted by group
    weights: tuple[jax.Array, ...],  # each f[G, D, F]
    group_sizes: jax.Array,  # i32[G]
    *,
    precision: Any,
    combine: Any,  # (f[tiles, m, F] per weight) -> f[tiles, m, F_out] before the last
    last: jax.Array,  # f[G, F, D_out]
) -> jax.Array:  # f[T*k, D_out], zeros for rows past sum(group_sizes)
    """combine(rows @ w[g] for w in weights) @ last[g] per group g, by tiles of m rows.

    Static shapes from T*k and G alone. Padding slots compute on a copy of row 0 and are
    never read back; rows of other devices' experts come out as zeros.
    """
    n, d = rows.shape
    m, num_tiles = tile_rows_and_count(n, group_sizes.shape[0])
    layout = tiled_layout(group_sizes, n, m, num_tiles)
    tiles = jnp.take(rows, layout.source, axis=0).reshape(num_tiles, m, d)
    dot = dict(precision=precision, preferred_element_type=rows.dtype)

    # Each tile times its expert's weights (8-bit ones with their scales; block-wise ones
    # dequantized a tile at a time).
    parts = [tile_matmul(tiles, w, layout.tile_expert, **dot) for w in weights]
    y = tile_matmul(combine(*parts), last, layout.tile_expert, **dot)
    y = y.reshape(num_tiles * m, -1)
    return jnp.take(y, layout.slot, axis=0, mode="fill", fill_value=0)


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
    matmul: ExpertMatmul = "ragged_dot",
) -> jax.Array:  # f[T, D]
    """The summed output of experts [first_expert, first_expert + E_local) for every token.

    With every expert local (first_expert 0) this is the whole routed MLP; a device of an
    expert-parallel mesh passes its first expert and the psum adds the devices' parts.
    `matmul` picks the grouped matmul (EXPERT_MATMULS); both give the same rows. Block-wise
    fp8 experts always take the tiles (one dequantized expert matrix at a time).
    """
    if matmul not in EXPERT_MATMULS:
        raise ValueError(f"matmul={matmul!r}: expected one of {EXPERT_MATMULS}")
    plan = sort_by_expert(experts, gate.shape[0], first_expert)
    rows = x[plan.tokens]  # f[T*k, D]
    act = activation(hidden_act)
    with jax.named_scope(EXPERT_MATMUL_SCOPE):  # names its ops in the compiled HLO
        # Block-wise fp8 experts always take the tiles: ragged_dot would need every expert
        # dequantized at once (scales along the contraction cannot leave the product).
        if matmul == "tiled" or is_block_scaled(gate):
            y = tiled_grouped_matmul(
                rows,
                (gate, up),
                plan.group_sizes,
                precision=precision,
                combine=lambda g, u: act(g) * u,
                last=down,
            )
        else:
            dot = dict(precision=precision, preferred_element_type=x.dtype)
            h = act(grouped_ragged_dot(rows, gate, plan.group_sizes, **dot)) * grouped_ragged_dot(
                rows, up, plan.group_sizes, **dot
            )
            y = grouped_ragged_dot(h, down, plan.group_sizes, **dot)  # f[T*k, D]
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

    # The experts axis leads every leaf (8-bit weights and their scales alike), after the
    # layer axis of a scan's whole stacks (QuantizedExpertWeight.layer).
    rep, split = PartitionSpec(), PartitionSpec(TP_AXIS)

    def spec(w: Any) -> Any:
        if getattr(w, "layer", None) is None:
            return split
        return dataclasses.replace(
            w, q=PartitionSpec(None, TP_AXIS), scale=PartitionSpec(None, TP_AXIS), layer=rep
        )

    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(rep, rep, rep, *map(spec, params)),
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

    def weights(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(gate, up, down) as the grouped matmul takes them (QuantizedExperts: 8-bit)."""
        return self.gate_proj[...], self.up_proj[...], self.down_proj[...]


class SparseMoeBlock(nnx.Module):
    """Router, routed experts and (Qwen2-MoE) a sigmoid-gated shared expert.

    Attributes:
        expert_mesh: the mesh whose "tp" axis splits the experts (set by
            `set_expert_mesh` when the model is sharded); None: one device.
        expert_matmul: the grouped matmul (EXPERT_MATMULS); None: the choice of
            `default_expert_matmul` for the platform the block runs on (the expert
            mesh's devices, else jax's default backend). `set_expert_matmul` sets it.
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
        self.expert_matmul: ExpertMatmul | None = None

    def matmul(self) -> ExpertMatmul:
        """The grouped matmul this block traces with."""
        if self.expert_matmul is not None:
            return self.expert_matmul
        mesh = self.expert_mesh
        return default_expert_matmul(None if mesh is None else mesh.devices.flat[0].platform)

    def __call__(self, x: jax.Array) -> jax.Array:  # f[..., D] -> f[..., D]
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts = route(
            self.router(x),
            self.top_k,
            norm_topk_prob=self.norm_topk_prob,
            weight_dtype=self.router_weight_dtype,
        )
        params = self.experts.weights()
        static = dict(hidden_act=self.hidden_act, precision=self.precision, matmul=self.matmul())
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


def set_expert_matmul(model: Any, matmul: ExpertMatmul | None) -> None:
    """Makes every SparseMoeBlock of `model` trace with `matmul` (None: per platform)."""
    if matmul is not None and matmul not in EXPERT_MATMULS:
        raise ValueError(f"matmul={matmul!r}: expected one of {EXPERT_MATMULS} or None")
    for _, module in nnx.iter_graph(model):
        if isinstance(module, SparseMoeBlock):
            module.expert_matmul = matmul


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
