"""Contiguous-KV baseline: reservation accounting by hand, greedy tokens equal the paged engine's."""

from __future__ import annotations

import pytest

from paged_jax.baselines.contiguous_kv import (
    ContiguousKVEngine,
    kv_bytes_per_token,
    max_concurrent_for_budget,
)
from paged_jax.baselines.workload import TraceRequest

# Tiny Llama of the fixture: 2 layers, 2 KV heads of dim 64 / 4 = 16, float32.
# One token's K and V over all layers: 2 layers * 2 (K, V) * 2 heads * 16 * 4 bytes = 512.
BYTES_PER_TOKEN = 512


@pytest.fixture(scope="module")
def tiny_llama(tiny_hf_checkpoint):
    from paged_jax.models import load_model

    return load_model(tiny_hf_checkpoint("llama"), dtype="float32")


def _req(i: int, prompt_len: int, num_out: int) -> TraceRequest:
    tokens = tuple(3 + (7 * i + 5 * j) % 120 for j in range(prompt_len))
    return TraceRequest(f"r{i}", tokens, num_out)


def test_max_concurrent_is_budget_over_full_reservation():
    # 100_000 bytes / (64 slots * 512 bytes) = 3.05 -> 3 requests.
    assert max_concurrent_for_budget(100_000, 64, BYTES_PER_TOKEN) == 3
    assert max_concurrent_for_budget(3 * 64 * BYTES_PER_TOKEN, 64, BYTES_PER_TOKEN) == 3
    with pytest.raises(ValueError, match="budget_bytes=1000 must hold one request"):
        max_concurrent_for_budget(1000, 64, BYTES_PER_TOKEN)


def test_engine_reserves_max_model_len_per_request(tiny_llama):
    assert kv_bytes_per_token(tiny_llama) == BYTES_PER_TOKEN
    engine = ContiguousKVEngine(tiny_llama, 100_000, 64)
    assert engine.max_concurrent == 3
    k_cache, _ = engine.runner.kv_caches[0]
    assert k_cache.shape == (3, 64, 2, 16)
    assert engine.runner.cache_bytes == 3 * 64 * BYTES_PER_TOKEN <= 100_000
    for i, n in enumerate((5, 7, 9, 11)):
        engine.add_request(_req(i, n, 3))
    engine.step()  # admits 3 (prefill: 1 token each), then one decode step
    assert engine.num_running == 3 and len(engine.waiting) == 1
    # K/V held: prompt + the token fed to decode = 6 + 8 + 10; reserved: 3 * 64.
    assert (engine.used_tokens(), engine.reserved_tokens()) == (24, 192)
    assert engine.kv_utilization == pytest.approx(24 / 192)
    with pytest.raises(ValueError, match="must be <= max_model_len=64"):
        engine.add_request(_req(9, 60, 5))


def test_pow2_and_oracle_reserve_by_policy_first_fit(tiny_llama):
    # kv_len = prompt + output - 1: 5+4-1 = 8, 9+8-1 = 16, 20+13-1 = 32; pow2 rounds
    # the output: 5 + 4 = 9, 9 + 8 = 17, 20 + 16 = 36.
    trace = [_req(0, 5, 4), _req(1, 9, 8), _req(2, 20, 13)]
    for policy, sizes in (("pow2", [9, 17, 36]), ("oracle", [8, 16, 32])):
        engine = ContiguousKVEngine(tiny_llama, 40 * BYTES_PER_TOKEN, 64, policy=policy)
        assert [engine.reservation(r) for r in trace] == sizes
    # 40 slots: pow2 fits 9 + 17, the 36-slot request waits until a reservation is freed.
    engine = ContiguousKVEngine(tiny_llama, 40 * BYTES_PER_TOKEN, 64, policy="pow2")
    for r in trace:
        engine.add_request(r)
    engine.step()
    assert engine.num_running == 2 and engine.reserved_tokens() == 26
    outs = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o.token_ids) for o in engine.step())
    assert [len(outs[r.request_id]) for r in trace] == [4, 8, 13]
    assert engine.reserved_tokens() == 0
    # A 3-token request reserves exactly what it writes under oracle (pow2 would take 4).
    oracle = ContiguousKVEngine(tiny_llama, 40 * BYTES_PER_TOKEN, 64, policy="oracle")
    assert oracle.reservation(_req(3, 2, 2)) == 3
    with pytest.raises(ValueError, match="policy='best' must be one of"):
        ContiguousKVEngine(tiny_llama, 40 * BYTES_PER_TOKEN, 64, policy="best")


