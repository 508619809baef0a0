"""The paged forward as a scan over layers: its plan, its stacked KV ids, and outputs equal to
the unrolled forward (uniform, window/full alternating, a tail after the scan, fp8, swaps,
copies, validate)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import Engine, EngineConfig, SamplingParams
from paged_jax.models import load_model
from paged_jax.models.layer_scan import ids_in_every_tensor, plan_layer_scan, shift_to_tensor
from paged_jax.models.simple_paged import make_attn_metadata
from paged_jax.worker.runner import num_backend_compiles, scans_layers

# Gemma 3 with 5 layers alternating window/full: period 2, two scan steps, one tail layer.
GEMMA3_TAIL = dict(
    num_hidden_layers=5,
    layer_types=["sliding_attention", "full_attention"] * 2 + ["sliding_attention"],
    sliding_window=4,
)


@pytest.mark.parametrize(
    ("family", "overrides", "expected"),
    [
        ("llama", dict(num_hidden_layers=4), (1, 4, (0, 1, 2, 3), 4)),
        ("gemma2", dict(num_hidden_layers=4), (2, 2, (0, 0, 1, 1), 2)),
        ("gemma3_text", GEMMA3_TAIL, (2, 2, (0, 0, 1, 1, 2), 3)),
        ("llama", dict(num_hidden_layers=1), None),  # nothing repeats
        ("gemma2", dict(num_hidden_layers=2), None),  # one period: nothing to scan
    ],
)
def test_plan_finds_the_period(family, overrides, expected, tiny_hf_checkpoint):
    model = load_model(tiny_hf_checkpoint(family, **overrides))
    plan = plan_layer_scan(model)
    if expected is None:
        assert plan is None
    else:
        assert (plan.period, plan.num_steps, plan.tensor_of_layer, plan.num_tensors) == expected


def test_stacked_ids_stay_in_their_tensor_and_out_of_pool_stays_out():
    # 3 tensors of 5 blocks each (rows 0-14); 15 is past the stacked pool.
    ids = jnp.asarray([0, 4, -1, 5, 7], jnp.int32)
    assert ids_in_every_tensor(ids, 5, 3).tolist() == [
        *[0, 4, -1, 15, 15],
        *[5, 9, -1, 15, 15],
        *[10, 14, -1, 15, 15],
    ]
    _, meta = make_attn_metadata([[1, 4], [3]], [0, 0], [6, 2], block_size=4, num_seqs=3)
    bad = meta.block_tables[0].copy()
    bad[1, 1] = 9  # out of the 5-block pool
    meta = type(meta)(
        slot_mappings=np.concatenate([meta.slot_mappings[0][:-1], [20]]).astype(np.int32),
        block_tables=bad,
        seq_lens=meta.seq_lens,
        query_start_loc=meta.query_start_loc,
        logits_indices=meta.logits_indices,
    )
    shifted = shift_to_tensor(meta, jnp.int32(2), num_blocks=5, num_tensors=3, block_size=4)
    table = np.asarray(shifted.block_tables[0])
    assert table[0].tolist() == [11, 14] and table[1].tolist() == [13, 15]
    assert table[2].tolist() == [10, 10]  # padding rows read tensor 2's null block
    slots = np.asarray(shifted.slot_mappings[0])
    original = np.asarray(meta.slot_mappings[0])
    assert slots[:-1].tolist() == (original[:-1] + 40).tolist()  # 2 tensors x 5 blocks x 4
    assert slots[-1] == 60  # slot 20 is outside a 20-slot tensor: past the whole pool


def _greedy(model, prompts, **engine_kw):
    engine = Engine(model, EngineConfig(**engine_kw))
    engine.warmup()
    compiles = num_backend_compiles()
    for i, prompt in enumerate(prompts):
        n = 2 if i == 0 else 1  # a fork: copy-on-write copies move every tensor's block
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=6, temperature=0.0, n=n))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens = [s.token_ids for s in out.samples] if out.samples else [out.token_ids]
            done[out.request_id] = [list(t) for t in tokens]
    assert num_backend_compiles() == compiles, "a step compiled after warm-up"
    return [done[str(i)] for i in range(len(prompts))], engine


@pytest.mark.parametrize(
    ("family", "overrides", "engine_kw"),
    [
        # swap and an fp8 cache in one engine pair: the scan's swap copies move every
        # tensor's fp8 blocks (two cases before, the same Llama engines twice)
        (
            "llama",
            dict(num_hidden_layers=3),
            dict(preemption_mode="swap", kv_cache_dtype="fp8_e4m3"),
        ),
        ("gemma2", dict(num_hidden_layers=4), dict(validate=True)),
        ("gemma3_text", GEMMA3_TAIL, {}),
    ],
)
def test_scanned_engine_equals_unrolled(family, overrides, engine_kw, tiny_hf_checkpoint):
    path = tiny_hf_checkpoint(family, **overrides)
    rng = np.random.default_rng(0)
    # A pool too small for all at once: preemption (swap or recompute) runs too.
    prompts = [rng.integers(0, 128, size=n).tolist() for n in (11, 4, 9, 14)]
    kw = dict(
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=64,
        num_kv_blocks=14,
        attention_backend="reference",
        **engine_kw,
    )
    unrolled, _ = _greedy(load_model(path), prompts, scan_layers=False, **kw)
    scanned, engine = _greedy(load_model(path), prompts, scan_layers=True, **kw)
    assert engine.runner.layer_scan is not None
    assert len(engine.runner.kv_caches) == 1  # every tensor in one stacked (K, V) pair
    assert scanned == unrolled
    if engine_kw.get("preemption_mode") == "swap":
        assert engine.get_stats()["num_preemptions"] > 0


def test_owned_model_layers_are_freed_and_kept_otherwise(tiny_hf_checkpoint):
    path = tiny_hf_checkpoint("llama", num_hidden_layers=3)
    kw = dict(
        block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, scan_layers=True
    )
    kept = load_model(path)
    Engine(kept, EngineConfig(**kw))
    assert not any(x.is_deleted() for x in jax.tree.leaves(kept))
    owned = load_model(path)
    Engine(owned, EngineConfig(**kw), owns_model=True)
    layer_arrays = jax.tree.leaves(list(owned.layers))
    assert layer_arrays and all(x.is_deleted() for x in layer_arrays)
    assert not owned.embed_tokens.embedding[...].is_deleted()


def test_llm_hands_a_model_it_loads_to_the_engine(tiny_hf_checkpoint):
    from paged_jax import LLM

    path = tiny_hf_checkpoint("llama", num_hidden_layers=3)
    kw = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, scan_layers="on")
    llm = LLM(path, warmup=False, **kw)
    assert all(x.is_deleted() for x in jax.tree.leaves(list(llm.model.layers)))
    model = load_model(path)
    LLM(model, warmup=False, **kw)  # a model object passed in stays usable
    assert not any(x.is_deleted() for x in jax.tree.leaves(model))


def test_scan_layers_setting():
    assert EngineConfig(scan_layers=True).scan_layers == "on"
    assert EngineConfig(scan_layers=False).scan_layers == "off"
    assert scans_layers(EngineConfig(scan_layers="on"))
    assert not scans_layers(EngineConfig(scan_layers="off"))
    # auto: unrolled on CPU (XLA copies each layer's weight slice out of the stack there).
    assert scans_layers(EngineConfig()) == (jax.default_backend() != "cpu")
    with pytest.raises(ValueError, match="scan_layers='yes'.*'auto', 'on', 'off'"):
        EngineConfig(scan_layers="yes")
