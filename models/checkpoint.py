"""Saving converted params with orbax-checkpoint, for a faster reload than re-converting.

Layout of a saved directory:
    paged_jax_config.json   the ModelConfig (to_json_dict)
    params/                 orbax StandardCheckpointer tree of the nnx.Param values
"""

from __future__ import annotations

import json
import pathlib

import orbax.checkpoint as ocp
from flax import nnx

from paged_jax.models.config import ModelConfig
from paged_jax.models.decoder import CausalLM
from paged_jax.models.loader import abstract_model
from paged_jax.models.registry import MODEL_CLASSES

CONFIG_FILE = "paged_jax_config.json"


def save_params(model: CausalLM, directory: str | pathlib.Path) -> pathlib.Path:
    """Writes the model's params and config under `directory` (which must not hold a save).

    Returns:
        The absolute directory.
    """
    directory = pathlib.Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(directory / "params", params)
    checkpointer.wait_until_finished()
    config = model.config.to_json_dict()
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return directory


def load_model_from_orbax(
    directory: str | pathlib.Path, *, attention_backend: str = "auto"
) -> CausalLM:
    """Restores a model written by `save_params`.

    Raises:
        FileNotFoundError: if `directory` holds no saved config.
    """
    directory = pathlib.Path(directory).absolute()
    config_file = directory / CONFIG_FILE
    if not config_file.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {directory} (not written by save_params)")
    config = ModelConfig.from_json_dict(json.loads(config_file.read_text()))
    graphdef, state = abstract_model(MODEL_CLASSES[config.model_type], config, attention_backend)
    target = nnx.to_pure_dict(nnx.state(nnx.merge(graphdef, state), nnx.Param))
    restored = ocp.StandardCheckpointer().restore(directory / "params", target)
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state)
