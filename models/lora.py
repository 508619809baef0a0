"""Multi-LoRA on device: fixed-shape adapter stacks and the per-row low-rank product.

Every LoRA-capable projection of every layer has one stack pair, whatever adapters sit in
it, so any mix of adapters runs in the same compiled programs:

    A  f[num_layers, in, max_loras * R]     R = max_lora_rank (an adapter's r zero-padded);
    B  f[num_layers, max_loras * R, out]    slot s owns columns / rows [s * R, (s + 1) * R),
                                            the adapter's scaling folded into B

A step carries one slot per token row (-1: the base model). A projection's output gains

    delta[t] = (x[t] @ A_s) @ B_s        s = slot[t]

computed as two plain matmuls over every slot's columns, the columns of other slots
masked out in between (``lora_delta``): the gather is a mask, so shapes never depend on
the mix. The
step's layers are trace-local copies merged from the weights, so ``LoRAStep.wrap`` swaps a
layer's projections for LoRALinear wrappers without touching the model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax.lora import ATTENTION_LORA_MODULES, LORA_MODULES, MLP_LORA_MODULES

LoRAStacks = dict[str, tuple[jax.Array, jax.Array]]  # module -> (A, B), shapes above


def lora_delta(
    x: jax.Array,  # f[T, in]
    slots: jax.Array,  # i32[T]; -1 = no adapter
    a: jax.Array,  # f[in, N * R]
    b: jax.Array,  # f[N * R, out]
    rank: int,  # R
    precision: Any = None,
) -> jax.Array:  # f[T, out]
    """Each row's low-rank product through its own slot's adapter (zero for slot -1)."""
    column_slot = jnp.arange(a.shape[-1], dtype=slots.dtype) // rank  # i32[N * R]
    mask = (slots[:, None] == column_slot[None, :]).astype(x.dtype)  # f[T, N * R]
    xa = jnp.dot(x, a, precision=precision)  # f[T, N * R]
    return jnp.dot(xa * mask, b, precision=precision)


class LoRALinear:
    """A projection plus its rows' adapters: ``base(x) + lora_delta(x, ...)``.

    Plain Python (not an nnx Module): it lives only inside one traced step.
    """

    def __init__(
        self,
        base: Any,
        a: jax.Array,
        b: jax.Array,
        slots: jax.Array,
        active: jax.Array,
        rank: int,
        precision: Any,
    ):
        self.base, self.a, self.b, self.rank, self.precision = base, a, b, rank, precision
        self.slots, self.active = slots, active

    def __call__(self, x: jax.Array) -> jax.Array:  # f[T, in] -> f[T, out]
        y = self.base(x)
        x2 = x.reshape(-1, x.shape[-1])

        def delta() -> jax.Array:
            d = lora_delta(x2, self.slots, self.a, self.b, self.rank, self.precision)
            return d.reshape(y.shape).astype(y.dtype)

        # A step without adapter rows skips the product (same program, a runtime branch).
        return y + jax.lax.cond(self.active, delta, lambda: jnp.zeros_like(y))


@dataclasses.dataclass(frozen=True)
class LoRAStep:
    """One step's LoRA input (a pytree): the stacks and each token row's slot.

    Attributes:
        stacks: module -> (A f[L, in, N * R], B f[L, N * R, out]).
        slots: i32[T] slot of each token row; -1 = the base model (padding rows too).
        active: bool[]: some row has an adapter (else the products are skipped).
        rank: R, the columns of one slot (static).
    """

    stacks: Mapping[str, tuple[jax.Array, jax.Array]]
    slots: jax.Array
    active: jax.Array
    rank: int = dataclasses.field(default=1, metadata=dict(static=True))

    def layer_stacks(self, layer: int) -> dict[str, tuple[jax.Array, jax.Array]]:
        """Layer ``layer``'s (A f[in, N * R], B f[N * R, out]) per module."""
        return {m: (a[layer], b[layer]) for m, (a, b) in self.stacks.items()}

    def scanned(self, period: int, num_steps: int) -> dict[str, tuple[jax.Array, jax.Array]]:
        """The stacks of the scanned layers as scan inputs: leading axes (num_steps, period)."""
        n = period * num_steps
        return {
            m: (
                a[:n].reshape(num_steps, period, *a.shape[1:]),
                b[:n].reshape(num_steps, period, *b.shape[1:]),
            )
            for m, (a, b) in self.stacks.items()
        }

    def wrap(self, layer: Any, stacks: Mapping[str, tuple[jax.Array, jax.Array]]) -> Any:
        """``layer`` (a trace-local copy) with each stacked projection wrapped in LoRALinear."""
        for module, (a, b) in stacks.items():
            parent = layer.attn if module in ATTENTION_LORA_MODULES else layer.mlp
            base = getattr(parent, module)
            precision = getattr(base, "precision", None)
            wrapped = LoRALinear(base, a, b, self.slots, self.active, self.rank, precision)
            setattr(parent, module, wrapped)
        return layer


