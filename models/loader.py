"""load_model: a Hugging Face checkpoint directory -> a Flax NNX model, checked before built.

config.json (+ generation_config.json) -> registry -> family.config_from_hf -> ModelConfig
*.safetensors headers -> key set and every shape checked against family.weight_rules
-> tensors converted (transpose / split / cast) -> nnx.merge into the abstract model
"""

from __future__ import annotations

import json
import pathlib
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from paged_jax.models.config import ConfigFileError, ModelConfig, canonical_dtype
from paged_jax.models.decoder import CausalLM
from paged_jax.models.fp8_checkpoint import (
    ACTIVATION_SCALE_KEY,
    WeightQuantization,
    check_block_sharding,
    weight_quantization,
)
from paged_jax.models.kv_scales import KV_SCALE_KEY, as_scale_pairs, read_kv_scales
from paged_jax.models.moe import set_expert_mesh
from paged_jax.models.partitioning import (
    kv_head_replication,
    param_shardings,
    tensor_parallel_config,
    tensor_parallel_weight_rules,
)
from paged_jax.models.quantized_model import replace_linears
from paged_jax.models.registry import model_class_for
from paged_jax.models.safetensors_io import SafetensorsCheckpoint
from paged_jax.models.weights import WeightRule

# A config file is a few kB; anything past this is not one (and is not read into memory).
MAX_CONFIG_BYTES = 16 * 2**20


class WeightCastWarning(UserWarning):
    """A checkpoint tensor stored in another dtype than the model's was cast at load."""


def read_hf_config(path: str | pathlib.Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json, generation_config.json or {}) of a checkpoint directory.

    Raises:
        FileNotFoundError: naming the path when config.json is missing.
    """
    path = pathlib.Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"no config.json in {path} (expected a Hugging Face model directory)"
        )
    generation_file = path / "generation_config.json"
    generation = read_json_object(generation_file) if generation_file.is_file() else {}
    return read_json_object(config_file), generation


def read_json_object(file: pathlib.Path) -> dict[str, Any]:
    """The JSON object in `file`.

    Raises:
        ValueError: naming the file when it is too large, not UTF-8 JSON, nested too
            deeply for the parser, or not an object.
    """
    size = file.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ValueError(f"{file} is {size} bytes: not a config file (limit {MAX_CONFIG_BYTES})")
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{file} is not valid JSON: {err}") from err
    except RecursionError as err:
        raise ValueError(f"{file} is not a config file: its JSON is nested too deeply") from err
    if not isinstance(value, dict):
        raise ValueError(f"{file} must hold a JSON object, not {type(value).__name__}")
    return value


def family_config(
    path: str | pathlib.Path, dtype: str = "float32"
) -> tuple[type[CausalLM], ModelConfig]:
    """(model class, ModelConfig) of a checkpoint directory, every config field checked.

    Raises:
        FileNotFoundError: no config.json.
        ValueError: unsupported architecture or dtype; a field of config.json or
            generation_config.json of the wrong type or out of its domain, as
            "PATH/config.json: field=value must be ..." (a ConfigFileError).
    """
    path = pathlib.Path(path)
    dtype = canonical_dtype(dtype)
    hf, generation = read_hf_config(path)
    cls = model_class_for(hf)
    try:
        return cls, cls.config_from_hf(hf, generation, dtype)
    except ConfigFileError as err:
        raise ConfigFileError(path / str(err.file), err.message) from err
    except ValueError as err:  # ModelConfig's own checks: the values came from config.json
        raise ConfigFileError(path / "config.json", str(err)) from err


def load_config(path: str | pathlib.Path, dtype: str = "float32") -> ModelConfig:
    """The ModelConfig of a checkpoint directory, without reading any weights."""
    return family_config(path, dtype)[1]


def _canonical_names(
    keys: Sequence[str], cls: type[CausalLM], config: ModelConfig
) -> tuple[dict[str, str], list[str]]:
    """Maps table names to checkpoint keys; returns (name -> key, ignored keys).

    A checkpoint saved from the base model (LlamaModel, GPT2Model, OPTModel) lacks the
    *ForCausalLM prefix; it gets it here. Buffers and a tied duplicate lm_head are ignored.
    """
    ignored_patterns = [*cls.hf_ignored_keys, KV_SCALE_KEY.pattern]  # fp8 KV scales: not params
    if config.tie_word_embeddings:
        ignored_patterns.append(r"^lm_head\.weight$")
    prefix = cls.hf_base_prefix
    has_prefix = any(key.startswith(prefix) for key in keys)
    names, ignored = {}, []
    for key in keys:
        if any(re.search(pattern, key) for pattern in ignored_patterns):
            ignored.append(key)
            continue
        name = key if has_prefix or key.startswith("lm_head.") else prefix + key
        names[name] = key
    return names, ignored


def check_checkpoint(
    rules: Sequence[WeightRule], shapes: Mapping[str, tuple[int, ...]], source: str
) -> None:
    """Checks that `shapes` (table name -> checkpoint shape) is exactly what `rules` need.

    Raises:
        ValueError: listing every missing key, unexpected key and shape mismatch at once.
    """
    expected = {rule.hf_name: rule.hf_shape for rule in rules}
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    mismatched = [
        f"{name}: checkpoint {tuple(shapes[name])}, expected {expected[name]}"
        for name in sorted(set(expected) & set(shapes))
        if tuple(shapes[name]) != tuple(expected[name])
    ]
    problems = []
    if missing:
        problems.append(f"missing keys ({len(missing)}): {missing}")
    if unexpected:
        problems.append(f"unexpected keys ({len(unexpected)}): {unexpected}")
    if mismatched:
        problems.append(f"shape mismatches ({len(mismatched)}): {mismatched}")
    if problems:
        raise ValueError(f"checkpoint {source} does not match the model: " + "; ".join(problems))


def abstract_model(
    cls: type[CausalLM],
    config: ModelConfig,
    attention_backend: str,
    quantization: WeightQuantization | None = None,
) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state of ShapeDtypeStructs) of the model, allocating nothing; with
    `quantization`, its linear layers are 8-bit (models/quantization.py)."""
    model = nnx.eval_shape(
        lambda: cls(config, rngs=nnx.Rngs(0), attention_backend=attention_backend)
    )
    if quantization is not None:
        replace_linears(
            model,
            quantization.method,
            block_size=quantization.block_size,
            embeddings=quantization.embeddings,
        )
    return nnx.split(model)


