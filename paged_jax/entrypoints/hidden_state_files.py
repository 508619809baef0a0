"""The generate CLI's hidden states: .npy files beside the output JSONL, one per row set and layer.

A line that asked (``"return_hidden_states": true``, or --return-hidden-states) gets

    <output>.<index>.prompt.layer<L>.npy        f32[num_prompt_tokens, hidden_size]
    <output>.<index>.out<j>.layer<L>.npy        f32[N - 1, hidden_size] of completion j

for every layer L of --hidden-state-layers (``layer-1`` is the final-norm output), and
its record names them under "hidden_states". Host module: numpy only, no jax.
"""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np

__all__ = ["hidden_state_file_name", "write_hidden_state_files"]


def hidden_state_file_name(output: pathlib.Path, index: int, part: str, layer: int) -> str:
    """The file name of one line's rows of one layer (``part``: "prompt" or "out<j>")."""
    return f"{output.name}.{index}.{part}.layer{layer}.npy"


def write_hidden_state_files(output: pathlib.Path, index: int, out: Any) -> dict[str, Any]:
    """Writes a RequestOutput's hidden states beside ``output``; the record's entry.

    Returns {} when the request asked for none, else {"hidden_states": {"prompt": {layer:
    file name}, "outputs": [{layer: file name}, ...]}} (names relative to the output's
    folder).
    """
    if out.prompt_hidden_states is None:
        return {}

    def save(part: str, states: dict[int, Any]) -> dict[str, str]:
        names = {}
        for layer, rows in states.items():
            name = hidden_state_file_name(output, index, part, layer)
            np.save(output.parent / name, np.asarray(rows, np.float32))
            names[str(layer)] = name
        return names

    return {
        "hidden_states": {
            "prompt": save("prompt", out.prompt_hidden_states),
            "outputs": [save(f"out{c.index}", c.hidden_states or {}) for c in out.outputs],
        }
    }
