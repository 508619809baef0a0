"""LLM under failures and threads: Ctrl-C in generate, two threads, abandoned iterators.

All on SumModel (token-id prompts, hand-computable greedy outputs), every engine loop
under a time limit so a wedged LLM fails instead of hanging.
"""

from __future__ import annotations

import gc
import threading

import pytest

from paged_jax.llm import LLM
from paged_jax.sampling_params import SamplingParams
from paged_jax.testing.fake_model import SumModel, SumModelConfig
from tests.engine.test_step_failures import WHERE, FailOnce, within_time_limit

VOCAB = 97
ENGINE_ARGS = dict(
    block_size=4,
    num_kv_blocks=128,
    max_num_seqs=8,
    max_num_batched_tokens=32,
    attention_backend="reference",
)
PROMPTS = [[1 + i, 2 * i % VOCAB, 3, 4 + i] * (1 + i % 3) for i in range(6)]


def make_llm(**kwargs) -> LLM:
    model = SumModel(SumModelConfig(vocab_size=VOCAB, max_position_embeddings=128))
    return LLM(model, warmup=False, **{**ENGINE_ARGS, **kwargs})


def greedy_want(prompts, max_tokens):
    return [SumModel.reference_continuation(p, max_tokens, VOCAB) for p in prompts]


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llms():
    """One LLM per scheduling mode, shared by this module's tests (each leaves it idle)."""
    made: dict[bool, tuple[LLM, FailOnce]] = {}

    def get(async_scheduling: bool) -> tuple[LLM, FailOnce]:
        if async_scheduling not in made:
            llm = make_llm(async_scheduling=async_scheduling)
            made[async_scheduling] = llm, FailOnce(llm.engine)
        return made[async_scheduling]

    return get


SEEDED = SamplingParams(temperature=1.0, seed=11, max_tokens=10)


@pytest.fixture(scope="module")
def fresh_seeded_outputs():
    """What a fresh LLM returns for PROMPTS with SEEDED (the reference after a failure)."""
    return token_ids(make_llm().generate(PROMPTS, SEEDED, use_tqdm=False))


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_keyboard_interrupt_in_generate_leaves_a_usable_llm(
    llms, async_scheduling, fresh_seeded_outputs
):
    """Ctrl-C at each point of a step: generate raises KeyboardInterrupt, its requests
    are withdrawn, and the next generate equals a fresh LLM's (before: it spun forever)."""
    llm, fail = llms(async_scheduling)
    for where in WHERE:

        def interrupted(where=where):
            fail.arm(where, KeyboardInterrupt())
            with pytest.raises(KeyboardInterrupt):
                llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
            assert not llm.engine.has_unfinished(), "the interrupted call left requests behind"
            return llm.generate(PROMPTS, SEEDED, use_tqdm=False)

        outs = within_time_limit(interrupted)
        assert token_ids(outs) == fresh_seeded_outputs, where
        llm.engine.kv_cache_manager.check_invariants()


