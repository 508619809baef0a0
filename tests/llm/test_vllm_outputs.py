"""vLLM's output surface on LLM: Logprob objects, cumulative_logprob, get_tokenizer(),
LLM(chat_template=...), and how generate and generate_iter report bad prompts."""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax import LLM, Logprob, SamplingParams
from paged_jax.engine import NONFINITE_LOGITS_ERROR
from paged_jax.testing.fake_model import SumModel, SumModelConfig

SMALL = dict(block_size=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128)


@pytest.fixture
def llm(small_llm):
    """tests/conftest.py's shared LLM (SMALL_LLM settings), prefix cache emptied per test."""
    return small_llm


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    top = logits.max(axis=-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))


def test_logprobs_are_logprob_objects_with_real_ranks_and_decoded_tokens(llm, model_dir, hf_logits):
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=8, logprobs=2)
    out = llm.generate(["Paged attention"], params, use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids)
    ref = _log_softmax(hf_logits(model_dir, np.asarray([out.prompt_token_ids + c.token_ids]))[0])
    start = len(out.prompt_token_ids) - 1
    outside_top = 0
    for j, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        dist = ref[start + j]
        assert next(iter(entry)) == token, "the sampled token comes first"
        assert all(isinstance(lp, Logprob) for lp in entry.values())
        sampled = entry[token]
        assert sampled.logprob == pytest.approx(dist[token], abs=2e-4)
        # Its real rank in the raw distribution, even outside the top 2.
        lo = int((dist > dist[token] + 1e-5).sum()) + 1
        hi = int((dist >= dist[token] - 1e-5).sum())
        assert lo <= sampled.rank <= hi
        outside_top += sampled.rank > 2
        ranks = sorted(lp.rank for tid, lp in entry.items() if tid != token or lp.rank <= 2)
        assert ranks[:2] == [1, 2]
        for tid, lp in entry.items():
            assert lp.decoded_token == llm.get_tokenizer().decode([tid], skip_special_tokens=False)
    assert outside_top > 0, "temperature 1 on random weights samples outside the top 2"
    assert c.cumulative_logprob == pytest.approx(
        sum(entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs))
    )


def test_cumulative_logprob_is_set_per_completion_only_with_logprobs(llm):
    prompt = list(range(3, 30))
    with_lp = SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=5, logprobs=0)
    out = llm.generate([prompt], with_lp, use_tqdm=False)[0]
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids) and all(len(e) == 1 for e in c.logprobs)
        assert c.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs))
        )
        assert c.cumulative_logprob < 0
    plain = llm.generate([prompt], SamplingParams(n=2, seed=9, max_tokens=5), use_tqdm=False)[0]
    assert [c.logprobs for c in plain.outputs] == [None, None]
    assert [c.cumulative_logprob for c in plain.outputs] == [None, None]


def test_get_tokenizer_returns_the_tokenizer_in_use_or_none(llm):
    tok = llm.get_tokenizer()
    assert tok is llm.tokenizer
    assert llm.encode("hi") == tok.encode("hi").ids
    model = SumModel(SumModelConfig(vocab_size=50, max_position_embeddings=32))
    bare = LLM(model, warmup=False, block_size=4, num_kv_blocks=16, max_num_seqs=2)
    assert bare.get_tokenizer() is None
    out = bare.generate([[1, 2]], SamplingParams(max_tokens=2, logprobs=1), use_tqdm=False)[0]
    entry = out.outputs[0].logprobs[0]
    assert all(lp.decoded_token is None for lp in entry.values())


def test_chat_template_given_to_llm_is_used_unless_the_call_gives_one(model_dir):
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    llm = LLM(str(model_dir), warmup=False, chat_template=template, **SMALL)
    messages = [{"role": "user", "content": "hi"}]
    assert llm.render_chat(messages)[0]["prompt"] == "<user>hi"
    other = "[{{ messages[0]['content'] }}]"
    assert llm.render_chat(messages, chat_template=other)[0]["prompt"] == "[hi]"


def test_generate_raises_the_error_generate_iter_reports(llm):
    prompts = ["fine", [1, 2, 10**6]]
    with pytest.raises(ValueError, match=r"^prompts\[1\]: prompt_token_ids contains 1000000") as e:
        llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    got = dict(llm.generate_iter(prompts, SamplingParams(max_tokens=2)))
    assert got[1].error == str(e.value) and got[1].outputs == []
    assert got[0].error is None and got[0].outputs[0].finish_reason == "length"
    assert llm.get_stats()["num_compiles_after_warmup"] == 0


def test_a_request_failing_while_running_has_its_error_in_generate_and_generate_iter():
    bad = 5  # SumModel poisons the logits after this token
    model = SumModel(
        SumModelConfig(vocab_size=50, max_position_embeddings=32, nonfinite_token_id=bad)
    )
    llm = LLM(model, warmup=False, block_size=4, num_kv_blocks=16, max_num_seqs=2)
    prompts = [[1, 2, 3], [7, 8, bad]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    assert outs[0].error is None and outs[0].outputs[0].finish_reason == "length"
    assert outs[1].outputs[0].finish_reason == "error"
    assert outs[1].error == NONFINITE_LOGITS_ERROR
    got = dict(llm.generate_iter(prompts, SamplingParams(max_tokens=2)))
    assert [got[i].error for i in (0, 1)] == [None, NONFINITE_LOGITS_ERROR]
