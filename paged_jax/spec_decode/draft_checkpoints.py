"""Draft checkpoints made from a target: its own first layers, saved as a new checkpoint.

A draft that is the target's first n layers (embeddings, the first n decoder layers,
the final norm and the head) shares its vocabulary and much of its function, the
standard cheap draft when no trained small model exists (layer-skip self-speculation).
Host side: numpy and safetensors only.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import numpy as np

# "model.layers.3.mlp..." (Llama, Qwen, Mistral, Gemma), "transformer.h.3..." (GPT-2),
# "model.decoder.layers.3..." (OPT): the number after the layer list's name.
_LAYER_KEY = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")
# config.json's layer-count key per naming scheme.
_LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer")
# Files copied beside the weights (tokenizer and generation settings).
_SIDE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def truncate_checkpoint(
    src: str | pathlib.Path, dst: str | pathlib.Path, num_layers: int
) -> pathlib.Path:
    """Saves the checkpoint at ``src`` with only its first ``num_layers`` layers to ``dst``.

    Args:
        src: a Hugging Face checkpoint directory (config.json + *.safetensors).
        dst: the directory to write (created; files there are overwritten).
        num_layers: layers to keep, in [1, the source's layer count].

    Returns:
        dst as a Path: config.json with the new layer count, one model.safetensors,
        and the tokenizer / generation files the source has.

    Raises:
        ValueError: num_layers out of range, or a config without a layer count.
    """
    from safetensors.numpy import load_file, save_file

    src, dst = pathlib.Path(src), pathlib.Path(dst)
    config = json.loads((src / "config.json").read_text())
    key = next((k for k in _LAYER_COUNT_KEYS if k in config), None)
    if key is None:
        raise ValueError(f"{src / 'config.json'} has none of {_LAYER_COUNT_KEYS}")
    total = int(config[key])
    if not isinstance(num_layers, int) or not 1 <= num_layers <= total:
        raise ValueError(f"num_layers={num_layers!r} must be an int in [1, {total}]")
    tensors: dict[str, np.ndarray] = {}
    for file in sorted(src.glob("*.safetensors")):
        for name, value in load_file(str(file)).items():
            match = _LAYER_KEY.search(name)
            if match is None or int(match.group(1)) < num_layers:
                tensors[name] = value
    config[key] = num_layers
    for list_key in ("layer_types",):  # per-layer lists (Gemma 2/3, newer configs)
        if isinstance(config.get(list_key), list):
            config[list_key] = config[list_key][:num_layers]
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for name in _SIDE_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    return dst


__all__ = ["truncate_checkpoint"]
