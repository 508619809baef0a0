"""The generate CLI's hidden states: .npy files beside the output JSONL, one per row set and layer.

A line that asked (``"return_hidden_states": true``, or --return-hidden-states) gets

    <output>.<index>.prompt.layer<L>.npy        f32[num_prompt_tokens, hidden_size]
    <output>.<index>.out<j>.layer<L>.npy        f32[N - 1, hidden_size] of completion j

for every layer L of --hidden-state-layers (``layer-1`` is the final-norm output), and
its record names them under "hidden_states". A data-parallel replica sends a request's
rows back as one ``.npz`` payload (encode_hidden_states), which the CLI writes as the same
files. Host module: numpy only, no jax.
"""

from __future__ import annotations

import io
import pathlib
from typing import Any

import numpy as np

__all__ = [
    "decode_hidden_states",
    "encode_hidden_states",
    "hidden_state_file_name",
    "request_hidden_states",
    "write_hidden_state_files",
]

PROMPT_PART = "prompt"


def hidden_state_file_name(output: pathlib.Path, index: int, part: str, layer: int) -> str:
    """The file name of one line's rows of one layer (``part``: "prompt" or "out<j>")."""
    return f"{output.name}.{index}.{part}.layer{layer}.npy"


def request_hidden_states(out: Any) -> dict[str, dict[int, np.ndarray]] | None:
    """A RequestOutput's rows by part: {"prompt": {layer: f32[P, hidden]}, "out<j>":
    {layer: f32[N_j - 1, hidden]}, ...} in completion order; None when it asked for none."""
    if out.prompt_hidden_states is None:
        return None
    parts = {PROMPT_PART: dict(out.prompt_hidden_states)}
    for c in out.outputs:
        parts[f"out{c.index}"] = dict(c.hidden_states or {})
    return {
        part: {layer: np.asarray(rows, np.float32) for layer, rows in states.items()}
        for part, states in parts.items()
    }


def encode_hidden_states(parts: dict[str, dict[int, np.ndarray]]) -> bytes:
    """request_hidden_states' rows as one uncompressed ``.npz`` (exact f32 bytes).

    A part without layers keeps its place by an empty marker entry, so a completion
    without rows still has its (empty) entry after the round trip.
    """
    arrays: dict[str, np.ndarray] = {}
    for part, states in parts.items():
        arrays[part] = np.zeros(0, np.float32)  # the part's marker, in completion order
        for layer, rows in states.items():
            arrays[f"{part}.layer{layer}"] = np.asarray(rows, np.float32)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def decode_hidden_states(payload: bytes) -> dict[str, dict[int, np.ndarray]]:
    """The rows encode_hidden_states packed: {"prompt": {layer: rows}, "out<j>": ...}."""
    parts: dict[str, dict[int, np.ndarray]] = {}
    with np.load(io.BytesIO(payload), allow_pickle=False) as npz:
        for key in npz.files:
            part, sep, layer = key.partition(".layer")
            if not sep:
                parts[part] = {}
            else:
                parts[part][int(layer)] = npz[key]
    return parts


def write_hidden_state_files(output: pathlib.Path, index: int, states: Any) -> dict[str, Any]:
    """Writes a request's hidden states beside ``output``; the record's entry.

    Args:
        output: the output JSONL's path (the files go into its folder).
        index: the line's index (in every file name).
        states: the line's RequestOutput, or request_hidden_states' rows of one (what
            a data-parallel replica sent back), or None.

    Returns:
        {} when the request asked for none, else {"hidden_states": {"prompt": {layer:
        file name}, "outputs": [{layer: file name}, ...]}} (names relative to the
        output's folder).
    """
    if states is not None and not isinstance(states, dict):
        states = request_hidden_states(states)
    if states is None:
        return {}

    def save(part: str, rows_by_layer: dict[int, np.ndarray]) -> dict[str, str]:
        names = {}
        for layer, rows in rows_by_layer.items():
            name = hidden_state_file_name(output, index, part, layer)
            np.save(output.parent / name, np.asarray(rows, np.float32))
            names[str(layer)] = name
        return names

    return {
        "hidden_states": {
            "prompt": save(PROMPT_PART, states[PROMPT_PART]),
            "outputs": [save(part, rows) for part, rows in states.items() if part != PROMPT_PART],
        }
    }
