"""Loading never accepts silently: dtype casts warn, duplicate tensors, shard paths outside
the model directory and non-regular weights files are refused with the file named."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from paged_jax.models import load_model
from paged_jax.models.loader import WeightCastWarning, check_model_dir


@pytest.fixture
def ckpt(tiny_hf_checkpoint, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_hf_checkpoint("llama"), dst)
    return dst


def rewrite(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_f32_checkpoint_loaded_as_f32_casts_nothing_and_warns_nothing(ckpt):
    with warnings.catch_warnings():
        warnings.simplefilter("error", WeightCastWarning)
        load_model(ckpt)


def test_int_bool_and_f64_weights_warn_naming_tensor_file_and_dtypes(ckpt):
    def edit(t):
        t["model.norm.weight"] = np.ones_like(t["model.norm.weight"], dtype=np.int32)
        t["model.layers.0.input_layernorm.weight"] = np.ones(64, dtype=bool)
        t["model.layers.1.input_layernorm.weight"] = t[
            "model.layers.1.input_layernorm.weight"
        ].astype(np.float64)

    rewrite(ckpt, edit)
    file = ckpt / "model.safetensors"
    with pytest.warns(WeightCastWarning) as record:
        load_model(ckpt)
    messages = sorted(str(w.message) for w in record)
    assert len(messages) == 3, messages
    assert messages[0].startswith("1 weight tensor(s) stored as bool cast to float32")
    assert messages[0].endswith(f"'model.layers.0.input_layernorm.weight' in {file}")
    assert messages[1].startswith("1 weight tensor(s) stored as float64 cast to float32")
    assert "values may change" in messages[1]
    assert "'model.norm.weight'" in messages[2] and "int32 cast to float32" in messages[2]


def test_bf16_weights_loaded_as_f32_warn_once_as_exact(ckpt):
    import ml_dtypes

    rewrite(ckpt, lambda t: t.update({k: v.astype(ml_dtypes.bfloat16) for k, v in t.items()}))
    with pytest.warns(WeightCastWarning) as record:
        load_model(ckpt)
    [warning] = record
    assert "stored as bfloat16 cast to float32 (exact)" in str(warning.message)
    assert " more" in str(warning.message)  # 21 tensors: three named, the rest counted


def test_duplicate_tensor_across_unindexed_shards_names_both_files(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    names = sorted(tensors)
    first = {k: tensors[k] for k in names[: len(names) // 2]}
    second = {k: tensors[k] for k in names[len(names) // 2 :]}
    second["model.norm.weight"] = tensors["model.norm.weight"] * 2  # which one would win?
    first["model.norm.weight"] = tensors["model.norm.weight"]
    save_file(first, ckpt / "a.safetensors")
    save_file(second, ckpt / "b.safetensors")
    for check in (check_model_dir, load_model):
        with pytest.raises(ValueError, match="in more than one weights file") as info:
            check(ckpt)
        message = str(info.value)
        assert f"'model.norm.weight' in {ckpt / 'a.safetensors'} and {ckpt / 'b.safetensors'}" in (
            message
        )


def test_tie_word_embeddings_false_as_a_string_is_refused_not_read_as_true(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    config["tie_word_embeddings"] = "false"
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json: tie_word_embeddings='false' must be true"):
        load_model(ckpt)


@pytest.mark.parametrize("kind", ["absolute", "parent", "nested_parent", "not_a_string"])
def test_shard_index_cannot_name_files_outside_the_model_directory(ckpt, tmp_path, kind):
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(ckpt / "model.safetensors", outside / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    entry = {
        "absolute": str(outside / "model.safetensors"),
        "parent": "../outside/model.safetensors",
        "nested_parent": "sub/../../outside/model.safetensors",
        "not_a_string": 7,
    }[kind]
    weight_map = {k: entry for k in load_file(outside / "model.safetensors")}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for check in (check_model_dir, load_model):
        with pytest.raises(ValueError, match=r"entry '.*': .* must be a file name inside the"):
            check(ckpt)


def test_shard_index_subfolders_inside_the_directory_still_load(ckpt):
    (ckpt / "shards").mkdir()
    (ckpt / "model.safetensors").rename(ckpt / "shards" / "model.safetensors")
    weight_map = {
        k: "shards/model.safetensors" for k in load_file(ckpt / "shards/model.safetensors")
    }
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    check_model_dir(ckpt)


def run_in_subprocess(code: str, *args: str, timeout: float = 300.0) -> str:
    """Runs `code` in a fresh interpreter; a hang (a blocked open of a FIFO may hold the
    GIL, so a thread cannot time it out) fails the test instead of blocking the run.
    `timeout` is that hang guard, not a speed limit: far above a checkpoint check."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"did not return within {timeout} s")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


