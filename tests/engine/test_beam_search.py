"""Beam search through the engine against transformers' generate(num_beams=W) on a tiny Llama.

The beams are forked engine requests that share KV blocks and copy the partial
last block on write; transformers keeps one dense cache per beam. Equal tokens
and cum_logprobs within 1e-3 mean the forks, copies and frees lost nothing.
"""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax import BeamSearchParams
from paged_jax.beam_search import run_beam_search
from paged_jax.config import EngineConfig
from paged_jax.constants import cdiv
from paged_jax.engine import Engine
from paged_jax.models import load_model

BS = 4
TOL = 1e-3


@pytest.fixture(scope="module")
def llama_dir(tiny_hf_checkpoint):
    return tiny_hf_checkpoint("llama")


@pytest.fixture(scope="module")
def engine(llama_dir):
    model = load_model(llama_dir, attention_backend="reference")
    config = EngineConfig(
        block_size=BS,
        max_num_seqs=16,
        max_num_batched_tokens=32,
        max_model_len=128,
        attention_backend="reference",
    )
    engine = Engine(model, config)
    engine.warmup()
    return engine


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 128, n).tolist() for n in (5, 11, 17)]


@pytest.fixture(scope="module")
def hf_beams(llama_dir):
    """(prompt, W, max_new, eos, **generate kwargs) -> [(generated ids, score)], best first."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        llama_dir, attn_implementation="eager", dtype=torch.float32
    ).eval()

    def run(prompt, width, max_new, eos=None, **kwargs):
        model.generation_config.eos_token_id = eos  # None: no EOS in play
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                num_beams=width,
                num_return_sequences=width,
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=0,
                return_dict_in_generate=True,
                output_scores=True,
                **kwargs,
            )
        beams = []
        for seq, score in zip(out.sequences.tolist(), out.sequences_scores.tolist()):
            gen = seq[len(prompt) :]
            if eos is not None and eos in gen:  # shorter beams are padded after their EOS
                gen = gen[: gen.index(eos) + 1]
            beams.append((gen, score))
        return beams

    return run


def assert_pool_drained(engine):
    kv = engine.kv_cache_manager
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert not engine.has_unfinished()
    assert engine.step() == []  # drops the rows of the requests aborted last
    assert engine.input_batch.row_of == {}


@pytest.mark.parametrize(
    ("width", "length_penalty"),
    [(2, 0.0), (4, 0.0), (3, 1.0)],  # equal lengths (no EOS): the penalty keeps the order
)
def test_beams_equal_transformers_without_eos(engine, prompts, hf_beams, width, length_penalty):
    params = BeamSearchParams(width, 6, ignore_eos=True, length_penalty=length_penalty)
    outs = run_beam_search(engine, prompts, params)
    for prompt, out in zip(prompts, outs):
        want = hf_beams(prompt, width, 6, length_penalty=length_penalty)
        assert [s.output_token_ids for s in out.sequences] == [g for g, _ in want]
        for seq, (_, score) in zip(out.sequences, want):
            assert seq.tokens[: len(prompt)] == prompt
            assert abs(seq.score - score) <= TOL
            assert abs(seq.cum_logprob - score * 6**length_penalty) <= TOL * 6**length_penalty
            assert seq.finish_reason == "length"
    assert_pool_drained(engine)


@pytest.mark.parametrize("early_stopping", [False, True])
@pytest.mark.parametrize("eos", [14, 84])
def test_hf_semantics_with_eos_and_length_penalty_equal_transformers(
    engine, prompts, hf_beams, eos, early_stopping, monkeypatch
):
    # Tokens these prompts' beams produce often; the same weights with this EOS id.
    monkeypatch.setattr(engine, "eos_token_ids", (eos,))
    params = BeamSearchParams(3, 8, early_stopping=early_stopping)  # length_penalty 1.0
    outs = run_beam_search(engine, prompts, params)
    num_stopped = 0
    for prompt, out in zip(prompts, outs):
        want = hf_beams(prompt, 3, 8, eos=eos, early_stopping=early_stopping)
        assert [s.output_token_ids for s in out.sequences] == [g for g, _ in want]
        for seq, (gen, score) in zip(out.sequences, want):
            assert abs(seq.score - score) <= TOL
            # HF's score: cum_logprob / generated length (EOS included, prompt not).
            assert abs(seq.cum_logprob / len(gen) - seq.score) <= 1e-6
            stopped = gen[-1] == eos
            assert seq.finish_reason == ("stop" if stopped else "length")
            num_stopped += stopped
    assert num_stopped > 0, "the EOS id was meant to end some beams"
    assert_pool_drained(engine)


def test_forks_and_independent_requests_find_the_same_beams(engine, prompts):
    params = BeamSearchParams(3, 5, ignore_eos=True, length_penalty=0.0)
    forked = run_beam_search(engine, prompts, params)
    independent = run_beam_search(engine, prompts, params, forks=False)
    for a, b in zip(forked, independent):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        for x, y in zip(a.sequences, b.sequences):
            assert abs(x.cum_logprob - y.cum_logprob) <= TOL
    assert_pool_drained(engine)


def test_width_4_on_a_long_prompt_holds_one_prompt_copy_plus_beam_tails(engine):
    prompt = np.random.default_rng(5).integers(3, 128, 102).tolist()
    width, max_tokens = 4, 8
    peak = [0]

    def on_step(e):
        kv = e.kv_cache_manager
        peak[0] = max(peak[0], kv.num_usable_blocks - kv.num_free_blocks)

    params = BeamSearchParams(width, max_tokens, ignore_eos=True)
    (out,) = run_beam_search(engine, [prompt], params, on_step=on_step)
    assert len(out.sequences) == width
    prompt_blocks = cdiv(len(prompt), BS)
    # Each beam owns at most its copied partial block plus the blocks of its tail;
    # W + 1 requests live for a moment while a step's forks are made.
    tails = (width + 1) * cdiv(len(prompt) % BS + max_tokens, BS)
    assert prompt_blocks < peak[0] <= prompt_blocks + tails
    unshared = width * cdiv(len(prompt) + max_tokens, BS)
    assert peak[0] < 0.5 * unshared, (peak[0], unshared)
    assert_pool_drained(engine)


def test_max_model_len_caps_the_beams(engine):
    prompt = list(range(3, 3 + 124))  # max_model_len 128: room for 4 tokens
    (out,) = run_beam_search(engine, [prompt], BeamSearchParams(2, 10, ignore_eos=True))
    assert {len(s.output_token_ids) for s in out.sequences} == {4}
    assert_pool_drained(engine)
