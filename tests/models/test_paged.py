"""The paged forward (chunked prefill, decode, permuted blocks, padding) equals the dense one."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from paged_jax.models import AttentionMetadata, load_model
from paged_jax.models.simple_paged import greedy_generate_paged, make_attn_metadata

# Paged and dense run the same f32 math in a different order (gathered pages, chunks).
PAGED_ATOL = 1e-4


def assert_paged_matches_dense(model, prompts, *, max_new_tokens, **kwargs) -> None:
    generated, step_logits = greedy_generate_paged(
        model, prompts, max_new_tokens, block_size=4, prefill_chunk=4, **kwargs
    )
    for prompt, tokens, logits in zip(prompts, generated, step_logits):
        assert len(tokens) == max_new_tokens
        dense = np.asarray(model(np.asarray([prompt + tokens], np.int32)))[0]
        expected = dense[len(prompt) - 1 : len(prompt) - 1 + max_new_tokens]
        np.testing.assert_allclose(logits, expected, atol=PAGED_ATOL, rtol=0)
        # The continuation is greedy under the dense model as well.
        assert tokens == [int(t) for t in expected.argmax(-1)]


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("llama", {}),
        ("qwen2", {}),
        ("mistral", {"sliding_window": 5}),
        ("gpt2", {}),
        ("opt", {}),
        ("gemma2", {}),  # two KV-cache groups: one table per group, shared tensors
    ],
)
def test_paged_reference_matches_dense(family, overrides, tiny_hf_checkpoint):
    model = load_model(tiny_hf_checkpoint(family, **overrides), attention_backend="reference")
    rng = np.random.default_rng(0)
    # Prompt lengths straddle block edges (block_size 4); prefill runs in chunks of 4.
    prompts = [rng.integers(0, 128, size=n).tolist() for n in (11, 4, 6)]
    assert_paged_matches_dense(model, prompts, max_new_tokens=3)


def test_paged_pallas_interpret_matches_dense(tiny_hf_checkpoint):
    model = load_model(tiny_hf_checkpoint("llama"))
    prompts = [[5, 9, 1, 77, 3, 12], [40, 2, 8]]
    assert_paged_matches_dense(
        model, prompts, max_new_tokens=2, attention_backend="pallas_interpret"
    )


def test_jitted_split_merge_with_donated_caches_and_padding(tiny_hf_checkpoint):
    """The engine's pattern: nnx.split once, jit a pure merge + forward_paged, donate caches."""
    model = load_model(tiny_hf_checkpoint("qwen2"))
    graphdef, state = nnx.split(model)

    def step(state, token_ids, positions, kv_caches, attn_metadata):
        return nnx.merge(graphdef, state).forward_paged(
            token_ids, positions, kv_caches, attn_metadata
        )

    jitted = jax.jit(step, donate_argnums=(3,))
    prompts = [[3, 1, 4, 1, 5, 9, 2], [6, 5, 3]]
    tables = [[7, 2], [5]]  # permuted ids; block 0 (null) and others unused
    # Padded step: T=16 > 10 real tokens, S=4 > 2 real sequences, width 3 > 2.
    positions, metadata = make_attn_metadata(
        tables, [0, 0], [7, 3], block_size=4, num_tokens=16, num_seqs=4, max_blocks_per_seq=3
    )
    assert isinstance(metadata, AttentionMetadata)
    assert (
        metadata.slot_mappings[0][10:].tolist() == [-1] * 6 and positions[10:].tolist() == [0] * 6
    )
    assert metadata.seq_lens.tolist() == [7, 3, 0, 0]
    token_ids = np.zeros(16, np.int32)
    token_ids[:10] = prompts[0] + prompts[1]
    kv_caches = model.init_kv_caches(num_blocks=8, block_size=4)
    eager_logits, eager_caches = model.forward_paged(token_ids, positions, kv_caches, metadata)
    logits, new_caches = jitted(state, token_ids, positions, kv_caches, metadata)
    assert logits.shape == (4, 128)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(eager_logits), atol=1e-5, rtol=0)
    for prompt, row in zip(prompts, np.asarray(logits)):
        dense = np.asarray(model(np.asarray([prompt], np.int32)))[0, -1]
        np.testing.assert_allclose(row, dense, atol=PAGED_ATOL, rtol=0)
    for (k, v), (k_eager, _) in zip(new_caches, eager_caches):
        np.testing.assert_allclose(np.asarray(k), np.asarray(k_eager), atol=1e-5, rtol=0)
        # Padding rows (slot -1) wrote nothing: the null block and unused blocks stay zero.
        for block in (0, 1, 3, 4, 6):
            assert not np.asarray(k)[block].any() and not np.asarray(v)[block].any()


def test_kv_cache_helpers(tiny_hf_checkpoint):
    model = load_model(tiny_hf_checkpoint("llama"))
    caches = model.init_kv_caches(num_blocks=5, block_size=4)
    assert len(caches) == model.config.num_hidden_layers
    per_block = sum(a.nbytes for kv in caches for a in kv) // 5
    # 2 layers * (K + V) * 4 tokens * 2 kv heads * 16 head_dim * 4 bytes.
    assert model.kv_bytes_per_block(4) == per_block == 2 * 2 * 4 * 2 * 16 * 4
    assert model.init_kv_caches(2, 4, dtype="bfloat16")[0][0].dtype == np.dtype("bfloat16")
    positions, metadata = make_attn_metadata([[1]], [0], [1], block_size=4)
    with pytest.raises(ValueError, match="len\\(kv_caches\\)=1 must be 2"):
        model.forward_paged(np.zeros(1, np.int32), positions, caches[:1], metadata)
