"""batch_invariant=True (issue 39 item 5): a request's tokens and logprobs are bitwise the same
whatever runs beside it.

One tiny f32 Llama; three module-scoped engines in the mode (token budget 64 with async
scheduling, budget 32, budget 64 synchronous), each compiling its one step program. A
sampled (seeded, temperature > 0) and a greedy target request are run alone on a fresh
prefix cache, then among 24 others, with a prefix-cache hit, with their prompt cut into
other chunks (budget 32) and synchronously; every comparison is exact (tokens, the sampled
tokens' logprobs and the top-3 logprobs). Without the mode, the crowd and the chunking
comparisons fail on CPU (docs/research_integration.md, "Batch invariance").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import LLM, SamplingParams
from paged_jax.config import EngineConfig
from paged_jax.entrypoints.generate_cli import build_parser, engine_args_from_args
from paged_jax.models.batch_invariant import ROW_TILE, map_row_tiles, row_tiled_dot_general
from paged_jax.worker.executable_cache import program_context

# Bits compared across batch shapes: XLA's own CPU emitters (tests/conftest.py).
pytestmark = pytest.mark.xla_default_cpu_codegen

ENGINE = dict(
    dtype="float32",
    block_size=4,
    max_num_seqs=32,
    max_model_len=96,
    warmup=False,
    batch_invariant=True,
)
_rng = np.random.default_rng(39)
# 45 tokens: one chunk alone under a budget of 64, two under 32.
SAMPLED_PROMPT = [int(t) for t in _rng.integers(3, 128, 45)]
GREEDY_PROMPT = [int(t) for t in _rng.integers(3, 128, 30)]
SAMPLED = SamplingParams(temperature=0.9, seed=1234, max_tokens=10, logprobs=3)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, logprobs=3)
TARGETS = ((SAMPLED_PROMPT, SAMPLED), (GREEDY_PROMPT, GREEDY))
# 24 others of mixed lengths, settings and output lengths, so the batch changes every step.
OTHERS = [[int(t) for t in _rng.integers(3, 128, int(n))] for n in _rng.integers(2, 40, size=24)]
OTHER_PARAMS = [
    SamplingParams(
        temperature=0.0 if i % 3 == 0 else 1.0,
        top_k=0 if i % 2 else 20,
        top_p=0.9 if i % 4 == 1 else 1.0,
        seed=i,
        max_tokens=int(4 + i % 9),
        logprobs=1 if i % 5 == 0 else None,
    )
    for i in range(24)
]


def _result(out) -> tuple:
    """(token ids, per token: the sorted (id, logprob) pairs of its logprob entry): exact."""
    completion = out.outputs[0]
    entries = tuple(
        tuple(sorted((tok, lp.logprob) for tok, lp in step.items())) for step in completion.logprobs
    )
    return tuple(completion.token_ids), entries


def _fresh(llm: LLM) -> LLM:
    """The engine idle with an empty prefix cache (each comparison controls its own hits)."""
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv_cache_manager.reset_prefix_cache()
    return llm


def _alone(llm: LLM) -> list[tuple]:
    """Each target run by itself on an empty prefix cache."""
    results = []
    for prompt, params in TARGETS:
        out = _fresh(llm).generate([prompt], params, use_tqdm=False)[0]
        assert out.metrics.num_cached_tokens == 0
        results.append(_result(out))
    return results


@pytest.fixture(scope="module")
def checkpoint(tiny_hf_checkpoint) -> str:
    return str(tiny_hf_checkpoint("llama"))


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(checkpoint, max_num_batched_tokens=64, **ENGINE)


@pytest.fixture(scope="module")
def alone(llm) -> list[tuple]:
    return _alone(llm)


def test_alone_equals_among_24_others(llm, alone):
    prompts = OTHERS[:12] + [p for p, _ in TARGETS] + OTHERS[12:]
    params = OTHER_PARAMS[:12] + [p for _, p in TARGETS] + OTHER_PARAMS[12:]
    outs = _fresh(llm).generate(prompts, params, use_tqdm=False)
    crowd = [_result(outs[12]), _result(outs[13])]
    assert crowd == alone
    assert len(alone[0][0]) == SAMPLED.max_tokens and len(alone[1][0]) == GREEDY.max_tokens
    # One attention path (no step took the decode kernel) and one step shape.
    assert llm.engine.runner.num_decode_only_steps == 0
    assert llm.engine.config.step_shapes() == [(64, 32)]


def test_prefix_cache_hit_changes_nothing(llm, alone):
    _fresh(llm)
    for (prompt, params), want in zip(TARGETS, alone):
        llm.generate([prompt], params, use_tqdm=False)  # its blocks now cached
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert out.metrics.num_cached_tokens >= len(prompt) - 2 * ENGINE["block_size"]
        assert _result(out) == want


def test_other_prompt_chunking_changes_nothing(checkpoint, alone):
    chunked = LLM(checkpoint, max_num_batched_tokens=32, **ENGINE)
    assert len(SAMPLED_PROMPT) > 32  # cut into two prefill chunks here, one in `llm`
    assert _alone(chunked) == alone


def test_synchronous_scheduling_changes_nothing(checkpoint, alone):
    sync = LLM(checkpoint, max_num_batched_tokens=64, async_scheduling=False, **ENGINE)
    assert _alone(sync) == alone


def test_row_tiles_give_the_same_bits_for_any_number_of_rows():
    rng = np.random.default_rng(0)
    # A product and a row mean whose plain XLA CPU forms round rows differently at T=64.
    w = jnp.asarray(rng.standard_normal((768, 3072)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((512, 768)), jnp.float32)
    dims = (((1,), (0,)), ((), ()))
    matmul = jax.jit(lambda a: row_tiled_dot_general(a, w, dims, precision="highest"))
    mean = jax.jit(lambda a: map_row_tiles(lambda t: jnp.mean(t * t, -1, keepdims=True), a))
    for fn, data in ((matmul, x), (mean, x[:, :64])):
        first = np.asarray(fn(data[:ROW_TILE]))
        last = np.asarray(fn(data[-ROW_TILE:]))
        for t in (ROW_TILE, 64, 512):
            out = np.asarray(fn(data[-t:]))
            assert np.array_equal(out[-ROW_TILE:], last), t
            out = np.asarray(fn(data[:t]))
            assert np.array_equal(out[:ROW_TILE], first), t
    # An all-zero tile (the engine's padding) is skipped: zeros, the other tiles unchanged.
    padded = x[:96].at[32:64].set(0.0)
    out = np.asarray(matmul(padded))
    assert not out[32:64].any()
    np.testing.assert_array_equal(out[:32], np.asarray(matmul(x[:32])))
    # Leading dims are rows too (the dense forward's [batch, seq, in]), and odd row counts pad.
    y = x[:75].reshape(3, 25, 768)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(lambda a: row_tiled_dot_general(a, w, (((2,), (0,)), ((), ()))))(y)),
        np.asarray(matmul(x[:75])).reshape(3, 25, 3072),
    )


def test_the_mode_is_one_bucket_and_refuses_what_it_cannot_pin():
    config = EngineConfig(max_num_batched_tokens=96, max_num_seqs=8, batch_invariant=True)
    assert config.token_buckets == (96,) and config.step_shapes() == [(96, 8)]
    assert len(EngineConfig(max_num_batched_tokens=96).token_buckets) > 1
    with pytest.raises(ValueError, match=r"EngineConfig.batch_invariant=True must be False with "):
        EngineConfig(
            batch_invariant=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
    with pytest.raises(ValueError, match=r"EngineConfig.batch_invariant=1 must be a bool"):
        EngineConfig(batch_invariant=1)
    args = engine_args_from_args(build_parser().parse_args(["--batch-invariant"]))
    assert args["batch_invariant"] is True
    # The mode changes the compiled programs, so it keys the executable cache.
    key = program_context({}, EngineConfig(max_model_len=64), 8)["engine"]
    on = program_context({}, EngineConfig(max_model_len=64, batch_invariant=True), 8)["engine"]
    assert key != on and on["batch_invariant"] is True


def test_lora_is_refused():
    with pytest.raises(ValueError, match=r"batch_invariant.*enable_lora"):
        EngineConfig(batch_invariant=True, enable_lora=True)


def test_8bit_weights_are_refused(tiny_hf_checkpoint):
    # Quantized products are not row-tiled: the mode refuses them before warm-up.
    with pytest.raises(ValueError, match=r"batch_invariant=True is not supported .* 8-bit"):
        LLM(str(tiny_hf_checkpoint("llama")), quantization="int8", **ENGINE)


def test_mixture_of_experts_models_are_refused(tiny_hf_checkpoint):
    with pytest.raises(ValueError, match=r"batch_invariant=True is not supported for .*experts"):
        LLM(str(tiny_hf_checkpoint("mixtral")), **ENGINE)
