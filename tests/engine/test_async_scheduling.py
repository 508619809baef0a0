"""Async scheduling (one device step in flight) against the synchronous engine.

Both modes run the same workloads on SumModel; every output field must agree, and
greedy outputs must also equal SumModel's hand-computed continuation.
"""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax.sampling_params import SamplingParams
from paged_jax.testing.fake_model import SumModel
from tests.engine.test_engine_fake import VOCAB, assert_pool_drained, make_engine, run_all


def mixed_workload(seed: int) -> list[tuple[str, list[int], SamplingParams]]:
    """Greedy and seeded-sampling requests with stops, min_tokens and logprobs mixed in."""
    rng = np.random.default_rng(seed)
    work = []
    for i in range(20):
        prompt = rng.integers(0, VOCAB, int(rng.integers(1, 40))).tolist()
        kind = i % 5
        if kind == 0:
            params = SamplingParams(temperature=0, max_tokens=int(rng.integers(1, 20)))
        elif kind == 1:
            params = SamplingParams(temperature=1.0, seed=i, max_tokens=15, logprobs=2)
        elif kind == 2:  # a stop token that greedy decoding reaches
            cont = SumModel.reference_continuation(prompt, 8, VOCAB)
            params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[cont[4]])
        elif kind == 3:
            params = SamplingParams(temperature=0.8, top_k=5, seed=100 + i, max_tokens=12)
        else:
            params = SamplingParams(temperature=0, max_tokens=10, min_tokens=3)
        work.append((f"r{i}", prompt, params))
    return work


def run_mode(async_scheduling: bool, work, **config) -> tuple[dict, dict]:
    engine = make_engine(eos=(7,), async_scheduling=async_scheduling, **config)
    for rid, prompt, params in work:
        engine.add_request(rid, prompt, params)
    outs = run_all(engine)
    assert_pool_drained(engine)
    return outs, engine.get_stats()


def fields(out) -> tuple:
    return (out.token_ids, out.finish_reason, out.stop_reason, out.logprobs, out.num_cached_tokens)


@pytest.mark.parametrize(
    "config",
    [
        dict(),  # plain continuous batching
        dict(num_kv_blocks=22, preemption_mode="recompute"),  # preempts mid-flight
        dict(num_kv_blocks=22, preemption_mode="swap"),
        dict(max_num_batched_tokens=8, max_num_seqs=4, num_kv_blocks=80),  # chunked prefill
    ],
    ids=["plain", "recompute", "swap", "chunked"],
)
def test_async_outputs_equal_sync(config):
    work = mixed_workload(seed=len(config))
    sync_outs, sync_stats = run_mode(False, work, **config)
    async_outs, async_stats = run_mode(True, work, **config)
    assert set(sync_outs) == set(async_outs) == {rid for rid, _, _ in work}
    for rid, prompt, params in work:
        assert fields(async_outs[rid]) == fields(sync_outs[rid]), rid
        if params.temperature == 0 and params.min_tokens == 0:
            ref = SumModel.reference_continuation(prompt, params.max_tokens, VOCAB, (7,))
            n = len(sync_outs[rid].token_ids)
            assert sync_outs[rid].token_ids == ref[:n], rid
    if "num_kv_blocks" in config and config["num_kv_blocks"] < 30:
        assert sync_stats["num_preemptions"] > 0 and async_stats["num_preemptions"] > 0
    assert any(o.finish_reason == "stop" for o in async_outs.values())


def test_a_stop_costs_at_most_one_extra_step_and_length_none(default_engine):
    cont = SumModel.reference_continuation([5], 10, VOCAB)
    # One engine per mode serves both cases; num_steps is cumulative, so each case counts
    # its own steps (every run ends drained: no step in flight carries over).
    assert default_engine.config.async_scheduling  # the default
    engines = {False: make_engine(async_scheduling=False), True: default_engine}
    for params, reason in (
        (SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[cont[5]]), "stop"),
        (SamplingParams(temperature=0, max_tokens=6), "length"),
    ):
        steps = {}
        for mode, engine in engines.items():
            before = engine.get_stats()["num_steps"]
            assert engine.kv_cache_manager.reset_prefix_cache()  # the same prompt again
            engine.add_request("a", [5], params)
            out = run_all(engine)["a"]
            assert out.token_ids == cont[:6] and out.finish_reason == reason
            assert_pool_drained(engine)
            steps[mode] = engine.get_stats()["num_steps"] - before
        assert steps[False] == 6  # one token per step
        # A stop token is seen one step late (that step's token is discarded); a length
        # stop is known in advance and costs nothing.
        assert steps[True] == steps[False] + (1 if reason == "stop" else 0), (reason, steps)


def test_a_reused_request_id_never_receives_a_stale_token(default_engine):
    cont = SumModel.reference_continuation([5], 10, VOCAB)
    engine = default_engine
    engine.add_request(
        "a", [5], SamplingParams(temperature=0, max_tokens=9, stop_token_ids=[cont[2]])
    )
    outs = run_all(engine)  # "a" ends with its extra step still in flight
    assert outs["a"].token_ids == cont[:3]
    engine.add_request("a", [9, 9], SamplingParams(temperature=0, max_tokens=4))
    again = run_all(engine)["a"]
    assert again.token_ids == SumModel.reference_continuation([9, 9], 4, VOCAB)
    assert_pool_drained(engine)


def test_abort_with_a_step_in_flight(default_engine):
    engine = default_engine
    engine.add_request("a", [1] * 10, SamplingParams(temperature=0, max_tokens=50))
    engine.add_request("b", [2] * 10, SamplingParams(temperature=0, max_tokens=5))
    engine.step()
    engine.step()  # "a" now has a token in flight
    out = engine.abort_request("a")
    assert out.finish_reason == "abort"
    assert out.token_ids == SumModel.reference_continuation([1] * 10, len(out.token_ids), VOCAB)
    outs = run_all(engine)
    assert outs["b"].token_ids == SumModel.reference_continuation([2] * 10, 5, VOCAB)
    assert_pool_drained(engine)


def test_async_no_compiles_after_warmup():
    engine = make_engine(max_num_seqs=8, max_num_batched_tokens=32, num_kv_blocks=30)
    engine.warmup()
    prompts = {f"r{i}": [i % VOCAB + 1] * (1 + i % 23) for i in range(40)}
    for rid, prompt in prompts.items():
        engine.add_request(
            rid, prompt, SamplingParams(temperature=0, max_tokens=1 + len(prompt) % 9)
        )
    outs = run_all(engine)
    for rid, prompt in prompts.items():
        n = 1 + len(prompt) % 9
        assert outs[rid].token_ids == SumModel.reference_continuation(prompt, n, VOCAB)
    stats = engine.get_stats()
    assert stats["num_compiles_after_warmup"] == 0, stats
    assert stats["host_time_ms"] > 0
