"""Gemma 2, Gemma 3 (text) and Qwen3: what sets them apart matters, and they serve correctly.

Dense logit parity for the three families is in test_parity.py (FAMILIES). Here: the
Gemma-specific knobs really change transformers' logits (so that parity is not vacuous),
the KV layout shares device tensors across groups, and the engine's greedy output equals
transformers' on prompts and generations longer than the window (8 tokens), with chunked
prefill and prefix caching through the hybrid coordinator.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from paged_jax import SamplingParams
from paged_jax.config import EngineConfig
from paged_jax.engine import Engine
from paged_jax.models import load_model

MAX_NEW = 10


SAME_ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 1000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
}


@pytest.mark.parametrize(
    ("family", "change"),
    [
        pytest.param("gemma2", dict(attn_logit_softcapping=None), id="attn-softcap"),
        pytest.param("gemma2", dict(final_logit_softcapping=None), id="final-softcap"),
        pytest.param("gemma2", dict(query_pre_attn_scalar=16), id="query-scalar"),
        pytest.param("gemma2", dict(sliding_window=4), id="window"),
        pytest.param("gemma3_text", dict(rope_parameters=SAME_ROPE), id="local-rope"),
    ],
)
def test_gemma_knobs_change_transformers_logits(
    family, change, tiny_hf_checkpoint, hf_logits, tmp_path
):
    """Both configs load to HF parity, and the knob moves the logits by > 1e-3."""
    path = tiny_hf_checkpoint(family)
    changed = tmp_path / "changed"
    shutil.copytree(path, changed)
    config = json.loads((changed / "config.json").read_text())
    config.update(change)
    (changed / "config.json").write_text(json.dumps(config))
    ids = (np.arange(19, dtype=np.int32)[None] * 7) % 128
    ours_changed = np.asarray(load_model(changed)(ids))
    assert np.abs(ours_changed - hf_logits(changed, ids)).max() <= 1e-4
    assert np.abs(ours_changed - hf_logits(path, ids)).max() > 1e-3


@pytest.mark.parametrize(
    ("family", "num_tensors", "groups"),
    [
        ("gemma2", 2, [(None, (1, 3)), (8, (0, 2))]),
        ("gemma3_text", 5, [(None, (5,)), (8, (0, 1, 2, 3, 4))]),
        ("qwen3", 2, [(None, (0, 1))]),
    ],
)
def test_kv_layout_shares_tensors_across_groups(family, num_tensors, groups, tiny_hf_checkpoint):
    model = load_model(tiny_hf_checkpoint(family))
    assert [(g.sliding_window, g.layer_ids) for g in model.kv_cache_groups()] == groups
    caches = model.init_kv_caches(3, 4)
    assert len(caches) == num_tensors
    k = caches[0][0]
    assert model.kv_bytes_per_block(4) == num_tensors * 2 * k.size // 3 * k.dtype.itemsize


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "qwen3"])
def test_engine_greedy_matches_transformers_past_the_window(family, tiny_hf_checkpoint, hf_greedy):
    path = tiny_hf_checkpoint(family)
    rng = np.random.default_rng(5)
    shared = rng.integers(3, 128, 13).tolist()
    prompts = [rng.integers(3, 128, 21).tolist(), shared + [9, 4], shared + [11, 3, 7, 1, 2]]
    expected = [hf_greedy(path, p, MAX_NEW) for p in prompts]
    model = load_model(path, attention_backend="reference")
    engine = Engine(
        model,
        EngineConfig(
            block_size=4,
            max_num_seqs=4,
            max_num_batched_tokens=8,
            max_model_len=64,
            attention_backend="reference",
        ),
    )
    outs = {}
    for batch in ([0, 1], [2]):  # the second batch hits the first's shared prefix
        for i in batch:
            engine.add_request(
                str(i), prompts[i], SamplingParams(temperature=0, max_tokens=MAX_NEW)
            )
        while engine.has_unfinished():
            outs.update({o.request_id: o.token_ids for o in engine.step()})
            engine.kv_cache_manager.check_invariants()
    assert [outs[str(i)] for i in range(3)] == expected
    assert engine.get_stats()["prefix_cache_hits"] > 0