jax.tree_util.register_dataclass(LoRAStep)


def lora_module_shapes(model: Any) -> tuple[dict[str, tuple[int, int]], dict[str, str]]:
    """(module -> (in, out), module -> why refused) of a paged_jax.models CausalLM's layers.

    A projection is LoRA-capable when every layer has it as a float nnx.Linear. MoE
    layers (experts, no dense gate/up/down) and quantized bases (integer kernels) are
    refused with the reason.

    Raises:
        ValueError: the model has no decoder layers with Llama-style projections.
    """
    layers = getattr(model, "layers", None)
    if not layers:
        raise ValueError(
            f"enable_lora=True needs a paged_jax.models decoder; {type(model).__name__} has "
            "no layers"
        )
    shapes: dict[str, tuple[int, int]] = {}
    refused: dict[str, str] = {}
    for module in LORA_MODULES:
        parent_name = "attn" if module in ATTENTION_LORA_MODULES else "mlp"
        found = [getattr(getattr(layer, parent_name, None), module, None) for layer in layers]
        if any(x is None for x in found):
            if module in MLP_LORA_MODULES and any(
                hasattr(getattr(layer, "mlp", None), "experts") for layer in layers
            ):
                refused[module] = "not an MoE expert projection (LoRA on MoE experts is not served)"
            continue
        odd = next((x for x in found if not isinstance(x, nnx.Linear)), None)
        if odd is not None:  # a quantized or otherwise custom projection
            refused[module] = (
                f"a float nnx.Linear projection; this base's is a {type(odd).__name__}: LoRA "
                "on quantized bases is not served"
            )
            continue
        kernel = found[0].kernel
        if not jnp.issubdtype(kernel.dtype, jnp.floating):
            refused[module] = (
                f"a float projection; this base is quantized ({kernel.dtype}): LoRA on "
                "quantized bases is not served"
            )
            continue
        shapes[module] = (int(kernel.shape[0]), int(kernel.shape[1]))
    if not shapes and not refused:
        raise ValueError(
            f"enable_lora=True: {type(model).__name__} has none of the projections "
            f"{LORA_MODULES} LoRA adapters target"
        )
    return shapes, refused


