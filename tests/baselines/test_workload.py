"""ShareGPT-like trace: deterministic per seed, lengths inside their bounds, valid token ids."""

from __future__ import annotations

import pytest

from paged_jax.baselines.workload import WorkloadConfig, make_trace, trace_summary


def test_trace_is_seeded_and_bounded():
    config = WorkloadConfig(num_requests=300, vocab_size=50, input_max=40, output_max=30)
    trace = make_trace(config)
    assert trace == make_trace(config)
    assert trace != make_trace(WorkloadConfig(num_requests=300, vocab_size=50, seed=1))
    assert len(trace) == 300 and len({r.request_id for r in trace}) == 300
    assert all(config.input_min <= r.num_prompt_tokens <= 40 for r in trace)
    assert all(config.output_min <= r.num_output_tokens <= 30 for r in trace)
    assert all(3 <= t < 50 for r in trace for t in r.prompt_token_ids)
    assert trace_summary(trace)["total_output_tokens"] == sum(r.num_output_tokens for r in trace)
    # Log-normal, unclipped by the default bounds: the mean sits above the median (long tail).
    summary = trace_summary(make_trace(WorkloadConfig(num_requests=300)))
    assert summary["input_mean"] > summary["input_median"] * 1.1
    assert summary["output_mean"] > summary["output_median"] * 1.1


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="output_max=2 must be >= output_min=4"):
        WorkloadConfig(output_max=2)
    with pytest.raises(ValueError, match="num_requests=0 must be >= 1"):
        WorkloadConfig(num_requests=0)
