"""Fixtures shared by the engine tests on SumModel (tests/engine/test_engine_fake.py's helpers)."""

from __future__ import annotations

import pytest

from paged_jax.engine import Engine
from tests.engine.test_engine_fake import assert_pool_drained, make_engine


@pytest.fixture(scope="module")
def _shared_default_engine() -> Engine:
    return make_engine()


@pytest.fixture
def default_engine(_shared_default_engine) -> Engine:
    """make_engine() with its defaults, built once per module: drained, prefix cache empty.

    The tests using it need nothing but the default settings; sharing saves an engine build
    (about 3 CPU s with the test compilation cache warm) each. Each starts from an idle
    engine with no cached prefix, so none depends on the tests before it. get_stats()
    counters are cumulative: read them as differences.
    """
    engine = _shared_default_engine
    assert_pool_drained(engine)
    assert engine.kv_cache_manager.reset_prefix_cache(), "blocks still held by a request"
    return engine


@pytest.fixture(scope="session")
def _activations_llm(tiny_hf_checkpoint):
    from paged_jax import LLM

    path = tiny_hf_checkpoint("llama")
    llm = LLM(
        str(path),
        hidden_state_layers=(0, 1, -1),
        steering_layers=(0, 1),
        enable_prompt_embeds=True,
        scan_layers="on",
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=64,
        attention_backend="reference",
    )
    return llm, path


@pytest.fixture
def activations_llm(_activations_llm):
    """(LLM, checkpoint path): a tiny Llama (scanned layers) with every activation option
    (hidden_state_layers (0, 1, -1), steering_layers (0, 1), enable_prompt_embeds), built
    once for the hidden-state, steering and prompt-embedding tests; its prefix cache is
    empty at the start of each test."""
    llm, path = _activations_llm
    assert llm.engine.kv_cache_manager.reset_prefix_cache(), "blocks still held by a request"
    return llm, path
