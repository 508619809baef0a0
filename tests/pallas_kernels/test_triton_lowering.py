"""Cross-lower every kernel, and the whole jitted engine step, for CUDA on the CPU machine.

Proves the Triton lowering rules accept each kernel (shapes, indexing, loops, masks)
without a GPU, on every supported jax (0.10.2 .. 0.12). From jax 0.11 the Triton lowering
needs a target device; `pk_testing.h200_target()` supplies an abstract H200 (an AbstractMesh with an
AbstractDevice), which older releases accept too. Compiling the Triton IR to PTX still
needs a GPU (see test_gpu_kernels.py).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from pk_testing import TRITON_CALL, lower_for_cuda

import pallas_kernels as pk
from paged_jax.config import EngineConfig
from paged_jax.models import LlamaForCausalLM, ModelConfig
from paged_jax.worker.input_batch import InputBatch
from paged_jax.worker.runner import Runner

KERNEL_NAMES = (
    "paged_decode_attention",
    "ragged_paged_attention",
    "paged_write_kv",
    "paged_copy_blocks",
)


def kernel_calls(text: str) -> dict[str, int]:
    """How many Triton custom calls of each of our kernels (by pallas_call name) one call
    of the exported main makes, following the module's call graph (a nested jit is a
    private function that may be called once per layer)."""
    direct: dict[str, dict[str, int]] = {}
    calls: dict[str, list[str]] = {}
    func = None
    for line in text.splitlines():
        m = re.search(r"func\.func (?:public |private )?@([\w.$-]+)\(", line)
        if m:
            func = m.group(1)
            direct[func], calls[func] = dict.fromkeys(KERNEL_NAMES, 0), []
        elif func is not None and TRITON_CALL in line:
            names = [n for n in KERNEL_NAMES if f'"{n}"' in line]
            assert len(names) == 1, f"a Triton call that is none of our kernels: {line[:200]}"
            direct[func][names[0]] += 1
        elif func is not None:
            calls[func] += re.findall(r"\bcall @([\w.$-]+)\(", line)

    def total(f: str) -> dict[str, int]:
        out = dict(direct[f])
        for callee in calls[f]:
            for name, n in total(callee).items():
                out[name] += n
        return out

    return total("main")


def _spec(shape, dtype=jnp.int32):
    return jax.ShapeDtypeStruct(shape, dtype)


def _only(name: str, count: int = 1) -> dict[str, int]:
    return {k: (count if k == name else 0) for k in KERNEL_NAMES}


@pytest.mark.parametrize(
    "kind,block_size,kv_heads,group,kw",
    [
        pytest.param("decode", 16, 8, 4, {}, id="decode-gqa4-bs16"),
        pytest.param(
            "decode", 8, 4, 1, dict(sliding_window=64, soft_cap=30.0), id="decode-mha-win-cap"
        ),
        pytest.param("decode", 16, 2, 8, dict(num_splits=4), id="decode-gqa8-split4"),
        pytest.param("ragged", 16, 8, 4, {}, id="ragged-gqa4-bs16"),
        pytest.param(
            "ragged", 32, 2, 8, dict(sliding_window=100, num_splits=2), id="ragged-gqa8-win-split"
        ),
    ],
)
def test_attention_lowers_to_one_triton_call(kind, block_size, kv_heads, group, kw):
    head_dim, rows, num_seqs = 128, 40, 4
    cache = _spec((64, kv_heads, block_size, head_dim), jnp.bfloat16)
    tables, lens = _spec((num_seqs, 8)), _spec((num_seqs,))
    if kind == "decode":
        q = _spec((num_seqs, kv_heads * group, head_dim), jnp.bfloat16)
        fn = functools.partial(pk.paged_attention, scale=0.1, **kw)
        text = lower_for_cuda(fn, q, cache, cache, tables, lens)
        assert kernel_calls(text) == _only("paged_decode_attention")
    else:
        q = _spec((rows, kv_heads * group, head_dim), jnp.bfloat16)
        fn = functools.partial(pk.ragged_paged_attention, scale=0.1, **kw)
        text = lower_for_cuda(fn, q, cache, cache, tables, lens, _spec((num_seqs + 1,)))
        assert kernel_calls(text) == _only("ragged_paged_attention")


def test_f32_attention_lowers():
    cache = _spec((16, 2, 16, 64), jnp.float32)
    q = _spec((4, 8, 64), jnp.float32)
    fn = functools.partial(pk.paged_attention, scale=0.1)
    text = lower_for_cuda(fn, q, cache, cache, _spec((4, 4)), _spec((4,)))
    assert kernel_calls(text) == _only("paged_decode_attention")


def test_kv_ops_lower_to_one_triton_call_each():
    cache = _spec((64, 8, 16, 128), jnp.bfloat16)
    new = _spec((40, 8, 128), jnp.bfloat16)
    text = lower_for_cuda(pk.write_kv, cache, cache, new, new, _spec((40,)))
    assert kernel_calls(text) == _only("paged_write_kv")
    ids = _spec((3,))
    text = lower_for_cuda(pk.copy_blocks, cache, cache, ids, ids)
    assert kernel_calls(text) == _only("paged_copy_blocks")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("head_dim", [80, 96])
def test_kv_ops_lower_for_a_head_dim_that_is_not_a_power_of_two(head_dim, dtype):
    cache = _spec((64, 8, 16, head_dim), dtype)
    new = _spec((40, 8, head_dim), jnp.bfloat16 if dtype != jnp.bfloat16 else dtype)
    text = lower_for_cuda(pk.write_kv, cache, cache, new, new, _spec((40,)))
    assert kernel_calls(text) == _only("paged_write_kv")
    ids = _spec((3,))
    text = lower_for_cuda(pk.copy_blocks, cache, cache, ids, ids)
    assert kernel_calls(text) == _only("paged_copy_blocks")


# ------------------------------------------------------------------ whole engine step

NUM_LAYERS = 3


@pytest.fixture(scope="module", params=[False, True], ids=["unrolled", "scanned"])
def pallas_runner(request):
    """A tiny Llama (GQA 4/2, head_dim 64, 3 layers) on a Runner with the Pallas backend,
    its layers unrolled or run as a scan (one layer body: each kernel lowers once)."""
    config = ModelConfig(
        model_type="llama",
        vocab_size=128,
        hidden_size=256,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=128,
        max_position_embeddings=256,
        dtype="bfloat16",
    )
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0), attention_backend="pallas")
    engine_config = EngineConfig(
        block_size=16,
        num_kv_blocks=32,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=256,
        attention_backend="pallas",
        dtype="bfloat16",
        scan_layers=request.param,
    )
    runner = Runner(model, engine_config)
    assert (runner.layer_scan is not None) == request.param
    return runner, InputBatch(engine_config)


def _calls_per_program(runner: Runner) -> int:
    """Kernel calls a per-layer op lowers to: one per layer, or one in the scanned body."""
    return 1 if runner.layer_scan is not None else NUM_LAYERS


def _lower_step(runner: Runner, step) -> str:
    def spec(x):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype)

    args = runner.step_args(step)
    return lower_for_cuda(runner.jitted_step, *jax.tree.map(spec, args))


@pytest.mark.parametrize("decode_only", [False, True], ids=["mixed", "decode-only"])
def test_engine_step_lowers_for_cuda_with_kernel_calls_per_layer(pallas_runner, decode_only):
    runner, batch = pallas_runner
    text = _lower_step(runner, batch.dummy_step_input(16, 8, decode_only=decode_only))
    # Per layer: one KV write and the decode kernel (all q heads of a KV head in one tile);
    # a mixed step adds the ragged kernel for its prefill chunks, while its decode tokens
    # still take the decode kernel (not a block_q-token query block each).
    # No block copy: copy-on-write is its own call, dispatched only with a real copy.
    n = _calls_per_program(runner)
    expected = {name: 0 for name in KERNEL_NAMES}
    expected.update({"paged_write_kv": n, "paged_decode_attention": n})
    if not decode_only:
        expected["ragged_paged_attention"] = n
    assert kernel_calls(text) == expected


def test_the_step_copy_lowers_to_one_block_copy_per_layer(pallas_runner):
    runner, batch = pallas_runner
    copies = batch.dummy_step_input(16, 8).copies

    def spec(x):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype)

    args = jax.tree.map(spec, (runner.kv_caches, copies))
    text = lower_for_cuda(runner.jitted_copy, *args)
    # Scanned: one copy over the stacked pair, its ids repeated for every layer's tensor.
    assert kernel_calls(text) == _only("paged_copy_blocks", _calls_per_program(runner))
