"""Multi-LoRA device pieces: the per-row low-rank product against a per-row loop, and the
executable cache key telling LoRA engines apart (their stacks change the programs)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.config import EngineConfig
from paged_jax.models.lora import lora_delta
from paged_jax.worker.executable_cache import program_context


def test_lora_delta_is_each_rows_own_adapter():
    rng = np.random.default_rng(0)
    n, t, d_in, r, d_out = 3, 7, 5, 4, 6
    x = rng.normal(size=(t, d_in)).astype(np.float32)
    a = rng.normal(size=(n, d_in, r)).astype(np.float32)
    b = rng.normal(size=(n, r, d_out)).astype(np.float32)
    slots = np.array([0, -1, 2, 1, 2, -1, 0], np.int32)
    a_cat = a.transpose(1, 0, 2).reshape(d_in, n * r)  # slot s owns columns [s * r, (s + 1) * r)
    b_cat = b.reshape(n * r, d_out)
    got = lora_delta(jnp.asarray(x), jnp.asarray(slots), a_cat, b_cat, r, jax.lax.Precision.HIGHEST)
    got = np.asarray(got)
    for row, slot in enumerate(slots):
        want = np.zeros(d_out) if slot < 0 else x[row] @ a[slot] @ b[slot]
        np.testing.assert_allclose(got[row], want, rtol=1e-5, atol=1e-5)


def test_lora_fields_key_the_executable_cache():
    config = EngineConfig(max_model_len=64)
    keys = {
        str(program_context({"m": 1}, c, 16)["engine"])
        for c in (
            config,
            dataclasses.replace(config, enable_lora=True),
            dataclasses.replace(config, enable_lora=True, max_loras=2),
            dataclasses.replace(config, enable_lora=True, max_lora_rank=64),
        )
    }
    assert len(keys) == 4


def abstract(family: str):
    from flax import nnx

    from paged_jax.models.random_init import config_from_dict
    from paged_jax.testing.tiny_models import TINY_CONFIGS

    arch = {"llama": "LlamaForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}[family]
    hf = dict(TINY_CONFIGS[family], model_type=family, architectures=[arch])
    cls, config = config_from_dict(hf)
    return nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))


def test_lora_modules_of_dense_and_moe_families():
    from paged_jax.models.lora import lora_module_shapes

    shapes, refused = lora_module_shapes(abstract("llama"))
    assert shapes == {
        "q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
        "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64),
    } and refused == {}  # fmt: skip
    shapes, refused = lora_module_shapes(abstract("qwen2_moe"))
    assert sorted(shapes) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert sorted(refused) == ["down_proj", "gate_proj", "up_proj"]
    assert "LoRA on MoE experts is not served" in refused["gate_proj"]


def test_quantized_bases_are_refused():
    from flax import nnx

    from paged_jax.models.lora import lora_module_shapes

    class Int8Linear(nnx.Module):  # a quantized projection module of its own
        def __init__(self):
            self.kernel = nnx.Param(jnp.zeros((64, 32), jnp.int8))

    model = abstract("llama")
    for layer in model.layers:  # an 8-bit base: integer kernels, or a module of its own
        layer.attn.q_proj.kernel = nnx.Param(jnp.zeros((64, 64), jnp.int8))
        layer.attn.k_proj = Int8Linear()
    shapes, refused = lora_module_shapes(model)
    assert "q_proj" not in shapes and "k_proj" not in shapes and "v_proj" in shapes
    for module in ("q_proj", "k_proj"):
        assert "LoRA on quantized bases is not served" in refused[module]
    assert "Int8Linear" in refused["k_proj"]
