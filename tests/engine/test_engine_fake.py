"""Engine + scheduler behaviour on SumModel, whose outputs are computable by hand.

SumModel reads every context token back through the paged KV cache, so a wrong block
table, slot mapping, preemption or swap shows up as a wrong token.
"""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax.config import EngineConfig
from paged_jax.engine import Engine
from paged_jax.sampling_params import SamplingParams
from paged_jax.testing.fake_model import SumModel, SumModelConfig

VOCAB = 97


def make_engine(eos=(), max_len=128, **kwargs) -> Engine:
    model = SumModel(
        SumModelConfig(vocab_size=VOCAB, max_position_embeddings=max_len, eos_token_ids=eos)
    )
    base = dict(
        block_size=4,
        num_kv_blocks=64,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        attention_backend="reference",
        validate=True,  # range-check block ids and slots on device in every step
    )
    base.update(kwargs)
    return Engine(model, EngineConfig(**base))


def run_all(engine: Engine) -> dict:
    outs = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            assert o.request_id not in outs, "a request finished twice"
            outs[o.request_id] = o
    assert not engine.has_unfinished(), "the engine stopped making progress"
    return outs


def assert_pool_drained(engine: Engine) -> None:
    kv = engine.kv_cache_manager
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_usable_blocks, "blocks leaked after the run"
    assert engine.input_batch.row_of == {}, "input-batch rows leaked after the run"
    assert engine.runner.num_swapped_requests == 0


def random_prompts(n: int, seed: int, lo=1, hi=30) -> dict[str, list[int]]:
    rng = np.random.default_rng(seed)
    return {f"r{i}": rng.integers(0, VOCAB, rng.integers(lo, hi)).tolist() for i in range(n)}


def check_greedy(engine: Engine, prompts: dict[str, list[int]], max_tokens: dict[str, int]):
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens[rid]))
    outs = run_all(engine)
    assert set(outs) == set(prompts)
    for rid, prompt in prompts.items():
        o = outs[rid]
        assert o.finish_reason == "length"
        assert len(o.token_ids) == max_tokens[rid]
        assert o.token_ids == SumModel.reference_continuation(prompt, max_tokens[rid], VOCAB), rid
    assert_pool_drained(engine)
    return outs


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_small_pool_preempts_and_outputs_stay_exact(mode):
    engine = make_engine(num_kv_blocks=24, preemption_mode=mode)
    engine.warmup()
    prompts = random_prompts(24, seed=1)
    rng = np.random.default_rng(2)
    max_tokens = {rid: int(rng.integers(1, 25)) for rid in prompts}
    check_greedy(engine, prompts, max_tokens)
    stats = engine.get_stats()
    assert stats["num_preemptions"] > 0, "the pool was meant to be small enough to preempt"
    assert stats["kv_cache_usage_peak"] > 0.9
    assert stats["num_compiles_after_warmup"] == 0


def test_chunked_prefill_with_a_small_token_budget():
    engine = make_engine(max_num_seqs=4, max_num_batched_tokens=8, max_len=256, num_kv_blocks=80)
    prompts = random_prompts(6, seed=3, lo=20, hi=60)  # every prompt spans several steps
    check_greedy(engine, prompts, {rid: 5 for rid in prompts})
    assert engine.get_stats()["num_steps"] >= sum(map(len, prompts.values())) // 8


def test_prefix_caching_shares_blocks_and_stays_exact(default_engine):
    engine = default_engine  # num_kv_blocks=64
    hits_before = engine.get_stats()["prefix_cache_hits"]
    rng = np.random.default_rng(4)
    system = rng.integers(0, VOCAB, 21).tolist()
    prompts = {f"r{i}": system + rng.integers(0, VOCAB, 1 + i).tolist() for i in range(10)}
    # Submit one first so its blocks are cached when the others arrive.
    first = {"r0": prompts.pop("r0")}
    check_greedy(engine, first, {"r0": 3})
    outs = check_greedy(engine, prompts, {rid: 4 for rid in prompts})
    assert engine.get_stats()["prefix_cache_hits"] > hits_before
    # 21 shared tokens = 5 full blocks of 4 tokens.
    assert all(o.num_cached_tokens == 20 for o in outs.values())


