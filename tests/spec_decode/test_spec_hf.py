"""Greedy n-gram speculation on tiny random Llama and Qwen2 checkpoints equals
transformers' greedy generate and the engine without speculation."""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax.config import EngineConfig
from paged_jax.engine import Engine
from paged_jax.models import load_model
from paged_jax.sampling_params import SamplingParams
from paged_jax.testing.bounded import call_within

MAX_NEW = 12


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    phrase = rng.integers(3, 120, 6).tolist()
    # Repetitive (copy-style: lookups hit) and plain random prompts.
    return [
        phrase * 4,
        rng.integers(3, 120, 11).tolist(),
        phrase * 2 + rng.integers(3, 120, 5).tolist() + phrase[:3],
        rng.integers(3, 120, 3).tolist(),
    ]


def run(path, speculative_config) -> tuple[list[list[int]], dict]:
    model = load_model(path, attention_backend="reference")
    # A small pool (preemption) and budget (chunked prefill).
    engine = Engine(
        model,
        EngineConfig(
            block_size=4,
            num_kv_blocks=14,
            max_num_seqs=4,
            max_num_batched_tokens=16,
            max_model_len=64,
            attention_backend="reference",
            speculative_config=speculative_config,
        ),
    )
    ps = prompts()
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=MAX_NEW))

    def loop():
        outs = {}
        while engine.has_unfinished():
            outs.update({o.request_id: o.token_ids for o in engine.step()})
        return outs

    outs = call_within(1200, loop)  # a hang guard, generous for a loaded machine
    kv = engine.kv_cache_manager
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_usable_blocks
    return [outs[str(i)] for i in range(len(ps))], engine.get_stats()


@pytest.mark.parametrize(
    "family",
    [
        "llama",
        # Slow (~45 s of compiles on 2 cores): the same path as Llama's on another family.
        pytest.param("qwen2", marks=pytest.mark.slow),
    ],
)
def test_ngram_greedy_equals_transformers(family, tiny_hf_checkpoint, hf_greedy):
    path = tiny_hf_checkpoint(family)
    want = [hf_greedy(path, p, MAX_NEW) for p in prompts()]
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
    }
    got, stats = run(path, spec)
    assert got == want
    assert stats["spec_num_draft_tokens"] > 0
    assert stats["num_preemptions"] > 0, "the pool was meant to force preemption"
