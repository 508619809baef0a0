"""kv_cache_dtype="fp8_*" through LLM/Engine: pool sizing, every family, scales, no recompiles."""

from __future__ import annotations

import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from paged_jax import LLM, SamplingParams
from paged_jax.config import EngineConfig
from paged_jax.constants import cdiv
from paged_jax.entrypoints.generate_cli import main as generate_main
from paged_jax.models import calibrate_kv_scales, load_model
from paged_jax.models.simple_paged import jit_forward_paged, make_attn_metadata
from paged_jax.worker.runner import num_backend_compiles

FAMILIES = ("llama", "qwen2", "mistral", "gpt2", "opt")
# One (num_tokens, num_seqs) bucket: each LLM compiles its step once.
SMALL = dict(block_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=48)
PROMPTS = [[5, 9, 17, 33, 2, 8, 100, 41, 3], [7, 7, 7, 1, 3], list(range(20, 40))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_config_rejects_unknown_kv_cache_dtype():
    with pytest.raises(ValueError, match=r"EngineConfig.kv_cache_dtype='int8' must be one of"):
        EngineConfig(kv_cache_dtype="int8")


@pytest.mark.parametrize(
    "dtype,kv_cache_dtype,ratio",
    [("bfloat16", "fp8_e4m3", 2), ("float32", "fp8_e5m2", 4), ("bfloat16", "fp8", 2)],
)
def test_same_budget_holds_more_fp8_blocks(tiny_hf_checkpoint, dtype, kv_cache_dtype, ratio):
    path = tiny_hf_checkpoint("llama")
    budget = 3 * 2**20
    base = LLM(str(path), dtype=dtype, kv_cache_memory=budget, warmup=False, **SMALL)
    fp8 = LLM(
        str(path),
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory=budget,
        warmup=False,
        **SMALL,
    )
    base_runner, fp8_runner = base.engine.runner, fp8.engine.runner
    # 2 layers x (K, V) x 2 KV heads x 4 tokens x head_dim 16 elements per block.
    assert fp8_runner.bytes_per_block == 2 * 2 * 2 * 4 * 16
    assert base_runner.bytes_per_block == ratio * fp8_runner.bytes_per_block
    assert fp8_runner.num_kv_blocks == budget // fp8_runner.bytes_per_block
    assert fp8_runner.num_kv_blocks == ratio * base_runner.num_kv_blocks
    k_cache, v_cache = fp8_runner.kv_caches[0]
    assert k_cache.dtype == v_cache.dtype and jnp.dtype(k_cache.dtype).itemsize == 1
    assert fp8.get_stats()["num_kv_blocks"] == fp8_runner.num_kv_blocks


# Max |logprob diff| of the first token vs transformers (f32). docs/fp8_kv_cache.md
# measures max |logit diff| 0.1-0.4 for e4m3 on these tiny checkpoints; a wrong scale or a
# misplaced write costs several nats.
LOGPROB_ATOL = 0.5


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_e4m3_serves_every_family(tiny_hf_checkpoint, hf_logits, family):
    path = tiny_hf_checkpoint(family)
    llm = LLM(str(path), kv_cache_dtype="fp8_e4m3", warmup=False, **SMALL)
    assert llm.engine.runner.kv_caches[0][0].dtype == jnp.float8_e4m3fn
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert len(out.outputs[0].token_ids) == 4
        ref = hf_logits(path, np.asarray([prompt]))[0, -1].astype(np.float64)
        ref = ref - ref.max() - np.log(np.exp(ref - ref.max()).sum())  # log_softmax
        first = out.outputs[0].logprobs[0]  # {token: Logprob}: sampled + top 5
        assert len(first) >= 5
        for token, logprob in first.items():
            assert abs(logprob.logprob - ref[token]) < LOGPROB_ATOL, (family, token)


def test_scale_change_never_recompiles(tiny_hf_checkpoint):
    path = tiny_hf_checkpoint("llama")
    llm = LLM(str(path), kv_cache_dtype="fp8_e5m2", **SMALL)  # warmup compiles every bucket
    runner = llm.engine.runner
    np.testing.assert_array_equal(np.asarray(runner.kv_scales), np.ones((2, 2), np.float32))
    lp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    before = llm.generate(PROMPTS, lp, use_tqdm=False)
    compiles = num_backend_compiles()
    runner.set_kv_scales(np.asarray([[0.01, 8.0], [4.0, 0.02]], np.float32))
    after = llm.generate(PROMPTS, lp, use_tqdm=False)
    assert num_backend_compiles() == compiles
    assert llm.get_stats()["num_compiles_after_warmup"] == 0
    # The new scales are used: e5m2 with these scales changes the logprobs.
    first = [o.outputs[0].logprobs[0] for o in before]
    second = [o.outputs[0].logprobs[0] for o in after]
    assert first != second
    with pytest.raises(ValueError, match=r"kv_cache_scales has shape \(3,\); expected \(2, 2\)"):
        runner.set_kv_scales([1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="must be finite and > 0"):
        runner.set_kv_scales([[1.0, 0.0], [1.0, 1.0]])
    auto = LLM(str(path), warmup=False, **SMALL)
    with pytest.raises(ValueError, match="kv_cache_dtype='auto' has no scales"):
        auto.engine.runner.set_kv_scales([[1.0, 1.0], [1.0, 1.0]])


def test_checkpoint_kv_scales_are_loaded(tiny_hf_checkpoint, tmp_path):
    src = tiny_hf_checkpoint("qwen2")
    dst = tmp_path / "qwen2_fp8_scales"
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    want = np.asarray([[0.5, 0.25], [2.0, 0.125]], np.float32)
    for layer, (k, v) in enumerate(want):
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = np.asarray(k, np.float32)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = np.asarray(v, np.float32)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(dst), kv_cache_dtype="fp8_e4m3", warmup=False, **SMALL)
    np.testing.assert_array_equal(np.asarray(llm.engine.runner.kv_scales), want)
    assert len(_greedy(llm)[0]) == 8
    del tensors["model.layers.1.self_attn.v_scale"]
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing \['layer 1 v_scale'\]"):
        load_model(dst)


def test_calibrated_scales_match_the_cached_kv(tiny_hf_checkpoint):
    # Independent path: write the prompt's K/V through the paged forward into an f32
    # cache and take max |cache| per layer; calibration reads them off the dense forward.
    model = load_model(tiny_hf_checkpoint("llama"))
    prompt = PROMPTS[2]
    scales = calibrate_kv_scales(model, [prompt])
    table = list(range(1, 1 + cdiv(len(prompt), 4)))
    positions, meta = make_attn_metadata([table], [0], [len(prompt)], block_size=4)
    caches = model.init_kv_caches(len(table) + 1, 4)
    _, caches = jit_forward_paged(model)(np.asarray(prompt, np.int32), positions, caches, meta)
    amax = np.asarray([[np.abs(k).max(), np.abs(v).max()] for k, v in caches], np.float32)
    np.testing.assert_allclose(scales, amax / np.asarray([200.0, 100.0]), rtol=1e-5)


def test_generate_cli_kv_cache_dtype_flag(model_dir, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("one\ntwo two\n")
    args = ["--model", str(model_dir), "--prompts", str(prompts), "--kv-cache-dtype", "fp8_e5m2"]
    args += ["--max-tokens", "3", "--block-size", "4", "--max-num-seqs", "8"]
    args += ["--max-num-batched-tokens", "32", "--max-model-len", "64", "--no-tqdm"]
    assert generate_main(args) == 0
    assert "compiles_after_warmup: 0" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        generate_main(["--kv-cache-dtype", "int4"])
