"""EngineConfig and SamplingParams validate at construction and derive buckets."""

from __future__ import annotations

import pytest

from paged_jax.config import EngineConfig, bucket_for
from paged_jax.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block_size": 12}, r"block_size=12 must be a power of two"),
        ({"block_size": 0}, r"block_size=0 must be"),
        ({"num_kv_blocks": 1}, r"num_kv_blocks=1 must be None or an int >= 2"),
        ({"kv_cache_memory": 1.5}, r"kv_cache_memory=1.5 must be a fraction"),
        ({"kv_cache_memory": -3}, r"kv_cache_memory=-3 must be a positive number of bytes"),
        ({"num_kv_blocks": 8, "kv_cache_memory": 0.5}, r"set one of them"),
        ({"max_num_seqs": 0}, r"max_num_seqs=0 must be an int >= 1"),
        ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, r"max_num_batched_tokens=32"),
        ({"max_model_len": 1}, r"max_model_len=1"),
        ({"preemption_mode": "drop"}, r"preemption_mode='drop' must be one of"),
        ({"scheduling_policy": "lifo"}, r"scheduling_policy='lifo' must be one of"),
        ({"attention_backend": "cuda"}, r"attention_backend='cuda' must be one of"),
        ({"dtype": "int8"}, r"dtype='int8' must be one of"),
        ({"enable_prefix_caching": 1}, r"enable_prefix_caching=1 must be a bool"),
        ({"seed": -1}, r"seed=-1 must be"),
    ],
)
def test_engine_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_buckets_are_powers_of_two_capped_by_the_budget():
    cfg = EngineConfig(max_num_seqs=48, max_num_batched_tokens=200, max_model_len=100)
    assert cfg.token_buckets == (16, 64, 200)  # 4x steps up to 256, then 2x
    wide = EngineConfig(max_num_batched_tokens=2048)
    assert wide.token_buckets == (16, 64, 256, 512, 1024, 2048)
    assert cfg.seq_buckets == (8, 16, 32, 48)
    assert cfg.max_blocks_per_seq == 7  # ceil(100 / 16)
    assert bucket_for(17, cfg.token_buckets) == 64
    assert bucket_for(200, cfg.token_buckets) == 200
    with pytest.raises(ValueError, match="n=201"):
        bucket_for(201, cfg.token_buckets)
    # One shape per token bucket: S holds min(T, max_num_seqs) sequences.
    shapes = cfg.step_shapes()
    assert shapes == [(16, 16), (64, 48), (200, 48)]
    assert (16, 16) in shapes and (16, 32) not in shapes
    assert (200, 48) in shapes


def test_unresolved_max_model_len_has_no_block_table_width():
    with pytest.raises(ValueError, match="max_model_len=None"):
        _ = EngineConfig().max_blocks_per_seq


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n": 0}, r"n=0 must be an int >= 1"),
        ({"temperature": -0.5}, r"temperature=-0.5 must be"),
        ({"top_p": 0.0}, r"top_p=0.0 must be in \(0, 1\]"),
        ({"top_k": -2}, r"top_k=-2 must be"),
        ({"min_p": 1.5}, r"min_p=1.5 must be in \[0, 1\]"),
        ({"seed": -1}, r"seed=-1 must be"),
        ({"max_tokens": 0}, r"max_tokens=0 must be an int >= 1"),
        ({"max_tokens": 4, "min_tokens": 5}, r"min_tokens=5 must be an int in \[0, max_tokens=4\]"),
        ({"stop": [""]}, r"stop=\(''"),
        ({"stop_token_ids": [-1]}, r"stop_token_ids=\(-1,\) must be"),
        ({"logprobs": 100}, r"logprobs=100 must be"),
    ],
)
def test_sampling_params_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_normalises_stop_inputs():
    p = SamplingParams(stop="###", stop_token_ids=[3, 4], top_k=-1, temperature=0)
    assert p.stop == ("###",)
    assert p.stop_token_ids == (3, 4)
    assert p.effective_top_k == 0
    assert p.greedy


def test_tensor_parallel_size_defaults_to_one_and_is_validated():
    assert EngineConfig().tensor_parallel_size == 1
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match=rf"tensor_parallel_size={bad!r} must be an int >= 1"):
            EngineConfig(tensor_parallel_size=bad)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (0.0, r"gpu_memory_utilization=0\.0 must be None or a fraction in \(0, 1\]"),
        (1.5, r"gpu_memory_utilization=1\.5 must be None or a fraction in \(0, 1\]"),
        ("0.9", r"gpu_memory_utilization='0\.9' must be None or a fraction in \(0, 1\]"),
        (True, r"gpu_memory_utilization=True must be None or a fraction in \(0, 1\]"),
    ],
)
def test_gpu_memory_utilization_is_a_fraction(value, match):
    # vLLM's share of the device's memory (issue 38 item 13).
    with pytest.raises(ValueError, match=match):
        EngineConfig(gpu_memory_utilization=value)
    assert EngineConfig(gpu_memory_utilization=1).gpu_memory_utilization == 1.0
    assert EngineConfig(gpu_memory_utilization=0.9).gpu_memory_utilization == 0.9


def test_gpu_memory_utilization_and_kv_cache_memory_are_one_or_the_other():
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0\.9.*kv_cache_memory=0\.5"):
        EngineConfig(gpu_memory_utilization=0.9, kv_cache_memory=0.5)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0\.9.*num_kv_blocks=8"):
        EngineConfig(gpu_memory_utilization=0.9, num_kv_blocks=8)
