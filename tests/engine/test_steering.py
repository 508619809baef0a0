"""Steering vectors: EngineConfig(steering_layers=...) + SamplingParams(steering_vectors=...).

The engine must equal transformers with a forward hook that adds the same vector to the
same decoder layer's output: greedy tokens equal, logprobs within 1e-4, for a steered
request batched with an unsteered one (which must equal the plain model). Steered and
unsteered KV never share cached blocks; bad layers and lengths are ValueErrors naming
them; nothing compiles after warm-up.
"""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax import SamplingParams
from paged_jax.config import EngineConfig

# Logprobs of a 128-token vocabulary from 64-wide f32 matmuls: ~1e-6 of error.
TOL = 1e-4


def _prompt(seed: int, length: int, vocab: int = 128) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, length)]


def _vectors(seed: int) -> dict[int, list[float]]:
    rng = np.random.default_rng(seed)
    return {0: list(rng.normal(0, 2, 64).astype(np.float32)), 1: list(rng.normal(0, 2, 64))}


@pytest.fixture
def steered_llm(activations_llm):
    """The shared activations engine (tests/engine/conftest.py): steering_layers (0, 1)."""
    return activations_llm


@pytest.fixture(scope="module")
def hf_steered_logprobs():
    """(path, ids, vectors) -> f64[L, V] log-softmax of transformers with the vectors added
    to the decoder layers' outputs by forward hooks."""
    import torch
    import transformers

    models = {}

    def run(path, ids, vectors):
        if path not in models:
            models[path] = transformers.AutoModelForCausalLM.from_pretrained(
                path, attn_implementation="eager", dtype=torch.float32
            ).eval()
        model = models[path]
        handles = []
        for layer, vector in (vectors or {}).items():
            v = torch.as_tensor(np.asarray(vector, np.float32))

            def add(_module, _inputs, output, v=v):
                if isinstance(output, tuple):
                    return (output[0] + v, *output[1:])
                return output + v

            handles.append(model.model.layers[layer].register_forward_hook(add))
        try:
            with torch.no_grad():
                logits = model(torch.as_tensor([ids])).logits[0].double().numpy()
        finally:
            for h in handles:
                h.remove()
        top = logits.max(-1, keepdims=True)
        return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))

    return run


def test_steering_equals_a_transformers_forward_hook(steered_llm, hf_steered_logprobs):
    llm, path = steered_llm
    prompt = _prompt(1, 21)
    vectors = _vectors(2)
    steered = SamplingParams(
        temperature=0.0,
        max_tokens=5,
        ignore_eos=True,
        logprobs=0,
        prompt_logprobs=0,
        steering_vectors=vectors,
    )
    plain = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0)
    outs = llm.generate([prompt, prompt], [steered, plain], use_tqdm=False)
    for out, vecs in ((outs[0], vectors), (outs[1], None)):
        tokens = out.outputs[0].token_ids
        ref = hf_steered_logprobs(str(path), prompt + tokens, vecs)
        p = len(prompt)
        assert tokens == [int(t) for t in ref[p - 1 : p + 4].argmax(-1)], "greedy tokens"
        got = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)]
        want = [ref[p - 1 + j, t] for j, t in enumerate(tokens)]
        np.testing.assert_allclose(got, want, atol=TOL)
    # The steered prompt's own rows are steered too (prompt logprobs read them).
    got = [next(iter(e.values())).logprob for e in outs[0].prompt_logprobs[1:]]
    ref = hf_steered_logprobs(str(path), prompt, vectors)
    want = [ref[i - 1, prompt[i]] for i in range(1, len(prompt))]
    np.testing.assert_allclose(got, want, atol=TOL)
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids, "vectors changed nothing"
    assert llm.get_stats()["num_compiles_after_warmup"] == 0


def test_steered_and_unsteered_kv_are_never_shared(steered_llm):
    llm, _ = steered_llm
    prompt = _prompt(5, 24)
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    steered = SamplingParams(temperature=0.0, max_tokens=2, steering_vectors=_vectors(6))
    other = SamplingParams(temperature=0.0, max_tokens=2, steering_vectors=_vectors(7))
    assert llm.generate([prompt], plain)[0].metrics.num_cached_tokens == 0
    assert llm.generate([prompt], steered)[0].metrics.num_cached_tokens == 0
    assert llm.generate([prompt], other)[0].metrics.num_cached_tokens == 0
    # The same vectors share their own blocks.
    assert llm.generate([prompt], steered)[0].metrics.num_cached_tokens == 20
    assert llm.generate([prompt], plain)[0].metrics.num_cached_tokens == 20
    assert llm.get_stats()["num_compiles_after_warmup"] == 0


def test_bad_steering_is_a_value_error_naming_it(steered_llm, small_llm):
    llm, _ = steered_llm
    vec = [0.0] * 64
    with pytest.raises(ValueError, match=r"steering_vectors layer 3 must be one of .*\(0, 1\)"):
        llm.generate([[5, 6]], SamplingParams(steering_vectors={3: vec}))
    with pytest.raises(ValueError, match=r"steering_vectors\[1\] has length 3; expected hidden"):
        llm.generate([[5, 6]], SamplingParams(steering_vectors={1: [1.0, 2.0, 3.0]}))
    with pytest.raises(ValueError, match="steering_vectors layer 0 must be one of .*\\(\\)"):
        small_llm.generate([[5, 6]], SamplingParams(steering_vectors={0: vec}))
    with pytest.raises(ValueError, match="steering_vectors"):
        SamplingParams(steering_vectors={0: [float("inf")]})
    with pytest.raises(ValueError, match="steering_layers"):
        EngineConfig(steering_layers=(-1,))
