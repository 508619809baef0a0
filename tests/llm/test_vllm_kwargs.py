"""vLLM's LLM(...) keyword arguments run unedited where their meaning carries over.

Issue 38 item 13: gpu_memory_utilization, enforce_eager and trust_remote_code were
refused as unknown engine arguments. gpu_memory_utilization is vLLM's (the share of the
device's memory for weights + KV cache + activations); enforce_eager and
trust_remote_code are accepted and ignored with one warning each. Host-side sizing
arithmetic is tested with the device's memory passed in; LLMs run SumModel on CPU.
"""

from __future__ import annotations

import dataclasses
import re
import warnings

import pytest

from paged_jax.config import EngineConfig
from paged_jax.llm import LLM
from paged_jax.testing.fake_model import SumModel, SumModelConfig
from paged_jax.worker.runner import DeviceMemory, activation_bytes_estimate, resolve_num_kv_blocks

ENGINE_ARGS = dict(
    block_size=4, max_num_seqs=8, max_num_batched_tokens=32, attention_backend="reference"
)
GIB = 2**30


def make_llm(**kwargs) -> LLM:
    model = SumModel(SumModelConfig(vocab_size=97, max_position_embeddings=128))
    return LLM(model, warmup=False, **{**ENGINE_ARGS, **kwargs})


def _no_warnings(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn()


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("enforce_eager", r"enforce_eager=True is ignored: .*always compiles"),
        ("trust_remote_code", r"trust_remote_code=True is ignored: .*never runs"),
    ],
)
def test_vllm_switches_are_accepted_with_one_warning(name, match):
    with pytest.warns(UserWarning) as record:
        llm = make_llm(**{name: True})
    ours = [w for w in record if name in str(w.message)]
    assert len(ours) == 1
    assert re.search(match, str(ours[0].message)), str(ours[0].message)
    assert llm.generate([[1, 2, 3]], use_tqdm=False)[0].outputs[0].token_ids
    # False asks for what the engine does anyway: accepted silently.
    _no_warnings(lambda: make_llm(**{name: False}))


@pytest.mark.parametrize("name", ["enforce_eager", "trust_remote_code"])
def test_vllm_switches_must_be_bools(name):
    with pytest.raises(ValueError, match=rf"{name}='yes' must be a bool"):
        make_llm(**{name: "yes"})


def test_gpu_memory_utilization_with_kv_cache_memory_names_both():
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0\.5.*kv_cache_memory"):
        make_llm(gpu_memory_utilization=0.5, kv_cache_memory=GIB)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0\.5.*num_kv_blocks"):
        make_llm(gpu_memory_utilization=0.5, num_kv_blocks=64)


def test_gpu_memory_utilization_on_cpu_warns_once_and_sizes_the_default_pool():
    from paged_jax.worker.runner import device_memory

    if device_memory() is not None:
        pytest.skip("the backend reports device memory (this is the CPU behaviour)")
    plain = make_llm()
    with pytest.warns(UserWarning, match=r"gpu_memory_utilization=0\.9 is ignored on cpu") as rec:
        llm = make_llm(gpu_memory_utilization=0.9)
    assert sum("gpu_memory_utilization" in str(w.message) for w in rec) == 1
    assert llm.config.gpu_memory_utilization == 0.9
    assert llm.engine.runner.num_kv_blocks == plain.engine.runner.num_kv_blocks
    assert llm.generate([[4, 5, 6]], use_tqdm=False)[0].outputs[0].token_ids


def test_gpu_memory_utilization_budgets_weights_activations_and_kv():
    # KV budget = utilization * total - weights - activations, in whole blocks.
    config = EngineConfig(max_model_len=64, gpu_memory_utilization=0.5)
    memory = DeviceMemory(total_bytes=10 * GIB, in_use_bytes=2 * GIB)
    per_block = 1 << 20
    blocks = resolve_num_kv_blocks(
        config, per_block, memory=memory, weight_bytes=2 * GIB, activation_bytes=GIB
    )
    assert blocks == (5 * GIB - 2 * GIB - GIB) // per_block
    higher = dataclasses.replace(config, gpu_memory_utilization=0.75)
    assert (
        resolve_num_kv_blocks(
            higher, per_block, memory=memory, weight_bytes=2 * GIB, activation_bytes=GIB
        )
        == (7.5 * GIB - 3 * GIB) // per_block
    )


