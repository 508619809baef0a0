"""Multi-LoRA, host side: LoRARequest, PEFT adapters read without torch, LRU slots, the
scheduler's deferral and per-adapter prefix caching (no jax, no torch)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from paged_jax.config import EngineConfig
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.request import Request
from paged_jax.core.scheduler import Scheduler
from paged_jax.lora import (
    AdapterSlots,
    LoRARegistry,
    LoRARequest,
    lora_requests_per_prompt,
    read_peft_adapter,
)
from paged_jax.sampling_params import SamplingParams

HIDDEN, KV_DIM, INTER, LAYERS = 8, 4, 16, 2
SHAPES = {
    "q_proj": (HIDDEN, HIDDEN),
    "k_proj": (HIDDEN, KV_DIM),
    "v_proj": (HIDDEN, KV_DIM),
    "o_proj": (HIDDEN, HIDDEN),
    "gate_proj": (HIDDEN, INTER),
    "up_proj": (HIDDEN, INTER),
    "down_proj": (INTER, HIDDEN),
}
PREFIX = "base_model.model.model.layers"


def write_adapter(path, *, rank=2, alpha=4, modules=("q_proj", "v_proj"), layers=(0, 1), **extra):
    """A PEFT adapter directory of random factors; returns (path, {key: array})."""
    rng = np.random.default_rng(rank)
    tensors = {}
    for layer in layers:
        for m in modules:
            d_in, d_out = SHAPES.get(m, (HIDDEN, HIDDEN))
            where = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"{PREFIX}.{layer}.{where}.{m}"
            tensors[f"{key}.lora_A.weight"] = rng.normal(size=(rank, d_in)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.normal(size=(d_out, rank)).astype(np.float32)
    path.mkdir(parents=True, exist_ok=True)
    config = dict(peft_type="LORA", r=rank, lora_alpha=alpha, target_modules=list(modules))
    config.update(extra)
    (path / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path, tensors


def read(path, name="ad", *, max_lora_rank=8, shapes=SHAPES, refused=None):
    request = LoRARequest(name, 1, str(path))
    return read_peft_adapter(
        request,
        module_shapes=shapes,
        num_layers=LAYERS,
        max_lora_rank=max_lora_rank,
        refused=refused,
    )


def test_lora_request_fields_are_checked():
    assert LoRARequest("a", 1, "/x").lora_path == "/x"
    with pytest.raises(ValueError, match=r"lora_int_id=0 must be an int >= 1"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(ValueError, match=r"lora_name='' must be a non-empty str"):
        LoRARequest("", 1, "/x")
    with pytest.raises(ValueError, match=r"lora_path=3 must be a path"):
        LoRARequest("a", 1, 3)


def test_adapter_is_padded_scaled_and_transposed(tmp_path):
    path, tensors = write_adapter(tmp_path / "a", rank=2, alpha=4, modules=("q_proj", "down_proj"))
    adapter = read(path, max_lora_rank=8)
    assert adapter.rank == 2 and adapter.scaling == 2.0
    assert adapter.target_modules == ("q_proj", "down_proj")
    a, b = adapter.weights["down_proj"]
    assert a.shape == (LAYERS, INTER, 8) and b.shape == (LAYERS, 8, HIDDEN)
    key = f"{PREFIX}.1.mlp.down_proj"
    np.testing.assert_array_equal(a[1, :, :2], tensors[f"{key}.lora_A.weight"].T)
    np.testing.assert_allclose(b[1, :2], 2.0 * tensors[f"{key}.lora_B.weight"].T)
    assert not a[:, :, 2:].any() and not b[:, 2:].any()  # rank padding is zero
    # x @ A @ B is PEFT's B(A(x)) * scaling
    x = np.random.default_rng(0).normal(size=(3, INTER)).astype(np.float32)
    want = x @ tensors[f"{key}.lora_A.weight"].T @ tensors[f"{key}.lora_B.weight"].T * 2.0
    np.testing.assert_allclose(x @ a[1] @ b[1], want, rtol=1e-5, atol=1e-5)


def test_rslora_scaling(tmp_path):
    path, _ = write_adapter(tmp_path / "a", rank=4, alpha=8, use_rslora=True)
    assert read(path).scaling == pytest.approx(8 / 2.0)


@pytest.mark.parametrize(
    "setup, match",
    [
        (lambda p: None, r"lora_path='.*' must be a PEFT adapter directory with adapter_config"),
        (lambda p: write_adapter(p, rank=16), r"'ad' .*: r=16 must be <= max_lora_rank=8"),
        (
            lambda p: write_adapter(p, modules=("c_attn",)),
            r"target_modules='c_attn' must be one of \['down_proj'",
        ),
        (lambda p: write_adapter(p, use_dora=True), r"use_dora=True must be false"),
        (lambda p: write_adapter(p, bias="all"), r"bias='all' must be 'none'"),
        (lambda p: write_adapter(p, layers=(5,)), r"must be in a layer < num_hidden_layers=2"),
    ],
)
def test_bad_adapters_name_the_adapter_and_field(tmp_path, setup, match):
    setup(tmp_path / "a")
    with pytest.raises(ValueError, match=match):
        read(tmp_path / "a")


def test_shapes_that_do_not_fit(tmp_path):
    path, _ = write_adapter(tmp_path / "a", modules=("q_proj",))
    shapes = dict(SHAPES, q_proj=(HIDDEN, 2 * HIDDEN))
    with pytest.raises(
        ValueError, match=r"layers\.0\.q_proj\.lora_B\.shape=\(8, 2\) must be \(16, 2\)"
    ):
        read(path, shapes=shapes)


def test_moe_experts_are_refused(tmp_path):
    path, _ = write_adapter(tmp_path / "a", modules=("gate_proj",))
    shapes = {
        k: v for k, v in SHAPES.items() if k.endswith(("q_proj", "k_proj", "v_proj", "o_proj"))
    }
    refused = {"gate_proj": "not an MoE expert projection (LoRA on MoE experts is not served)"}
    with pytest.raises(ValueError, match=r"gate_proj' must be not an MoE expert.*MoE experts"):
        read(path, shapes=shapes, refused=refused)


def test_registry_reads_once_and_keeps_ids_unique(tmp_path):
    path, _ = write_adapter(tmp_path / "a")
    registry = LoRARegistry(SHAPES, LAYERS, 8)
    first = registry.resolve(LoRARequest("a", 3, str(path)))
    assert registry.resolve(LoRARequest("a", 3, str(path))) is first
    with pytest.raises(ValueError, match=r"lora_int_id=3 is already"):
        registry.resolve(LoRARequest("b", 3, str(path)))


def test_lora_requests_per_prompt():
    r = LoRARequest("a", 1, "/x")
    assert lora_requests_per_prompt(r, 3) == [r, r, r]
    assert lora_requests_per_prompt([None, r], 2) == [None, r]
    with pytest.raises(
        ValueError, match=r"len\(lora_request\)=1 must equal the number of prompts \(2\)"
    ):
        lora_requests_per_prompt([r], 2)


def test_slots_lru_never_evict_pinned():
    slots = AdapterSlots(2)
    assert slots.assign([7], pinned=[7]) == [(0, 7)]
    assert slots.assign([3], pinned=[3, 7]) == [(1, 3)]
    assert slots.assign([7, 3], pinned=[3, 7]) == []  # resident: no load; 3 now most recent
    assert slots.assign([9], pinned=[9, 7]) == [(1, 9)]  # 3 unpinned: evicted, 7 kept
    assert slots.assign([5], pinned=[5]) == [(0, 5)]  # 7 least recently used
    assert dict(slots.slot_of) == {9: 1, 5: 0} and slots.num_loads == 4
    with pytest.raises(AssertionError, match="every slot is pinned"):
        slots.assign([1], pinned=[9, 5])
    assert AdapterSlots.fits(9, [9, 5], 2) and not AdapterSlots.fits(1, [9, 5], 2)


def make_scheduler(max_loras=1, num_blocks=64):
    config = EngineConfig(
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=64,
        enable_lora=True,
        max_loras=max_loras,
        num_kv_blocks=num_blocks,
    )
    kv = KVCacheManager(num_blocks, 4, max_model_len=64)
    return Scheduler(config, kv), kv


def request(rid, adapter, tokens=(1, 2, 3, 4, 5, 6, 7, 8, 9)):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), adapter_id=adapter)


def test_scheduler_defers_adapters_without_a_slot():
    sched, _ = make_scheduler(max_loras=1)
    for rid, adapter in (("a", 1), ("b", None), ("c", 1), ("d", 2), ("e", 1)):
        sched.add_request(request(rid, adapter))
    out = sched.schedule()
    # One adapter among the running: d (adapter 2) steps aside, e (adapter 1) behind it runs
    assert [s.req_id for s in out.scheduled] == ["a", "b", "c", "e"]
    assert [r.request_id for r in sched.waiting] == ["d"]
    for rid in ("a", "c", "e"):
        sched.finish_request(rid, sched.requests[rid].status.FINISHED_ABORTED)
    out = sched.schedule()
    assert "d" in [s.req_id for s in out.scheduled]  # adapter 1 left: d gets the slot


def test_adapter_id_keys_the_prefix_cache():
    _, kv = make_scheduler()
    tokens = list(range(1, 14))  # three full blocks of 4
    base = request("base", None, tokens)
    kv.allocate_slots(base, len(tokens))
    kv.free(base)  # its full blocks stay cached
    hits = {}
    for rid, adapter in (("same", None), ("other", 1)):
        _, hits[rid] = kv.get_computed_blocks(request(rid, adapter, tokens))
    assert hits == {"same": 12, "other": 0}
    adapted = request("a1", 1, tokens)
    kv.allocate_slots(adapted, len(tokens))
    kv.free(adapted)
    assert kv.get_computed_blocks(request("a1b", 1, tokens))[1] == 12
    assert kv.get_computed_blocks(request("a2", 2, tokens))[1] == 0
