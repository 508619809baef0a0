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

``SteerLayers`` adds a per-sequence vector to the residual stream after chosen layers
(zero rows for unsteered sequences), every token of a sequence getting its row:

    vectors f32[J + 1, S, hidden]   slot j = the j-th steerable layer, slot J = zeros
    after layer i:  x += vectors[slot_of_layer[i], seq_of_token]

``StepHooks`` runs both, steering first, so a captured row is the steered stream, and
carries the step's prompt-embedding rows (``input_rows``), which the forward's embedding
takes instead of the table's rows where their mask is set.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["CaptureLayers", "SteerLayers", "StepHooks"]


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

    def after_layer(
        self,
        state: jax.Array,  # f32[K + 1, T, hidden]
        layer: int | jax.Array,  # i32[] under a scan
        x: jax.Array,  # f[T, hidden]
    ) -> tuple[jax.Array, jax.Array]:
        """Stores x in its layer's slot (the discard slot when not captured); x unchanged."""
        slot = _slots(self.layers, self.num_layers)[layer]
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


def _slots(layers: tuple[int, ...], num_layers: int) -> jax.Array:
    """i32[num_layers]: the position of each layer in ``layers``, len(layers) if absent."""
    slots = [len(layers)] * num_layers
    for k, i in enumerate(layers):
        if i >= 0:
            slots[i] = k
    return jnp.asarray(slots, jnp.int32)


@dataclasses.dataclass(frozen=True)
class SteerLayers:
    """Adds each sequence's vector to the residual stream after the steerable layers.

    Built inside the traced step from its inputs.

    Attributes:
        layers: the steerable decoder layers (EngineConfig.steering_layers), in the order
            of ``vectors``' first axis.
        num_layers: the model's depth.
        vectors: f32[J, S, hidden] per steerable layer and sequence (zeros: unsteered).
        query_start_loc: i32[S + 1] where each sequence's tokens start in the step.
    """

    layers: tuple[int, ...]
    num_layers: int
    vectors: Any
    query_start_loc: Any

    def seq_of_token(self, num_tokens: int) -> jax.Array:  # i32[T]; S for padding rows
        ends = self.query_start_loc[1:]
        return jnp.searchsorted(ends, jnp.arange(num_tokens, dtype=ends.dtype), side="right")

    def after_layer(
        self,
        rows: jax.Array,  # f32[J + 1, T, hidden]: per slot, each token's vector
        layer: int | jax.Array,
        x: jax.Array,  # f[T, hidden]
    ) -> jax.Array:
        slot = _slots(self.layers, self.num_layers)[layer]
        add = jax.lax.dynamic_index_in_dim(rows, slot, 0, keepdims=False)
        return (x.astype(jnp.float32) + add).astype(x.dtype)

    def token_rows(self, num_tokens: int) -> jax.Array:  # f32[J + 1, T, hidden]
        """Each token's vector per slot (its sequence's; zeros for padding and slot J)."""
        vectors = self.vectors.astype(jnp.float32)
        zeros = jnp.zeros((vectors.shape[0], 1, vectors.shape[2]), jnp.float32)
        by_seq = jnp.concatenate([vectors, zeros], axis=1)  # row S: padding tokens
        seq = jnp.minimum(self.seq_of_token(num_tokens), vectors.shape[1])
        rows = by_seq[:, seq]
        return jnp.concatenate([rows, jnp.zeros_like(rows[:1])], axis=0)


@dataclasses.dataclass(frozen=True)
class StepHooks:
    """The step's hooks together: steering (if any), then capture (if any).

    The state is (capture buffer or None, per-token steering rows or None).
    """

    capture: CaptureLayers | None = None
    steer: SteerLayers | None = None
    # (f[T, embed] rows, bool[T] mask): prompt embeddings replacing the table's rows
    input_rows: tuple[Any, Any] | None = None

    def init(self, x: jax.Array) -> tuple[Any, Any]:
        buffer = None if self.capture is None else self.capture.init(x)
        rows = None if self.steer is None else self.steer.token_rows(x.shape[0])
        return buffer, rows

    def after_layer(self, state: tuple[Any, Any], layer: int | jax.Array, x: jax.Array):
        buffer, rows = state
        if self.steer is not None:
            x = self.steer.after_layer(rows, layer, x)
        if self.capture is not None:
            buffer, x = self.capture.after_layer(buffer, layer, x)
        return (buffer, rows), x