def test_decode_reads_only_the_live_context(tiny_llama):
    engine = ContiguousKVEngine(tiny_llama, 1000 * BYTES_PER_TOKEN, 512, policy="oracle")
    runner = engine.runner
    assert runner.decode_bounds == (128, 256, 384, 512)
    assert runner.decode_row_buckets == (8, 16, 32, 64)
    seen = []
    real = runner.decode_step

    def spy(weights, caches, tokens, positions, bound):
        seen.append((tokens.shape[0], bound))
        return real(weights, caches, tokens, positions, bound)

    runner.decode_step = spy
    engine.add_request(_req(0, 100, 40))  # positions 100 .. 138: bound 128, then 256
    while engine.has_unfinished():
        engine.step()
    assert seen[0] == (8, 128) and seen[-1] == (8, 256)
    assert {b for _, b in seen} == {128, 256}


def test_greedy_tokens_equal_paged_engine(tiny_llama):
    from paged_jax.config import EngineConfig
    from paged_jax.engine import Engine
    from paged_jax.sampling_params import SamplingParams

    # Prompts straddle the prefill buckets (16, 32); 2 slots so the third request waits.
    trace = [_req(0, 5, 8), _req(1, 17, 6), _req(2, 33, 7)]
    contiguous = ContiguousKVEngine(tiny_llama, 2 * 64 * BYTES_PER_TOKEN, 64)
    for r in trace:
        contiguous.add_request(r)
    got: dict[str, list[int]] = {}
    while contiguous.has_unfinished():
        got.update((o.request_id, o.token_ids) for o in contiguous.step())
    assert contiguous.max_running == 2

    config = EngineConfig(
        num_kv_blocks=32, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64
    )
    engine = Engine(tiny_llama, config)
    for r in trace:
        params = SamplingParams(temperature=0.0, max_tokens=r.num_output_tokens, ignore_eos=True)
        engine.add_request(r.request_id, list(r.prompt_token_ids), params)
    want: dict[str, list[int]] = {}
    while engine.has_unfinished():
        want.update((o.request_id, o.token_ids) for o in engine.step())
    assert got == want
    assert [len(got[r.request_id]) for r in trace] == [8, 6, 7]


def test_hf_kv_utilization_is_read_from_the_live_cache(tiny_hf_checkpoint):
    from paged_jax.baselines.hf_generate import run_hf_generate

    # Prompts 2 and 4 (cache width 4), outputs 1 and 3: two decode calls. Call 1: cache
    # 4 columns, only the 3-token request still wants tokens and holds 4; call 2: 5
    # columns, it holds 5. used 9 / reserved 2 * (4 + 5) = 18.
    res = run_hf_generate(tiny_hf_checkpoint("llama"), [_req(0, 2, 1), _req(1, 4, 3)], 2)
    assert res.kv_utilization == pytest.approx(9 / 18)
    assert res.max_concurrent_seqs == 1


def test_hf_baseline_ignores_eos(tiny_hf_checkpoint):
    from paged_jax.baselines.hf_generate import run_hf_generate

    trace = [_req(0, 6, 8), _req(1, 3, 5)]
    plain = run_hf_generate(tiny_hf_checkpoint("llama"), trace, 2).outputs
    # Same seeded weights, but EOS is now a token the greedy output contains: it must not stop.
    eos = plain["r0"][2]
    again = run_hf_generate(tiny_hf_checkpoint("llama", eos_token_id=eos), trace, 2).outputs
    assert again == plain
    assert [len(again["r0"]), len(again["r1"])] == [8, 5]