def fill_params(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    rules: Sequence[WeightRule],
    read: Callable[[str], np.ndarray],
    dtype: str,
    place: Callable[[Any, np.ndarray], Any] | None = None,
) -> CausalLM:
    """Converts each checkpoint tensor by its rules into the abstract state and merges.

    `place(param_path, host_array)` puts each converted array on device (default: the
    default device, cast to `dtype`); a mesh-sharded load places each shard directly.
    """
    # Each param keeps its own dtype: `dtype` for float params, int8 / fp8 and float32
    # for a quantized layer's weight and scales.
    dtypes = {path: var.get_value().dtype for path, var in nnx.to_flat_state(state)}
    if place is None:

        def place(path: Any, value: np.ndarray) -> Any:
            return jnp.asarray(value, dtype=dtypes[tuple(path)])

    expected_paths = {path for path, _ in nnx.to_flat_state(state)}
    # A whole-param rule counts once; a stacked param's rules once together.
    table_paths = [rule.param_path for rule in rules if rule.stack is None or rule.stack[0] == 0]
    assert set(table_paths) == expected_paths and len(table_paths) == len(expected_paths), (
        "the weight table does not cover the model's params one-to-one: a bug in "
        f"weight_rules (table only: {sorted(set(table_paths) - expected_paths, key=str)}, "
        f"model only: {sorted(expected_paths - set(table_paths), key=str)})"
    )
    shapes = {path: var.get_value().shape for path, var in nnx.to_flat_state(state)}
    by_name: dict[str, list[WeightRule]] = {}
    for rule in rules:
        by_name.setdefault(rule.hf_name, []).append(rule)
    pure: dict[Any, Any] = {}
    # Stacked params (MoE experts): slices gather on the host, placed once all arrived.
    pending: dict[Any, tuple[np.ndarray, set[int]]] = {}

    def put(param_path: Any, converted: Any) -> None:
        node = pure
        for part in param_path[:-1]:
            node = node.setdefault(part, {})
        node[param_path[-1]] = converted

    for name, name_rules in by_name.items():
        array = read(name)
        for rule in name_rules:
            path_name = ".".join(map(str, rule.param_path))
            try:
                value = np.asarray(rule.transform(array))
                if rule.stack is None:
                    converted = place(rule.param_path, value)
            except (ValueError, TypeError) as err:
                raise ValueError(
                    f"tensor {name!r} ({array.dtype}{list(array.shape)}) cannot be converted "
                    f"to {dtype} for {path_name}: {err}"
                ) from err
            if rule.stack is None:
                assert value.shape == shapes[rule.param_path], f"bad transform for {name}"
                put(rule.param_path, converted)
                continue
            index, count = rule.stack
            assert (count, *value.shape) == shapes[rule.param_path], f"bad stack for {name}"
            if rule.param_path not in pending:
                pending[rule.param_path] = (np.empty((count, *value.shape), value.dtype), set())
            buffer, filled = pending[rule.param_path]
            buffer[index] = value
            filled.add(index)
            if len(filled) == count:
                put(rule.param_path, place(rule.param_path, buffer))
                del pending[rule.param_path]
    assert not pending, f"stacked params missing slices (a bug in weight_rules): {list(pending)}"
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def params_from_named_tensors(
    cls: type[CausalLM],
    config: ModelConfig,
    named_tensors: Iterable[tuple[str, Any]],
    *,
    tensor_parallel_size: int = 1,
) -> dict[tuple[Any, ...], np.ndarray]:
    """(Hugging Face name, array) pairs -> {param path: host array in the model's layout}.

    The family's weight table converts each tensor as load_model does (transposes, fused
    tensors split, MoE experts stacked); names are taken with or without the base-model
    prefix, and buffers (rotary inv_freq, a tied lm_head, fp8 KV scales) are skipped. A
    subset of the parameters may be given, but a stacked parameter needs all its slices.

    ``config`` is the checkpoint's. With ``tensor_parallel_size`` > 1 the arrays are in
    the layout load_model(mesh=...) gives that many devices (KV heads repeated when fewer
    than devices), still on the host.

    Raises:
        ValueError: naming an unknown name, a shape that differs from the table's, or a
            stacked parameter with slices missing.
    """
    rules = cls.weight_rules(config)
    if tensor_parallel_size > 1:
        rules = tensor_parallel_weight_rules(
            rules, cls.partition_rules, config, tensor_parallel_size
        )
    by_name: dict[str, list[WeightRule]] = {}
    for rule in rules:
        by_name.setdefault(rule.hf_name, []).append(rule)
    ignored = [*cls.hf_ignored_keys, KV_SCALE_KEY.pattern]
    if config.tie_word_embeddings:
        ignored.append(r"^lm_head\.weight$")
    target = np.dtype(jnp.dtype(config.dtype))
    out: dict[tuple[Any, ...], np.ndarray] = {}
    pending: dict[tuple[Any, ...], tuple[np.ndarray, set[int], str]] = {}
    for i, pair in enumerate(named_tensors):
        if not (isinstance(pair, tuple | list) and len(pair) == 2 and isinstance(pair[0], str)):
            raise ValueError(f"named_tensors[{i}]={pair!r:.80} must be a (name, array) pair")
        key, tensor = pair
        if any(re.search(pattern, key) for pattern in ignored):
            continue
        name = key if key in by_name else cls.hf_base_prefix + key
        if name not in by_name:
            example = next(iter(by_name))
            raise ValueError(
                f"named_tensors[{i}]: {key!r} is not a parameter name of {cls.__name__} "
                f"(Hugging Face names, e.g. {example!r})"
            )
        array = np.asarray(tensor)
        for rule in by_name[name]:
            if tuple(array.shape) != tuple(rule.hf_shape):
                raise ValueError(
                    f"named_tensors[{i}]: {key!r} has shape {tuple(array.shape)}, expected "
                    f"{tuple(rule.hf_shape)}"
                )
            value = np.asarray(rule.transform(array)).astype(target, copy=False)
            if rule.stack is None:
                out[tuple(rule.param_path)] = value
                continue
            index, count = rule.stack
            path = tuple(rule.param_path)
            if path not in pending:
                pending[path] = (np.empty((count, *value.shape), target), set(), key)
            buffer, filled, _ = pending[path]
            buffer[index] = value
            filled.add(index)
            if len(filled) == count:
                out[path] = buffer
                del pending[path]
    for path, (buffer, filled, key) in pending.items():
        missing = sorted(set(range(buffer.shape[0])) - filled)
        raise ValueError(
            f"named_tensors: {key!r} is one slice of the stacked {'.'.join(map(str, path))} "
            f"[{buffer.shape[0]}, ...]: all its slices must be given together (missing "
            f"{missing[:8]})"
        )
    return out


