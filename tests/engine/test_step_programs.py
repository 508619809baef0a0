"""Warm-up builds one program per token bucket (plus the copy), a warm start loads them all,
and nothing compiles afterwards.

SumModel's output is computable by hand and travels through the paged cache, so a
loaded program that ran the wrong step would change it.
"""

from __future__ import annotations

import logging

from paged_jax.config import EngineConfig
from paged_jax.engine import Engine
from paged_jax.sampling_params import SamplingParams
from paged_jax.testing.fake_model import SumModel, SumModelConfig
from paged_jax.worker.executable_cache import (
    ExecutableCache,
    ProgramRecord,
    model_identity,
    program_context,
)
from paged_jax.worker.input_batch import decode_step_shapes
from paged_jax.worker.runner import num_backend_compiles

VOCAB = 97
ENGINE = dict(
    block_size=4,
    num_kv_blocks=32,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    attention_backend="reference",
)
PROMPTS = {"a": [5, 9, 2], "b": list(range(1, 12)), "c": [7] * 6}
MAX_TOKENS = 5


def make_engine(cache_dir=None, **kwargs) -> Engine:
    model = SumModel(SumModelConfig(vocab_size=VOCAB, max_position_embeddings=64))
    return Engine(model, EngineConfig(**{**ENGINE, **kwargs}), executable_cache_dir=cache_dir)


def check_outputs(engine: Engine) -> None:
    """Exact greedy outputs for PROMPTS, and no compile while serving them."""
    before = num_backend_compiles()
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o.token_ids for o in engine.step()})
    for rid, prompt in PROMPTS.items():
        assert outs[rid] == SumModel.reference_continuation(prompt, MAX_TOKENS, VOCAB), rid
    assert num_backend_compiles() == before
    if engine.warmup_report is not None:
        assert engine.get_stats()["num_compiles_after_warmup"] == 0


def test_one_program_per_token_bucket_with_the_sequences_it_can_hold():
    cfg = EngineConfig(max_num_seqs=48, max_num_batched_tokens=1024, max_model_len=100)
    assert cfg.step_shapes() == [(16, 16), (64, 48), (256, 48), (512, 48), (1024, 48)]
    demo = EngineConfig(max_model_len=2048)  # the demo job's settings: was 21 (T, S) pairs
    assert demo.step_shapes() == [(16, 16), (64, 64), (256, 64), (512, 64)]
    # Decode steps have n tokens for n <= max_num_seqs sequences: the first two only.
    assert decode_step_shapes(demo) == [(16, 16), (64, 64)]


def test_warmup_builds_the_buckets_their_decode_variant_and_the_copy():
    engine = make_engine()
    assert engine.warmup() == 4
    report = engine.warmup_report
    # 4 sequences at most: every decode step (n tokens, n <= 4) lands in the first bucket.
    assert [p.name for p in report.programs] == [
        "step tokens=16 seqs=4",
        "step tokens=16 seqs=4 decode-only",
        "step tokens=32 seqs=4",
        "copy",
    ]
    assert report.start == "cold" and report.num_compiled == 4 and report.cache_dir is None
    check_outputs(engine)
    assert engine.runner.num_decode_only_steps == MAX_TOKENS - 1


def test_a_warm_start_loads_every_program_and_compiles_nothing(tmp_path):
    cold = make_engine(tmp_path)
    cold.warmup()
    assert cold.warmup_report.start == "cold" and cold.warmup_report.num_compiled == 4
    assert all(p.cached for p in cold.warmup_report.programs)
    check_outputs(cold)
    warm = make_engine(tmp_path)
    before = num_backend_compiles()
    warm.warmup()
    assert num_backend_compiles() == before
    report = warm.warmup_report
    assert report.start == "warm" and report.num_loaded == 4 and report.problems == []
    phases = report.phase_seconds()
    assert phases["compile_s"] == phases["trace_s"] == phases["lower_s"] == 0
    assert phases["load_s"] > 0
    check_outputs(warm)


def test_engine_settings_that_shape_the_step_key_the_programs(tmp_path):
    def entry(**kwargs):
        engine = make_engine(**kwargs)
        model = SumModel(SumModelConfig(vocab_size=VOCAB, max_position_embeddings=64))
        context = program_context(model_identity(model), engine.config, engine.runner.num_kv_blocks)
        cache = ExecutableCache(tmp_path, context)
        args = engine.runner.step_args(engine.input_batch.dummy_step_input(16, 4))
        key, _ = cache.key("step tokens=16 seqs=4", args)
        return key, cache.path(key)

    key, path = entry()
    assert key["engine"]["num_kv_blocks"] == 32 and "seed" not in key["engine"]
    assert entry(num_kv_blocks=40)[1] != path  # another cache shape
    assert entry(block_size=8)[1] != path
    assert entry(seed=7, enable_prefix_caching=False, async_scheduling=False)[1] == path


class _BrokenOnce(ExecutableCache):
    """Hands out one "loaded" program that fails when run, as a bad entry could."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.broken = 0

    def build(self, name, jitted, args, on_start=None, *, load=True):
        if load and self.broken == 0:
            self.broken += 1

            def fails(*_args):
                raise RuntimeError("NOT_FOUND: Function fusion.1 not found")

            return fails, ProgramRecord(name, "loaded")
        return super().build(name, jitted, args, on_start, load=load)


def test_a_loaded_program_that_fails_to_run_is_rebuilt(caplog):
    engine = make_engine()
    steps = [engine.input_batch.dummy_step_input(t, s) for t, s in engine.config.step_shapes()]
    cache = _BrokenOnce()
    with caplog.at_level(logging.WARNING):
        report = engine.runner.warmup(steps, cache=cache)
    assert report.num_compiled == 4 and len(report.problems) == 1
    assert "the loaded program failed (RuntimeError" in report.problems[0]
    check_outputs(engine)
