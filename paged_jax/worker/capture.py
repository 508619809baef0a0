"""Hidden-state capture on the device side: the step's hook and the copy of requested rows.

With ``EngineConfig.hidden_state_layers`` every step program runs the model with a
``CaptureLayers`` hook and also returns the captured layers' rows, cut into chunks of a
fixed number of rows (one shape for every bucket):

    captured f32[K, T, hidden] -> chunks f32[K, C, hidden] x ceil(T / C)

They stay on device unless a request asked: ``PendingCapture`` copies only the chunks that
hold requested rows, so a step nobody asked of transfers nothing, and what leaves the
device always has the same per-chunk shape (no program is built for it).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.config import EngineConfig
from paged_jax.constants import cdiv
from paged_jax.models.activation_hooks import CaptureLayers

__all__ = ["PendingCapture", "capture_chunks", "capture_hook"]


def capture_hook(model: Any, config: EngineConfig, hidden_path: bool) -> CaptureLayers | None:
    """The step's capture hook for ``config.hidden_state_layers`` (None when empty).

    Raises:
        ValueError: layers given for a model without forward_paged_hidden, or an index
            outside [-1, num_hidden_layers).
    """
    layers = tuple(config.hidden_state_layers)
    if not layers:
        return None
    if not hidden_path:
        raise ValueError(
            f"EngineConfig.hidden_state_layers={layers!r} needs a model with "
            f"forward_paged_hidden and logits (every paged_jax.models model); "
            f"{type(model).__name__} has not: pass hidden_state_layers=()"
        )
    return CaptureLayers(layers, int(model.config.num_hidden_layers))


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
