"""LoRA under tensor parallelism on 4 forced CPU devices: adapter stacks split like their
base weights (column-parallel q/k/v/gate/up split B's columns, row-parallel o/down split
A's rows; k/v's B columns repeated with the KV heads), greedy tokens equal transformers +
peft. One subprocess (jax fixes the CPU device count at start-up)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("peft", reason="needs peft (the parity oracle)")

from paged_jax.testing.cpu_devices import env_with_cpu_devices
from paged_jax.testing.tiny_lora import (  # noqa: E402
    ALL_LINEAR_TARGETS,
    build_tiny_peft_adapter,
    greedy_with_logits,
    peft_model,
)

# 8 query heads, 2 KV heads: at N=4 each KV head is held twice (repeated k/v columns).
CHECKPOINT = dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=2)
PROMPTS = [[5, 9, 14, 3, 8, 22, 7], [40, 41, 42, 43, 44], [3, 60, 61, 62, 63, 64, 65, 66, 67]]


def test_lora_under_tensor_parallelism(tiny_hf_checkpoint, tmp_path):
    base = tiny_hf_checkpoint("llama", **CHECKPOINT)
    adapters = [
        build_tiny_peft_adapter(
            base, tmp_path / "a8", rank=8, target_modules=ALL_LINEAR_TARGETS, seed=7
        ),
        build_tiny_peft_adapter(base, tmp_path / "a4", rank=4, seed=8),
    ]
    env = env_with_cpu_devices(4)
    script = pathlib.Path(__file__).with_name("tp_lora_run.py")
    args = [
        sys.executable,
        str(script),
        "4",
        str(base),
        *map(str, adapters),
        "--",
        json.dumps(PROMPTS),
    ]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["compiles_after_warmup"] == 0
    # A f[L, in, N * R], B f[L, N * R, out]: axis 1 is A's input, axis 2 B's output.
    split = result["split_axes"]
    for module in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        assert split[module] == [[], [2]], module
    for module in ("o_proj", "down_proj"):
        assert split[module] == [[1], []], module
    for prompt, adapter, got in zip(PROMPTS, [None, *adapters], result["tokens"]):
        want, _ = greedy_with_logits(peft_model(base, adapter), prompt, 4)
        assert got == want, adapter
