"""Decode-only steps take the decode kernel; validate=True turns a bad block id into an error.

SumModel reads every context token back through the paged cache, so an exact output
proves the decode path attends over the right blocks.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.experimental import checkify

from paged_jax.config import EngineConfig
from paged_jax.engine import Engine
from paged_jax.sampling_params import SamplingParams
from paged_jax.testing.fake_model import SumModel, SumModelConfig

VOCAB = 97


def make_engine(**kwargs) -> Engine:
    model = SumModel(SumModelConfig(vocab_size=VOCAB, max_position_embeddings=64))
    base = dict(
        block_size=4,
        num_kv_blocks=32,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        attention_backend="reference",
        validate=True,
    )
    base.update(kwargs)
    return Engine(model, EngineConfig(**base))


def run(engine: Engine, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o.token_ids for o in engine.step()})
    return outs


ON_GPU = jax.default_backend() == "gpu"


@pytest.mark.parametrize(
    "backend",
    [
        "reference",
        "pallas_interpret",
        pytest.param(
            "pallas",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (Triton kernels)"),
            ],
        ),
    ],
)
def test_decode_only_steps_take_the_decode_path_and_stay_exact(backend):
    engine = make_engine(attention_backend=backend)
    engine.warmup()
    rng = np.random.default_rng(0)
    prompts = {f"r{i}": rng.integers(0, VOCAB, n).tolist() for i, n in enumerate((3, 9, 6))}
    max_tokens = 3 if backend == "pallas_interpret" else 5
    outs = run(engine, prompts, max_tokens)
    for rid, prompt in prompts.items():
        assert outs[rid] == SumModel.reference_continuation(prompt, max_tokens, VOCAB), rid
    # One prefill step, then every step is decode-only (all three run together).
    assert engine.runner.num_decode_only_steps == max_tokens - 1
    assert engine.get_stats()["num_compiles_after_warmup"] == 0


def test_an_out_of_range_block_id_is_an_error_not_a_wrong_answer():
    engine = make_engine()
    engine.add_request("a", list(range(1, 10)), SamplingParams(temperature=0.0, max_tokens=4))
    engine.step()  # the prefill: 9 tokens in blocks at columns 0..2 of the request's table
    # Table slot 0 of group 0 names block 40; the pool has blocks 0..31.
    engine.input_batch.replace_block_ids("a", [(0, 0, 40)])
    with pytest.raises(
        checkify.JaxRuntimeError,
        match=r"block_tables\[0, 0\] = 40 is not a block id in \[0, 32\)",
    ):
        engine.step()


def test_without_validate_the_same_corruption_passes_silently():
    """The hazard validate=True exists for: the reference clamps the bad id (and a GPU
    would read out of bounds), so the step 'succeeds' with a wrong token."""
    engine = make_engine(validate=False)
    prompt = list(range(1, 10))
    engine.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=2))
    first = engine.step()
    assert first == [] or first[0].token_ids
    engine.input_batch.replace_block_ids("a", [(0, 0, 40)])
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o.token_ids for o in engine.step()})
    assert outs["a"] != SumModel.reference_continuation(prompt, 2, VOCAB)
