"""Device sampler: greedy, filters, seeds independent of batch composition."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from paged_jax.sampling_params import MAX_LOGPROBS
from paged_jax.worker.sampling import SamplingMetadata, sample


def meta(rows: int, **overrides) -> SamplingMetadata:
    base = dict(
        temperature=np.ones(rows, np.float32),
        top_k=np.zeros(rows, np.int32),
        top_p=np.ones(rows, np.float32),
        min_p=np.zeros(rows, np.float32),
        seeds=np.arange(rows, dtype=np.uint32),
        counters=np.zeros(rows, np.int32),
        masked_token_ids=np.full((rows, 4), -1, np.int32),
    )
    base.update({k: np.asarray(v, dtype=base[k].dtype) for k, v in overrides.items()})
    return SamplingMetadata(**{k: jnp.asarray(v) for k, v in base.items()})


def test_greedy_takes_argmax_and_reports_raw_logprobs():
    logits = jnp.asarray([[0.0, 3.0, 1.0, -1.0], [2.0, 0.0, 0.0, 5.0]])
    out = sample(logits, meta(2, temperature=[0.0, 0.0]))
    np.testing.assert_array_equal(out.token_ids, [1, 3])
    expected = np.log(np.exp([3.0, 5.0]) / np.exp(np.asarray(logits)).sum(-1))
    np.testing.assert_allclose(out.logprobs, expected, rtol=1e-5)
    assert out.top_token_ids.shape == (2, min(MAX_LOGPROBS, 4))
    np.testing.assert_array_equal(out.top_token_ids[:, 0], [1, 3])


def test_top_k_one_and_tiny_top_p_are_greedy():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(6, 50)).astype(np.float32))
    want = np.asarray(logits).argmax(-1)
    out = sample(logits, meta(6, top_k=[1] * 6, seeds=range(6)))
    np.testing.assert_array_equal(out.token_ids, want)
    out = sample(logits, meta(6, top_p=[1e-6] * 6, seeds=range(6)))
    np.testing.assert_array_equal(out.token_ids, want)
    out = sample(logits, meta(6, min_p=[1.0] * 6, seeds=range(6)))
    np.testing.assert_array_equal(out.token_ids, want)


def test_top_k_only_samples_among_the_k_best():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(64, 20)).astype(np.float32)
    out = sample(jnp.asarray(logits), meta(64, top_k=[3] * 64, seeds=range(64)))
    top3 = np.argsort(-logits, axis=-1)[:, :3]
    assert all(t in row for t, row in zip(np.asarray(out.token_ids), top3))
    # With 64 rows, the sampler does not always pick the argmax.
    assert (np.asarray(out.token_ids) != logits.argmax(-1)).any()


def test_top_p_keeps_the_token_that_crosses_the_threshold():
    # probs ~ [0.5, 0.3, 0.2]: top_p=0.6 keeps the first two, never the third.
    logits = np.log(np.asarray([[0.5, 0.3, 0.2]] * 200, np.float32))
    out = np.asarray(
        sample(jnp.asarray(logits), meta(200, top_p=[0.6] * 200, seeds=range(200))).token_ids
    )
    assert set(out.tolist()) == {0, 1}


def test_row_samples_do_not_depend_on_the_rest_of_the_batch():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(5, 30)).astype(np.float32)
    m = dict(
        seeds=[11, 22, 33, 44, 55], counters=[0, 3, 1, 7, 2], temperature=[1.0, 0.7, 1.3, 1.0, 0.9]
    )
    full = np.asarray(sample(jnp.asarray(logits), meta(5, **m)).token_ids)
    perm = [3, 0, 4, 1, 2]
    sub = {k: [v[i] for i in perm] for k, v in m.items()}
    permuted = np.asarray(sample(jnp.asarray(logits[perm]), meta(5, **sub)).token_ids)
    np.testing.assert_array_equal(permuted, full[perm])
    # A different counter changes the key, so the draw sequence differs over steps.
    draws = {
        int(sample(jnp.asarray(logits[:1]), meta(1, seeds=[11], counters=[c])).token_ids[0])
        for c in range(20)
    }
    assert len(draws) > 1


def test_masked_tokens_are_never_sampled():
    logits = jnp.asarray([[9.0, 0.0, 0.0, 8.0]] * 32)
    banned = np.full((32, 4), -1, np.int32)
    banned[:, 0] = 0
    out = sample(logits, meta(32, masked_token_ids=banned, seeds=range(32)))
    assert 0 not in np.asarray(out.token_ids).tolist()
    out = sample(logits, meta(32, masked_token_ids=banned, temperature=[0.0] * 32))
    assert (np.asarray(out.token_ids) == 3).all()
