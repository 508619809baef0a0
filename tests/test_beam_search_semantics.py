"""BeamSearch bookkeeping on hand-made candidates: HF vs vLLM EOS and length-penalty rules.

No engine: every expected beam and score below is worked out by hand from the rules
in docs/beam_search.md (transformers' _beam_search, vLLM's LLM.beam_search).
"""

from __future__ import annotations

import pytest

from paged_jax import BeamSearchParams
from paged_jax.beam_search import BeamSearch

EOS = 9
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 10, 11]  # 10 tokens


def run(search: BeamSearch, steps):
    for candidates in steps:
        if search.done:
            break
        search.step([candidates[len(b.tokens) and b.tokens[-1]] for b in search.running])
    assert search.done
    return [
        (s.output_token_ids, round(s.cum_logprob, 6), round(s.score, 6), s.finish_reason)
        for s in search.results(PROMPT, lambda ids: "").sequences
    ]


# Candidates keyed by the beam's last token (0 = the prompt): (token, logprob), best first.
STEP1 = {0: [(5, -0.5), (6, -0.7), (EOS, -1.0), (7, -2.0)]}
STEP2 = {
    5: [(20, -3.0), (21, -3.1), (22, -3.2), (23, -3.3)],
    6: [(30, -3.05), (31, -3.15), (32, -3.25), (33, -3.35)],
}


def test_hf_drops_an_eos_outside_the_top_w_but_vllm_finishes_it():
    params = dict(beam_width=2, max_tokens=2, length_penalty=0.0)
    hf = run(BeamSearch(10, BeamSearchParams(**params), (EOS,)), [STEP1, STEP2])
    # HF: EOS ranked 3rd of the 4 candidates (top W = 2) is discarded; both survivors
    # reach max_tokens: [5, 20] = -3.5, [6, 30] = -3.75 beat [5, 21] = -3.6? No:
    # candidates at step 2 are -3.5, -3.6, -3.7, -3.75, ... so the top 2 are [5,20], [5,21].
    assert hf == [([5, 20], -3.5, -3.5, "length"), ([5, 21], -3.6, -3.6, "length")]
    vllm = run(BeamSearch(10, BeamSearchParams(**params, semantics="vllm"), (EOS,)), [STEP1, STEP2])
    # vLLM: the EOS candidate of the prompt's top 2W finishes at -1.0 and ranks first.
    assert vllm == [([EOS], -1.0, -1.0, "stop"), ([5, 20], -3.5, -3.5, "length")]


def test_length_penalty_counts_generated_tokens_in_hf_and_the_prompt_in_vllm():
    steps = [{0: [(EOS, -1.0), (5, -1.5), (6, -4.0), (7, -5.0)]}, STEP2]
    hf = run(BeamSearch(10, BeamSearchParams(2, 2, length_penalty=1.0), (EOS,)), steps)
    # HF: [EOS] finishes with 1 generated token: score -1.0 / 1; the running beam [5]
    # continues (the running score is not length-normalised): [5, 20] = -4.5 / 2.
    assert hf == [([EOS], -1.0, -1.0, "stop"), ([5, 20], -4.5, -2.25, "length")]
    params = BeamSearchParams(2, 2, length_penalty=1.0, semantics="vllm")
    vllm = run(BeamSearch(10, params, (EOS,)), steps)
    # vLLM: lengths include the 10 prompt tokens, minus a final EOS: [EOS] -> -1.0 / 10,
    # [5, 20] -> -4.5 / 12, [5, 21] -> -4.6 / 12.
    assert vllm == [
        ([EOS], -1.0, -0.1, "stop"),
        ([5, 20], -4.5, -0.375, "length"),
    ]


def test_hf_early_stopping_true_stops_once_w_beams_finished():
    step1 = {0: [(EOS, -0.1), (5, -0.2), (6, -0.3), (7, -0.4)]}
    step2 = {
        5: [(41, -0.05), (EOS, -0.1), (42, -5.1), (43, -5.2)],
        6: [(44, -6.0), (45, -6.1), (46, -6.2), (47, -6.3)],
    }
    later = {t: [(50 + t, -1.0), (51, -1.1), (52, -1.2), (53, -1.3)] for t in range(40, 48)}
    search = BeamSearch(10, BeamSearchParams(2, 5, early_stopping=True), (EOS,))
    out = run(search, [step1, step2, later, later, later])
    # [EOS] finished at step 1 (-0.1 / 1), [5, EOS] at step 2 (-0.3 / 2): W = 2 finished.
    assert out == [([EOS], -0.1, -0.1, "stop"), ([5, EOS], -0.3, -0.15, "stop")]
    assert search.cur_len == 2  # stopped after the second step
    # early_stopping=False keeps going while the best running beam could still beat the
    # worst finished one: [5, 41] at -0.25 / 2 = -0.125 > -0.15.
    search = BeamSearch(10, BeamSearchParams(2, 5), (EOS,))
    run(search, [step1, step2, later, later, later])
    assert search.cur_len > 2


def test_ignore_eos_treats_eos_as_a_token():
    out = run(BeamSearch(10, BeamSearchParams(1, 1, ignore_eos=True), (EOS,)), [STEP1])
    assert out == [([5], -0.5, -0.5, "length")]
    out = run(BeamSearch(10, BeamSearchParams(1, 1), (EOS,)), [{0: [(EOS, -0.1), (5, -0.2)]}])
    assert out == [([EOS], -0.1, -0.1, "stop")]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(beam_width=0, max_tokens=4), r"beam_width=0 must be an int in \[1, 10\]"),
        (dict(beam_width=11, max_tokens=4), r"beam_width=11 must be"),
        (dict(beam_width=2, max_tokens=0), r"max_tokens=0 must be an int >= 1"),
        (dict(beam_width=2, max_tokens=4, semantics="x"), r"semantics='x' must be one of"),
        (dict(beam_width=2, max_tokens=4, early_stopping="no"), r"early_stopping='no' must"),
        (dict(beam_width=2, max_tokens=4, temperature=-1.0), r"temperature=-1.0 must be"),
    ],
)
def test_bad_params_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**kwargs)


def test_too_many_eos_ids_for_the_candidate_width_is_an_error():
    with pytest.raises(ValueError, match="needs 30 candidates per beam; at most 20"):
        BeamSearch(10, BeamSearchParams(10, 4), (1, 2))
