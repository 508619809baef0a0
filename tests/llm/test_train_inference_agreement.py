"""Train/inference agreement (issue 39 items 3 and 6).

The logprobs LLM.generate returns for its sampled tokens equal the dense forward's
(paged_jax.training, the function a trainer differentiates) log-softmax of the same
sequence within 1e-5 in f32, on Llama, Qwen3 and Gemma 2 (and Llama with
batch_invariant=True), in both logprobs modes:
"raw_logprobs" against log_softmax(logits), "processed_logprobs" against the log-softmax
of the logits the sampler draws from (worker.sampling.apply_penalties and
processed_logits applied to the dense logits). And the dense forward is differentiable
over exactly get_weights()'s parameters.

One LLM per family (module scope, f32, warmup=False: only the programs used compile).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import LLM, SamplingParams
from paged_jax.training import dense_logits, model_graphdef, sequence_logprobs
from paged_jax.worker.live_weights import flat_weights
from paged_jax.worker.sampling import apply_penalties, processed_logits

FAMILIES = ("llama", "qwen3", "gemma2")
ATOL = 1e-5
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42]]
MAX_TOKENS = 8
ENGINE = dict(
    dtype="float32",
    block_size=4,
    max_num_seqs=8,
    max_num_batched_tokens=32,
    max_model_len=64,
    warmup=False,
)


# Each family in the default mode, and Llama with batch_invariant=True (row-tiled matmuls
# and norms, one bucket: the engine's numbers still equal the dense forward's).
MODES = [(family, False) for family in FAMILIES] + [("llama", True)]


@pytest.fixture(
    scope="module",
    params=MODES,
    ids=[f + ("-batch-invariant" if invariant else "") for f, invariant in MODES],
)
def family_llm(request, tiny_hf_checkpoint):
    family, invariant = request.param
    llm = LLM(str(tiny_hf_checkpoint(family)), batch_invariant=invariant, **ENGINE)
    yield llm
    del llm


def _generated(llm: LLM, params: SamplingParams):
    """[(prompt ids, output ids, engine logprob of each output token)] per prompt."""
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    rows = []
    for prompt, out in zip(PROMPTS, outs):
        for completion in out.outputs:
            ids = list(completion.token_ids)
            lps = [completion.logprobs[t][tok].logprob for t, tok in enumerate(ids)]
            rows.append((prompt, ids, np.asarray(lps, np.float32)))
    return rows


def _dense_rows(llm: LLM, prompt, output) -> jax.Array:
    """f32[len(output), V] dense logits at the positions that predicted each output token."""
    seq = jnp.asarray([prompt + output], jnp.int32)
    logits = dense_logits(llm, llm.get_weights(), seq)[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(output)]


def _pick(logprobs: jax.Array, output) -> np.ndarray:
    return np.asarray(jnp.take_along_axis(logprobs, jnp.asarray(output)[:, None], axis=-1)[:, 0])


def test_raw_logprobs_equal_dense_log_softmax(family_llm):
    params = SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=MAX_TOKENS, logprobs=0)
    rows = _generated(family_llm, params)
    assert len(rows) == 2 * len(PROMPTS)
    for prompt, output, engine_lps in rows:
        dense = _pick(jax.nn.log_softmax(_dense_rows(family_llm, prompt, output)), output)
        np.testing.assert_allclose(engine_lps, dense, rtol=0, atol=ATOL)
        # The trainer's helper reads the same numbers from the same forward.
        mask = np.zeros((1, len(prompt) + len(output)), np.int32)
        mask[0, len(prompt) :] = 1
        total = sequence_logprobs(
            family_llm, family_llm.get_weights(), jnp.asarray([prompt + output]), mask
        )
        np.testing.assert_allclose(float(total[0]), dense.sum(), rtol=0, atol=1e-4)


def test_processed_logprobs_equal_the_sampled_distribution(family_llm):
    settings = dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.02, presence_penalty=0.5)
    params = SamplingParams(
        seed=5, max_tokens=MAX_TOKENS, logprobs=3, logprobs_mode="processed_logprobs", **settings
    )
    raw_params = SamplingParams(seed=5, max_tokens=MAX_TOKENS, logprobs=0, **settings)
    rows = _generated(family_llm, params)
    raw_rows = _generated(family_llm, raw_params)
    for (prompt, output, engine_lps), (_, raw_output, raw_lps) in zip(rows, raw_rows):
        # The mode changes what is reported, not what is sampled.
        assert output == raw_output
        n = len(output)
        logits = _dense_rows(family_llm, prompt, output)
        # Row t's history: the prompt and the first t output tokens (presence penalty).
        history = np.zeros((n, len(prompt) + n), np.int32)
        for t in range(n):
            history[t, : len(prompt) + t] = prompt + output[:t]

        def f32(v, n=n):
            return jnp.full((n,), v, jnp.float32)

        penalised = apply_penalties(
            logits,
            jnp.asarray(history),
            jnp.arange(len(prompt), len(prompt) + n, dtype=jnp.int32),
            jnp.arange(n, dtype=jnp.int32),
            f32(settings["presence_penalty"]),
            f32(0.0),
            f32(1.0),
        )
        sampled_from = processed_logits(
            penalised,
            f32(settings["temperature"]),
            jnp.full((n,), settings["top_k"], jnp.int32),
            f32(settings["top_p"]),
            f32(settings["min_p"]),
        )
        dense = _pick(jax.nn.log_softmax(sampled_from), output)
        np.testing.assert_allclose(engine_lps, dense, rtol=0, atol=ATOL)
        # Raw mode still reports the model's own distribution: the two modes differ.
        raw_dense = _pick(jax.nn.log_softmax(logits), output)
        np.testing.assert_allclose(raw_lps, raw_dense, rtol=0, atol=ATOL)
        assert np.abs(engine_lps - raw_lps).max() > 1e-3


def test_dense_forward_is_differentiable_over_get_weights(family_llm):
    weights = family_llm.get_weights()
    ids = jnp.asarray([PROMPTS[0]], jnp.int32)
    mask = np.ones(ids.shape, np.int32)
    graphdef = model_graphdef(family_llm)
    grads = jax.grad(lambda w: sequence_logprobs(graphdef, w, ids, mask).sum())(weights)
    got, want = flat_weights(grads), flat_weights(weights)
    assert got.keys() == want.keys()
    for path, grad in got.items():
        assert grad.shape == want[path].shape, path
        assert np.isfinite(np.asarray(grad)).all(), path
    # Every parameter the engine serves moves the loss (none is a dead copy).
    assert all(np.abs(np.asarray(g)).max() > 0 for g in got.values())


def test_logprobs_mode_is_checked():
    with pytest.raises(ValueError, match=r"SamplingParams.logprobs_mode='raw_logits' must be"):
        SamplingParams(logprobs_mode="raw_logits")
    assert SamplingParams().logprobs_mode == "raw_logprobs"


def test_processed_logprobs_refused_with_speculative_decoding(tiny_hf_checkpoint):
    llm = LLM(
        str(tiny_hf_checkpoint("llama")),
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        **ENGINE,
    )
    params = SamplingParams(logprobs=0, logprobs_mode="processed_logprobs")
    with pytest.raises(ValueError, match=r"prompts\[0\]: logprobs_mode='processed_logprobs'"):
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_training_helpers_name_bad_input():
    with pytest.raises(TypeError, match=r"model=int must be an LLM, an nnx.Module or"):
        model_graphdef(3)
    with pytest.raises(ValueError, match=r"input_ids has shape \(3,\); expected \[batch, seq\]"):
        dense_logits(None, None, jnp.asarray([1, 2, 3]))
    with pytest.raises(ValueError, match=r"mask has shape \(1, 2\); expected input_ids' \(1, 3\)"):
        sequence_logprobs(None, None, jnp.asarray([[1, 2, 3]]), np.ones((1, 2)))
