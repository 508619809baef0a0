"""Tensor parallelism end to end on 8 forced CPU devices, against N=1 and transformers.

jax fixes the CPU device count at start-up, so every multi-device run happens in ONE
subprocess (paged_jax.testing.tp_checks) with XLA_FLAGS=--xla_force_host_platform_
device_count=8; this process keeps one device. The tests below read its JSON.

Every run uses a KV pool too small for its batch (preemption: recompute or swap) and
prompts that share a 3-block prefix (prefix caching), so each checks those under TP too.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from paged_jax.testing.cpu_devices import env_with_cpu_devices

MAX_NEW = 8
ENGINE = dict(
    block_size=4,
    max_num_seqs=8,
    max_num_batched_tokens=16,  # one token bucket: one step compile per run
    max_model_len=64,
    num_kv_blocks=16,  # 15 usable: the 4 prompts below need ~23 at once -> preemption
    enable_prefix_caching=True,
    attention_backend="reference",
)
# family, checkpoint overrides, [(N, preemption_mode, attention_backend)]
RUNS = {
    # GQA: 8 query heads, 2 KV heads, so N=4 and N=8 repeat each KV head 2x / 4x.
    "llama": (
        dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=2),
        [
            (1, "recompute", "reference"),
            (2, "swap", "reference"),
            (4, "recompute", "pallas_interpret"),
            (8, "swap", "reference"),
        ],
    ),
    # q/k/v biases split with their columns; 4 heads, 2 KV heads.
    # (N=4's head split and KV-head repetition are the Llama runs'.)
    "qwen2": ({}, [(2, "swap", "reference")]),
    # fused c_attn, tied vocab-parallel head, learned positions; 4 heads.
    "gpt2": ({}, [(2, "recompute", "reference")]),
    "opt": ({}, [(2, "swap", "reference")]),
    "mistral": ({}, [(2, "recompute", "reference")]),
    # per-head q/k norms (replicated); head_dim 32 != hidden / heads.
    "qwen3": ({}, [(2, "swap", "reference")]),
    # hybrid: two KV groups (window 8 / full), soft caps, sandwich norms (window models
    # preempt by recompute only).
    "gemma2": ({}, [(2, "recompute", "reference")]),
    # Mixture of experts: 8 experts split 4 / 2 per device (expert parallelism on "tp"),
    # the shared expert split like a dense MLP. Mixtral and Qwen3-MoE run the same
    # expert code (tests/models/test_moe.py checks the shards' sum on one device).
    "qwen2_moe": ({}, [(2, "swap", "reference"), (4, "recompute", "reference")]),
}
SEEDS = [11, 12, 13]
# The Llama runs at N=1 and N=2 also build the activation options and serve a steered
# and a prompt-embeddings request, both capturing (tp_checks.run_activations).
ACTIVATIONS = dict(hidden_state_layers=(0, -1), steering_layers=(1,), enable_prompt_embeds=True)
# N-gram speculation at N=2 on the Llama checkpoint (same prompts and pool, so it
# preempts and hits the prefix cache too): greedy must equal N=1 without speculation.
# Lookup from one token on proposes drafts on these random prompts every few steps.
SPEC_RUN = "llama-ngram-tp2"
SPEC_CONFIG = {
    "method": "ngram",
    "num_speculative_tokens": 2,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}


def _name(family: str, tp: int) -> str:
    return f"{family}-tp{tp}"


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 128, 12).tolist()  # 3 full blocks of 4
    return [
        shared + rng.integers(3, 128, 3).tolist(),
        rng.integers(3, 128, 9).tolist(),
        shared + rng.integers(3, 128, 5).tolist(),
        rng.integers(3, 128, 22).tolist(),
    ]


@pytest.fixture(scope="module")
def checkpoints(tiny_hf_checkpoint):
    return {family: tiny_hf_checkpoint(family, **over) for family, (over, _) in RUNS.items()}


@pytest.fixture(scope="module")
def expected(checkpoints, prompts, hf_greedy):
    """transformers' greedy continuation of every prompt, per family."""
    return {
        family: [hf_greedy(path, p, MAX_NEW) for p in prompts]
        for family, path in checkpoints.items()
    }