# Every FIFO case runs in ONE fresh interpreter (each start imports jax: about 2 CPU s), one
# case after another; each prints the error it got. A case that blocks hangs them all and
# fails every FIFO test at the guard, which names no case: run the script by hand then.
FIFO_CASES = """
    import json, os, pathlib, sys
    from paged_jax.models.loader import check_model_dir
    from paged_jax.models.safetensors_io import SafetensorsCheckpoint
    out = {}
    for case in json.loads(sys.argv[1]):
        path = pathlib.Path(case["dir"])
        try:
            if case["kind"] == "check_dir":
                check_model_dir(path)
            else:  # the weights file becomes a FIFO after its header was read
                checkpoint = SafetensorsCheckpoint(path)
                weights = path / "model.safetensors"
                weights.unlink()
                os.mkfifo(weights)
                checkpoint.read("model.norm.weight")
            out[case["name"]] = "no error"
        except ValueError as err:
            out[case["name"]] = str(err)
    print(json.dumps(out))
"""
FIFO_NAMES = ["model.safetensors", "model-00001-of-00001.safetensors"]


@pytest.fixture(scope="module")
def fifo_errors(tiny_hf_checkpoint, tmp_path_factory):
    """{case name: the ValueError's text} for every FIFO case, and each case's directory."""
    root = tmp_path_factory.mktemp("fifo")
    cases, dirs = [], {}

    def case(name, kind):
        dirs[name] = root / name
        shutil.copytree(tiny_hf_checkpoint("llama"), dirs[name])
        cases.append(dict(name=name, kind=kind, dir=str(dirs[name])))
        return dirs[name]

    for name in FIFO_NAMES:  # a FIFO named as the weights file
        ckpt = case(f"named-{name}", "check_dir")
        (ckpt / "model.safetensors").unlink()
        os.mkfifo(ckpt / name)
    ckpt = case("in-index", "check_dir")  # a FIFO the shard index names
    weight_map = {k: "shard.safetensors" for k in load_file(ckpt / "model.safetensors")}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    os.mkfifo(ckpt / "shard.safetensors")
    for bf16 in (False, True):
        ckpt = case(f"replaced-bf16={bf16}", "replaced_after_header")
        if bf16:
            import ml_dtypes

            rewrite(
                ckpt, lambda t: t.update({k: v.astype(ml_dtypes.bfloat16) for k, v in t.items()})
            )
    out = run_in_subprocess(FIFO_CASES, json.dumps(cases))
    return json.loads(out.strip().splitlines()[-1]), dirs


@pytest.mark.parametrize("name", FIFO_NAMES)
def test_a_fifo_named_safetensors_is_refused_without_blocking(fifo_errors, name):
    errors, dirs = fifo_errors
    fifo = dirs[f"named-{name}"] / name
    assert fifo.is_fifo()
    want = f"weights file {fifo} is a FIFO: only regular files are read as weights"
    assert want in errors[f"named-{name}"]


def test_a_fifo_named_in_the_shard_index_is_refused_without_blocking(fifo_errors):
    errors, _ = fifo_errors
    assert "shard.safetensors is a FIFO" in errors["in-index"]


@pytest.mark.parametrize("bf16", [False, True])
def test_a_weights_file_replaced_by_a_fifo_after_its_header_was_read(fifo_errors, bf16):
    errors, _ = fifo_errors
    assert "is a FIFO" in errors[f"replaced-bf16={bf16}"]


def test_more_layers_than_tensors_is_one_short_error(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    config["num_hidden_layers"] = 5000
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"num_hidden_layers=5000 cannot match a checkpoint of 21 tensors"
    ):
        check_model_dir(ckpt)
