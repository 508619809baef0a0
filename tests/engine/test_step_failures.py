"""A step that raises (in packing, dispatch or reading its result) never wedges or poisons;
a request with non-finite logits ends alone, with an error.

Failures are injected once, where the engine calls InputBatch.prepare, Runner.dispatch,
PendingStep.result and Scheduler.update_from_output, in both scheduling modes, as a RuntimeError (a device error)
and as a KeyboardInterrupt (Ctrl-C in a notebook). After the exception reaches the
caller, the engine must keep its invariants and serve every request exactly as a fresh
engine would; no block of the prefix cache may name KV that was never written. Every
engine loop here runs under a time limit, so a wedged engine fails instead of hanging.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from paged_jax.config import EngineConfig
from paged_jax.core.hashing import make_block_hash_with_group_id
from paged_jax.core.request import Request
from paged_jax.engine import NONFINITE_LOGITS_ERROR, Engine
from paged_jax.sampling_params import SamplingParams
from paged_jax.testing.fake_model import SumModel, SumModelConfig
from tests.engine.test_engine_fake import VOCAB, assert_pool_drained, make_engine

# A hang guard, not a speed check: a failed step must never leave generate() waiting
# forever. Generous for a loaded 2-core machine (one SumModel start + generate took 55 s
# at load 15).
TIME_LIMIT_S = 900.0
WHERE = ("prepare", "dispatch", "dispatch_lost", "result", "apply")


def within_time_limit(fn: Callable[[], Any], seconds: float = TIME_LIMIT_S) -> Any:
    """fn() run in a daemon thread; fails the test if it has not returned within seconds.

    Whatever fn raises (KeyboardInterrupt included) is re-raised here.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"did not finish within {seconds} s (the engine is wedged)")
    if "error" in box:
        raise box["error"]
    return box.get("value")


