"""Checkpoint loading: key/shape checks, config forms, shards, bf16 files, orbax, no torch."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from paged_jax.models import (
    ModelConfig,
    load_config,
    load_model,
    load_model_from_orbax,
    save_params,
    supported_architectures,
)

F32_ATOL = 1e-4


def copy_checkpoint(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def edit_tensors(path, edit) -> None:
    """Rewrites model.safetensors with `edit(dict of numpy arrays)` applied."""
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def edit_config(path, edit) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture
def llama_copy(tiny_hf_checkpoint, tmp_path):
    return copy_checkpoint(tiny_hf_checkpoint("llama"), tmp_path)


def test_missing_tensor(llama_copy):
    edit_tensors(llama_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        ValueError, match=r"missing keys \(1\): \['model.layers.1.mlp.up_proj.weight'\]"
    ):
        load_model(llama_copy)


def test_unexpected_tensor(llama_copy):
    edit_tensors(
        llama_copy, lambda t: t.update({"model.layers.0.extra.weight": np.ones(3, np.float32)})
    )
    with pytest.raises(
        ValueError, match=r"unexpected keys \(1\): \['model.layers.0.extra.weight'\]"
    ):
        load_model(llama_copy)


def test_wrong_shape(llama_copy):
    edit_tensors(
        llama_copy,
        lambda t: t.update(
            {"model.layers.0.self_attn.k_proj.weight": np.ones((16, 64), np.float32)}
        ),
    )
    with pytest.raises(
        ValueError,
        match=r"model.layers.0.self_attn.k_proj.weight: checkpoint \(16, 64\), expected \(32, 64\)",
    ):
        load_model(llama_copy)


def test_all_problems_reported_in_one_error(llama_copy):
    def edit(t):
        t.pop("model.norm.weight")
        t["stray"] = np.ones(1, np.float32)
        t["model.embed_tokens.weight"] = np.ones((127, 64), np.float32)

    edit_tensors(llama_copy, edit)
    with pytest.raises(ValueError, match="missing keys.*unexpected keys.*shape mismatches") as info:
        load_model(llama_copy)
    assert "model.norm.weight" in str(info.value) and "stray" in str(info.value)


def test_unsupported_architecture(llama_copy):
    edit_config(
        llama_copy,
        lambda c: c.update(model_type="bert", architectures=["BertForMaskedLM"]),
    )
    with pytest.raises(
        ValueError, match="unsupported architecture.*'bert'.*BertForMaskedLM.*llama"
    ):
        load_model(llama_copy)
    assert "LlamaForCausalLM" in supported_architectures()


def test_no_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"no config.json in {tmp_path}"):
        load_model(tmp_path)


def test_no_safetensors(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors weights"):
        load_model(llama_copy)


def test_bad_dtype(tiny_hf_checkpoint):
    with pytest.raises(ValueError, match="dtype='int8' must be one of"):
        load_model(tiny_hf_checkpoint("llama"), dtype="int8")


def test_unsupported_rope_type(llama_copy):
    edit_config(
        llama_copy, lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0})
    )
    with pytest.raises(ValueError, match="rope_type='yarn' is not supported"):
        load_model(llama_copy)


def test_sharded_checkpoint(tiny_hf_checkpoint, hf_logits):
    path = tiny_hf_checkpoint("llama", max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1
    ids = np.arange(12, dtype=np.int32).reshape(2, 6)
    assert np.abs(np.asarray(load_model(path)(ids)) - hf_logits(path, ids)).max() <= F32_ATOL


def test_bf16_checkpoint_files_load_exactly(llama_copy):
    """bf16 tensors (which numpy cannot hold) go through the raw reader, bit-exact."""
    import ml_dtypes

    reference = load_model(llama_copy)
    edit_tensors(
        llama_copy,
        lambda t: t.update({k: v.astype(ml_dtypes.bfloat16) for k, v in t.items()}),
    )
    model = load_model(llama_copy)
    expected = np.asarray(reference.layers[0].attn.q_proj.kernel[...])
    expected = expected.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(model.layers[0].attn.q_proj.kernel[...]), expected)


def test_gpt2_base_model_keys_and_mask_buffers(tiny_hf_checkpoint, tmp_path):
    """Original GPT-2 files: no "transformer." prefix, causal-mask buffers saved as tensors."""
    src = tiny_hf_checkpoint("gpt2")
    path = copy_checkpoint(src, tmp_path)

    def edit(t):
        for key in list(t):
            t[key.removeprefix("transformer.")] = t.pop(key)
        t["h.0.attn.bias"] = np.tril(np.ones((1, 1, 8, 8), np.float32))
        t["h.0.attn.masked_bias"] = np.asarray(-1e4, np.float32)

    edit_tensors(path, edit)
    ids = np.arange(10, dtype=np.int32)[None]
    np.testing.assert_array_equal(
        np.asarray(load_model(path)(ids)), np.asarray(load_model(src)(ids))
    )


def test_tied_checkpoint_with_explicit_lm_head(tiny_hf_checkpoint, tmp_path):
    src = tiny_hf_checkpoint("llama", tie_word_embeddings=True)
    path = copy_checkpoint(src, tmp_path)
    edit_tensors(path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"]}))
    model = load_model(path)
    assert model.lm_head is None and model.config.tie_word_embeddings


def test_config_fields_and_generation_config(llama_copy):
    (llama_copy / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2, 7], "bos_token_id": 1, "temperature": 0.6})
    )
    config = load_config(llama_copy, dtype="bf16")
    assert config.eos_token_ids == (2, 7) and config.bos_token_id == 1
    assert config.pad_token_id is None and config.dtype == "bfloat16"
    assert config.generation_config["temperature"] == 0.6
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert config.sliding_window is None and config.rope.theta == 10000.0
    hash(config)  # static under jit: must be hashable
    assert ModelConfig.from_json_dict(json.loads(json.dumps(config.to_json_dict()))) == config
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        dataclasses.replace(config, num_key_value_heads=3)


def test_orbax_round_trip(tiny_hf_checkpoint, tmp_path):
    model = load_model(tiny_hf_checkpoint("opt"))
    save_params(model, tmp_path / "orbax")
    restored = load_model_from_orbax(tmp_path / "orbax")
    assert restored.config == model.config
    ids = np.arange(14, dtype=np.int32).reshape(2, 7)
    np.testing.assert_array_equal(np.asarray(restored(ids)), np.asarray(model(ids)))
    with pytest.raises(FileNotFoundError, match="paged_jax_config.json"):
        load_model_from_orbax(tmp_path)


def test_loading_and_running_never_imports_torch(tiny_hf_checkpoint):
    path = tiny_hf_checkpoint("gpt2")
    code = textwrap.dedent(
        f"""
        import sys
        import numpy as np
        from paged_jax.models import load_model
        model = load_model({str(path)!r})
        model(np.zeros((1, 4), np.int32))
        leaked = sorted(m for m in ("torch", "transformers") if m in sys.modules)
        assert not leaked, leaked
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
