"""LLM API as vLLM users expect: penalties vs transformers, stop-text rules, chat, isolation."""

from __future__ import annotations

import pytest

from paged_jax.engine import EngineOutput
from paged_jax.output_processor import completion_output
from paged_jax.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 5, 6], [40, 41, 42], [100, 3, 100, 3, 100]]


@pytest.fixture
def llm(small_llm):
    """tests/conftest.py's shared LLM (SMALL_LLM settings), prefix cache emptied per test."""
    return small_llm


@pytest.fixture(scope="module")
def hf_generate(model_dir):
    """(prompt ids, max_new, **generate kwargs) -> greedy ids from transformers."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="eager", dtype=torch.float32
    ).eval()

    def run(prompt, max_new, **kwargs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
                **kwargs,
            )
        return out[0, len(prompt) :].tolist()

    return run


def test_repetition_penalty_matches_transformers_generate(llm, hf_generate):
    params = SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.8)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    for prompt, out, base in zip(PROMPTS, outs, plain):
        assert out.outputs[0].token_ids == hf_generate(prompt, 12, repetition_penalty=1.8)
        assert base.outputs[0].token_ids == hf_generate(prompt, 12)
    assert any(o.outputs[0].token_ids != b.outputs[0].token_ids for o, b in zip(outs, plain))
    assert llm.get_stats()["num_compiles_after_warmup"] == 0


def test_presence_and_frequency_penalties_match_the_openai_formula(llm, hf_generate):
    torch = pytest.importorskip("torch")
    from transformers import LogitsProcessor, LogitsProcessorList

    class OpenAIPenalties(LogitsProcessor):
        """logit -= frequency * count(output) + presence * [count(output) > 0]."""

        def __init__(self, prompt_len, presence, frequency):
            self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

        def __call__(self, input_ids, scores):
            counts = torch.zeros_like(scores)
            out = input_ids[:, self.prompt_len :]
            counts.scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
            return scores - self.frequency * counts - self.presence * (counts > 0).float()

    mixed = [
        SamplingParams(temperature=0, max_tokens=10, presence_penalty=1.5),
        SamplingParams(temperature=0, max_tokens=10, frequency_penalty=0.9),
        SamplingParams(temperature=0, max_tokens=10),  # no penalty beside penalised rows
    ]
    outs = llm.generate(PROMPTS, mixed, use_tqdm=False)
    for prompt, out, p in zip(PROMPTS, outs, mixed):
        proc = OpenAIPenalties(len(prompt), p.presence_penalty, p.frequency_penalty)
        want = hf_generate(prompt, 10, logits_processor=LogitsProcessorList([proc]))
        assert out.outputs[0].token_ids == want
    assert llm.get_stats()["num_compiles_after_warmup"] == 0


def _finished(token_ids, stop_reason=None, finish_reason="stop"):
    return EngineOutput("r", [1], token_ids, finish_reason, stop_reason=stop_reason)


def test_stop_text_rules_follow_vllm(llm):
    h, i, bos, eos = 72 + 3, 105 + 3, 1, 2  # byte tokenizer: id = byte + 3

    def done(index, out, params):
        return completion_output(index, out, params, llm.decode)

    # EOS ends the output: its id stays in token_ids, its text never shows.
    out = done(0, _finished([h, bos, i, eos]), SamplingParams())
    assert out.token_ids == [h, bos, i, eos] and out.text == "Hi"
    raw = SamplingParams(skip_special_tokens=False)
    assert done(0, _finished([h, bos, i, eos]), raw).text == "H<s>i"
    keep = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True)
    assert done(0, _finished([h, bos, i, eos]), keep).text == "H<s>i</s>"
    # A stop token id that is an ordinary token: its text is left out unless asked for.
    assert done(0, _finished([h, i, h], stop_reason=h), SamplingParams()).text == "Hi"
    with_stop = SamplingParams(include_stop_str_in_output=True)
    assert done(0, _finished([h, i, h], stop_reason=h), with_stop).text == "HiH"
    # A stop string is cut off (or kept up to its end); a length finish keeps everything.
    ids = [h, i, 32 + 3, h, i]  # "Hi Hi"
    assert done(0, _finished(ids, stop_reason=" H"), SamplingParams()).text == "Hi"
    assert done(0, _finished(ids, stop_reason=" H"), with_stop).text == "Hi H"
    assert done(0, _finished(ids, finish_reason="length"), SamplingParams()).text == "Hi Hi"


def test_generate_iter_isolates_bad_prompts(llm):
    params = SamplingParams(temperature=0, max_tokens=4)
    prompts = ["ok one", "", [1, 999], list(range(3, 200)), {"prompt_token_ids": [7, 8, 9]}]
    got = dict(llm.generate_iter(prompts, params))
    assert sorted(got) == [0, 1, 2, 3, 4]
    errors = {i: o.error for i, o in got.items() if o.error}
    assert sorted(errors) == [1, 2, 3]
    assert "must be a non-empty string" in errors[1]
    assert "must be < vocab_size" in errors[2]
    assert "must be < max_model_len" in errors[3]
    good = llm.generate(["ok one", [7, 8, 9]], params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == good[0].outputs[0].token_ids
    assert got[4].outputs[0].token_ids == good[1].outputs[0].token_ids
    assert not llm.engine.has_unfinished()


def test_chat_renders_with_the_template_and_generates(llm):
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    template += "{% if add_generation_prompt %}<assistant>{% endif %}"
    conv = [{"role": "system", "content": "Be short."}, {"role": "user", "content": "Hi"}]
    params = SamplingParams(temperature=0, max_tokens=5)
    outs = llm.chat([conv, conv[1:]], params, chat_template=template, use_tqdm=False)
    text = "<system>Be short.<user>Hi<assistant>"
    assert outs[0].prompt == text and outs[1].prompt == "<user>Hi<assistant>"
    assert outs[0].prompt_token_ids == [b + 3 for b in text.encode()]
    want = llm.generate([text], params, use_tqdm=False)[0].outputs[0].token_ids
    assert outs[0].outputs[0].token_ids == want
    one = llm.chat(conv, params, chat_template=template, add_generation_prompt=False)
    assert one[0].prompt == "<system>Be short.<user>Hi"
    with pytest.raises(ValueError, match="has no chat template"):
        llm.chat(conv, params)