def _weight_table(
    path: pathlib.Path,
    cls: type[CausalLM],
    config: ModelConfig,
    names: dict[str, str],
    quantization: str | None,
    quantize_embeddings: bool = False,
) -> tuple[dict[str, str], list[WeightRule], Any, WeightQuantization | None]:
    """(names, weight rules, partition rules, WeightQuantization or None) of a load:
    the family's tables, turned 8-bit where the load quantizes (models/fp8_checkpoint.py).

    Raises:
        ValueError: an unsupported quantization_config, naming quant_method.
    """
    quant = weight_quantization(
        read_hf_config(path)[0], quantization, str(path / "config.json"), quantize_embeddings
    )
    rules = cls.weight_rules(config)
    partition_rules = cls.partition_rules
    if quant is None:
        return names, rules, partition_rules, None
    if quant.prequantized:  # static activation scales: not applied (W8A16)
        names = {n: k for n, k in names.items() if not ACTIVATION_SCALE_KEY.search(k)}
    state = abstract_model(cls, config, "reference", quant)[1]
    # The 8-bit modules: linears (a "qweight"), MoE experts ("gate_proj_scale", ...) and
    # an embedding ("qembedding").
    leaves = [p for p, _ in nnx.to_flat_state(state)]
    eight_bit = ("qweight", "_scale", "qembedding")
    paths = list(dict.fromkeys(p[:-1] for p in leaves if str(p[-1]).endswith(eight_bit)))
    rules = quant.weight_rules(rules, paths)
    if partition_rules is not None:
        partition_rules = quant.partition_rules(partition_rules)
    return names, rules, partition_rules, quant


