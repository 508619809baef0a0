"""random_model: weights drawn on the device by one jitted function of a key, no host copy."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from paged_jax.baselines.engine_cell import REHEARSAL_MODEL_CONFIG
from paged_jax.baselines.hf_generate import llama_num_parameters
from paged_jax.models.loader import abstract_model
from paged_jax.models.random_init import (
    LLAMA3_8B_CONFIG,
    config_from_dict,
    init_groups,
    random_init_fn,
    random_model,
)

_ITEMSIZE = {"i1": 1, "i8": 1, "ui8": 1, "i16": 2, "ui16": 2, "bf16": 2, "f16": 2}
_ITEMSIZE |= {"i32": 4, "ui32": 4, "f32": 4, "i64": 8, "ui64": 8, "f64": 8}
_CONSTANT = re.compile(r"stablehlo\.constant\b.*:\s*tensor<([^>]*)>")


def constant_bytes(lowered_text: str) -> list[int]:
    """Bytes of every constant in a StableHLO module (an unknown dtype counts 8 a value)."""
    sizes = []
    for match in _CONSTANT.finditer(lowered_text):
        *dims, dtype = match.group(1).split("x")
        sizes.append(math.prod(int(d) for d in dims) * _ITEMSIZE.get(dtype, 8))
    return sizes


def _groups(hf_config, dtype="bfloat16"):
    cls, config = config_from_dict(hf_config, dtype)
    return init_groups(abstract_model(cls, config, "auto")[1])


def test_the_8b_init_is_a_function_of_a_key_only_with_no_array_constant():
    """Lowered at the full Llama-3-8B shape (lowering allocates nothing): the key is the
    only argument, the outputs are every one of its 8.03B parameters, and no constant
    is bigger than the RNG's own 16-byte ones (one captured weight would be MiBs)."""
    groups = _groups(LLAMA3_8B_CONFIG)
    lowered = random_init_fn(groups).lower(jax.random.key(0))
    args, kwargs = lowered.in_avals
    assert len(args) == 1 and not kwargs
    assert jnp.issubdtype(args[0].dtype, jax.dtypes.prng_key)
    outputs = jax.tree.leaves(lowered.out_info)
    num_params = sum(math.prod(o.shape) for o in outputs)
    assert num_params == llama_num_parameters(LLAMA3_8B_CONFIG) == 8_030_261_248
    assert {o.dtype for o in outputs} == {jnp.dtype(jnp.bfloat16)}
    sizes = constant_bytes(lowered.as_text())
    assert sizes and max(sizes) <= 64 and sum(sizes) < 4096
    # 7 groups: embedding, head, q/o, k/v, gate/up, down, norm scales; layers stacked.
    assert sorted(len(g.paths) for g in groups) == [1, 1, 32, 64, 64, 64, 65]


def test_the_constant_check_sees_a_captured_host_array():
    """The check above fails on a planted capture: one norm-sized host array."""
    host = np.ones((4096,), jnp.bfloat16)

    def captures(key):
        return jax.random.normal(key, (4096,), jnp.bfloat16) + host

    sizes = constant_bytes(jax.jit(captures).lower(jax.random.key(0)).as_text())
    assert max(sizes) == 4096 * 2


def test_init_groups_by_kind_shape_and_dtype():
    """The rehearsal Llama (2 layers, hidden 256, 8 q / 2 kv heads of 32, MLP 896, vocab
    4096) plus q/k/v/o biases: counts worked out by hand."""
    groups = _groups({**REHEARSAL_MODEL_CONFIG, "attention_bias": True})
    got = {(g.kind, g.shape): len(g.paths) for g in groups}
    assert got == {
        ("normal", (4096, 256)): 1,  # embed_tokens
        ("normal", (256, 4096)): 1,  # lm_head
        ("normal", (256, 256)): 4,  # q_proj, o_proj x 2 layers
        ("normal", (256, 64)): 4,  # k_proj, v_proj x 2
        ("normal", (256, 896)): 4,  # gate_proj, up_proj x 2
        ("normal", (896, 256)): 2,  # down_proj x 2
        ("ones", (256,)): 5,  # 2 norms x 2 layers + the final norm
        ("zeros", (256,)): 4,  # q_proj.bias, o_proj.bias x 2
        ("zeros", (64,)): 4,  # k_proj.bias, v_proj.bias x 2
    }


def test_random_model_draws_every_weight_on_the_device():
    """No implicit host-to-device transfer while the model is built (a captured or
    numpy-built weight would be one); every param is there with its shape, matrices are
    N(0, 0.02^2) and differ from each other, norm scales are 1; a seed repeats."""
    key = jax.random.key(7)  # made before the guard: the host sends only this
    with jax.transfer_guard_host_to_device("disallow"):
        model = random_model(REHEARSAL_MODEL_CONFIG, dtype="bfloat16", seed=key)
        flat = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}
    cls, config = config_from_dict(REHEARSAL_MODEL_CONFIG, "bfloat16")
    expected = nnx.to_flat_state(abstract_model(cls, config, "auto")[1])
    assert {p: (v.get_value().shape, v.get_value().dtype) for p, v in expected} == {
        p: (v.shape, v.dtype) for p, v in flat.items()
    }
    assert all(isinstance(v, jax.Array) for v in flat.values())
    q0 = np.asarray(flat["layers", 0, "attn", "q_proj", "kernel"], np.float32)
    q1 = np.asarray(flat["layers", 1, "attn", "q_proj", "kernel"], np.float32)
    o0 = np.asarray(flat["layers", 0, "attn", "o_proj", "kernel"], np.float32)
    # 65,536 draws: the sample std strays ~0.3% from 0.02 and the mean ~8e-5 from 0 (one
    # sigma); the bounds are 5% of the std.
    for w in (q0, q1, o0):
        assert abs(w.std() - 0.02) < 0.001 and abs(w.mean()) < 0.001
    assert not np.array_equal(q0, q1) and not np.array_equal(q0, o0)
    assert np.all(np.asarray(flat["final_norm", "scale"], np.float32) == 1.0)
    again = random_model(REHEARSAL_MODEL_CONFIG, dtype="bfloat16", seed=7)
    other = random_model(REHEARSAL_MODEL_CONFIG, dtype="bfloat16", seed=8)
    q0_again = np.asarray(again.layers[0].attn.q_proj.kernel[...], np.float32)
    q0_other = np.asarray(other.layers[0].attn.q_proj.kernel[...], np.float32)
    assert np.array_equal(q0, q0_again) and not np.array_equal(q0, q0_other)


def test_config_from_dict_refuses_an_unknown_family():
    with pytest.raises(ValueError, match="unsupported architecture: model_type='nope'"):
        config_from_dict({"model_type": "nope"})
