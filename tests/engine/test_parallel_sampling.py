"""Parallel sampling (n > 1) as an engine parent request, and the engine's public surface.

On SumModel a greedy sample's tokens are computable by hand and a seeded sample's tokens
depend only on its seed and its progress, so a parent's samples can be checked against
plain requests of the same prompt.
"""

from __future__ import annotations

import time

import pytest

from paged_jax.config import EngineConfig
from paged_jax.engine import HOST_PHASES, Engine, EngineOutput
from paged_jax.sampling_params import SamplingParams
from paged_jax.testing.fake_model import SumModel, SumModelConfig

VOCAB = 97
BS = 4


def make_engine(**kwargs) -> Engine:
    model = SumModel(SumModelConfig(vocab_size=VOCAB, max_position_embeddings=128))
    base = dict(
        block_size=BS,
        num_kv_blocks=64,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        attention_backend="reference",
    )
    base.update(kwargs)
    return Engine(model, EngineConfig(**base))


def run_all(engine: Engine) -> dict[str, EngineOutput]:
    outs: dict[str, EngineOutput] = {}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id not in outs, f"{o.request_id!r} finished twice"
            outs[o.request_id] = o
    kv = engine.kv_cache_manager
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_usable_blocks, "blocks leaked"
    return outs


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_parent_finishes_once_with_its_samples_in_index_order(async_scheduling):
    engine = make_engine(async_scheduling=async_scheduling)
    prompt = list(range(1, 12))
    engine.add_request("p", prompt, SamplingParams(n=3, temperature=0.0, max_tokens=5))
    engine.add_request("q", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4))
    assert engine.is_live("p") and engine.is_live("q")
    outs = run_all(engine)
    assert set(outs) == {"p", "q"}, "one output per request, none for carriers or samples"
    assert not engine.is_live("p")
    parent = outs["p"]
    assert [s.request_id for s in parent.samples] == ["p_0", "p_1", "p_2"]
    want = SumModel.reference_continuation(prompt, 5, VOCAB)
    assert [s.token_ids for s in parent.samples] == [want] * 3
    assert [c.request_id for c in parent.completions] == ["p_0", "p_1", "p_2"]
    assert parent.token_ids == [] and parent.finish_reason == "length"
    assert parent.prompt_token_ids == prompt
    assert parent.first_token_time is not None and parent.finish_time >= parent.first_token_time
    # n = 1 outputs are unchanged: no samples, their own tokens.
    assert outs["q"].samples is None and outs["q"].completions == [outs["q"]]
    assert outs["q"].token_ids == SumModel.reference_continuation([5, 6, 7], 4, VOCAB)


def test_sample_j_is_seeded_with_seed_plus_j():
    prompt = list(range(3, 20))
    params = SamplingParams(n=3, temperature=1.0, seed=2**32 - 2, max_tokens=6)
    engine = make_engine()
    engine.add_request("p", prompt, params)
    samples = run_all(engine)["p"].samples
    plain = make_engine()
    for j, seed in enumerate([2**32 - 2, 2**32 - 1, 0]):  # wraps modulo 2**32
        plain.add_request(str(j), prompt, SamplingParams(temperature=1.0, seed=seed, max_tokens=6))
    singles = run_all(plain)
    assert [s.token_ids for s in samples] == [singles[str(j)].token_ids for j in range(3)]
    assert len({tuple(s.token_ids) for s in samples}) > 1


def test_a_one_token_prompt_and_a_full_batch_fall_back_to_plain_samples():
    engine = make_engine(max_num_seqs=2)
    engine.add_request("one", [9], SamplingParams(n=2, temperature=0.0, max_tokens=3))
    engine.add_request("p", list(range(1, 9)), SamplingParams(n=3, temperature=0.0, max_tokens=3))
    outs = run_all(engine)
    assert [s.token_ids for s in outs["one"].samples] == [
        SumModel.reference_continuation([9], 3, VOCAB)
    ] * 2
    want = SumModel.reference_continuation(list(range(1, 9)), 3, VOCAB)
    assert [s.token_ids for s in outs["p"].samples] == [want] * 3