def check_model_dir(
    path: str | pathlib.Path,
    dtype: str = "float32",
    quantization: str | None = None,
    quantize_embeddings: bool = False,
) -> ModelConfig:
    """Everything load_model checks, without reading a tensor or building the model.

    Reads config.json, picks the architecture, opens every safetensors header (a
    truncated or corrupted file fails here, named) and checks the key set and shapes.

    Raises:
        FileNotFoundError / ValueError: as load_model, naming the file or tensor.
    """
    path = pathlib.Path(path)
    cls, config = family_config(path, dtype)
    checkpoint = SafetensorsCheckpoint(path)
    names = _checked_names(checkpoint, cls, config, path)
    names, rules, _, _ = _weight_table(path, cls, config, names, quantization, quantize_embeddings)
    check_checkpoint(
        rules, {name: checkpoint.shapes[key] for name, key in names.items()}, str(path)
    )
    return config


def _checked_names(
    checkpoint: SafetensorsCheckpoint, cls: type[CausalLM], config: ModelConfig, path: pathlib.Path
) -> dict[str, str]:
    """Table name -> checkpoint key, after a cheap check that the layer count is possible.

    Every layer holds at least one tensor: a config.json claiming more layers than the
    checkpoint has tensors is refused before a weight table of that many layers is built.
    """
    if config.num_hidden_layers > len(checkpoint.shapes):
        raise ValueError(
            f"{path / 'config.json'}: num_hidden_layers={config.num_hidden_layers} cannot "
            f"match a checkpoint of {len(checkpoint.shapes)} tensors (at least one per layer)"
        )
    return _canonical_names(list(checkpoint.shapes), cls, config)[0]


def warn_casts(casts: Sequence[tuple[str, str, str]], dtype: str) -> None:
    """One WeightCastWarning per stored dtype, naming its tensors and their files.

    Args:
        casts: (tensor name, file, stored dtype) of every tensor that was cast.
        dtype: the model dtype they were cast to.
    """
    by_dtype: dict[str, list[tuple[str, str]]] = {}
    for name, file, stored in casts:
        by_dtype.setdefault(stored, []).append((name, file))
    for stored, tensors in by_dtype.items():
        names = ", ".join(repr(name) for name, _ in tensors[:3])
        more = f" and {len(tensors) - 3} more" if len(tensors) > 3 else ""
        files = ", ".join(dict.fromkeys(file for _, file in tensors))
        exact = stored in ("bfloat16", "float16") and dtype == "float32"
        warnings.warn(
            f"{len(tensors)} weight tensor(s) stored as {stored} cast to {dtype} "
            f"({'exact' if exact else 'values may change'}): {names}{more} in {files}",
            WeightCastWarning,
            stacklevel=3,
        )


