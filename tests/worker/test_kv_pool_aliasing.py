"""The compiled engine step updates the KV pool in place: never a copy of it per step.

The runner donates the KV caches to its jitted step, so XLA may alias each cache
parameter to the matching output and write the new K/V into the same buffer. Lose the
donation (or let the layer scan's carry force a copy) and every step copies the whole
pool: slow on a GPU, and a second pool's worth of memory. This compiles the engine's
real step function (a tiny Llama with the layer scan on, CPU) and reads both what XLA
promises (input_output_alias in the compiled module: every KV parameter aliased) and
what it allocates (memory_analysis: aliased bytes cover the pool, temporaries are a
small fraction of it). scripts/gpu_compile_check.py checks the same on the deviceless
H200 compile of a Llama-3-8B-shaped step.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from flax import nnx

from paged_jax.config import EngineConfig
from paged_jax.models import LlamaForCausalLM
from paged_jax.worker.input_batch import InputBatch
from paged_jax.worker.runner import Runner

# Temporaries above this share of the pool mean something pool-sized is being built.
MAX_TEMP_FRACTION = 0.05
TINY_LLAMA = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=128,
    num_hidden_layers=2,
    max_position_embeddings=256,
)


def _entry_parameters(hlo: str) -> list[str]:
    """The entry computation's parameter shapes, in parameter order ("f32[4096,2,16,16]")."""
    layout = re.search(r"entry_computation_layout=\{\((.*?)\)->", hlo, re.S)
    assert layout, "no entry_computation_layout in the compiled module's text"
    text = re.sub(r"/\*index=\d+\*/", "", layout.group(1))
    return [
        re.sub(r"\{[^}]*\}", "", s).strip() for s in re.findall(r"\w+\[[\d,]*\]\{[^}]*\}", text)
    ]


def _aliased_parameters(hlo: str) -> set[int]:
    """Parameter numbers that input_output_alias maps to an output."""
    found = re.search(r"input_output_alias=\{(.*?)\}\s*,\s*entry_computation_layout", hlo, re.S)
    return {int(p) for p in re.findall(r"\(\s*(\d+),", found.group(1))} if found else set()


def _shape_text(x) -> str:
    name = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[str(x.dtype)]
    return f"{name}[{','.join(map(str, x.shape))}]"


@pytest.fixture(scope="module")
def compiled_step():
    config = LlamaForCausalLM.config_from_hf(TINY_LLAMA, {}, "float32")
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    engine_config = EngineConfig(
        block_size=16,
        num_kv_blocks=2048,  # 16 MiB of f32 K + V: far above the step's own working set
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=256,
        attention_backend="reference",
        scan_layers="on",
    )
    runner = Runner(model, engine_config)
    step = InputBatch(engine_config).dummy_step_input(16, 4)
    compiled = runner.jitted_step.lower(*runner.step_args(step)).compile()
    return runner, compiled


def test_step_aliases_the_kv_pool_input_to_output(compiled_step):
    runner, compiled = compiled_step
    assert runner.layer_scan is not None, "the layer scan is on"
    leaves = jax.tree.leaves(runner.kv_caches)
    assert len(leaves) == 2, "a scanned model keeps one stacked K and one stacked V"
    hlo = compiled.as_text()
    params = _entry_parameters(hlo)
    kv_params = [i for i, s in enumerate(params) if s == _shape_text(leaves[0])]
    assert len(kv_params) == len(leaves), (params, _shape_text(leaves[0]))
    missing = set(kv_params) - _aliased_parameters(hlo)
    assert not missing, f"KV parameters {sorted(missing)} are not aliased to an output"


def test_step_temporaries_stay_far_below_the_pool(compiled_step):
    runner, compiled = compiled_step
    stats = compiled.memory_analysis()
    if stats is None:
        pytest.skip(f"jax {jax.__version__}: this backend gives no compiled memory analysis")
    pool = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(runner.kv_caches))
    assert stats.alias_size_in_bytes >= pool, (stats, pool)
    assert stats.temp_size_in_bytes < MAX_TEMP_FRACTION * pool, (stats, pool)
    # The outputs are the pool itself plus small per-step results, not a second pool.
    assert stats.output_size_in_bytes - stats.alias_size_in_bytes < MAX_TEMP_FRACTION * pool