@pytest.mark.parametrize("steps", [0, 1, 3])
def test_aborting_a_parent_aborts_its_carrier_and_samples(steps):
    engine = make_engine()
    engine.add_request("p", list(range(1, 12)), SamplingParams(n=3, temperature=0.0, max_tokens=8))
    for _ in range(steps):
        assert engine.step() == []
    with pytest.raises(ValueError, match="not a part of the parallel-sampling request 'p'"):
        engine.abort_request("p__prefill" if steps < 2 else "p_1")
    out = engine.abort_request("p")
    assert out.request_id == "p" and out.finish_reason == "abort"
    assert [s.request_id for s in out.samples] == ["p_0", "p_1", "p_2"]
    assert all(s.finish_reason == "abort" for s in out.samples)
    assert not engine.is_live("p") and not engine.has_unfinished()
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks
    with pytest.raises(ValueError, match="request_id='p' must name a live request"):
        engine.abort_request("p")
    assert run_all(engine) == {}


def test_a_parent_reserves_its_sample_ids():
    engine = make_engine()
    engine.add_request("p_1", [1, 2, 3])
    with pytest.raises(ValueError, match="request_id='p' must leave 'p_1' free for its samples"):
        engine.add_request("p", [4, 5, 6], SamplingParams(n=2))
    engine.add_request("p", [4, 5, 6], SamplingParams(n=1))  # n=1 needs no other id
    engine.add_request("r", [4, 5, 6], SamplingParams(n=2, max_tokens=2))
    for taken in ("r", "r_0", "r__prefill"):
        with pytest.raises(ValueError, match=f"request_id='{taken}' must be unique"):
            engine.add_request(taken, [1, 2])
    with pytest.raises(ValueError, match="child_id='r_1' must be unique"):
        engine.fork_request("p_1", "r_1")
    # A bad prompt is named as the caller gave it, and nothing of it is queued.
    with pytest.raises(ValueError, match=r"len\(prompt_token_ids\)=128 must be < max_model_len"):
        engine.add_request("long", [1] * 128, SamplingParams(n=2))
    assert not engine.is_live("long") and not engine.is_live("long__prefill")
    assert set(run_all(engine)) == {"p_1", "p", "r"}


def test_synchronous_reads_each_steps_tokens_and_restores_the_mode():
    engine = make_engine()
    assert engine.config.async_scheduling
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2))
    with engine.synchronous():
        engine.step()  # the prefill and its token
        assert engine.get_request("a").num_output_tokens == 1
        with engine.synchronous():
            pass
        engine.step()
        assert not engine.is_live("a")
    engine.add_request("b", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2))
    engine.step()  # async again: the prefill's token is read one call later
    assert engine.get_request("b").num_output_tokens == 0
    run_all(engine)


def test_step_times_and_peaks_reset():
    engine = make_engine()
    calls = []

    def clock():
        calls.append(None)
        return time.perf_counter()

    engine.phase_clock = clock
    for i in range(4):
        engine.add_request(str(i), [1, 2, 3, i], SamplingParams(temperature=0.0, max_tokens=6))
    run_all(engine)
    stats = engine.get_stats()
    assert calls, "the phases are timed with phase_clock"
    assert set(stats["host_phase_time_ms"]) == set(HOST_PHASES)
    assert all(v >= 0 for v in stats["host_phase_time_ms"].values())
    assert 0 < stats["host_time_min_ms"] <= stats["host_time_ms"] <= stats["host_time_total_ms"]
    assert stats["host_time_ms"] <= stats["step_time_ms"]
    assert stats["kv_cache_usage_peak"] > 0 and stats["kv_blocks_per_request_peak"] > 0
    engine.reset_step_times()
    engine.reset_peak_stats()
    stats = engine.get_stats()
    assert stats["host_time_total_ms"] == 0.0 and stats["step_time_ms"] == 0.0
    assert stats["kv_cache_usage_peak"] == 0.0 and stats["kv_blocks_per_request_peak"] == 0
    assert stats["num_steps"] > 0  # counters are not reset