def test_prefix_caching_off_gives_the_same_tokens():
    prompts = random_prompts(12, seed=5)
    max_tokens = dict.fromkeys(prompts, 6)
    check_greedy(make_engine(enable_prefix_caching=False), prompts, max_tokens)


def test_no_compiles_after_warmup_over_100_requests():
    engine = make_engine(max_num_seqs=16, max_num_batched_tokens=64, num_kv_blocks=40)
    engine.warmup()
    prompts = random_prompts(110, seed=6, lo=1, hi=50)
    rng = np.random.default_rng(7)
    check_greedy(engine, prompts, {rid: int(rng.integers(1, 30)) for rid in prompts})
    stats = engine.get_stats()
    assert stats["num_compiles_after_warmup"] == 0, stats
    assert stats["num_compiles"] > 0  # the counter does count (warmup compiled)


def sampled_outputs(engine, order: list[str], prompts, extra: int) -> dict[str, list[int]]:
    assert engine.kv_cache_manager.reset_prefix_cache()  # the second run recomputes, too
    for i in range(extra):  # unrelated traffic changes the batch composition
        engine.add_request(f"x{i}", [i + 1] * (3 + i), SamplingParams(max_tokens=7, seed=i))
    for rid in order:
        engine.add_request(
            rid, prompts[rid], SamplingParams(temperature=1.0, seed=123, max_tokens=12)
        )
    outs = run_all(engine)
    assert_pool_drained(engine)
    return {rid: outs[rid].token_ids for rid in prompts}


def test_seeded_sampling_ignores_batch_composition_and_arrival_order():
    prompts = random_prompts(5, seed=8)
    engine = make_engine(max_num_seqs=4)  # one engine for both runs: request ids are reused
    a = sampled_outputs(engine, list(prompts), prompts, extra=0)
    b = sampled_outputs(engine, list(reversed(prompts)), prompts, extra=6)
    assert a == b
    # And sampling is not secretly greedy.
    greedy = {rid: SumModel.reference_continuation(p, 12, VOCAB) for rid, p in prompts.items()}
    assert a != greedy


def test_stop_tokens_eos_min_tokens_and_ignore_eos():
    # SumModel: prompt [5] -> 5, then (5+5+1)=11, (21+2)=23, ...
    cont = SumModel.reference_continuation([5], 6, VOCAB)
    engine = make_engine(eos=(cont[2],))
    engine.add_request("eos", [5], SamplingParams(temperature=0, max_tokens=10))
    engine.add_request("ignore", [5], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    engine.add_request(
        "stopid", [5], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[cont[1]])
    )
    engine.add_request(
        "min", [5], SamplingParams(temperature=0, max_tokens=10, min_tokens=4, ignore_eos=True)
    )
    outs = run_all(engine)
    assert outs["eos"].token_ids == cont[:3] and outs["eos"].finish_reason == "stop"
    assert outs["eos"].stop_reason is None
    assert outs["ignore"].token_ids == cont and outs["ignore"].finish_reason == "length"
    assert outs["stopid"].token_ids == cont[:2] and outs["stopid"].stop_reason == cont[1]
    assert outs["min"].finish_reason == "length" and len(outs["min"].token_ids) == 10
    assert_pool_drained(engine)


def test_min_tokens_masks_eos_until_reached():
    cont = SumModel.reference_continuation([5], 3, VOCAB)
    engine = make_engine(eos=(cont[0],))
    engine.add_request("m", [5], SamplingParams(temperature=0, max_tokens=5, min_tokens=2))
    out = run_all(engine)["m"]
    # The first token would be EOS; it is masked, so the greedy pick is its neighbour.
    assert out.token_ids[0] != cont[0]
    assert len(out.token_ids) >= 2


