"""config.json is read strictly: every unusable value is a ValueError naming the file and field.

These tests need no weights: load_config reads config.json (+ generation_config.json) only.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading

import pytest

from paged_jax.models import ModelConfig, RopeConfig, load_config
from paged_jax.models.config import MAX_NUM_LAYERS, ConfigFileError

LLAMA = dict(
    model_type="llama",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    eos_token_id=2,
)
GPT2 = dict(model_type="gpt2", vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64)
OPT = dict(
    model_type="opt",
    vocab_size=128,
    hidden_size=64,
    ffn_dim=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
)
GEMMA2 = dict(LLAMA, model_type="gemma2", head_dim=16, query_pre_attn_scalar=24)


def write_config(path, config, generation=None):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


def expect_config_error(path, match, file="config.json"):
    with pytest.raises(ValueError, match=match) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path / file}: "), message
    assert "\n" not in message
    return message


def test_valid_configs_still_load(tmp_path):
    config = load_config(write_config(tmp_path / "llama", LLAMA))
    assert config.tie_word_embeddings is False and config.eos_token_ids == (2,)
    assert load_config(write_config(tmp_path / "gpt2", GPT2)).tie_word_embeddings is True
    assert load_config(write_config(tmp_path / "opt", OPT)).pre_norm is True
    gemma = load_config(write_config(tmp_path / "gemma2", dict(GEMMA2, sliding_window=None)))
    assert gemma.sliding_window is None and gemma.attn_logit_softcapping == 50.0
    mistral = load_config(write_config(tmp_path / "mistral", dict(LLAMA, model_type="mistral")))
    assert mistral.sliding_window == 4096  # absent: transformers' default
    no_window = dict(LLAMA, model_type="mistral", sliding_window=None)
    assert load_config(write_config(tmp_path / "mistral0", no_window)).sliding_window is None


@pytest.mark.parametrize(
    ("base", "changes", "match"),
    [
        # Booleans are JSON booleans: the string "false" was read as True (lm_head dropped).
        (LLAMA, {"tie_word_embeddings": "false"}, r"tie_word_embeddings='false' must be true or"),
        (LLAMA, {"attention_bias": "no"}, r"attention_bias='no' must be true or false"),
        (GPT2, {"tie_word_embeddings": "false"}, r"tie_word_embeddings='false' must be true"),
        (GPT2, {"scale_attn_weights": "false"}, r"scale_attn_weights='false' must be true"),
        (OPT, {"do_layer_norm_before": "false"}, r"do_layer_norm_before='false' must be true"),
        (OPT, {"enable_bias": 1}, r"enable_bias=1 must be true or false"),
        (GEMMA2, {"attention_bias": "false"}, r"attention_bias='false' must be true"),
        (dict(LLAMA, model_type="qwen2"), {"use_sliding_window": "true"}, r"use_sliding_window="),
        # Ints are ints: 0 heads divided by zero, "16" reached a comparison with an int.
        (LLAMA, {"num_attention_heads": 0}, r"num_attention_heads=0 must be an int >= 1"),
        (LLAMA, {"hidden_size": "64"}, r"hidden_size='64' must be an int >= 1"),
        (LLAMA, {"vocab_size": 128.0}, r"vocab_size=128.0 must be an int >= 1"),
        (LLAMA, {"num_hidden_layers": True}, r"num_hidden_layers=True must be an int in"),
        (LLAMA, {"num_hidden_layers": 10**12}, r"num_hidden_layers=1000000000000 must be an int"),
        (GPT2, {"n_head": 0}, r"n_head=0 must be an int >= 1"),
        (GPT2, {"n_head": 5}, r"n_embd=64 must be a multiple of n_head=5"),
        (OPT, {"num_attention_heads": 0}, r"num_attention_heads=0 must be an int >= 1"),
        (dict(LLAMA, model_type="mistral"), {"sliding_window": "16"}, r"sliding_window='16' must"),
        (GEMMA2, {"sliding_window": "16"}, r"sliding_window='16' must be an int >= 1 or null"),
        (dict(LLAMA, model_type="qwen2"), {"layer_types": "full"}, r"layer_types='full' must be"),
        (LLAMA, {"num_key_value_heads": 3}, r"num_attention_heads=4 must be a multiple of"),
        # Token ids: "x" named neither the field nor the file.
        (LLAMA, {"eos_token_id": "x"}, r"eos_token_id='x' must be a token id"),
        (LLAMA, {"eos_token_id": [2, "x"]}, r"eos_token_id=\[2, 'x'\] must be a token id"),
        (LLAMA, {"bos_token_id": 1.5}, r"bos_token_id=1.5 must be a token id"),
        # Out-of-domain numbers that gave NaN logits at every step.
        (LLAMA, {"rms_norm_eps": -1}, r"rms_norm_eps=-1 must be a finite number > 0"),
        (LLAMA, {"rms_norm_eps": 0}, r"rms_norm_eps=0 must be a finite number > 0"),
        (LLAMA, {"rms_norm_eps": float("nan")}, r"rms_norm_eps=nan must be a finite number > 0"),
        (GPT2, {"layer_norm_epsilon": 0.0}, r"layer_norm_epsilon=0.0 must be a finite number"),
        (LLAMA, {"rope_theta": 0}, r"rope_theta=0 must be a finite number > 0"),
        (LLAMA, {"rope_theta": -5.0}, r"rope_theta=-5.0 must be a finite number > 0"),
        (LLAMA, {"rope_theta": float("inf")}, r"rope_theta=inf must be a finite number > 0"),
        (
            LLAMA,
            {"rope_scaling": {"rope_type": "linear", "factor": 0}},
            r"rope_scaling.factor=0 must be a finite number > 0",
        ),
        (
            LLAMA,
            {"rope_parameters": {"rope_type": "linear", "factor": -2.0}},
            r"rope_parameters.factor=-2.0 must be a finite number > 0",
        ),
        (
            LLAMA,
            {"rope_parameters": {"rope_theta": "1e4"}},
            r"rope_parameters.rope_theta='1e4' must be a finite number > 0",
        ),
        (LLAMA, {"rope_scaling": "abc"}, r"rope_scaling='abc' must be a JSON object"),
        (
            GEMMA2,
            {"final_logit_softcapping": 0},
            r"final_logit_softcapping=0 must be a finite number > 0 or null",
        ),
        (GEMMA2, {"query_pre_attn_scalar": -1}, r"query_pre_attn_scalar=-1 must be a finite"),
        (
            dict(GEMMA2, model_type="gemma3_text"),
            {"rope_local_base_freq": 0},
            r"rope_local_base_freq=0 must be a finite number > 0",
        ),
        (LLAMA, {"hidden_act": 5}, r"hidden_act=5 must be one of \('silu'"),
        (LLAMA, {"hidden_act": "tanhh"}, r"hidden_act='tanhh' must be one of"),
    ],
)
def test_bad_field_names_the_file_and_the_field(tmp_path, base, changes, match):
    expect_config_error(write_config(tmp_path, {**base, **changes}), match)


def test_generation_config_fields_name_generation_config_json(tmp_path):
    path = write_config(tmp_path, LLAMA, generation={"eos_token_id": "x"})
    expect_config_error(path, r"eos_token_id='x' must be a token id", "generation_config.json")
    path = write_config(tmp_path, LLAMA, generation={"pad_token_id": "0"})
    expect_config_error(path, r"pad_token_id='0' must be a token id", "generation_config.json")


def test_llama3_rope_needs_a_band(tmp_path):
    rope = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}
    ok = load_config(write_config(tmp_path, {**LLAMA, "rope_scaling": rope})).rope
    assert (ok.rope_type, ok.low_freq_factor, ok.high_freq_factor) == ("llama3", 1.0, 4.0)
    flat = {**rope, "low_freq_factor": 4.0, "high_freq_factor": 4.0}
    expect_config_error(
        write_config(tmp_path, {**LLAMA, "rope_scaling": flat}),
        r"RopeConfig.high_freq_factor=4.0 must be > low_freq_factor=4.0",
    )


def test_deeply_nested_config_json_is_one_error_naming_the_file(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ValueError, match=r"config.json is not a config file: its JSON is nested"):
        load_config(tmp_path)


def test_a_huge_layer_count_is_refused_before_anything_per_layer_is_built(tmp_path):
    """A layer count past MAX_NUM_LAYERS was a tuple of that many layer types (minutes, GBs)."""
    errors: list[BaseException] = []

    def load():
        try:
            load_config(write_config(tmp_path, {**LLAMA, "num_hidden_layers": 10**9}))
        except BaseException as err:  # noqa: BLE001 (reported below)
            errors.append(err)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(timeout=30)  # a hang guard: a correct refusal takes milliseconds
    assert not thread.is_alive(), "load_config did not return within 30 s"
    assert isinstance(errors[0], ConfigFileError)
    assert f"num_hidden_layers=1000000000 must be an int in [1, {MAX_NUM_LAYERS}]" in str(errors[0])


def base_config(**changes) -> ModelConfig:
    fields = dict(
        model_type="llama",
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    return ModelConfig(**{**fields, **changes})


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"norm_eps": -1.0}, r"ModelConfig.norm_eps=-1.0 must be a finite number > 0"),
        ({"norm_eps": math.nan}, r"ModelConfig.norm_eps=nan must be a finite number > 0"),
        ({"final_logit_softcapping": 0.0}, r"final_logit_softcapping=0.0 must be a finite"),
        ({"tie_word_embeddings": "false"}, r"ModelConfig.tie_word_embeddings='false' must be"),
        ({"sliding_window": "16"}, r"sliding_window='16' must be positive or None"),
        ({"vocab_size": True}, r"vocab_size=True must be a positive int"),
        ({"eos_token_ids": ("x",)}, r"ModelConfig.eos_token_ids=\('x',\) must be a tuple"),
    ],
)
def test_model_config_rejects_out_of_domain_values(changes, match):
    with pytest.raises(ValueError, match=match):
        base_config(**changes)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"theta": 0.0}, r"RopeConfig.theta=0.0 must be a finite number > 0"),
        ({"theta": -1.0}, r"RopeConfig.theta=-1.0 must be"),
        ({"theta": math.nan}, r"RopeConfig.theta=nan must be"),
        ({"rope_type": "linear", "factor": 0.0}, r"RopeConfig.factor=0.0 must be"),
        ({"original_max_position_embeddings": 0}, r"original_max_position_embeddings=0 must"),
    ],
)
def test_rope_config_rejects_out_of_domain_values(changes, match):
    with pytest.raises(ValueError, match=match):
        RopeConfig(**changes)


def test_replace_keeps_validating():
    with pytest.raises(ValueError, match=r"norm_eps=0.0"):
        dataclasses.replace(base_config(), norm_eps=0.0)
