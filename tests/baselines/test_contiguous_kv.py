"""Contiguous-KV baseline: reservation accounting by hand, greedy tokens equal the paged engine's."""

from __future__ import annotations

import pytest

from paged_jax.baselines.contiguous_kv import (
    ContiguousKVEngine,
    kv_bytes_per_token,
    max_concurrent_for_budget,
)
from paged_jax.baselines.hf_generate import static_batch_utilization
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


def test_static_batch_utilization_by_hand():
    # prompts 2 and 4 (padded to 4), outputs 1 and 3: cache columns 4, 5, 6 over 3 steps.
    # used: t=1: 2 + 4; t=2: 5 (first request done); t=3: 6.  reserved: 2 * (4 + 5 + 6).
    batch = [_req(0, 2, 1), _req(1, 4, 3)]
    assert static_batch_utilization(batch) == (17, 30)


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


def test_hf_baseline_ignores_eos(tiny_hf_checkpoint):
    from paged_jax.baselines.hf_generate import run_hf_generate

    trace = [_req(0, 6, 8), _req(1, 3, 5)]
    plain = run_hf_generate(tiny_hf_checkpoint("llama"), trace, 2).outputs
    # Same seeded weights, but EOS is now a token the greedy output contains: it must not stop.
    eos = plain["r0"][2]
    again = run_hf_generate(tiny_hf_checkpoint("llama", eos_token_id=eos), trace, 2).outputs
    assert again == plain
    assert [len(again["r0"]), len(again["r1"])] == [8, 5]