def test_logprobs_are_returned_per_token(default_engine):
    engine = default_engine
    engine.add_request("lp", [3, 4], SamplingParams(temperature=0, max_tokens=3, logprobs=2))
    out = run_all(engine)["lp"]
    assert len(out.logprobs) == 3
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and len(entry) == 2  # the sampled token is also the top-1
        assert max(entry.values()) == entry[tok] <= 0.0


def test_bad_input_is_rejected_and_the_rest_still_complete():
    engine = make_engine(max_len=64)
    engine.add_request("ok1", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4))
    with pytest.raises(ValueError, match=r"prompt_token_ids=\[\] must not be empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(ValueError, match=r"len\(prompt_token_ids\)=64 must be < max_model_len=64"):
        engine.add_request("long", [1] * 64, SamplingParams())
    with pytest.raises(ValueError, match=r"contains 97: token ids must be < vocab_size=97"):
        engine.add_request("vocab", [1, 97], SamplingParams())
    with pytest.raises(ValueError, match=r"token id"):
        engine.add_request("neg", [1, -2], SamplingParams())
    with pytest.raises(ValueError, match=r"temperature=-1"):
        engine.add_request("params", [1], SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match=r"request_id='ok1' must be unique"):
        engine.add_request("ok1", [1], SamplingParams())
    with pytest.raises(ValueError, match=r"request_id='nope' must name a live request"):
        engine.abort_request("nope")
    engine.add_request("ok2", [4, 5], SamplingParams(temperature=0, max_tokens=4))
    outs = run_all(engine)
    assert set(outs) == {"ok1", "ok2"}
    assert outs["ok1"].token_ids == SumModel.reference_continuation([1, 2, 3], 4, VOCAB)
    assert_pool_drained(engine)


def test_abort_frees_a_running_request(default_engine):
    engine = default_engine
    engine.add_request("a", [1] * 10, SamplingParams(temperature=0, max_tokens=50))
    engine.add_request("b", [2] * 10, SamplingParams(temperature=0, max_tokens=5))
    engine.step()
    out = engine.abort_request("a")
    assert out.finish_reason == "abort"
    outs = run_all(engine)
    assert set(outs) == {"b"}
    assert_pool_drained(engine)


def test_a_request_that_outgrows_the_pool_ends_with_an_error():
    # 8 blocks of 4 tokens: 7 usable = 28 token slots; the request would need 40.
    engine = make_engine(num_kv_blocks=8)
    engine.add_request("big", [1] * 20, SamplingParams(temperature=0, max_tokens=20))
    engine.add_request("small", [2] * 3, SamplingParams(temperature=0, max_tokens=3))
    outs = run_all(engine)
    assert outs["big"].finish_reason == "error"
    assert "usable blocks" in outs["big"].error
    assert 0 < len(outs["big"].token_ids) < 20  # what it generated is kept
    assert outs["small"].finish_reason == "length"
    assert_pool_drained(engine)


def test_priority_policy_serves_low_values_first():
    engine = make_engine(scheduling_policy="priority", max_num_seqs=1)
    for rid, prio in (("late", 5), ("urgent", 0), ("mid", 2)):
        engine.add_request(rid, [1, 2], SamplingParams(temperature=0, max_tokens=2), priority=prio)
    order = []
    while engine.has_unfinished():
        order += [o.request_id for o in engine.step()]
    assert order == ["urgent", "mid", "late"]


def test_priority_preemption_evicts_the_lowest_priority():
    engine = make_engine(scheduling_policy="priority", num_kv_blocks=12)
    engine.add_request("low", [1] * 16, SamplingParams(temperature=0, max_tokens=20), priority=9)
    engine.add_request("high", [2] * 16, SamplingParams(temperature=0, max_tokens=20), priority=0)
    outs = run_all(engine)
    assert outs["low"].num_preemptions > 0
    assert outs["high"].num_preemptions == 0
    for rid, tok in (("low", 1), ("high", 2)):
        assert outs[rid].token_ids == SumModel.reference_continuation([tok] * 16, 20, VOCAB)
    assert_pool_drained(engine)