def lora_stack_specs(model: Any, modules: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Per module, the PartitionSpecs of (A, B) consistent with the base kernel's sharding.

    A kernel f[in, out] split (s_in, s_out) gives A f[L, in, N * R] split (-, s_in, -)
    and B f[L, N * R, out] split (-, -, s_out): a column-parallel projection (q/k/v,
    gate/up) keeps A whole and splits B's columns like its own; a row-parallel one (o,
    down) splits A's rows like its input, and XLA sums the partial products as it does
    the base's.
    """
    from jax.sharding import PartitionSpec

    layer = model.layers[0]
    specs = {}
    for module in modules:
        parent = layer.attn if module in ATTENTION_LORA_MODULES else layer.mlp
        sharding = getattr(getattr(parent, module).kernel[...], "sharding", None)
        spec = getattr(sharding, "spec", None)
        s_in, s_out = (tuple(spec) + (None, None))[:2] if spec is not None else (None, None)
        specs[module] = (
            PartitionSpec(None, s_in, None),
            PartitionSpec(None, None, s_out),
        )
    return specs


class DeviceLoRA:
    """The device stacks of an engine with enable_lora and the jitted slot write.

    Args:
        shapes: module -> (in, out) of the served model's projections (lora_module_shapes).
        num_layers, max_loras, max_lora_rank: the stack sizes.
        dtype: the model's dtype.
        refused: module -> why the model takes no LoRA there (lora_module_shapes).
        repeated_heads: module -> (head_dim, {checkpoint out dim: repeats}) for k/v
            projections whose KV heads the model repeats (paged_jax.lora.read_peft_adapter).
        mesh, specs: under tensor parallelism, the mesh and lora_stack_specs; else None.
    """

    def __init__(
        self,
        shapes: Mapping[str, tuple[int, int]],
        num_layers: int,
        max_loras: int,
        max_lora_rank: int,
        dtype: Any,
        *,
        refused: Mapping[str, str] | None = None,
        repeated_heads: Mapping[str, tuple[int, Mapping[int, int]]] | None = None,
        mesh: Any = None,
        specs: Mapping[str, tuple[Any, Any]] | None = None,
    ):
        self.shapes = dict(shapes)
        self.refused = dict(refused or {})
        self.repeated_heads = dict(repeated_heads or {})
        self.num_layers = num_layers
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras
        self.dtype = jnp.dtype(dtype)
        n, r = max_loras, max_lora_rank
        shardings = None
        if mesh is not None:
            from jax.sharding import NamedSharding

            shardings = {
                m: (NamedSharding(mesh, sa), NamedSharding(mesh, sb))
                for m, (sa, sb) in (specs or {}).items()
            }
        stacks = {}
        for m, (d_in, d_out) in self.shapes.items():
            a = np.zeros((num_layers, d_in, n * r), self.dtype)
            b = np.zeros((num_layers, n * r, d_out), self.dtype)
            if shardings is None:
                stacks[m] = (jnp.asarray(a), jnp.asarray(b))
            else:
                stacks[m] = tuple(jax.device_put(x, s) for x, s in zip((a, b), shardings[m]))
        self.stacks: LoRAStacks = stacks
        out = {} if shardings is None else dict(out_shardings=shardings)
        self._write = jax.jit(_write_slot, donate_argnums=(0,), **out)
        self._no_adapter: dict[int, jax.Array] = {}  # T -> i32[T] of -1
        self._inactive = jax.device_put(np.bool_(False))

    @property
    def bytes_per_adapter(self) -> int:
        """Device bytes one resident adapter takes (one slot of every stack)."""
        total = sum(a.nbytes + b.nbytes for a, b in self.stacks.values())
        return total // self.max_loras

    def write_slot(self, slot: int, weights: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """Writes an adapter's padded, scaled factors into ``slot`` of every stack (zeros for
        the modules it does not target); one compiled program for every slot and adapter."""
        new = {}
        for m, (a, b) in self.stacks.items():
            pair = weights.get(m)
            if pair is None:
                pair = (
                    np.zeros((a.shape[0], a.shape[1], self.max_lora_rank), self.dtype),
                    np.zeros((b.shape[0], self.max_lora_rank, b.shape[2]), self.dtype),
                )
            new[m] = (np.asarray(pair[0], self.dtype), np.asarray(pair[1], self.dtype))
        self.stacks = self._write(self.stacks, np.int32(slot * self.max_lora_rank), new)

    def step_input(self, slots: np.ndarray | None, num_tokens: int) -> LoRAStep:
        """The step's LoRAStep: ``slots`` i32[T], or every row on the base model (a
        resident all -1 array of that bucket, so such steps share the program)."""
        if slots is None:
            slots = self._no_adapter.get(num_tokens)
            if slots is None:
                slots = jax.device_put(np.full(num_tokens, -1, np.int32))
                self._no_adapter[num_tokens] = slots
            return LoRAStep(self.stacks, slots, self._inactive, self.max_lora_rank)
        active = np.bool_(bool((slots >= 0).any()))
        return LoRAStep(self.stacks, slots, active, self.max_lora_rank)


def _write_slot(stacks: LoRAStacks, column: jax.Array, new: LoRAStacks) -> LoRAStacks:
    """stacks with one slot's columns of A (rows of B), starting at ``column`` = slot * R,
    replaced by ``new`` (A f[L, in, R], B f[L, R, out]) in every layer."""
    zero = jnp.zeros((), column.dtype)
    return {
        m: (
            jax.lax.dynamic_update_slice(a, new[m][0].astype(a.dtype), (zero, zero, column)),
            jax.lax.dynamic_update_slice(b, new[m][1].astype(b.dtype), (zero, column, zero)),
        )
        for m, (a, b) in stacks.items()
    }