def test_two_threads_generate_at_once_and_each_gets_its_own_outputs(llms):
    """Before: one thread failed with "Buffer has been deleted or donated", the other spun."""
    llm, _ = llms(True)
    a_prompts, b_prompts = PROMPTS[:3], PROMPTS[3:]
    results: dict[str, list] = {}
    start = threading.Barrier(2)

    def run(name, prompts):
        start.wait()
        for _ in range(3):
            outs = llm.generate(
                prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False
            )
            results.setdefault(name, []).append(token_ids(outs))

    def both():
        threads = [
            threading.Thread(target=run, args=("a", a_prompts), daemon=True),
            threading.Thread(target=run, args=("b", b_prompts), daemon=True),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    within_time_limit(both)
    assert results["a"] == [greedy_want(a_prompts, 16)] * 3
    assert results["b"] == [greedy_want(b_prompts, 16)] * 3
    assert not llm.engine.has_unfinished()


def test_a_thread_generates_while_another_iterates(llms):
    llm, _ = llms(True)
    many = [[i % VOCAB + 1, 5, 6] for i in range(20)]
    got: dict[int, list[int]] = {}

    def iterate():
        for i, out in llm.generate_iter(many, SamplingParams(temperature=0, max_tokens=12)):
            got[i] = out.outputs[0].token_ids

    def both():
        t = threading.Thread(target=iterate, daemon=True)
        t.start()
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        t.join()
        return outs

    outs = within_time_limit(both)
    assert token_ids(outs) == greedy_want(PROMPTS, 8)
    assert got == dict(enumerate(greedy_want(many, 12)))


@pytest.mark.parametrize("how", ["close", "break", "drop"])
def test_an_abandoned_generate_iter_aborts_its_requests(llms, how):
    """Before: the next one-prompt generate silently ran all 38 abandoned requests."""
    llm, _ = llms(True)
    many = [[i % VOCAB + 1, 2, 3] for i in range(38)]
    params = SamplingParams(temperature=0, max_tokens=40)

    def scenario():
        it = llm.generate_iter(many, params)
        if how == "break":
            for _ in it:
                break
            del it  # a for loop left early drops its iterator
        else:
            next(it)
            if how == "close":
                it.close()
            else:
                del it
                gc.collect()
        assert not llm.engine.has_unfinished(), "the abandoned iterator's requests still run"
        steps = llm.get_stats()["num_steps"]
        out = llm.generate([[9, 9]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        return out, llm.get_stats()["num_steps"] - steps

    out, steps = within_time_limit(scenario)
    assert token_ids(out) == greedy_want([[9, 9]], 3)
    assert steps <= 4  # its own prefill and decodes (async: one read late), nothing else


def test_generate_during_an_open_iterator_runs_its_own_requests_and_keeps_the_rest(llms):
    llm, _ = llms(False)
    many = [[i % VOCAB + 1, 7] for i in range(10)]

    def scenario():
        it = llm.generate_iter(many, SamplingParams(temperature=0, max_tokens=30))
        first = [next(it)]
        out = llm.generate([[9, 9]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        rest = list(it)  # outputs the generate's steps produced were kept for the iterator
        return first + rest, out

    items, out = within_time_limit(scenario)
    assert token_ids(out) == greedy_want([[9, 9]], 3)
    assert sorted(i for i, _ in items) == list(range(10))
    want = greedy_want(many, 30)
    assert all(o.outputs[0].token_ids == want[i] for i, o in items)
    assert not llm.engine.has_unfinished()


def test_beam_search_interrupted_leaves_an_idle_engine(llms):
    from paged_jax.beam_search import BeamSearchParams

    llm, fail = llms(True)
    params = BeamSearchParams(beam_width=2, max_tokens=6)

    def scenario():
        want = llm.beam_search([[1, 2, 3]], params)
        fail.arm("result", KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            llm.beam_search([[1, 2, 3]], params)
        assert not llm.engine.has_unfinished()
        return want, llm.beam_search([[1, 2, 3]], params)

    want, again = within_time_limit(scenario)
    assert [s.tokens for s in again[0].sequences] == [s.tokens for s in want[0].sequences]


def test_a_failed_step_in_one_thread_leaves_the_other_threads_call_exact(llms):
    """The failure reaches whichever call ran the failed step; that call's requests are
    withdrawn, and the other thread's requests (rolled back with the step) finish exactly."""
    llm, fail = llms(True)
    params = SamplingParams(temperature=0, max_tokens=20)
    prompts = {"a": PROMPTS[:3], "b": PROMPTS[3:]}
    results: dict[str, object] = {}
    start = threading.Barrier(2)

    def run(name):
        start.wait()
        try:
            results[name] = token_ids(llm.generate(prompts[name], params, use_tqdm=False))
        except RuntimeError as e:
            results[name] = e

    def both():
        threads = [threading.Thread(target=run, args=(n,), daemon=True) for n in prompts]
        fail.arm("result", RuntimeError("device error"))
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    within_time_limit(both)
    raised = [n for n, r in results.items() if isinstance(r, RuntimeError)]
    assert len(raised) == 1, results
    (ok,) = set(prompts) - set(raised)
    assert results[ok] == greedy_want(prompts[ok], 20)
    assert not llm.engine.has_unfinished()
