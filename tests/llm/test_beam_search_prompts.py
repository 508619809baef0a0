"""LLM.beam_search takes every prompt form generate takes (vLLM's call shape included).

Issue 38 item 9: ``llm.beam_search([{"prompt": ...}], params)`` raised TypeError ('<='
between int and str) while generate accepted the dicts. On SumModel with the byte
tokenizer: no weights, milliseconds a step.
"""

from __future__ import annotations

import pytest

from paged_jax.beam_search import BeamSearchParams
from paged_jax.entrypoints.demo import build_byte_tokenizer
from paged_jax.llm import LLM
from paged_jax.testing.fake_model import SumModel, SumModelConfig

VOCAB = 259  # the byte tokenizer's: 3 special tokens + 256 bytes
PARAMS = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    model = SumModel(SumModelConfig(vocab_size=VOCAB, max_position_embeddings=64))
    return LLM(
        model,
        tokenizer=build_byte_tokenizer(),
        warmup=False,
        block_size=4,
        num_kv_blocks=64,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        attention_backend="reference",
    )


def _beams(out):
    return [(s.tokens, s.cum_logprob, s.text) for s in out.sequences]


def test_beam_search_takes_the_prompt_forms_generate_takes(llm):
    ids = llm.encode("Hello")
    forms = [
        "Hello",
        ids,
        {"prompt": "Hello"},
        {"prompt_token_ids": ids},
        {"prompt": "Hello", "prompt_token_ids": ids},
    ]
    outs = llm.beam_search(forms, PARAMS)
    assert len(outs) == len(forms)
    want = _beams(outs[0])
    assert len(want) == PARAMS.beam_width and all(t[: len(ids)] == ids for t, *_ in want)
    for form, out in zip(forms, outs):
        assert _beams(out) == want, form
    # One dict alone is one prompt, as in generate.
    (one,) = llm.beam_search({"prompt": "Hello"}, PARAMS)
    assert _beams(one) == want
    # generate takes the same list.
    assert len(llm.generate(forms, use_tqdm=False)) == len(forms)


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ({"text": "Hi"}, r"prompts\[1\]: prompt key 'text' must be one of"),
        ({"prompt": 5}, r"prompts\[1\]: prompt=\{'prompt': 5\} must hold 'prompt' or"),
        ({"prompt": ""}, r"prompts\[1\]: prompt='' must be a non-empty string"),
        ({"prompt_token_ids": 7}, r"prompts\[1\]: prompt_token_ids=7 must be a list of"),
        ({"prompt_token_ids": "abc"}, r"prompts\[1\]: prompt_token_ids='abc' must be a list"),
        ({"prompt_token_ids": []}, r"prompts\[1\]=\[\] must be a non-empty list of token ids"),
        ({"prompt_token_ids": [1, "a"]}, r"prompts\[1\]=\[1, 'a'\] must be a non-empty list"),
        ([5, VOCAB], rf"prompts\[1\]=\[5, {VOCAB}\] must be .* < vocab_size={VOCAB}"),
        (3.5, r"prompts\[1\]=3.5 must be a string or a list of token ids"),
    ],
)
def test_bad_beam_search_prompts_name_the_field(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.beam_search(["ok", prompt], PARAMS)
    assert not llm.engine.has_unfinished()
