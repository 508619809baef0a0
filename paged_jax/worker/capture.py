"""Activations on the device side: the step's hooks (capture, steering) and the copy of rows.

With ``EngineConfig.hidden_state_layers`` every step program runs the model with a
``CaptureLayers`` hook and also returns the captured layers' rows, cut into chunks of a
fixed number of rows (one shape for every bucket):

    captured f32[K, T, hidden] -> chunks f32[K, C, hidden] x ceil(T / C)

They stay on device unless a request asked: ``PendingCapture`` copies only the chunks that
hold requested rows, so a step nobody asked of transfers nothing, and what leaves the
device always has the same per-chunk shape (no program is built for it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.config import EngineConfig
from paged_jax.constants import cdiv
from paged_jax.models.activation_hooks import CaptureLayers, SteerLayers, StepHooks

__all__ = ["ActivationStep", "PendingCapture", "activation_hooks", "capture_chunks"]


@dataclasses.dataclass(frozen=True)
class ActivationStep:
    """How a step program runs the model with activation hooks (models.activation_hooks).

    Attributes:
        capture_layers: EngineConfig.hidden_state_layers.
        steer_layers: EngineConfig.steering_layers.
        num_layers / hidden_size: the model's.
        prompt_embeds: EngineConfig.enable_prompt_embeds.
        embed_dim: the embedding table's width (the prompt embeddings').
    """

    capture_layers: tuple[int, ...]
    steer_layers: tuple[int, ...]
    num_layers: int
    hidden_size: int
    prompt_embeds: bool = False
    embed_dim: int = 0

    def forward(
        self,
        model: Any,
        steering: jax.Array | None,  # f32[J, S, hidden]
        token_ids: jax.Array,  # i32[T]
        positions: jax.Array,  # i32[T]
        kv_caches: Any,
        attention: Any,  # AttentionMetadata
        backend: Any,
        extra: dict[str, Any],
        embeds: tuple[jax.Array, jax.Array] | None = None,  # f32[T, embed], bool[T]
    ) -> tuple[jax.Array, Any, jax.Array | None]:  # f[T, hidden], caches, f32[K, T, hidden]
        """The model's hooked paged forward: its last layer's output, the caches and the
        captured rows (None without capture layers)."""
        capture = (
            CaptureLayers(self.capture_layers, self.num_layers) if self.capture_layers else None
        )
        steer = None
        if self.steer_layers:
            steer = SteerLayers(
                self.steer_layers, self.num_layers, steering, attention.query_start_loc
            )
        hidden, kv_caches, (buffer, _) = model.forward_paged_hidden(
            token_ids,
            positions,
            kv_caches,
            attention,
            attention_backend=backend,
            hook=StepHooks(capture, steer, embeds if self.prompt_embeds else None),
            **extra,
        )
        if capture is None:
            return hidden, kv_caches, None
        return hidden, kv_caches, capture.finish(buffer, hidden, getattr(model, "final_norm", None))

    def chunks(self, captured: jax.Array | None, rows: int) -> tuple[jax.Array, ...]:
        """The captured rows in chunks of ``rows`` (capture_chunks); () without capture."""
        return () if captured is None else capture_chunks(captured, rows)

    def zero_steering(self, num_seqs: int) -> np.ndarray:  # f32[J, num_seqs, hidden]
        return np.zeros((len(self.steer_layers), num_seqs, self.hidden_size), np.float32)

    def no_embeds(self, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """f32[T, embed] zeros and bool[T] False: a step without prompt-embedding rows."""
        return np.zeros((num_tokens, self.embed_dim), np.float32), np.zeros(num_tokens, bool)


def activation_hooks(model: Any, config: EngineConfig, hidden_path: bool) -> ActivationStep | None:
    """The step's ActivationStep for ``config``'s hidden_state_layers and steering_layers
    (None when both are empty).

    Raises:
        ValueError: layers given for a model without forward_paged_hidden, or an index
            outside the model's layers (-1 allowed for capture only).
    """
    capture = tuple(config.hidden_state_layers)
    steer = tuple(config.steering_layers)
    embeds = config.enable_prompt_embeds
    if not capture and not steer and not embeds:
        return None
    name = (
        "hidden_state_layers" if capture else "steering_layers" if steer else "enable_prompt_embeds"
    )
    if not hidden_path:
        raise ValueError(
            f"EngineConfig.{name}={getattr(config, name)!r} needs a model with "
            f"forward_paged_hidden and logits (every paged_jax.models model); "
            f"{type(model).__name__} has not: leave {name} at its default"
        )
    num_layers = int(model.config.num_hidden_layers)
    if capture:
        CaptureLayers(capture, num_layers)  # checks the indices, naming the field
    for i in steer:
        if not 0 <= i < num_layers:
            raise ValueError(
                f"steering_layers entry {i!r} must be in [0, {num_layers}) (the model has "
                f"{num_layers} decoder layers)"
            )
    hidden = int(model.config.hidden_size)
    embed_dim = int(getattr(model.config, "word_embed_proj_dim", None) or hidden)
    return ActivationStep(capture, steer, num_layers, hidden, embeds, embed_dim)


def capture_chunks(
    captured: jax.Array,  # f32[K, T, hidden]
    rows: int,
) -> tuple[jax.Array, ...]:  # ceil(T / rows) x f32[K, rows, hidden]
    """The captured rows in chunks of ``rows`` rows, the last zero-padded."""
    num = cdiv(captured.shape[1], rows)
    captured = jnp.pad(captured, ((0, 0), (0, num * rows - captured.shape[1]), (0, 0)))
    return tuple(captured[:, c * rows : (c + 1) * rows] for c in range(num))


class PendingCapture:
    """The chunks of one step's captured rows that hold requested rows, being copied to host.

    Args:
        chunks: the step's capture_chunks output.
        rows: i32[M] requested token rows of the step.
        chunk_rows: rows per chunk.
    """

    def __init__(self, chunks: tuple[jax.Array, ...], rows: np.ndarray, chunk_rows: int):
        rows = np.asarray(rows, np.int64)
        self._rows = rows
        self._chunk_rows = chunk_rows
        self._chunks = {int(c): chunks[int(c)] for c in np.unique(rows // chunk_rows)}
        for array in self._chunks.values():
            array.copy_to_host_async()

    def result(self) -> np.ndarray:  # f32[K, M, hidden] in the order the rows were asked
        host = {c: np.asarray(jax.device_get(a)) for c, a in self._chunks.items()}
        first = next(iter(host.values()))
        out = np.empty((first.shape[0], len(self._rows), first.shape[2]), np.float32)
        chunk_of = self._rows // self._chunk_rows
        for c, values in host.items():
            sel = np.flatnonzero(chunk_of == c)
            out[:, sel] = values[:, self._rows[sel] - c * self._chunk_rows]
        return out
