"""Prompt embeddings: EngineConfig(enable_prompt_embeds=True) + {"prompt_embeds": f32[T, hidden]}.

Rows taken from the input embeddings (transformers' get_input_embeddings(): the table,
scaled for Gemma) must give the token-id prompt's tokens; arbitrary
rows must equal transformers' ``inputs_embeds`` (greedy tokens, logprobs within 1e-4),
for Llama and Gemma 2,
mixed with ordinary prompts in one batch and prefilled over several steps. Prefix caching
hashes each block's embedding bytes (a shared prefix of rows hits). Nothing compiles after
warm-up.
"""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax import LLM, SamplingParams

CHUNKED = dict(
    block_size=4,
    max_num_seqs=4,
    max_num_batched_tokens=16,
    max_model_len=64,
    attention_backend="reference",
)
TOL = 1e-4  # logprobs over a 128-token vocabulary from 64-wide f32 matmuls: ~1e-6 of error
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)


def _prompt(seed: int, length: int, vocab: int = 128) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, length)]


@pytest.fixture(scope="module")
def _made():
    return {}  # family -> (LLM or None, transformers model)


@pytest.fixture
def embeds_llms(_made, activations_llm, tiny_hf_checkpoint):
    """family -> (LLM, transformers model). Llama is the shared activations engine
    (tests/engine/conftest.py: enable_prompt_embeds among its options); Gemma 2 its own."""
    import torch
    import transformers

    def get(family: str):
        if family not in _made:
            if family == "llama":
                llm, path = activations_llm
            else:
                path = tiny_hf_checkpoint(family)
                llm = LLM(str(path), enable_prompt_embeds=True, **CHUNKED)
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                path, attn_implementation="eager", dtype=torch.float32
            ).eval()
            _made[family] = llm, hf
        return _made[family]

    return get


def input_embeddings(hf, ids: list[int]) -> np.ndarray:
    """f32[L, hidden]: transformers' get_input_embeddings() of ids (Gemma's scale included)."""
    import torch

    with torch.no_grad():
        return hf.get_input_embeddings()(torch.as_tensor(ids)).numpy()


def hf_logprobs(hf, embeds: np.ndarray, generated: list[int]) -> np.ndarray:
    """f64[L, V] log-softmax of transformers fed inputs_embeds: the prompt rows, then the
    input embeddings of the generated tokens."""
    import torch

    rows = np.concatenate([embeds, input_embeddings(hf, generated)]).astype(np.float32)
    with torch.no_grad():
        logits = hf(inputs_embeds=torch.as_tensor(rows[None])).logits[0].double().numpy()
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_prompt_embeds_equal_transformers_inputs_embeds(embeds_llms, family):
    llm, hf = embeds_llms(family)
    prompt = _prompt(1, 21)
    table_rows = input_embeddings(hf, prompt)
    arbitrary = np.random.default_rng(2).normal(0, 1, (19, 64)).astype(np.float32)
    # One batch: table rows of `prompt`, the same prompt as token ids, arbitrary rows.
    outs = llm.generate(
        [{"prompt_embeds": table_rows}, prompt, {"prompt_embeds": arbitrary}],
        GREEDY,
        use_tqdm=False,
    )
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert outs[0].prompt_token_ids == [0] * 21, "placeholders stand for the rows"
    for out, embeds in ((outs[0], table_rows), (outs[2], arbitrary)):
        tokens = out.outputs[0].token_ids
        ref = hf_logprobs(hf, embeds, tokens[:-1])
        p = len(embeds)
        assert tokens == [int(t) for t in ref[p - 1 :].argmax(-1)], "greedy tokens"
        got = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)]
        want = [ref[p - 1 + j, t] for j, t in enumerate(tokens)]
        np.testing.assert_allclose(got, want, atol=TOL)
    assert llm.get_stats()["num_compiles_after_warmup"] == 0


