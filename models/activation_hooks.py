"""Residual-stream capture inside the paged forward: a hook the layer loop calls after each layer.

The paged forward (decoder.CausalLM.forward_paged_hidden, unrolled or scanned by
layer_scan.StackedLayers.run) calls ``hook.after_layer(state, layer, x)`` after decoder
layer ``layer`` and threads ``state`` through (a scan carries it), so a hook works on a
traced layer index as well as on a Python one. ``CaptureLayers`` keeps the rows of a
fixed set of layers in one buffer of fixed shape:

    buffer f32[K + 1, T, hidden]   slot k = the k-th captured layer, slot K = discarded
    after layer i:  buffer[slot_of_layer[i]] = x       (one dynamic update per layer)

Index -1 (the final-norm output, what the LM head reads) is filled by the caller once the
layers are done (``CaptureLayers.finish``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["CaptureLayers"]


@dataclasses.dataclass(frozen=True)
class CaptureLayers:
    """Captures the residual stream after chosen decoder layers (and -1, the final norm's).

    Attributes:
        layers: the captured indices in output order; ``i >= 0`` is the output of decoder
            layer ``i`` (before any final norm), ``-1`` the final-norm output.
        num_layers: the model's depth (indices must lie in [-1, num_layers)).
    """

    layers: tuple[int, ...]
    num_layers: int

    def __post_init__(self):
        for i in self.layers:
            if not -1 <= i < self.num_layers:
                raise ValueError(
                    f"hidden_state_layers entry {i!r} must be in [-1, {self.num_layers}) "
                    f"(-1 = final-norm output; the model has {self.num_layers} layers)"
                )
        if len(set(self.layers)) != len(self.layers):
            raise ValueError(f"hidden_state_layers={self.layers!r} must not repeat a layer")

    @property
    def num_slots(self) -> int:
        return len(self.layers)

    def init(self, x: jax.Array) -> jax.Array:  # f[T, hidden] -> f32[K + 1, T, hidden]
        """The empty buffer for a step whose residual stream is ``x``."""
        return jnp.zeros((self.num_slots + 1, *x.shape), jnp.float32)

    def _slot_table(self) -> jax.Array:  # i32[num_layers]: slot of each layer, K if none
        slots = [self.num_slots] * self.num_layers
        for k, i in enumerate(self.layers):
            if i >= 0:
                slots[i] = k
        return jnp.asarray(slots, jnp.int32)

    def after_layer(
        self,
        state: jax.Array,  # f32[K + 1, T, hidden]
        layer: int | jax.Array,  # i32[] under a scan
        x: jax.Array,  # f[T, hidden]
    ) -> tuple[jax.Array, jax.Array]:
        """Stores x in its layer's slot (the discard slot when not captured); x unchanged."""
        slot = self._slot_table()[layer]
        state = jax.lax.dynamic_update_index_in_dim(state, x.astype(jnp.float32), slot, 0)
        return state, x

    def finish(
        self,
        state: jax.Array,  # f32[K + 1, T, hidden]
        x: jax.Array,  # f[T, hidden]: the last layer's output
        final_norm: Callable[[jax.Array], jax.Array] | None,
    ) -> jax.Array:  # f32[K, T, hidden]
        """The captured layers in order, -1's slot filled from ``final_norm(x)``."""
        if -1 in self.layers:
            normed = x if final_norm is None else final_norm(x)
            state = state.at[self.layers.index(-1)].set(normed.astype(jnp.float32))
        return state[: self.num_slots]


def run_hook(hook: Any, state: Any, layer: int | jax.Array, x: jax.Array) -> tuple[Any, jax.Array]:
    """``hook.after_layer`` when there is a hook, else (state, x) unchanged."""
    if hook is None:
        return state, x
    return hook.after_layer(state, layer, x)
