"""Copy-on-write copies run as their own jitted call, only on steps that have one.

A step without copies dispatches no copy at all (the step's jit holds no block copy, so
no copy programs launch per layer); a step with copies runs the copy first, on the
donated caches, so the step's writes see the copied blocks by data dependency (async
scheduling included). Warm-up compiles the copy too, and validate=True checks it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from jax.experimental import checkify

from paged_jax.config import EngineConfig
from paged_jax.engine import Engine
from paged_jax.sampling_params import SamplingParams
from paged_jax.testing.fake_model import SumModel, SumModelConfig
from paged_jax.worker.step_input import StepCopies

VOCAB, BS = 97, 4


def _engine(**kw) -> Engine:
    model = SumModel(SumModelConfig(vocab_size=VOCAB, max_position_embeddings=64))
    base = dict(
        block_size=BS,
        num_kv_blocks=32,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=64,
        attention_backend="reference",
    )
    return Engine(model, EngineConfig(**{**base, **kw}))


def _count_copies(engine: Engine) -> list[int]:
    """Wraps the runner's copy program (built by warmup); returns the real copies per call."""
    calls = []
    runner = engine.runner
    copy = runner.programs["copy"]

    def spy(kv_caches, copies):
        calls.append(int((np.asarray(copies.dst) != -1).sum()))
        return copy(kv_caches, copies)

    runner.programs["copy"] = spy
    return calls


def _run(engine: Engine) -> dict:
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    return outs


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_only_steps_with_copies_dispatch_the_copy_and_forks_stay_exact(async_scheduling):
    engine = _engine(async_scheduling=async_scheduling)
    engine.warmup()
    calls = _count_copies(engine)
    prompt = list(range(1, 10))  # 9 tokens: the last block is partial
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    engine.add_request("p", prompt, greedy)
    engine.step()
    engine.step()
    assert calls == [], "a step without copies dispatched a copy"
    first = list(engine.scheduler.requests["p"].output_token_ids)
    engine.fork_request("p", "c", output_token_ids=[first[0], 5])
    outs = _run(engine)
    assert calls and all(n > 0 for n in calls), calls  # only real copies were dispatched
    want = SumModel.reference_continuation(prompt, 6, VOCAB)
    assert outs["p"].token_ids == want
    tail = [first[0], 5]
    assert outs["c"].token_ids == tail + SumModel.reference_continuation(prompt + tail, 4, VOCAB)
    assert engine.get_stats()["num_compiles_after_warmup"] == 0


def test_a_step_with_copies_copies_the_blocks_before_the_step():
    engine = _engine()
    runner = engine.runner
    k, v = runner.kv_caches[0]
    runner.kv_caches[0] = (k.at[3].set(7.0), v.at[3].set(-7.0))
    step = engine.input_batch.dummy_step_input(4, 1)
    width = step.copies.dst.shape[0]
    src, dst = np.zeros(width, np.int32), np.full(width, -1, np.int32)
    src[0], dst[0] = 3, 5
    step = dataclasses.replace(step, copies=StepCopies(src=src, dst=dst))
    runner.execute(step)
    k, v = (np.asarray(x) for x in runner.kv_caches[0])
    assert (k[5] == 7.0).all() and (v[5] == -7.0).all()


def test_validate_checks_the_copy_and_names_the_field():
    engine = _engine(validate=True)
    step = engine.input_batch.dummy_step_input(4, 1)
    width = step.copies.dst.shape[0]
    src, dst = np.zeros(width, np.int32), np.full(width, -1, np.int32)
    src[0], dst[0] = 1, 32 + 5  # past the pool
    step = dataclasses.replace(step, copies=StepCopies(src=src, dst=dst))
    with pytest.raises(checkify.JaxRuntimeError, match=r"dst_block_ids\[0\] = 37"):
        engine.runner.execute(step)
