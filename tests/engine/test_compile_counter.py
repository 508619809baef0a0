"""get_stats()' compile counters count the engine's own programs, not the process's.

jax reports every backend compile in the thread that compiles; the runner counts the
ones made inside its own calls (dispatch, copies, warm-up, swaps). A user's eager jnp
ops, in this thread or another, leave num_compiles_after_warmup at 0; a step shape the
warm-up did not build still counts.
"""

from __future__ import annotations

import threading

import jax.numpy as jnp

from paged_jax.config import EngineConfig
from paged_jax.engine import Engine
from paged_jax.sampling_params import SamplingParams
from paged_jax.testing.fake_model import SumModel, SumModelConfig
from paged_jax.worker.runner import counting_compiles, num_backend_compiles

VOCAB = 97
ENGINE = dict(
    block_size=4,
    num_kv_blocks=32,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    attention_backend="reference",
)


def _unrelated_jnp_ops(seed: int) -> None:
    """Five eager ops on shapes nothing else uses: five or more fresh compiles."""
    n = 1000 + seed
    x = jnp.arange(n, dtype=jnp.float32)
    y = jnp.sin(x) * 3.0 + 1.0
    z = jnp.cumsum(y[::-1])
    float(jnp.max(z) - jnp.min(y))


def _serve(engine: Engine) -> None:
    engine.add_request("a", [5, 9, 2], SamplingParams(temperature=0.0, max_tokens=4))
    engine.add_request("b", list(range(1, 12)), SamplingParams(temperature=0.0, max_tokens=4))
    while engine.has_unfinished():
        engine.step()


def test_user_jnp_ops_after_warmup_are_not_the_engines_compiles():
    engine = Engine(
        SumModel(SumModelConfig(vocab_size=VOCAB, max_position_embeddings=64)),
        EngineConfig(**ENGINE),
    )
    engine.warmup()
    warm = engine.get_stats()["num_compiles"]
    assert warm > 0  # the warm-up's compiles are the engine's
    before = num_backend_compiles()
    _unrelated_jnp_ops(seed=1)
    assert num_backend_compiles() - before >= 5, "the ops did compile"
    _serve(engine)
    stats = engine.get_stats()
    assert stats["num_compiles_after_warmup"] == 0
    assert stats["num_compiles"] == warm

    # Another thread's compiles while this one is inside the runner's scope do not count.
    def other_thread():
        worker = threading.Thread(target=_unrelated_jnp_ops, args=(2,))
        worker.start()
        worker.join(120)
        assert not worker.is_alive()

    counting_compiles(lambda runner: other_thread())(engine.runner)
    assert engine.get_stats()["num_compiles_after_warmup"] == 0

    # A step shape warm-up did not build compiles inside the engine: it counts.
    odd = engine.input_batch.dummy_step_input(24, 4)  # 24 tokens: not a bucket
    assert engine.runner.execute(odd).token_ids.shape == (0,)
    assert engine.get_stats()["num_compiles_after_warmup"] >= 1
    assert engine.get_stats()["num_compiles"] == warm + 1
