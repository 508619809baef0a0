"""Dense-forward logit parity with transformers on tiny seeded random-weight checkpoints."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from paged_jax.models import load_model

FAMILIES = ("llama", "qwen2", "mistral", "gpt2", "opt", "qwen3", "gemma2", "gemma3_text")
F32_ATOL = 1e-4
# bf16 params and activations against transformers in bf16, logits of magnitude ~3:
# measured 0.027-0.039 over the five families, the same size as transformers' own
# bf16-vs-f32 gap (0.031-0.042); the bound leaves 2x headroom.
BF16_ATOL = 0.08
PROMPT_LENGTHS = (3, 9, 17)


def max_diff_vs_hf(model, path, hf_logits, *, batch: int = 2, seed: int = 0) -> float:
    """Worst |logit diff| over equal-length batches of each prompt length."""
    rng = np.random.default_rng(seed)
    worst = 0.0
    for length in PROMPT_LENGTHS:
        ids = rng.integers(0, model.config.vocab_size, size=(batch, length), dtype=np.int32)
        ours = np.asarray(model(ids))
        ref = hf_logits(path, ids)
        assert ours.shape == ref.shape == (batch, length, model.config.vocab_size)
        worst = max(worst, float(np.abs(ours - ref).max()))
    return worst


@pytest.mark.parametrize("family", FAMILIES)
def test_dense_logits_match_transformers(family, tiny_hf_checkpoint, hf_logits):
    path = tiny_hf_checkpoint(family)
    model = load_model(path)
    assert model.config.model_type == family
    assert max_diff_vs_hf(model, path, hf_logits) <= F32_ATOL


LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(dict(rope_scaling=LLAMA3_ROPE, rope_theta=500000.0), id="llama3-rope"),
        pytest.param(dict(rope_scaling=dict(rope_type="linear", factor=2.0)), id="linear-rope"),
        pytest.param(dict(tie_word_embeddings=True), id="tied"),
        pytest.param(dict(num_key_value_heads=1), id="mqa"),
        pytest.param(
            dict(num_key_value_heads=4, attention_bias=True, mlp_bias=True), id="mha-bias"
        ),
    ],
)
def test_llama_variants_match_transformers(overrides, tiny_hf_checkpoint, hf_logits):
    path = tiny_hf_checkpoint("llama", **overrides)
    model = load_model(path)
    assert model.config.tie_word_embeddings == overrides.get("tie_word_embeddings", False)
    assert max_diff_vs_hf(model, path, hf_logits) <= F32_ATOL


def test_llama3_rope_from_older_config_form(tiny_hf_checkpoint, hf_logits, tmp_path):
    """Published checkpoints carry rope_theta + rope_scaling, not transformers-5 rope_parameters."""
    src = tiny_hf_checkpoint("llama", rope_scaling=LLAMA3_ROPE, rope_theta=500000.0)
    path = tmp_path / "old_form"
    shutil.copytree(src, path)
    config = json.loads((path / "config.json").read_text())
    params = config.pop("rope_parameters")
    assert params["rope_type"] == "llama3"
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = params
    (path / "config.json").write_text(json.dumps(config))
    model = load_model(path)
    assert model.config.rope.rope_type == "llama3" and model.config.rope.theta == 500000.0
    assert max_diff_vs_hf(model, src, hf_logits) <= F32_ATOL


def test_mistral_sliding_window_shorter_than_prompt(tiny_hf_checkpoint, hf_logits, tmp_path):
    path = tiny_hf_checkpoint("mistral", sliding_window=4)
    model = load_model(path)
    assert model.config.sliding_window == 4
    assert max_diff_vs_hf(model, path, hf_logits) <= F32_ATOL
    # The window really changes transformers' logits (so the parity above is not vacuous).
    full = tmp_path / "no_window"
    shutil.copytree(path, full)
    config = json.loads((full / "config.json").read_text())
    config["sliding_window"] = None
    (full / "config.json").write_text(json.dumps(config))
    ids = np.arange(17, dtype=np.int32)[None] % 128
    assert np.abs(np.asarray(load_model(full)(ids)) - hf_logits(path, ids)).max() > 1e-2


def test_qwen2_per_layer_sliding_window(tiny_hf_checkpoint, hf_logits):
    path = tiny_hf_checkpoint(
        "qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1
    )
    model = load_model(path)
    assert model.config.layer_types == ("full_attention", "sliding_attention")
    assert max_diff_vs_hf(model, path, hf_logits) <= F32_ATOL


def test_opt_post_norm_and_projected_embeddings(tiny_hf_checkpoint, hf_logits):
    path = tiny_hf_checkpoint("opt", do_layer_norm_before=False, word_embed_proj_dim=32)
    model = load_model(path)
    assert not model.config.pre_norm and model.config.word_embed_proj_dim == 32
    assert max_diff_vs_hf(model, path, hf_logits) <= F32_ATOL


def test_bf16_logits_match_transformers_bf16(tiny_hf_checkpoint, hf_logits):
    path = tiny_hf_checkpoint("llama")
    model = load_model(path, dtype="bfloat16")
    assert model.embed_tokens.embedding[...].dtype == np.dtype("bfloat16")
    ids = np.random.default_rng(1).integers(0, 128, size=(2, 17), dtype=np.int32)
    ours = np.asarray(model(ids))
    assert ours.dtype == np.float32
    assert np.abs(ours - hf_logits(path, ids, dtype="bfloat16")).max() <= BF16_ATOL
