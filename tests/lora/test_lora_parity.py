"""Multi-LoRA parity with transformers + peft: one engine per family serves the base model
and adapters of rank 8 (attention only) and rank 64 (all linear) in the same batches, at
max_lora_rank=64, under chunked prefill and preemption; a third adapter forces LRU swaps
and deferrals (max_loras=2). Greedy tokens equal each adapter's own peft model and the
sampled tokens' logprobs are within 1e-4 (f32)."""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax import LoRARequest, SamplingParams

pytest.importorskip("peft", reason="needs peft (the parity oracle; not in the torch-free venv)")

from paged_jax.testing.tiny_lora import (  # noqa: E402
    ALL_LINEAR_TARGETS,
    ATTENTION_TARGETS,
    build_tiny_peft_adapter,
    greedy_with_logits,
    peft_model,
)

F32_ATOL = 1e-4
MAX_TOKENS = 5
# Chunked prefill (16-token budget, prompts up to 19 tokens) and preemption (a pool of 17
# blocks of 4 for four sequences of up to 24 tokens).
ENGINE = dict(
    enable_lora=True,
    max_loras=2,
    max_lora_rank=64,
    block_size=4,
    max_num_seqs=4,
    max_num_batched_tokens=16,
    max_model_len=64,
    num_kv_blocks=17,
)
# Llama runs its layers unrolled, Qwen2 as a scan: both paths take the adapters.
SCAN = {"llama": "off", "qwen2": "on"}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def served(request, tiny_hf_checkpoint, tmp_path_factory):
    from paged_jax import LLM

    family = request.param
    base = tiny_hf_checkpoint(family)
    root = tmp_path_factory.mktemp(f"lora_{family}")
    specs = {
        "attn8": dict(rank=8, target_modules=ATTENTION_TARGETS, seed=1),
        "all64": dict(rank=64, target_modules=ALL_LINEAR_TARGETS, seed=2, use_rslora=True),
        "all16": dict(rank=16, target_modules=ALL_LINEAR_TARGETS, seed=3),
    }
    loras = {}
    for i, (name, spec) in enumerate(specs.items(), start=1):
        path = build_tiny_peft_adapter(base, root / name, **spec)
        loras[name] = LoRARequest(name, i, str(path))
    llm = LLM(str(base), scan_layers=SCAN[family], **ENGINE)
    oracles = {}

    def expected(lora: LoRARequest | None, prompt: list[int]):
        name = None if lora is None else lora.lora_name
        if name not in oracles:
            oracles[name] = peft_model(base, None if lora is None else lora.lora_path)
        return greedy_with_logits(oracles[name], prompt, MAX_TOKENS)

    return llm, loras, expected


def prompts(seed: int, count: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 120, size=int(rng.integers(6, 20))).tolist() for _ in range(count)]


def check(llm, expected, batch, loras):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
    outs = llm.generate(batch, params, lora_request=loras, use_tqdm=False)
    for prompt, lora, out in zip(batch, loras, outs):
        tokens, logits = expected(lora, prompt)
        got = out.outputs[0]
        assert got.token_ids == tokens, (lora, prompt)
        ref = logits - logits.max(-1, keepdims=True)
        ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
        for pos, (tok, entry) in enumerate(zip(tokens, got.logprobs)):
            assert abs(entry[tok].logprob - ref[pos, tok]) <= F32_ATOL, (lora, pos)


def test_mixed_batch_matches_peft(served):
    llm, loras, expected = served
    batch = prompts(0, 6)
    per_prompt = [None, loras["attn8"], loras["all64"], None, loras["attn8"], loras["all64"]]
    before = llm.engine.get_stats()["num_preemptions"]
    check(llm, expected, batch, per_prompt)
    stats = llm.engine.get_stats()
    assert stats["num_preemptions"] > before  # the pool is too small for the batch
    assert stats["num_compiles_after_warmup"] == 0


def test_more_adapters_than_slots_swap_and_defer(served):
    llm, loras, expected = served
    loads = llm.engine.lora.slots.num_loads
    batch = prompts(1, 4)
    per_prompt = [loras["all16"], loras["attn8"], loras["all64"], loras["all16"]]
    check(llm, expected, batch, per_prompt)
    assert llm.engine.lora.slots.num_loads >= loads + 2  # all16 swapped in, another back
    assert llm.engine.get_stats()["num_compiles_after_warmup"] == 0


def test_prefix_cache_is_per_adapter(served):
    llm, loras, expected = served
    prompt = prompts(2, 1)
    stats = llm.engine.get_stats
    check(llm, expected, prompt, [None])
    hits = stats()["prefix_cache_hits"]
    check(llm, expected, prompt, [loras["attn8"]])  # the base's blocks are not this adapter's
    assert stats()["prefix_cache_hits"] == hits
    check(llm, expected, prompt, [loras["attn8"]])  # its own blocks are
    assert stats()["prefix_cache_hits"] > hits


def test_adapter_errors_leave_the_engine_serving(served, tmp_path):
    llm, loras, expected = served
    bad = LoRARequest("missing", 9, str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=r"prompts\[1\]: LoRA adapter 'missing' .*adapter_config"):
        llm.generate([[5, 6, 7], [5, 6, 7]], lora_request=[None, bad], use_tqdm=False)
    check(llm, expected, prompts(3, 1), [loras["attn8"]])


def test_parallel_samples_keep_their_adapter(served):
    """An n > 1 request runs its carrier (the shared prompt prefill) and every sample with
    the request's adapter: greedy samples equal that adapter's peft model, as an n == 1
    request does, beside a base-model request in the same batch."""
    llm, loras, expected = served
    batch = prompts(3, 2)
    per_prompt = [loras["all64"], None]
    params = SamplingParams(n=2, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(batch, params, lora_request=per_prompt, use_tqdm=False)
    for prompt, lora, out in zip(batch, per_prompt, outs):
        tokens, _ = expected(lora, prompt)
        assert [c.token_ids for c in out.outputs] == [tokens, tokens], lora
    assert llm.engine.get_stats()["num_compiles_after_warmup"] == 0