@pytest.fixture(scope="module")
def results(checkpoints, prompts, tmp_path_factory):
    """One subprocess on 8 CPU devices runs every (family, N); returns its JSON."""
    spec = []
    for family, (_, runs) in RUNS.items():
        for i, (tp, mode, backend) in enumerate(runs):
            # Every other run scans its layers (stacked weights and KV sharded under TP).
            scan = "on" if i % 2 == 0 else "off"
            spec.append(
                dict(
                    name=_name(family, tp),
                    path=str(checkpoints[family]),
                    tensor_parallel_size=tp,
                    engine={
                        **ENGINE,
                        "preemption_mode": mode,
                        "attention_backend": backend,
                        "scan_layers": scan,
                        **(ACTIVATIONS if family == "llama" and tp <= 2 else {}),
                    },
                    prompts=prompts,
                    max_tokens=MAX_NEW,
                    sampling_seeds=SEEDS if family == "llama" else [],
                )
            )
    spec.append(
        dict(
            name=SPEC_RUN,
            path=str(checkpoints["llama"]),
            tensor_parallel_size=2,
            engine={
                **ENGINE,
                "preemption_mode": "recompute",
                "speculative_config": SPEC_CONFIG,
            },
            prompts=prompts,
            max_tokens=MAX_NEW,
            sampling_seeds=[],
        )
    )
    tmp = tmp_path_factory.mktemp("tp")
    (tmp / "spec.json").write_text(json.dumps(spec))
    env = env_with_cpu_devices(8, cpu_only=True)
    proc = subprocess.run(
        [sys.executable, "-m", "paged_jax.testing.tp_checks", tmp / "spec.json", tmp / "out.json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=2400,  # a hang guard only: every family at TP 1-8, minutes under load
    )
    assert proc.returncode == 0, f"tp_checks failed:\n{proc.stderr[-4000:]}"
    return json.loads((tmp / "out.json").read_text())


def _runs(family: str) -> list[int]:
    return [tp for tp, _, _ in RUNS[family][1]]


def test_activations_under_tp_equal_n1(results):
    """Captured rows of a steered and a prompt-embeddings request at N=2 equal N=1's
    (f32; each within 1e-5 of transformers at N=1: tests/engine/test_hidden_states.py)."""
    one, two = results[_name("llama", 1)], results[_name("llama", 2)]
    assert set(one["activations"]) == {"steered", "embeds"}
    for name, want in one["activations"].items():
        got = two["activations"][name]
        assert got["tokens"] == want["tokens"]
        assert set(got["rows"]) == {"0", "-1"}
        for layer, rows in want["rows"].items():
            assert np.asarray(rows).shape == (len(rows), 128) and len(rows) > 4
            np.testing.assert_allclose(got["rows"][layer], rows, atol=1e-5)


def test_subprocess_sees_eight_devices(results):
    assert {r["devices"] for r in results.values()} == {8}


@pytest.mark.parametrize("family", list(RUNS))
def test_greedy_tokens_equal_transformers_and_n1(family, results, expected):
    for tp in _runs(family):
        got = results[_name(family, tp)]["greedy"]
        assert got == expected[family], f"{family} N={tp} differs from transformers"
    if 1 in _runs(family):
        for tp in _runs(family):
            assert results[_name(family, tp)]["greedy"] == results[_name(family, 1)]["greedy"]


def test_ngram_speculation_under_tp_equals_n1_without(results):
    spec = results[SPEC_RUN]
    assert spec["greedy"] == results[_name("llama", 1)]["greedy"]
    assert spec["stats"]["spec_num_draft_tokens"] > 0, "no draft was verified under TP"
    assert spec["stats"]["spec_method"] == "ngram"


def test_seeded_sampling_equals_n1(results):
    ref = results[_name("llama", 1)]["seeded"]
    assert len(ref) == len(SEEDS) and all(len(t) > 0 for t in ref)
    # The seeds make the draws differ from greedy, so this compares real sampling.
    assert ref != results[_name("llama", 1)]["greedy"][: len(SEEDS)]
    for tp in _runs("llama")[1:]:
        assert results[_name("llama", tp)]["seeded"] == ref, f"seeded sampling differs at N={tp}"


@pytest.mark.parametrize("family", list(RUNS))
def test_prompt_logprobs_equal_transformers_under_tp(
    family, results, checkpoints, prompts, hf_logits
):
    logits = hf_logits(checkpoints[family], np.asarray(prompts[:1]))[0].astype(np.float64)
    ref = logits - logits.max(-1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    want = [ref[i - 1, t] for i, t in enumerate(prompts[0]) if i > 0]
    for tp in _runs(family):
        got = results[_name(family, tp)]["prompt_logprobs"]
        assert len(got) == len(want), f"{family} N={tp}"
        np.testing.assert_allclose([lp for lp, _ in got], want, atol=2e-4, err_msg=f"N={tp}")
        assert all(rank >= 1 for _, rank in got)
        if tp != 1 and 1 in _runs(family):
            one = results[_name(family, 1)]["prompt_logprobs"]
            assert [r for _, r in got] == [r for _, r in one], f"{family} N={tp} ranks"


def test_no_compiles_after_warmup_and_blocks_returned(results):
    for name, r in results.items():
        assert r["stats"]["num_compiles_after_warmup"] == 0, name
        assert r["stats"]["all_blocks_free"], name


def test_preemption_and_prefix_caching_ran_under_tp(results):
    for name, r in results.items():
        assert r["stats"]["num_preemptions"] > 0, f"{name}: the small pool should preempt"
        assert r["stats"]["prefix_cache_hits"] > 0, f"{name}: the shared prefix should hit"


def test_per_device_memory_halves_at_n2(results, checkpoints):
    """N=2 holds about half of N=1's weights and exactly half its KV per device.

    N=1's bytes are counted here, on this process's one device, from the same checkpoint
    (the engine's N=1 figure is llama-tp1's, checked against this below).
    """
    from paged_jax.models import load_model
    from paged_jax.worker.sharding import per_device_bytes

    for family in ("llama", "qwen2", "gpt2"):
        model = load_model(checkpoints[family])
        weights_one = sum(per_device_bytes(nnx.state(model)).values())
        kv_one = ENGINE["num_kv_blocks"] * model.kv_bytes_per_block(ENGINE["block_size"])
        two = results[_name(family, 2)]["stats"]
        assert two["kv_cache_bytes_per_device"] * 2 == kv_one
        # Only norms, row-parallel biases and GPT-2's position table stay whole.
        ratio = two["weight_bytes_per_device"] / weights_one
        assert 0.5 <= ratio < 0.6, f"{family}: weights per device at N=2 are {ratio:.2f} of N=1"
        if family == "llama":
            one = results[_name(family, 1)]["stats"]
            assert (one["weight_bytes_per_device"], one["kv_cache_bytes_per_device"]) == (
                weights_one,
                kv_one,
            )


def test_kv_heads_replicated_when_fewer_than_devices(results):
    """Llama has 2 KV heads: N=2 splits them; N=4 and N=8 keep one whole head per device."""
    heads = {tp: results[_name("llama", tp)]["stats"] for tp in _runs("llama")}
    assert [heads[tp]["num_kv_heads_per_device"] for tp in (1, 2, 4, 8)] == [2, 1, 1, 1]
    kv = {tp: heads[tp]["kv_cache_bytes_per_device"] for tp in heads}
    assert kv[4] == kv[8] == kv[2] == kv[1] // 2  # the replication's memory cost
    weights = [heads[tp]["weight_bytes_per_device"] for tp in (1, 2, 4, 8)]
    assert weights == sorted(weights, reverse=True)


def test_expert_bytes_split_one_over_n(results, checkpoints):
    """Each device holds 1/N of the stacked expert weights (N=2, 4; the issue allows 5%)."""
    from paged_jax.models import load_model
    from paged_jax.worker.sharding import expert_bytes_per_device

    for family in ("qwen2_moe",):
        total = expert_bytes_per_device(nnx.state(load_model(checkpoints[family])))
        assert total > 0
        for tp in _runs(family):
            per_device = results[_name(family, tp)]["stats"]["expert_bytes_per_device"]
            assert abs(per_device * tp / total - 1) <= 0.05, (family, tp, per_device, total)
