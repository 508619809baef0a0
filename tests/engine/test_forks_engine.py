"""Forks and copy-on-write through the engine, on SumModel (outputs computable by hand).

SumModel's next token is the sum of every context token read back through the paged
KV cache, so a fork that lost a shared block, a copy that ran late (after the step's
writes) or not at all, or a write into a still-shared block changes a token.
"""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax.config import EngineConfig
from paged_jax.constants import cdiv
from paged_jax.engine import Engine
from paged_jax.llm import LLM
from paged_jax.sampling_params import SamplingParams
from paged_jax.testing.fake_model import SumModel, SumModelConfig

VOCAB = 97
BS = 4


def make_engine(**kwargs) -> Engine:
    model = SumModel(SumModelConfig(vocab_size=VOCAB, max_position_embeddings=128))
    base = dict(
        block_size=BS,
        num_kv_blocks=64,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        attention_backend="reference",
    )
    base.update(kwargs)
    return Engine(model, EngineConfig(**base))


def record_copies(engine: Engine) -> list:
    """Wraps InputBatch.prepare to keep every step's real (src, dst) copies."""
    copies = []
    prepare = engine.input_batch.prepare

    def spy(seqs, block_copies=(), *rest):
        step = prepare(seqs, block_copies, *rest)
        real = step.copies.dst >= 0
        copies.extend(zip(step.copies.src[real].tolist(), step.copies.dst[real].tolist()))
        return step

    engine.input_batch.prepare = spy
    return copies


def run_all(engine: Engine) -> dict:
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    kv = engine.kv_cache_manager
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_usable_blocks, "blocks leaked"
    return outs


def expected(prompt, outputs, total):
    """SumModel's greedy continuation of prompt + outputs, as the full output list."""
    rest = SumModel.reference_continuation(prompt + outputs, total - len(outputs), VOCAB)
    return outputs + rest


@pytest.mark.parametrize("backend", ["reference", "pallas_interpret"])
def test_forks_mid_decode_copy_the_partial_block_and_stay_exact(backend):
    engine = make_engine(attention_backend=backend, max_num_batched_tokens=16)
    copies = record_copies(engine)
    prompt = list(range(1, 10))  # 9 tokens: the last block holds 1 token
    greedy = SamplingParams(temperature=0.0, max_tokens=7)
    engine.add_request("p", prompt, greedy)
    engine.step()
    engine.step()  # 10 computed tokens + 1 sampled: the shared block is partial (2 of 4)
    parent = engine.scheduler.requests["p"]
    first = list(parent.output_token_ids)
    engine.fork_request("p", "same")  # an exact copy
    engine.fork_request("p", "other", output_token_ids=[first[0], 5])
    outs = run_all(engine)
    assert outs["p"].token_ids == expected(prompt, [], 7)
    assert outs["same"].token_ids == outs["p"].token_ids
    assert outs["other"].token_ids == expected(prompt, [first[0], 5], 7)
    # Three writers of one partial block: two copies, the last writer in place.
    assert len(copies) == 2 and len({d for _, d in copies}) == 2
    assert {s for s, _ in copies} == {engine.kv_cache_manager.block_pool.blocks[3].block_id}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_many_forks_in_a_small_pool_preempt_and_stay_exact(mode):
    engine = make_engine(num_kv_blocks=16, preemption_mode=mode, max_num_seqs=16)
    rng = np.random.default_rng(0)
    prompts = {f"r{i}": rng.integers(0, VOCAB, rng.integers(5, 15)).tolist() for i in range(3)}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=12))
    engine.step()
    children = {}
    for rid in prompts:
        req = engine.scheduler.requests[rid]
        for j in range(2):
            cid = f"{rid}.{j}"
            tail = [int(rng.integers(VOCAB))]
            engine.fork_request(rid, cid, output_token_ids=tail)
            children[cid] = (rid, tail)
        assert req.status.name == "RUNNING"
    outs = run_all(engine)
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    for rid, prompt in prompts.items():
        assert outs[rid].token_ids == expected(prompt, [], 12)
    for cid, (rid, tail) in children.items():
        assert outs[cid].token_ids == expected(prompts[rid], tail, 12)


def test_fork_request_rejects_bad_children():
    engine = make_engine(max_num_seqs=2)
    engine.add_request("p", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4))
    with pytest.raises(ValueError, match="child 'c' must share at least one computed token"):
        engine.fork_request("p", "c")  # nothing computed yet
    engine.step()
    with pytest.raises(ValueError, match="parent_id='x' must name a live request"):
        engine.fork_request("x", "c")
    with pytest.raises(ValueError, match="must be < vocab_size=97"):
        engine.fork_request("p", "c", output_token_ids=[500])
    engine.fork_request("p", "c")
    with pytest.raises(ValueError, match="child_id='c' must be unique"):
        engine.fork_request("p", "c")
    with pytest.raises(ValueError, match="max_num_seqs=2 requests are running"):
        engine.fork_request("p", "d")
    assert not engine.is_live("d")
    run_all(engine)


def test_parallel_sampling_is_one_prefill_plus_n_forks():
    llm = LLM(
        SumModel(SumModelConfig(vocab_size=VOCAB, max_position_embeddings=128)),
        warmup=False,
        block_size=BS,
        num_kv_blocks=64,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        attention_backend="reference",
    )
    engine = llm.engine
    copies = record_copies(engine)
    computed = []
    prepare = engine.input_batch.prepare

    def count(seqs, block_copies=(), *rest):
        computed.append(sum(s.num_new_tokens for s in seqs))
        return prepare(seqs, block_copies, *rest)

    engine.input_batch.prepare = count
    peak = [0]
    step = engine.step

    def tracked_step():
        out = step()
        kv = engine.kv_cache_manager
        peak[0] = max(peak[0], kv.num_usable_blocks - kv.num_free_blocks)
        return out

    engine.step = tracked_step
    prompt = list(range(1, 31))  # 30 tokens: 7 full blocks and 2 tokens
    n, max_tokens = 4, 5
    out = llm.generate([prompt], SamplingParams(n=n, temperature=0.0, max_tokens=max_tokens))[0]
    want = SumModel.reference_continuation(prompt, max_tokens, VOCAB)
    assert [c.token_ids for c in out.outputs] == [want] * n
    # One prefill of all but the last prompt token, then n one-token rows for it; with
    # async scheduling (the default) the prefill's request runs one discarded token more
    # while its sample is read.
    assert llm.config.async_scheduling
    assert sum(computed) == (len(prompt) - 1) + 1 + n * max_tokens
    assert len(copies) == n - 1  # the shared partial block: the last child writes in place
    # One prompt copy plus each child's copied partial block and tail.
    assert peak[0] <= cdiv(len(prompt), BS) + n * cdiv(len(prompt) % BS + max_tokens, BS)
    assert peak[0] < n * cdiv(len(prompt) + max_tokens, BS) / 2
    kv = engine.kv_cache_manager
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_usable_blocks
    # Seeded samples repeat exactly and differ between children.
    params = SamplingParams(n=n, temperature=1.0, seed=3, max_tokens=max_tokens)
    a = llm.generate([prompt], params, use_tqdm=False)[0]
    b = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
