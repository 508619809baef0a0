"""paged_jax.PagedModel: the engine's contract with any model, and its errors."""

from __future__ import annotations

import dataclasses

import numpy as np
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


# -- model contract v1 (docs/research_integration.md, "Model contract versions") -------


def _v1_meta(num_groups: int):
    from paged_jax.models import AttentionMetadata

    return AttentionMetadata(
        tuple(np.full(4, 10 * g, np.int32) for g in range(num_groups)),
        tuple(np.full((2, 3), g + 1, np.int32) for g in range(num_groups)),
        np.asarray([3, 1], np.int32),
        np.asarray([0, 3, 4], np.int32),
        np.asarray([2, 3], np.int32),
    )


def test_one_group_step_keeps_the_single_group_accessors_with_a_deprecation_warning():
    meta = _v1_meta(1)
    with pytest.warns(DeprecationWarning, match=r"read attn_metadata\.for_group\(0\)\.slot_"):
        slot_mapping = meta.slot_mapping
    with pytest.warns(DeprecationWarning, match=r"read attn_metadata\.for_group\(0\)\.block_"):
        block_table = meta.block_table
    assert slot_mapping is meta.for_group(0).slot_mapping
    assert block_table is meta.for_group(0).block_table


@pytest.mark.parametrize("name", ["slot_mapping", "block_table"])
def test_multi_group_step_refuses_the_single_group_accessors_naming_for_group(name):
    with pytest.raises(AttributeError, match=rf"carries 2 KV-cache groups.*for_group\(g\)\.{name}"):
        getattr(_v1_meta(2), name)


@pytest.mark.parametrize("name", ["extra_slot_mappings", "extra_block_tables"])
def test_v1_extra_group_fields_are_gone_with_a_message_naming_for_group(name):
    with pytest.raises(
        AttributeError, match=rf"{name} was removed in model contract v2.*for_group"
    ):
        getattr(_v1_meta(2), name)


def test_metadata_with_the_accessors_is_still_a_pytree_read_under_jit():
    import jax

    meta = _v1_meta(1)
    leaves, treedef = jax.tree.flatten(meta)
    assert len(leaves) == 1 + 1 + 3  # the accessors are properties, not fields

    @jax.jit
    def read(m):  # contract v1's spelling, traced
        return m.slot_mapping + m.block_table[0, 0]

    with pytest.warns(DeprecationWarning):
        out = read(jax.tree.unflatten(treedef, leaves))
    np.testing.assert_array_equal(out, np.full(4, 0 + 1))


class _V1SumModel(SumModel):
    """SumModel's forward written to contract v1: attn_metadata.slot_mapping, one table."""

    def forward_paged(
        self, token_ids, positions, kv_caches, attn_metadata, *, attention_backend=None
    ):
        import jax.numpy as jnp

        import pallas_kernels
        from paged_jax.testing.fake_model import HEAD_DIM

        ops = pallas_kernels.get_attention_ops(attention_backend or self.attention_backend)
        v = jnp.zeros((token_ids.shape[0], 1, HEAD_DIM), jnp.float32)
        v = v.at[:, 0, 0].set(token_ids.astype(jnp.float32)).at[:, 0, 1].set(1.0)
        q = k = jnp.zeros_like(v)
        new_caches, out = [], None
        for k_cache, v_cache in kv_caches:
            k_cache, v_cache = ops.write_kv(k_cache, v_cache, k, v, attn_metadata.slot_mapping)
            out = ops.ragged_paged_attention(
                q,
                k_cache,
                v_cache,
                attn_metadata.block_table,
                attn_metadata.seq_lens,
                attn_metadata.query_start_loc,
                scale=1.0,
            )  # f32[T, 1, HEAD_DIM]: the mean id of the visible context
            new_caches.append((k_cache, v_cache))
        pos = positions[attn_metadata.logits_indices]
        mean_id = out[attn_metadata.logits_indices, 0, 0]
        total = jnp.round(mean_id * (pos + 1).astype(jnp.float32)).astype(jnp.int32) + pos
        target = jnp.mod(total, self.config.vocab_size)  # i32[S]
        vocab = jnp.arange(self.config.vocab_size)
        return -jnp.abs(vocab[None, :] - target[:, None]).astype(jnp.float32), new_caches


def test_a_one_group_model_written_to_contract_v1_is_served_with_a_deprecation_warning():
    config = SumModelConfig(vocab_size=97, max_position_embeddings=64)
    llm = paged_jax.LLM(_V1SumModel(config), attention_backend="reference", warmup=False, **ENGINE)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    with pytest.warns(DeprecationWarning, match=r"for_group\(0\)"):
        outs = llm.generate(prompts, paged_jax.SamplingParams(temperature=0, max_tokens=5))
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == SumModel.reference_continuation(prompt, 5, 97)
