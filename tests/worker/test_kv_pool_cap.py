"""A memory-sized KV pool never puts a cache array where 32-bit Triton offsets wrap.

The sizing is a pure function of the config, the model's cache shapes (abstract: no
allocation) and the free memory, so a terabyte budget is tested without a terabyte.
"""

from __future__ import annotations

import logging

import jax.numpy as jnp
import pytest
from flax import nnx

import pallas_kernels
from paged_jax.config import EngineConfig
from paged_jax.models import LlamaForCausalLM, ModelConfig
from paged_jax.worker.runner import kv_block_arrays, resolve_num_kv_blocks

KV_HEADS, HEAD_DIM, BS, LAYERS = 2, 64, 16, 2
BLOCK = KV_HEADS * BS * HEAD_DIM  # 2048 elements per block of one array
SAFE = 2**31 // BLOCK  # 1_048_576 fp8 blocks fill 2**31 elements
TIB = 2**40


@pytest.fixture(scope="module")
def model():
    config = ModelConfig(
        model_type="llama",
        vocab_size=64,
        hidden_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate_size=64,
        max_position_embeddings=128,
        dtype="bfloat16",
    )
    return LlamaForCausalLM(config, rngs=nnx.Rngs(0))


def _config(**kw):
    base = dict(block_size=BS, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
    return EngineConfig(**{**base, **kw})


def test_kv_block_arrays_reads_the_models_cache_shapes(model):
    fp8 = jnp.float8_e4m3fn
    assert kv_block_arrays(model, BS, fp8) == [(BLOCK, 1)]
    assert kv_block_arrays(model, BS, None) == [(BLOCK, 2)]  # the model's bf16
    assert kv_block_arrays(model, BS, None, tensor_parallel_size=2) == [(BLOCK // 2, 2)]


def test_a_budget_past_the_wrap_window_is_capped_with_one_log_line(model, caplog):
    arrays = kv_block_arrays(model, BS, jnp.float8_e4m3fn)
    per_block = model.kv_bytes_per_block(BS, jnp.float8_e4m3fn)
    # 3 * SAFE blocks: each array 3 * 2**31 bytes, inside the window (<= 4 GiB, > 2**31).
    budget = 3 * SAFE * per_block // 2
    with caplog.at_level(logging.INFO, logger="paged_jax.worker.kv_pool_sizing"):
        n = resolve_num_kv_blocks(_config(kv_cache_memory=budget), per_block, arrays)
    assert n == SAFE
    (record,) = [r for r in caplog.records if "capped" in r.getMessage()]
    message = record.getMessage()
    assert f"{SAFE} blocks" in message and str(3 * SAFE // 2) in message
    assert "32-bit" in message


def test_a_fraction_of_free_memory_is_capped_too(model):
    arrays = kv_block_arrays(model, BS, jnp.float8_e4m3fn)
    per_block = model.kv_bytes_per_block(BS, jnp.float8_e4m3fn)
    config = _config(kv_cache_memory=0.5)
    free = 3 * SAFE * per_block  # half of it: 1.5 * SAFE blocks, in the window
    assert resolve_num_kv_blocks(config, per_block, arrays, free_bytes=free) == SAFE
    # A small fraction stays as sized.
    small = SAFE * per_block // 4
    got = resolve_num_kv_blocks(config, per_block, arrays, free_bytes=small)
    assert got == small // 2 // per_block


def test_safe_pools_are_unchanged(model):
    fp8 = jnp.float8_e4m3fn
    per_block = model.kv_bytes_per_block(BS, fp8)
    arrays = kv_block_arrays(model, BS, fp8)
    # Over 4 GiB per array: 64-bit offsets, nothing to cap.
    big = (2**32 // BLOCK + 10) * per_block
    assert (
        resolve_num_kv_blocks(_config(kv_cache_memory=big), per_block, arrays) == big // per_block
    )
    # bf16 never wraps (2**31 elements are 4 GiB).
    bf16 = kv_block_arrays(model, BS, None)
    per_block = model.kv_bytes_per_block(BS, None)
    budget = 3 * SAFE * per_block // 2
    got = resolve_num_kv_blocks(_config(kv_cache_memory=budget), per_block, bf16)
    assert got == 3 * SAFE // 2


def test_an_explicit_num_kv_blocks_is_the_users_choice(model):
    arrays = kv_block_arrays(model, BS, jnp.float8_e4m3fn)
    config = _config(num_kv_blocks=3 * SAFE // 2)
    assert resolve_num_kv_blocks(config, 1, arrays) == 3 * SAFE // 2


class _TwoShapes:
    """A model whose KV arrays differ per group (e.g. a hybrid with other head counts)."""

    def init_kv_caches(self, num_blocks, block_size, dtype=None):
        dtype = dtype or jnp.bfloat16
        return [
            pallas_kernels.init_kv_cache(num_blocks, block_size, 1, 64, dtype),
            pallas_kernels.init_kv_cache(num_blocks, block_size, 8, 128, dtype),
        ]


def test_every_kv_array_is_capped_by_its_own_shape():
    fp8 = jnp.float8_e4m3fn
    arrays = kv_block_arrays(_TwoShapes(), BS, fp8)
    assert arrays == [(BS * 64, 1), (8 * BS * 128, 1)]
    per_block = 2 * sum(e for e, _ in arrays)
    want = 2**31 // (8 * BS * 128)  # the big array caps; the small one would fit more
    budget = (want + 1000) * per_block
    assert resolve_num_kv_blocks(_config(kv_cache_memory=budget), per_block, arrays) == want