def test_prefix_caching_hashes_the_embedding_bytes(embeds_llms):
    llm, _ = embeds_llms("llama")
    rng = np.random.default_rng(5)
    a = rng.normal(0, 1, (12, 64)).astype(np.float32)
    b = a.copy()
    b[0, 0] += 1e-3  # one value differs: no block may be shared
    params = SamplingParams(temperature=0.0, max_tokens=2)
    assert llm.generate({"prompt_embeds": a}, params)[0].metrics.num_cached_tokens == 0
    assert llm.generate({"prompt_embeds": b}, params)[0].metrics.num_cached_tokens == 0
    assert llm.generate([[0] * 12], params)[0].metrics.num_cached_tokens == 0
    again = llm.generate({"prompt_embeds": a.copy()}, params)[0]
    assert again.metrics.num_cached_tokens == 8  # its own full blocks, the last token recomputed
    # Each block hashes its own rows: a prompt sharing a's first 9 rows hits its first two
    # blocks (8 tokens), and gives what it gives with nothing cached.
    c = np.concatenate([a[:9], rng.normal(0, 1, (5, 64)).astype(np.float32)])
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=0)
    hit = llm.generate({"prompt_embeds": c}, greedy)[0]
    assert hit.metrics.num_cached_tokens == 8
    assert llm.engine.kv_cache_manager.reset_prefix_cache()
    cold = llm.generate({"prompt_embeds": c}, greedy)[0]
    assert cold.metrics.num_cached_tokens == 0
    assert hit.outputs[0].token_ids == cold.outputs[0].token_ids
    np.testing.assert_allclose(
        [next(iter(e.values())).logprob for e in hit.outputs[0].logprobs],
        [next(iter(e.values())).logprob for e in cold.outputs[0].logprobs],
        atol=TOL,
    )
    assert llm.get_stats()["num_compiles_after_warmup"] == 0


def test_bad_prompt_embeds_are_value_errors_naming_them(embeds_llms, small_llm):
    llm, _ = embeds_llms("llama")
    rows = np.zeros((3, 64), np.float32)
    with pytest.raises(ValueError, match=r"prompt_embeds.shape=\(3, 8\) must be"):
        llm.generate({"prompt_embeds": np.zeros((3, 8), np.float32)}, GREEDY)
    with pytest.raises(ValueError, match="finite"):
        llm.generate({"prompt_embeds": rows + np.nan}, GREEDY)
    with pytest.raises(ValueError, match="not both"):
        llm.generate({"prompt_embeds": rows, "prompt_token_ids": [1, 2, 3]}, GREEDY)
    with pytest.raises(ValueError, match="enable_prompt_embeds=True"):
        small_llm.generate({"prompt_embeds": rows}, GREEDY)
    # The engine keeps serving.
    assert len(llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids) == 4


def test_beam_search_with_table_rows_equals_the_token_prompt(embeds_llms):
    """Beam search over an embedded prompt (the table's rows of a token prompt) finds the
    token prompt's beams, with forked beams and with every beam started afresh (its
    embedded prompt followed by its tokens)."""
    from paged_jax import BeamSearchParams
    from paged_jax.beam_search import run_beam_search

    llm, hf = embeds_llms("llama")
    prompt = _prompt(8, 11)
    rows = input_embeddings(hf, prompt)
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    want = llm.beam_search([prompt], params)[0].sequences
    got = llm.beam_search([{"prompt_embeds": rows}], params)[0].sequences
    fresh = run_beam_search(
        llm.engine, [[0] * len(prompt)], params, forks=False, prompt_embeds=[rows]
    )[0].sequences
    for seqs in (got, fresh):
        assert [s.tokens[len(prompt) :] for s in seqs] == [s.tokens[len(prompt) :] for s in want]
        assert all(s.tokens[: len(prompt)] == [0] * len(prompt) for s in seqs)  # placeholders
        np.testing.assert_allclose(
            [s.cum_logprob for s in seqs], [s.cum_logprob for s in want], atol=4 * TOL
        )
    with pytest.raises(ValueError, match=r"prompts\[0\]: prompt_embeds.shape=\(3, 8\)"):
        llm.beam_search([{"prompt_embeds": np.zeros((3, 8), np.float32)}], params)
    assert llm.get_stats()["num_compiles_after_warmup"] == 0
