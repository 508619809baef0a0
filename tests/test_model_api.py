"""paged_jax.PagedModel: the engine's contract with any model, and its errors."""

from __future__ import annotations

import dataclasses

import pytest

import paged_jax
from paged_jax import EngineConfig, PagedModel
from paged_jax.core.kv_cache_spec import KVCacheGroupSpec
from paged_jax.model_api import check_paged_model, model_kv_cache_groups
from paged_jax.testing.fake_model import SumModel, SumModelConfig

ENGINE = dict(block_size=4, num_kv_blocks=32, max_num_seqs=4, max_num_batched_tokens=16)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gpt2", "opt"])
def test_every_family_satisfies_the_protocol(family, tiny_hf_checkpoint):
    from paged_jax.models import load_model

    model = load_model(tiny_hf_checkpoint(family))
    assert isinstance(model, PagedModel)
    check_paged_model(model)  # the config fields too


def test_sum_model_satisfies_the_protocol_and_is_exported():
    assert paged_jax.PagedModel is PagedModel
    assert isinstance(SumModel(), PagedModel)


class _NoForward:
    config = SumModelConfig()

    def init_kv_caches(self, num_blocks, block_size, dtype=None):
        return []

    def kv_bytes_per_block(self, block_size, dtype=None):
        return 1


@dataclasses.dataclass(frozen=True)
class _ConfigWithoutEos:
    vocab_size: int = 8
    max_position_embeddings: int = 8
    num_hidden_layers: int = 1
    dtype: str = "float32"


def test_missing_method_is_named():
    assert not isinstance(_NoForward(), PagedModel)
    with pytest.raises(TypeError, match=r"missing method 'forward_paged'"):
        paged_jax.Engine(_NoForward(), EngineConfig(**ENGINE))
    with pytest.raises(TypeError, match=r"model=_NoForward must implement PagedModel"):
        paged_jax.LLM(_NoForward(), warmup=False, **ENGINE)


def test_missing_config_field_is_named():
    model = SumModel()
    model.config = _ConfigWithoutEos()
    with pytest.raises(TypeError, match=r"missing field 'eos_token_ids'"):
        paged_jax.Engine(model, EngineConfig(**ENGINE))


def test_kv_cache_groups_default_to_one_full_group_over_every_layer():
    model = SumModel(SumModelConfig(num_hidden_layers=3))
    assert model_kv_cache_groups(model) == (KVCacheGroupSpec(None, (0, 1, 2)),)

    class Windowed(SumModel):
        def kv_cache_groups(self):
            return [KVCacheGroupSpec(None, (0,)), KVCacheGroupSpec(8, (1, 2))]

    groups = model_kv_cache_groups(Windowed(SumModelConfig(num_hidden_layers=3)))
    assert groups == (KVCacheGroupSpec(None, (0,)), KVCacheGroupSpec(8, (1, 2)))


def test_llm_serves_a_model_object_with_token_prompts():
    config = SumModelConfig(vocab_size=97, max_position_embeddings=64)
    llm = paged_jax.LLM(SumModel(config), attention_backend="reference", warmup=False, **ENGINE)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    outs = llm.generate(prompts, paged_jax.SamplingParams(temperature=0, max_tokens=5))
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == SumModel.reference_continuation(prompt, 5, 97)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["text needs a tokenizer"])
