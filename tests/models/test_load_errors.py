"""Every checkpoint load error names the weights file (and the tensor where there is one)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from paged_jax.models import load_model
from paged_jax.models.loader import check_model_dir


@pytest.fixture
def ckpt(tiny_hf_checkpoint, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_hf_checkpoint("llama"), dst)
    return dst


def test_corrupted_header_names_the_file(ckpt):
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:20] = b"not json at!"  # the JSON header starts after its u64 length
    weights.write_bytes(bytes(data))
    for check in (check_model_dir, load_model):
        with pytest.raises(ValueError, match=f"weights file {weights} is corrupted"):
            check(ckpt)


def test_truncated_file_is_caught_by_the_cheap_check(ckpt):
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    with pytest.raises(ValueError, match=f"weights file {weights} is corrupted"):
        check_model_dir(ckpt)


def test_shard_index_naming_a_missing_file(ckpt):
    index = {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="names missing weights files: .*00002"):
        check_model_dir(ckpt)
    (ckpt / "model.safetensors.index.json").write_text("{")
    with pytest.raises(ValueError, match="model.safetensors.index.json is not a valid"):
        check_model_dir(ckpt)


def test_unconvertible_tensor_names_tensor_and_file(ckpt, monkeypatch):
    from paged_jax.models.safetensors_io import SafetensorsCheckpoint

    real_read = SafetensorsCheckpoint.read
    name = "model.norm.weight"

    def read(self, key):
        array = real_read(self, key)
        return np.full(array.shape, "x") if key == name else array  # strings: no float cast

    monkeypatch.setattr(SafetensorsCheckpoint, "read", read)
    with pytest.raises(
        ValueError, match=f"tensor '{name}' .*weights file {ckpt}/model.safetensors"
    ):
        load_model(ckpt)


def test_a_file_changed_after_its_header_was_read_names_tensor_and_file(ckpt):
    from paged_jax.models.safetensors_io import SafetensorsCheckpoint

    checkpoint = SafetensorsCheckpoint(ckpt)
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    with pytest.raises(ValueError, match=f"tensor 'lm_head.weight' in weights file {weights}"):
        checkpoint.read("lm_head.weight")


def test_bad_config_json_names_the_file(ckpt):
    (ckpt / "config.json").write_text("{ nope")
    with pytest.raises(ValueError, match=f"{ckpt / 'config.json'} is not valid JSON"):
        check_model_dir(ckpt)
