"""Partition rules of every family, head checks and KV-head replication (one device, no mesh).

The multi-device runs are in tests/worker/test_tensor_parallel.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from paged_jax.models import ModelConfig, load_config, load_model, model_class_for
from paged_jax.models.loader import abstract_model, fill_params, read_hf_config
from paged_jax.models.partitioning import (
    check_tensor_parallel,
    logical_axes,
    partition_spec,
    repeat_kv_heads,
    tensor_parallel_config,
    tensor_parallel_weight_rules,
)
from paged_jax.models.safetensors_io import SafetensorsCheckpoint

# Every family declares partition rules.
TP_FAMILIES = ("llama", "qwen2", "mistral", "gpt2", "opt", "qwen3", "gemma2", "gemma3_text")

# Megatron layout, stated independently of the rules: (param path suffix, logical axes).
MEGATRON = {
    "attn/q_proj/kernel": (None, "heads"),
    "attn/k_proj/kernel": (None, "kv_heads"),
    "attn/v_proj/kernel": (None, "kv_heads"),
    "attn/o_proj/kernel": ("heads", None),
    "attn_norm/scale": (None,),
    "mlp_norm/scale": (None,),
    "post_attn_norm/scale": (None,),  # Gemma's sandwich norms
    "attn/q_norm/scale": (None,),  # Qwen3 / Gemma 3 per-head q/k norms
    "final_norm/scale": (None,),
    "embed_tokens/embedding": ("vocab", None),
}
GATED = {
    "mlp/gate_proj/kernel": (None, "mlp"),
    "mlp/up_proj/kernel": (None, "mlp"),
    "mlp/down_proj/kernel": ("mlp", None),
}
PLAIN = {"mlp/fc_in/kernel": (None, "mlp"), "mlp/fc_out/kernel": ("mlp", None)}
BIASES = {
    "attn/q_proj/bias": ("heads",),  # column-parallel: split with the matrix
    "attn/k_proj/bias": ("kv_heads",),
    "attn/o_proj/bias": (None,),  # row-parallel: added once after the all-reduce
    "mlp/fc_in/bias": ("mlp",),
    "mlp/fc_out/bias": (None,),
}


@pytest.mark.parametrize("family", TP_FAMILIES)
def test_every_param_has_a_rule_of_the_megatron_layout(family, tiny_hf_checkpoint):
    path = tiny_hf_checkpoint(family)
    cls = model_class_for(read_hf_config(path)[0])
    _, state = abstract_model(cls, load_config(path), "reference")
    expected = {**MEGATRON, **(PLAIN if family in ("gpt2", "opt") else GATED), **BIASES}
    seen = set()
    for param_path, var in nnx.to_flat_state(state):
        axes = logical_axes(cls.partition_rules, param_path)
        assert len(axes) == var.get_value().ndim, param_path
        name = "/".join(map(str, param_path))
        for suffix, want in expected.items():
            if name.endswith(suffix):
                assert axes == want, f"{family} {name}: {axes} != {want}"
                seen.add(suffix)
    assert {"attn/q_proj/kernel", "attn/o_proj/kernel", "embed_tokens/embedding"} <= seen


def test_families_without_rules_refuse_a_mesh(tiny_hf_checkpoint, monkeypatch):
    from paged_jax.worker.sharding import shard_model

    model = load_model(tiny_hf_checkpoint("qwen3"))
    monkeypatch.setattr(type(model), "partition_rules", None)  # a family that declares none
    with pytest.raises(ValueError, match=r"declares no partition_rules"):
        shard_model(model, mesh=None)


def test_unmatched_param_names_the_param():
    with pytest.raises(ValueError, match=r"param 'layers/0/odd/kernel' matches no partition rule"):
        logical_axes((("q_proj", (None,)),), ("layers", 0, "odd", "kernel"))


def _config(heads: int, kv: int) -> ModelConfig:
    return ModelConfig(
        model_type="llama",
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=64 // heads,
        intermediate_size=128,
        max_position_embeddings=64,
    )


@pytest.mark.parametrize(
    ("heads", "kv", "tp", "match"),
    [
        (4, 2, 3, r"tensor_parallel_size=3 must divide num_attention_heads=4"),
        (12, 3, 4, r"tensor_parallel_size=4 must divide num_key_value_heads=3 or be a multiple"),
        (4, 4, 0, r"tensor_parallel_size=0 must be an int >= 1"),
    ],
)
def test_heads_that_cannot_split_whole_are_refused(heads, kv, tp, match):
    with pytest.raises(ValueError, match=match):
        check_tensor_parallel(_config(heads, kv), tp)


def test_kv_heads_repeat_only_when_fewer_than_devices():
    assert tensor_parallel_config(_config(8, 4), 2).num_key_value_heads == 4
    assert tensor_parallel_config(_config(8, 2), 8).num_key_value_heads == 8
    assert tensor_parallel_config(_config(8, 1), 4).num_key_value_heads == 4


def test_repeat_kv_heads_keeps_each_head_whole_and_in_order():
    a, b = [1.0, 2.0], [3.0, 4.0]  # two heads of head_dim 2
    kernel = np.array([a + b, [x * 10 for x in a + b]])  # f[2, 4]
    out = repeat_kv_heads(kernel, axis=1, head_dim=2, repeats=2)
    np.testing.assert_array_equal(out[0], a + a + b + b)
    np.testing.assert_array_equal(out[1], [10, 20, 10, 20, 30, 40, 30, 40])
    bias = jnp.asarray(a + b)
    np.testing.assert_array_equal(repeat_kv_heads(bias, 0, 2, 3), a * 3 + b * 3)


def test_vocab_tp_does_not_divide_falls_back_to_replicated():
    assert partition_spec(("vocab", None), (128, 64), 2) == (("tp", None), False)
    assert partition_spec(("vocab", None), (50257, 768), 2) == ((None, None), True)
    assert partition_spec((None, "mlp"), (64, 128), 1) == ((None, None), False)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_model_with_kv_heads_repeated_at_load_gives_the_same_logits(family, tiny_hf_checkpoint):
    """2 KV heads loaded as 4 (what N=4 does): the dense forward is unchanged."""
    path = tiny_hf_checkpoint(family)  # 4 query heads, 2 KV heads
    original = load_model(path)
    cls, config = type(original), original.config
    rules = tensor_parallel_weight_rules(cls.weight_rules(config), cls.partition_rules, config, 4)
    wide = tensor_parallel_config(config, 4)
    graphdef, state = abstract_model(cls, wide, "reference")
    ckpt = SafetensorsCheckpoint(path)
    # The checkpoint's keys carry the full "model." prefix, as the table does.
    repeated = fill_params(graphdef, state, rules, ckpt.read, "float32")
    assert repeated.config.num_key_value_heads == 4
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 11)))
    np.testing.assert_allclose(repeated(ids), original(ids), rtol=1e-5, atol=1e-5)
