"""The top-level API: a short vLLM-shaped list, jax-free to import; internals moved to
paged_jax.core still import from the top level for one release, with a DeprecationWarning."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

import paged_jax

PUBLIC = {
    "LLM": "paged_jax.llm",
    "Engine": "paged_jax.engine",
    "EngineConfig": "paged_jax.config",
    "SamplingParams": "paged_jax.sampling_params",
    "SpeculativeConfig": "paged_jax.spec_decode.proposer",
    "StructuredOutputsParams": "paged_jax.structured_outputs",
    "BeamSearchParams": "paged_jax.beam_search",
    "BeamSearchOutput": "paged_jax.beam_search",
    "BeamSearchSequence": "paged_jax.beam_search",
    "RequestOutput": "paged_jax.outputs",
    "CompletionOutput": "paged_jax.outputs",
    "Logprob": "paged_jax.outputs",
    "LoRARequest": "paged_jax.lora",
    "PagedModel": "paged_jax.model_api",
    "PagedModelConfig": "paged_jax.model_api",
    "KVCacheManager": "paged_jax.core.kv_cache_manager",
    "BlockPool": "paged_jax.core.block_pool",
    "KVCacheBlock": "paged_jax.core.kv_cache_block",
    "Request": "paged_jax.core.request",
    "RequestStatus": "paged_jax.core.request",
}

DEPRECATED = {
    "FreeKVCacheBlockQueue": "paged_jax.core.kv_cache_block",
    "NONE_HASH": "paged_jax.core.hashing",
    "BlockHash": "paged_jax.core.hashing",
    "BlockHashWithGroupId": "paged_jax.core.hashing",
    "BlockHasher": "paged_jax.core.hashing",
    "hash_block_tokens": "paged_jax.core.hashing",
    "none_hash": "paged_jax.core.hashing",
    "KVCacheBlocks": "paged_jax.core.kv_cache_manager",
    "PrefixCacheStats": "paged_jax.core.kv_cache_manager",
}


def test_all_is_the_short_public_list():
    assert sorted(paged_jax.__all__) == sorted(PUBLIC)


def test_import_paged_jax_leaves_jax_unimported():
    code = (
        "import paged_jax, sys; print(sorted(m for m in sys.modules if m.split('.')[0] == 'jax'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_every_public_name_is_its_home_module_object_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name, home in PUBLIC.items():
            assert getattr(paged_jax, name) is getattr(importlib.import_module(home), name), name


@pytest.mark.parametrize("name", sorted(DEPRECATED))
def test_old_top_level_names_warn_and_name_the_new_import(name):
    home = DEPRECATED[name]
    match = rf"paged_jax\.{name} is deprecated .* `from {home} import {name}`"
    with pytest.warns(DeprecationWarning, match=match) as record:
        value = getattr(paged_jax, name)
    assert value is getattr(importlib.import_module(home), name)
    assert record[0].filename == __file__  # the warning points at the caller's line


def test_from_import_of_an_old_name_warns_too():
    with pytest.warns(DeprecationWarning, match="paged_jax.BlockHasher is deprecated"):
        from paged_jax import BlockHasher  # noqa: F401


def test_unknown_names_are_attribute_errors():
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        paged_jax.nope  # noqa: B018
    assert "nope" not in dir(paged_jax) and "LLM" in dir(paged_jax)
