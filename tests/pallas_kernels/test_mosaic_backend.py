"""The Mosaic GPU backend names through the seam: where they run, why not, and one engine step.

The refusals run on every jax (older jax must say why); the kernel runs need jax >= 0.11.2
(GPU interpret mode) and skip elsewhere with the reason.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pk_testing import assert_close, make_case, with_timeout

import pallas_kernels as pk
from pallas_kernels.backend import check_backend, mosaic_unavailable, valid_backends
from pallas_kernels.names import mosaic_jax_reason

OLD_JAX = mosaic_jax_reason(jax.__version__)
needs_mosaic = pytest.mark.skipif(OLD_JAX is not None, reason=str(OLD_JAX))
ON_GPU = jax.default_backend() == "gpu"


def test_the_mosaic_names_are_backend_names():
    assert {"mosaic_gpu", "mosaic_gpu_interpret"} <= set(pk.BACKEND_NAMES)
    assert "mosaic_gpu" not in valid_backends("cpu")
    assert ("mosaic_gpu_interpret" in valid_backends("cpu")) == (OLD_JAX is None)


def test_mosaic_gpu_off_a_gpu_is_a_one_line_error():
    with pytest.raises(ValueError, match="mosaic_gpu.*cannot run on this cpu platform") as e:
        check_backend("mosaic_gpu", "cpu")
    assert "\n" not in str(e.value)
    if not ON_GPU:
        with pytest.raises(ValueError, match="attention_backend='mosaic_gpu': the Mosaic") as e:
            pk.get_attention_ops("mosaic_gpu")
        assert "\n" not in str(e.value)
        if OLD_JAX is None:  # the refusal names the way to compile for a GPU from here
            assert "target=" in str(e.value)


@pytest.mark.skipif(OLD_JAX is None, reason="this jax runs the Mosaic kernels")
def test_mosaic_on_older_jax_says_which_jax_it_needs():
    for name in ("mosaic_gpu", "mosaic_gpu_interpret"):
        with pytest.raises(ValueError, match=r"need jax >= 0\.11\.2, found jax") as e:
            pk.get_attention_ops(name)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"need jax >= 0\.11\.2"):
        check_backend("mosaic_gpu_interpret", "cpu")
    # A compile target does not lift the jax requirement.
    with pytest.raises(ValueError, match=r"need jax >= 0\.11\.2"):
        pk.get_attention_ops("mosaic_gpu", target=FakeDevice())


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    """What the target checks read of a jax Device (a compile-only H200 has these)."""

    platform: str = "gpu"
    compute_capability: str = "9.0"
    device_kind: str = "NVIDIA H200"


@needs_mosaic
def test_a_gpu_compile_target_gets_the_mosaic_ops_without_a_gpu_client():
    # The deviceless compile asks for "mosaic_gpu" naming the GPU it compiles for; a
    # plain call on this host still gets the refusal (test above).
    ops = pk.get_attention_ops("mosaic_gpu", target=FakeDevice())
    assert ops.takes_plan and "mosaic" in ops.paged_attention.__module__
    assert "mosaic" in ops.ragged_paged_attention.__module__
    assert mosaic_unavailable("mosaic_gpu", FakeDevice()) is None
    old = FakeDevice(compute_capability="8.0", device_kind="NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"Hopper or newer.*A100-SXM4-80GB \(8\.0\)") as e:
        pk.get_attention_ops("mosaic_gpu", target=old)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="need an NVIDIA GPU target, got a cpu device"):
        pk.get_attention_ops("mosaic_gpu", target=jax.devices("cpu")[0])


def test_auto_keeps_the_triton_kernels():
    # "auto" switches only once a GPU measurement in the repository shows Mosaic ahead.
    ops = pk.get_attention_ops("auto")
    mosaic = "mosaic" in getattr(ops.paged_attention, "__module__", "")
    assert not mosaic


@needs_mosaic
def test_mosaic_interpret_ops_take_plans_and_use_reference_cache_ops():
    ops = pk.get_attention_ops("mosaic_gpu_interpret")
    assert ops.takes_plan
    assert ops.write_kv is pk.reference.write_kv
    assert ops.copy_blocks is pk.reference.copy_blocks
    assert ops.paged_attention.keywords == {"interpret": True}
    checked = pk.get_attention_ops("mosaic_gpu_interpret", validate=True)
    assert checked.validate and checked.ragged_paged_attention.keywords["validate"]
    assert mosaic_unavailable("mosaic_gpu_interpret") is None


@needs_mosaic
def test_a_mixed_step_through_the_mosaic_ops_equals_the_reference():
    # Prefill, a chunk over a cached prefix, two decodes, padding rows: the ragged kernel
    # on the chunks and the decode kernel on the decode rows, one plan. (Decode-only
    # steps: the engine test below.)
    decode_only = False
    shape = dict(seq_lens=[19, 53, 33, 16], q_lens=[19, 14, 1, 1], num_rows=40, block_size=16)
    case = make_case(11, num_kv_heads=2, group=2, head_dim=64, dtype="bfloat16", **shape)
    args = (
        case.q,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.seq_lens,
        case.query_start_loc,
    )
    kw = dict(decode_only=decode_only, scale=0.125, sliding_window=30)
    ops = pk.get_attention_ops("mosaic_gpu_interpret").for_step()
    out = with_timeout(pk.step_attention, ops, *args, **kw)
    ref = pk.step_attention(pk.get_attention_ops("reference"), *args, **kw)
    assert_close(out, ref, "bfloat16")
    assert ops.plan_cache, "the step's plan was memoized for the layers"


@needs_mosaic
def test_engine_greedy_output_with_mosaic_interpret_equals_the_reference(monkeypatch):
    # A tiny random-weight Llama built in JAX (no torch): a prefill step (ragged kernel),
    # then decode-only steps (decode kernel) in bf16; tokens must match the reference.
    from flax import nnx

    from models.llama import LlamaForCausalLM
    from paged_jax.config import EngineConfig
    from paged_jax.engine import Engine
    from paged_jax.sampling_params import SamplingParams
    from paged_jax.testing.tiny_models import TINY_CONFIGS

    hf = dict(TINY_CONFIGS["llama"], head_dim=64, hidden_act="silu", rms_norm_eps=1e-5)
    config = LlamaForCausalLM.config_from_hf(hf, {}, "bfloat16")
    prompts = [[3, 17, 99, 4, 56, 23, 8, 77, 41, 12, 5], [9, 31, 64]]

    def generate(backend):
        model = LlamaForCausalLM(config, rngs=nnx.Rngs(0), attention_backend=backend)
        engine = Engine(
            model,
            EngineConfig(
                attention_backend=backend,
                dtype="bfloat16",
                block_size=8,
                num_kv_blocks=16,
                max_num_seqs=2,
                max_num_batched_tokens=16,
                max_model_len=64,
            ),
        )
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=3))
        outs = {}
        while engine.has_unfinished():
            outs.update({o.request_id: o.token_ids for o in engine.step()})
        return [outs[str(i)] for i in range(len(prompts))]

    from pallas_kernels import mosaic_decode, mosaic_ragged

    traced = []  # kernels traced into the engine's steps

    def spy(module, name):
        fn = getattr(module, name)

        def wrapped(*args, **kwargs):
            traced.append(name)
            return fn(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapped)

    spy(mosaic_decode, "paged_attention_mosaic")
    spy(mosaic_ragged, "ragged_paged_attention_mosaic")
    ref = generate("reference")
    assert not traced
    out = with_timeout(generate, "mosaic_gpu_interpret")
    assert out == ref
    assert {"paged_attention_mosaic", "ragged_paged_attention_mosaic"} <= set(traced)


def test_unknown_names_still_list_every_backend():
    with pytest.raises(ValueError, match="mosaic_gpu_interpret"):
        pk.get_attention_ops("mosaic")
    assert np.all([isinstance(n, str) for n in pk.BACKEND_NAMES])
    assert jnp.dtype("bfloat16")  # the module imports cleanly on every jax
