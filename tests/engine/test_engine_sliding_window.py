"""Sliding-window models served with block recycling, against transformers' greedy generate.

Mistral (every layer windowed: one window group) and Qwen2 with a window on layer 1 only
(a full group plus a window group sharing one pool) with window 8 and block size 4;
prompts and generations run well past the window, under chunked prefill, prefix caching
and recompute preemption. A pure-window request may hold at most ceil(8 / 4) + 1 = 3
blocks in any decode step; the hybrid one adds its full-attention table.
"""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax import LLM, SamplingParams
from paged_jax.config import EngineConfig
from paged_jax.constants import cdiv
from paged_jax.engine import Engine
from paged_jax.models import load_model

WINDOW = 8
BS = 4
MAX_NEW = 12
WINDOW_BOUND = cdiv(WINDOW, BS) + 1
CHECKPOINTS = {
    "mistral": dict(sliding_window=WINDOW),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def family(request):
    return request.param


@pytest.fixture(scope="module")
def path(family, tiny_hf_checkpoint):
    return tiny_hf_checkpoint(family, **CHECKPOINTS[family])


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    shared = rng.integers(3, 128, 18).tolist()
    out = [rng.integers(3, 128, n).tolist() for n in (3, 11, 26)]
    out += [shared + rng.integers(3, 128, n).tolist() for n in (1, 6, 13)]
    return out


@pytest.fixture(scope="module")
def expected(path, prompts, hf_greedy):
    return [hf_greedy(path, p, MAX_NEW) for p in prompts]


def run_engine(path, prompts, rounds=1, **kwargs):
    model = load_model(path, attention_backend="reference")
    cfg = dict(block_size=BS, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    cfg.update(kwargs)
    engine = Engine(model, EngineConfig(attention_backend="reference", **cfg))
    outs = {}
    per_round = cdiv(len(prompts), rounds)
    for r in range(rounds):
        for i in range(r * per_round, min(len(prompts), (r + 1) * per_round)):
            engine.add_request(
                str(i), prompts[i], SamplingParams(temperature=0, max_tokens=MAX_NEW)
            )
        while engine.has_unfinished():
            outs.update({o.request_id: o for o in engine.step()})
            engine.kv_cache_manager.check_invariants()
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks
    return [outs[str(i)].token_ids for i in range(len(prompts))], engine


def test_model_declares_its_kv_groups(path, family):
    groups = load_model(path).kv_cache_groups()
    if family == "mistral":
        assert [(g.sliding_window, g.layer_ids) for g in groups] == [(WINDOW, (0, 1))]
    else:
        assert [(g.sliding_window, g.layer_ids) for g in groups] == [(None, (0,)), (WINDOW, (1,))]


def test_chunked_prefill_past_the_window_matches(path, family, prompts, expected):
    got, engine = run_engine(path, prompts, max_num_batched_tokens=8, enable_prefix_caching=False)
    assert got == expected
    longest = max(len(p) for p in prompts) + MAX_NEW
    # Decode steps: the window group holds <= 3 blocks, a full group all of them.
    full = cdiv(longest, BS) if family == "qwen2" else 0
    peak = engine.get_stats()["kv_blocks_per_request_peak"]
    assert WINDOW_BOUND <= peak <= WINDOW_BOUND + full


# Pools small enough to preempt: the hybrid model needs a block per group per position.
SMALL_POOL = {"mistral": 9, "qwen2": 19}


def test_prefix_caching_and_preemption_match(path, family, prompts, expected):
    got, engine = run_engine(
        path, prompts, rounds=2, num_kv_blocks=SMALL_POOL[family], max_num_batched_tokens=8
    )
    stats = engine.get_stats()
    assert stats["prefix_cache_hits"] > 0, "shared prefixes meant to hit"
    assert stats["num_preemptions"] > 0, "pool meant to force preemption"
    assert got == expected


def test_swap_preemption_is_refused_for_window_groups(path):
    with pytest.raises(ValueError, match="preemption_mode='swap' must be 'recompute'"):
        run_engine(path, [[5, 6, 7]], preemption_mode="swap")


def test_llm_stats_show_window_only_model_holds_window_blocks(tiny_hf_checkpoint, prompts):
    path = tiny_hf_checkpoint("mistral", **CHECKPOINTS["mistral"])
    llm = LLM(
        path,
        block_size=BS,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=64,
        attention_backend="reference",
        warmup=False,
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    llm.generate([list(p) for p in prompts], params)
    stats = llm.get_stats()
    # The 26-token prompt + 12 outputs would need 10 blocks with full attention.
    assert stats["kv_blocks_per_request_peak"] == WINDOW_BOUND
