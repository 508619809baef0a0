"""SamplingParams.structured_outputs and the sampler's bitmask (pure JAX vs the numpy reference)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.sampling_params import SamplingParams
from paged_jax.structured_outputs import StructuredOutputsParams, apply_bitmask_reference
from paged_jax.worker.sampling import apply_bitmask, sample
from paged_jax.worker.step_input import SamplingMetadata


def test_sampling_params_takes_structured_outputs():
    so = StructuredOutputsParams(choice=["a", "b"])
    assert SamplingParams(structured_outputs=so).structured_outputs is so
    assert SamplingParams().structured_outputs is None


def test_sampling_params_rejects_a_dict_naming_the_field():
    with pytest.raises(ValueError, match=r"SamplingParams\.structured_outputs=.*StructuredOutputs"):
        SamplingParams(structured_outputs={"json": {}})


@pytest.mark.parametrize("vocab", [5, 32, 33, 97])
def test_apply_bitmask_equals_reference(vocab):
    rng = np.random.default_rng(vocab)
    s = 4
    words = rng.integers(-(2**31), 2**31, size=(s, -(-vocab // 32)), dtype=np.int64)
    words = words.astype(np.int32)
    words[0] = -1  # unconstrained row
    words[1, :] = 0
    words[1, 0] = np.int32(-(2**31))  # only bit 31 (the sign bit) of word 0
    logits = rng.standard_normal((s, vocab)).astype(np.float32)
    got = np.asarray(jax.jit(apply_bitmask)(jnp.asarray(logits), jnp.asarray(words)))
    np.testing.assert_array_equal(got, apply_bitmask_reference(logits, words))
    np.testing.assert_array_equal(got[0], logits[0])


def _meta(s, temperature, top_k=0, top_p=1.0, min_p=0.0, bitmask=None, masked=None):
    return SamplingMetadata(
        temperature=jnp.full(s, temperature, jnp.float32),
        top_k=jnp.full(s, top_k, jnp.int32),
        top_p=jnp.full(s, top_p, jnp.float32),
        min_p=jnp.full(s, min_p, jnp.float32),
        seeds=jnp.arange(s, dtype=jnp.uint32),
        counters=jnp.zeros(s, jnp.int32),
        masked_token_ids=jnp.full((s, 2), -1, jnp.int32) if masked is None else masked,
        bitmask=bitmask,
    )


@pytest.mark.parametrize(
    "mode",
    [
        dict(temperature=0.0),
        dict(temperature=1.0),
        dict(temperature=1.5, top_k=3),
        dict(temperature=1.0, top_p=0.5),
        dict(temperature=1.0, min_p=0.3),
    ],
)
def test_sample_only_draws_allowed_tokens_and_logprobs_are_masked(mode):
    s, vocab = 8, 70
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((s, vocab)).astype(np.float32) * 3)
    allowed = np.zeros((s, vocab), bool)
    for i in range(s):
        allowed[i, rng.choice(vocab, size=3, replace=False)] = True
    words = np.zeros((s, 3), np.uint32)
    for i, t in zip(*np.nonzero(allowed)):
        words[i, t // 32] |= np.uint32(1) << np.uint32(t % 32)
    out = jax.jit(sample)(logits, _meta(s, bitmask=jnp.asarray(words.view(np.int32)), **mode))
    ids = np.asarray(out.token_ids)
    assert allowed[np.arange(s), ids].all()
    # Logprobs describe the masked distribution: the allowed tokens' mass is 1.
    top = np.asarray(out.top_logprobs)[:, :3]
    np.testing.assert_allclose(np.exp(top).sum(axis=1), 1.0, rtol=1e-5)


def test_a_ban_that_leaves_nothing_allowed_yields_to_the_mask():
    # min_tokens bans EOS; a finished grammar allows only EOS: the mask wins.
    s, vocab = 2, 40
    logits = jnp.zeros((s, vocab), jnp.float32)
    words = np.zeros((s, 2), np.int32)
    words[:, 0] = 1 << 7  # only token 7
    masked = jnp.asarray([[7, -1], [-1, -1]], jnp.int32)
    out = sample(logits, _meta(s, 0.0, bitmask=jnp.asarray(words), masked=masked))
    assert np.asarray(out.token_ids).tolist() == [7, 7]
