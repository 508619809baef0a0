"""LLM.generate and the generate CLI on tiny random-weight checkpoints."""

from __future__ import annotations

import pytest

from paged_jax.llm import LLM
from paged_jax.sampling_params import SamplingParams


@pytest.fixture
def llm(small_llm):
    """tests/conftest.py's shared LLM (SMALL_LLM settings), prefix cache emptied per test."""
    return small_llm


def test_string_and_token_prompts_match_transformers(llm, model_dir, hf_greedy):
    texts = ["Hello paged world", "a", "The block table maps logical blocks to physical ones."]
    params = SamplingParams(temperature=0, max_tokens=6)
    outs = llm.generate(texts + [[5, 6, 7, 8, 9]], params, use_tqdm=False)
    assert [o.prompt for o in outs] == texts + [None]
    for o in outs:
        ids = o.prompt_token_ids
        if o.prompt is not None:
            assert ids == [b + 3 for b in o.prompt.encode()]  # byte tokenizer: id = byte + 3
            assert llm.decode(ids) == o.prompt
        want = hf_greedy(model_dir, ids, 6)
        assert o.outputs[0].token_ids == want
        assert o.outputs[0].text == llm.decode(want)
        assert o.metrics.time_to_first_token is not None and o.metrics.time_to_first_token >= 0


def test_parallel_sampling_is_distinct_reproducible_and_shares_blocks(llm):
    prompt = list(range(3, 40))
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8)
    hits_before = llm.get_stats()["prefix_cache_hits"]
    a = llm.generate([prompt], params, use_tqdm=False)[0]
    b = llm.generate([prompt], params, use_tqdm=False)[0]
    samples = [tuple(c.token_ids) for c in a.outputs]
    assert len(samples) == 4 and len(set(samples)) > 1, "children should differ"
    assert samples == [tuple(c.token_ids) for c in b.outputs], "seeded runs should repeat"
    assert [c.index for c in a.outputs] == [0, 1, 2, 3]
    assert llm.get_stats()["prefix_cache_hits"] > hits_before


def test_stop_token_ids_and_stop_strings_cut_at_the_right_place(llm):
    prompt = "Stop here?"
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    toks = full.outputs[0].token_ids
    out = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[toks[3]]),
        use_tqdm=False,
    )[0].outputs[0]
    k = toks.index(toks[3])
    assert out.token_ids == toks[: k + 1] and out.finish_reason == "stop"
    assert out.stop_reason == toks[3]
    # A one-character ASCII stop string taken from the greedy output itself.
    k = next(i for i, t in enumerate(toks) if len(s := llm.decode([t])) == 1 and s.isalnum())
    stop = llm.decode([toks[k]])
    out = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=24, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == toks[: k + 1]
    assert out.text == llm.decode(toks[:k])


def test_bad_prompts_raise_naming_the_index_and_nothing_runs(llm):
    with pytest.raises(ValueError, match=r"prompts\[1\]: .*must be < vocab_size"):
        llm.generate([[1, 2], [1, 999]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    with pytest.raises(
        ValueError, match=r"engine argument max_seqs=4 is not an EngineConfig field"
    ):
        LLM("/nonexistent", max_seqs=4)
    with pytest.raises(FileNotFoundError, match="must be a Hugging Face model directory"):
        LLM("/nonexistent/dir")


def test_beam_search_api_returns_vllm_shaped_outputs_equal_to_transformers(llm, model_dir):
    import torch
    import transformers

    from paged_jax import BeamSearchParams

    prompts = ["Hello paged", [5, 6, 7, 8, 9]]
    params = BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True, length_penalty=0.0)
    outs = llm.beam_search(prompts, params)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="eager", dtype=torch.float32
    ).eval()
    hf.generation_config.eos_token_id = None
    assert len(outs) == 2
    for prompt, out in zip(prompts, outs):
        ids = llm.encode(prompt) if isinstance(prompt, str) else prompt
        t = torch.tensor([ids])
        with torch.no_grad():
            want = hf.generate(
                t,
                attention_mask=torch.ones_like(t),
                num_beams=2,
                num_return_sequences=2,
                max_new_tokens=5,
                do_sample=False,
                length_penalty=0.0,
                eos_token_id=None,
                pad_token_id=0,
            ).tolist()
        assert [s.tokens for s in out.sequences] == want  # prompt + generated, best first
        assert out.sequences[0].cum_logprob >= out.sequences[1].cum_logprob
        for s in out.sequences:
            assert s.text == llm.decode(s.tokens) and s.finish_reason == "length"
    with pytest.raises(ValueError, match="params=.* must be a BeamSearchParams"):
        llm.beam_search(prompts, SamplingParams())
    with pytest.raises(ValueError, match=r"prompts\[0\]=.* must be a non-empty list of token ids"):
        llm.beam_search([[1, 999]], params)