def test_gpu_memory_utilization_too_small_or_too_large_is_one_clear_error():
    per_block = 1 << 20
    memory = DeviceMemory(total_bytes=10 * GIB, in_use_bytes=2 * GIB)
    small = EngineConfig(max_model_len=64, gpu_memory_utilization=0.2)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0\.2 .*weights"):
        resolve_num_kv_blocks(
            small, per_block, memory=memory, weight_bytes=2 * GIB, activation_bytes=GIB
        )
    # Other arrays (another engine, another process) hold 6 of the 10 GiB: 0.9 cannot fit.
    busy = DeviceMemory(total_bytes=10 * GIB, in_use_bytes=8 * GIB)
    big = EngineConfig(max_model_len=64, gpu_memory_utilization=0.9)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0\.9 .*free"):
        resolve_num_kv_blocks(
            big, per_block, memory=busy, weight_bytes=2 * GIB, activation_bytes=GIB
        )


def test_activation_estimate_grows_with_the_step_and_the_vocabulary():
    class Cfg:
        hidden_size, intermediate_size, vocab_size = 64, 256, 1000

    small = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    more_tokens = dataclasses.replace(small, max_num_batched_tokens=256)
    estimate = activation_bytes_estimate(small, Cfg())
    assert 0 < estimate < activation_bytes_estimate(more_tokens, Cfg())
    Cfg.vocab_size = 100_000
    assert activation_bytes_estimate(small, Cfg()) > estimate


def test_cli_gpu_memory_utilization_flag_is_checked_before_loading(tmp_path, capsys):
    # The flag comes with the EngineConfig field; with --kv-cache-memory it is exit 2.
    from paged_jax.entrypoints.generate_cli import build_parser
    from paged_jax.entrypoints.generate_cli import main as generate_main

    assert (
        build_parser().parse_args(["--gpu-memory-utilization", "0.8"]).gpu_memory_utilization == 0.8
    )
    args = ["--model", str(tmp_path), "--gpu-memory-utilization", "0.8"]
    assert generate_main([*args, "--kv-cache-memory", "0.5", "--no-tqdm"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"gpu_memory_utilization=0\.8 must be None when kv_cache_memory=0\.5", err)
    assert "Traceback" not in err


def test_runner_sizes_the_pool_from_gpu_memory_utilization(monkeypatch):
    # The device's memory as a GPU reports it, on CPU: the runner's wiring of weights and
    # activations into the budget.
    from paged_jax.worker.runner import model_weight_bytes

    memory = DeviceMemory(total_bytes=2 * 2**20, in_use_bytes=2**16)
    monkeypatch.setattr("paged_jax.worker.runner.device_memory", lambda: memory)
    llm = _no_warnings(lambda: make_llm(gpu_memory_utilization=0.5, max_model_len=64))
    runner = llm.engine.runner
    weights = model_weight_bytes(llm.model)
    activations = activation_bytes_estimate(llm.config, llm.model.config)
    assert 0 < activations < 2**20
    want = (2**20 - weights - activations) // runner.bytes_per_block
    assert runner.num_kv_blocks == want


def test_weight_bytes_count_each_live_array_once():
    import jax.numpy as jnp
    from flax import nnx

    from paged_jax.worker.runner import model_weight_bytes

    linear = nnx.Linear(4, 8, rngs=nnx.Rngs(0))  # f32 kernel [4, 8] and bias [8]
    assert model_weight_bytes(linear) == (4 * 8 + 8) * 4
    shared, gone = jnp.ones(16, jnp.float32), jnp.ones(1000, jnp.float32)
    gone.delete()  # a per-layer weight freed once stacked
    assert model_weight_bytes(linear, {"a": shared, "b": shared, "c": gone}) == 40 * 4 + 64