def load_model(
    path: str | pathlib.Path,
    dtype: str = "float32",
    *,
    attention_backend: str = "auto",
    mesh: Mesh | None = None,
    quantization: str | None = None,
    quantize_embeddings: bool = False,
) -> CausalLM:
    """Loads a Hugging Face checkpoint directory (config.json + *.safetensors).

    Args:
        path: directory with config.json, optional generation_config.json, and
            model.safetensors or sharded files with model.safetensors.index.json.
        dtype: "float32", "bfloat16" or "float16": params and activations.
        attention_backend: pallas_kernels backend of the paged forward.
        mesh: a 1-D tensor-parallel mesh (paged_jax.worker.sharding.make_mesh): every
            param is placed split by the family's partition rules straight from the
            host copy (never whole on one device), KV heads repeated when fewer than
            devices (see paged_jax.models.partitioning).
        quantization: None, "int8" or "fp8": attention and MLP linear layers quantized
            while read, one scale per output channel, stored 8-bit on the device. A
            block-wise fp8 checkpoint (quantization_config quant_method "fp8") is kept
            8-bit with its block scales whatever this says (models/fp8_checkpoint.py).
        quantize_embeddings: also the token embedding (one scale per row; a tied head
            shares it) and an untied LM head (one scale per vocab column), by the same
            rule; needs `quantization`.

    Returns:
        The model; `model(input_ids)` is the dense forward, `model.config` its ModelConfig.
        A checkpoint's fp8 k_scale/v_scale tensors become `model.kv_cache_scales`.

    Raises:
        FileNotFoundError: no config.json or no safetensors files.
        ValueError: unsupported architecture or dtype; checkpoint keys or shapes that
            do not match (all problems in one message).
    """
    path = pathlib.Path(path)
    dtype = canonical_dtype(dtype)
    cls, config = family_config(path, dtype)
    checkpoint = SafetensorsCheckpoint(path)
    names = _checked_names(checkpoint, cls, config, path)
    names, rules, partition_rules, quant = _weight_table(
        path, cls, config, names, quantization, quantize_embeddings
    )
    check_checkpoint(
        rules, {name: checkpoint.shapes[key] for name, key in names.items()}, str(path)
    )
    place = None
    if mesh is not None:
        if partition_rules is None:
            raise ValueError(f"{cls.__name__} declares no partition_rules: no tensor parallelism")
        if quant is not None and quant.prequantized:
            check_block_sharding(rules, partition_rules, quant.block_size, mesh.size)
            if kv_head_replication(config, mesh.size) > 1:
                raise ValueError(
                    f"tensor_parallel_size={mesh.size} exceeds num_key_value_heads="
                    f"{config.num_key_value_heads}: a block-wise fp8 checkpoint's KV heads "
                    "cannot be repeated across devices (their scales cover whole blocks)"
                )
        rules = tensor_parallel_weight_rules(rules, partition_rules, config, mesh.size)
        config = tensor_parallel_config(config, mesh.size)
    kv_scales = read_kv_scales(checkpoint.shapes, checkpoint.read, config.num_hidden_layers)
    graphdef, state = abstract_model(cls, config, attention_backend, quant)
    if mesh is not None:
        shardings, _ = param_shardings(partition_rules, state, mesh)
        dtypes = {tuple(p): var.get_value().dtype for p, var in nnx.to_flat_state(state)}

        def place(param_path: Any, value: np.ndarray) -> Any:
            param_path = tuple(param_path)
            return jax.device_put(value.astype(dtypes[param_path]), shardings[param_path])

    target = np.dtype(jnp.dtype(dtype))
    casts: list[tuple[str, str, str]] = []

    def read(name: str) -> np.ndarray:
        array = checkpoint.read(names[name])
        stored_quantized = quant is not None and quant.is_stored_quantized(names[name], array)
        if array.dtype != target and not stored_quantized:
            casts.append((names[name], str(checkpoint.file_of(names[name])), array.dtype.name))
        return array

    try:
        model = fill_params(graphdef, state, rules, read, dtype, place)
    except ValueError as err:
        if "weights file" in str(err):
            raise
        key = re.search(r"tensor '([^']+)'", str(err))
        file = checkpoint.file_of(names[key.group(1)]) if key and key.group(1) in names else path
        raise ValueError(f"{err} (weights file {file})") from err
    warn_casts(casts, dtype)
    if mesh is not None:
        set_expert_mesh(model, mesh)
    if kv_scales is not None:  # used when the engine's kv_cache_dtype is fp8
        model.kv_cache_scales = as_scale_pairs(kv_scales)
    return model