class FailOnce:
    """Makes the engine's next step raise an exception at one point, once, when armed.

    Points (WHERE): "prepare" (InputBatch.prepare raises before packing), "dispatch"
    (before the jitted call), "dispatch_lost" (after the call consumed the donated KV
    caches and row tokens, before the runner got its results back: the device state is
    gone), "result" (PendingStep.result raises; the step itself ran), or "apply"
    (right after Scheduler.update_from_output appended the tokens and freed the
    requests that finished, before the engine reported them).
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.where: str | None = None
        self.exc: BaseException | None = None
        batch, runner, scheduler = engine.input_batch, engine.runner, engine.scheduler
        real_prepare, real_dispatch = batch.prepare, runner.dispatch
        real_update = scheduler.update_from_output

        def update_from_output(*args, **kwargs):
            done = real_update(*args, **kwargs)
            if self.where == "apply":
                self._fire()
            return done

        def prepare(*args, **kwargs):
            if self.where == "prepare":
                self._fire()
            return real_prepare(*args, **kwargs)

        def dispatch(*args, **kwargs):
            if self.where == "dispatch":
                self._fire()
            pending = real_dispatch(*args, **kwargs)
            if self.where == "dispatch_lost":
                for k, v in runner.kv_caches:
                    k.delete()
                    v.delete()
                runner.row_tokens.delete()
                self._fire()
            if self.where == "result":
                real_result = pending.result

                def result():
                    if self.where == "result":
                        self._fire()
                    return real_result()

                pending.result = result
            return pending

        batch.prepare = prepare
        runner.dispatch = dispatch
        scheduler.update_from_output = update_from_output

    def arm(self, where: str, exc: BaseException) -> FailOnce:
        assert where in WHERE, where
        self.where, self.exc = where, exc
        return self

    def _fire(self) -> None:
        exc, self.where = self.exc, None
        raise exc


def drain(engine: Engine, max_steps: int = 2_000) -> dict:
    """Steps until idle (bounded: a wedged engine fails instead of spinning)."""
    outs = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outs
        for o in engine.step():
            assert o.request_id not in outs, "a request finished twice"
            outs[o.request_id] = o
    pytest.fail(f"the engine did not finish its requests in {max_steps} steps")


def step_until_raises(engine: Engine, exc_type: type[BaseException], max_steps: int = 50) -> None:
    """Steps until the armed failure fires; the exception must reach the caller."""
    for _ in range(max_steps):
        try:
            engine.step()
        except exc_type:
            return
    pytest.fail("the injected failure never fired")


def requests_seen(engine: Engine, seen: dict[int, Request]) -> None:
    """Remembers every Request object the scheduler holds now (finished ones stay)."""
    for req in engine.scheduler.requests.values():
        seen[id(req)] = req


def assert_cached_blocks_hold_their_kv(engine: Engine, seen: dict[int, Request]) -> None:
    """No block of the prefix cache names KV that was never written: SumModel's V cache
    holds each token's id (channel 0) and 1.0 (channel 1), so a hashed block must hold
    exactly the tokens its hash was computed from."""
    tokens_of = {}
    bs = engine.config.block_size
    for req in seen.values():
        ids = req.all_token_ids
        for i, h in enumerate(req.block_hashes):
            tokens_of[make_block_hash_with_group_id(h, 0)] = ids[i * bs : (i + 1) * bs]
    cached = list(engine.kv_cache_manager.block_pool.cached_block_hash_to_block.items())
    if not cached:
        return
    v = np.asarray(engine.runner.kv_caches[0][1])  # f32[num_blocks, 1, bs, HEAD_DIM]
    for key, block in cached:
        assert key in tokens_of, f"block {block.block_id} is cached under an unknown hash"
        want = np.asarray(tokens_of[key], np.float32)
        got = v[block.block_id, 0, :, :2]
        assert (got[:, 1] == 1.0).all() and (got[:, 0] == want).all(), (
            f"block {block.block_id} is in the prefix cache but holds {got[:, 0].tolist()} "
            f"(written {got[:, 1].tolist()}), not the KV of {want.tolist()}"
        )


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def prompts_of(seed: int, n: int = 6, lo: int = 3, hi: int = 30) -> dict[str, list[int]]:
    rng = np.random.default_rng(seed)
    return {f"r{i}": rng.integers(0, VOCAB, rng.integers(lo, hi)).tolist() for i in range(n)}


@pytest.fixture(scope="module")
def engines():
    """One engine, its FailOnce and its requests seen (for the KV check) per scheduling
    mode, shared by this module's tests: each test leaves its engine idle, and
    compiling the step once per mode keeps the module fast."""
    made: dict[bool, tuple[Engine, FailOnce, dict[int, Request]]] = {}

    def get(async_scheduling: bool) -> tuple[Engine, FailOnce, dict[int, Request]]:
        if async_scheduling not in made:
            engine = make_engine(async_scheduling=async_scheduling, num_kv_blocks=40)
            made[async_scheduling] = engine, FailOnce(engine), {}
        return made[async_scheduling]

    return get


# ----------------------------------------------------------------------------- finding 1
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_failed_step_raises_then_the_engine_serves_exactly(engines, async_scheduling):
    """Every point x {device error, Ctrl-C}: the exception reaches the caller, then the
    same requests finish exactly as SumModel says (before: the next steps spun forever)."""
    engine, fail, seen = engines(async_scheduling)
    cases = [(w, e) for w in WHERE for e in (RuntimeError("device error"), KeyboardInterrupt())]
    for k, (where, exc) in enumerate(cases):
        prompts = {f"{k}-{rid}": p for rid, p in prompts_of(seed=k).items()}
        for rid, p in prompts.items():
            engine.add_request(rid, p, greedy(12))
        requests_seen(engine, seen)

        def scenario(where=where, exc=exc):
            for _ in range(3):  # prefills done, decodes under way (async: a step in flight)
                engine.step()
            fail.arm(where, exc)
            step_until_raises(engine, type(exc))
            engine.kv_cache_manager.check_invariants()
            assert_cached_blocks_hold_their_kv(engine, seen)
            return drain(engine)

        outs = within_time_limit(scenario)
        assert set(outs) == set(prompts), (where, exc)
        for rid, p in prompts.items():
            assert outs[rid].finish_reason == "length", (where, exc, rid)
            want = SumModel.reference_continuation(p, 12, VOCAB)
            assert outs[rid].token_ids == want, (where, exc, rid)
        assert_cached_blocks_hold_their_kv(engine, seen)
        assert_pool_drained(engine)


# ----------------------------------------------------------------------------- finding 2
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_recovery_leaves_no_unwritten_block_in_the_prefix_cache(engines, async_scheduling):
    """A prompt of 7 full blocks fails in its first step and is aborted; the same prompt
    must then be served from written KV only (before: 20 cached tokens of zeros)."""
    engine, fail, seen = engines(async_scheduling)
    for k, where in enumerate(WHERE):
        prompt = [(5 * k + 3 + i) % VOCAB for i in range(29)]  # a new prompt per point
        engine.add_request(f"a{k}", prompt, greedy(4))
        requests_seen(engine, seen)

        def scenario(k=k, where=where, prompt=prompt):
            fail.arm(where, RuntimeError("device error"))
            step_until_raises(engine, RuntimeError)
            assert_cached_blocks_hold_their_kv(engine, seen)
            if engine.is_live(f"a{k}"):
                engine.abort_request(f"a{k}")
            engine.add_request(f"b{k}", prompt, greedy(4))
            requests_seen(engine, seen)
            return drain(engine)

        out = within_time_limit(scenario)[f"b{k}"]
        assert out.token_ids == SumModel.reference_continuation(prompt, 4, VOCAB), where
        assert_cached_blocks_hold_their_kv(engine, seen)
        assert_pool_drained(engine)


# ----------------------------------------------------------------------------- non-finite
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_nonfinite_logits_end_only_their_request_with_an_error(async_scheduling):
    """SumModel with nonfinite_token_id=BAD gives a NaN logit to every sequence whose last
    token is BAD. Such a request ends with finish_reason "error" naming the likely cause,
    keeping the tokens before it; the others finish exactly (before: token 0 forever,
    NaN logprobs, finish_reason "length")."""
    bad = 13
    model_cfg = SumModelConfig(
        vocab_size=VOCAB, max_position_embeddings=128, nonfinite_token_id=bad
    )
    engine = Engine(
        SumModel(model_cfg),
        EngineConfig(
            block_size=4,
            num_kv_blocks=64,
            max_num_seqs=8,
            max_num_batched_tokens=32,
            attention_backend="reference",
            async_scheduling=async_scheduling,
        ),
    )
    good = {"g0": [1, 2, 3], "g1": [4, 5, 6, 7, 8]}
    good = {
        rid: p for rid, p in good.items() if bad not in SumModel.reference_continuation(p, 8, VOCAB)
    }
    assert len(good) == 2
    # A prompt whose third generated token is BAD: its 4th token's logits are NaN.
    late = next(
        [t] for t in range(VOCAB) if SumModel.reference_continuation([t], 8, VOCAB)[2] == bad
    )
    engine.add_request("at_prompt", [5, bad], greedy(8, logprobs=1))
    engine.add_request("late", late, greedy(8))
    for rid, p in good.items():
        engine.add_request(rid, p, greedy(8))
    outs = within_time_limit(lambda: drain(engine))
    for rid in ("at_prompt", "late"):
        assert outs[rid].finish_reason == "error", rid
        assert outs[rid].error == NONFINITE_LOGITS_ERROR
        assert "rms_norm_eps" in outs[rid].error and "NaN" in outs[rid].error
    assert outs["at_prompt"].token_ids == [] and outs["at_prompt"].logprobs == []
    assert outs["late"].token_ids == SumModel.reference_continuation(late, 3, VOCAB)
    for rid, p in good.items():
        assert outs[rid].finish_reason == "length"
        assert outs[rid].token_ids == SumModel.reference_continuation(p, 8, VOCAB)
    assert_pool_drained(engine)


# ----------------------------------------------------------------------------- threads
def test_two_threads_adding_and_stepping_one_engine_stay_exact(engines):
    """Engine calls from two threads are serialised: each thread gets the outputs of the
    steps it ran, and together they are every request's exact output."""
    engine, _, _ = engines(True)
    prompts = {f"t{n}-{rid}": p for n in range(2) for rid, p in prompts_of(seed=40 + n).items()}
    outs: dict[str, object] = {}
    start = threading.Barrier(2)

    def run(n):
        start.wait()
        for rid, p in prompts.items():
            if rid.startswith(f"t{n}-"):
                engine.add_request(rid, p, greedy(10))
        for _ in range(2_000):
            if not engine.has_unfinished():
                return
            for o in engine.step():
                assert o.request_id not in outs
                outs[o.request_id] = o

    def both():
        threads = [threading.Thread(target=run, args=(n,), daemon=True) for n in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    within_time_limit(both)
    assert set(outs) == set(prompts)
    for rid, p in prompts.items():
        assert outs[rid].token_ids == SumModel.reference_continuation(p, 10, VOCAB), rid
    assert_pool_drained(engine)
