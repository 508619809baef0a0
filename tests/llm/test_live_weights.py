"""Live weights (issue 39 items 1-2): get / update / load weights and sleep / wake_up.

One LLM of this module (the tiny byte-tokenizer Llama, SMALL_LLM's shapes) serves every
test; each test leaves it awake with the checkpoint's weights.
"""

from __future__ import annotations

import gc
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx

from paged_jax import LLM, SamplingParams
from paged_jax.models import load_model
from paged_jax.models.loader import params_from_named_tensors
from paged_jax.testing.cpu_devices import env_with_cpu_devices
from paged_jax.worker.live_weights import flat_weights, live_bytes
from tests.conftest import SMALL_LLM

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41, 42, 43, 44]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
SEEDED = SamplingParams(temperature=1.0, top_k=20, seed=7, max_tokens=8)


def _tokens(llm: LLM, params: SamplingParams = GREEDY, prompts=PROMPTS) -> list[list[int]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _host(weights) -> dict:
    return {k: np.asarray(v) for k, v in flat_weights(weights).items()}


def _compiles(llm: LLM) -> int:
    return llm.get_stats()["num_compiles"]


@pytest.fixture(scope="module")
def live(model_dir):
    llm = LLM(str(model_dir), **SMALL_LLM)
    original = _host(llm.get_weights())
    yield llm, original


@pytest.fixture
def llm(live):
    """The module's LLM, awake, with the checkpoint's weights and an empty prefix cache."""
    llm, original = live
    yield llm
    if llm.is_sleeping():
        try:
            llm.wake_up()
        except RuntimeError:  # asleep at level 2 without weights
            llm.update_weights(_pure(original))
            llm.wake_up()
    llm.update_weights(_pure(original))


def _pure(flat: dict) -> dict:
    """{path: array} -> the nested dict nnx.to_pure_dict would give."""
    out: dict = {}
    for path, value in flat.items():
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return out


def _fresh(model_dir: pathlib.Path, flat: dict) -> LLM:
    """A new LLM serving the weights `flat` from the start (nothing cached)."""
    model = load_model(model_dir)
    state = nnx.state(model)
    nnx.replace_by_pure_dict(state, _pure(flat))
    nnx.update(model, state)
    return LLM(model, warmup=False, **SMALL_LLM)


def test_get_weights_is_the_models_own_state_and_the_served_arrays(llm, model_dir):
    weights = llm.get_weights()
    assert isinstance(weights, nnx.State)
    reference = flat_weights(nnx.state(load_model(model_dir)))
    got = flat_weights(weights)
    assert list(got) == list(reference)  # every layer's own parameters, in the model's order
    assert ("layers", 1, "attn", "q_proj", "kernel") in got
    for path, value in reference.items():
        np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(value))
    served = jax.tree.leaves(llm.engine.runner.weights)  # unscanned: no copy
    assert all(a is b for a, b in zip(jax.tree.leaves(weights), served))


def test_update_weights_round_trip_keeps_outputs_and_compiles_nothing(llm):
    greedy, seeded = _tokens(llm), _tokens(llm, SEEDED)
    compiles = _compiles(llm)
    weights = llm.get_weights()
    before = live_bytes()
    llm.update_weights(weights)  # the served arrays themselves: used as they are
    assert live_bytes() == before
    assert _tokens(llm) == greedy and _tokens(llm, SEEDED) == seeded
    llm.update_weights(nnx.to_pure_dict(weights))  # the pure-dict form is accepted too
    assert _tokens(llm) == greedy
    assert _compiles(llm) == compiles


def test_perturbed_weights_serve_as_a_fresh_llm_would_and_reset_the_prefix_cache(
    llm, live, model_dir
):
    _, original = live
    long_prompt = [list(range(20, 44))]  # 6 full blocks of 4: cached by the first call
    old = _tokens(llm, prompts=PROMPTS + long_prompt)
    rng = np.random.default_rng(0)
    perturbed = {
        k: v + 0.05 * rng.standard_normal(v.shape).astype(v.dtype) for k, v in original.items()
    }
    compiles = _compiles(llm)
    llm.update_weights(_pure(perturbed))  # host arrays: one copy each to the device
    assert _compiles(llm) == compiles
    new = _tokens(llm, prompts=PROMPTS + long_prompt)
    seeded = _tokens(llm, SEEDED)
    assert new != old
    fresh = _fresh(model_dir, perturbed)
    # The long prompt's blocks were cached under the old weights: a served hit would differ.
    assert _tokens(fresh, prompts=PROMPTS + long_prompt) == new
    assert _tokens(fresh, SEEDED) == seeded


def test_update_weights_names_the_first_differing_path(llm, live):
    _, original = live
    flat = dict(original)
    path = ("layers", 0, "mlp", "up_proj", "kernel")
    wrong_shape = dict(flat, **{})
    wrong_shape[path] = np.zeros((3, 3), np.float32)
    with pytest.raises(
        ValueError, match=r"layers\.0\.mlp\.up_proj\.kernel.*shape \(3, 3\).*shape \(64, 128\)"
    ):
        llm.update_weights(_pure(wrong_shape))
    wrong_dtype = dict(flat)
    wrong_dtype[path] = flat[path].astype(np.float16)
    with pytest.raises(ValueError, match=r"up_proj\.kernel.*dtype float16.*dtype float32"):
        llm.update_weights(_pure(wrong_dtype))
    missing = {k: v for k, v in flat.items() if k != path}
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.up_proj\.kernel'\] is missing"):
        llm.update_weights(_pure(missing))
    extra = dict(flat)
    extra[("layers", 0, "mlp", "extra")] = np.zeros(2, np.float32)
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.extra'\] is not a parameter"):
        llm.update_weights(_pure(extra))


def test_weights_change_only_between_requests(llm):
    weights = llm.get_weights()
    short, long = SamplingParams(max_tokens=1), SamplingParams(max_tokens=30)
    it = llm.generate_iter(PROMPTS, [short, long])
    next(it)  # the short request finished; the long one is still running
    assert llm.engine.has_unfinished()
    calls = {
        "update_weights": lambda: llm.update_weights(weights),
        "load_weights": lambda: llm.load_weights([]),
        "sleep": lambda: llm.sleep(),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=f"{name} while requests are unfinished"):
            call()
    it.close()
    assert not llm.engine.has_unfinished()


def _checkpoint_tensors(model_dir: pathlib.Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def test_load_weights_takes_hugging_face_names(llm, live, model_dir):
    _, original = live
    tensors = _checkpoint_tensors(model_dir)
    name = "model.layers.1.self_attn.q_proj.weight"
    assert name in tensors
    compiles = _compiles(llm)
    greedy = _tokens(llm)
    changed = tensors[name] * 2.0
    llm.load_weights([(name, jax.numpy.asarray(changed))])  # one tensor, a jax array
    got = _host(llm.get_weights())
    # torch's Linear weight f[out, in] is the kernel f[in, out]: the family's table converts.
    np.testing.assert_array_equal(got[("layers", 1, "attn", "q_proj", "kernel")], changed.T)
    for path, value in original.items():
        if path != ("layers", 1, "attn", "q_proj", "kernel"):
            np.testing.assert_array_equal(got[path], value)
    assert _tokens(llm) != greedy
    llm.load_weights(tensors.items())  # the whole checkpoint, numpy: back to the start
    assert _tokens(llm) == greedy
    assert _compiles(llm) == compiles
    with pytest.raises(
        ValueError, match=r"'model\.layers\.9\.mlp\.up_proj\.weight' is not a parameter"
    ):
        llm.load_weights([("model.layers.9.mlp.up_proj.weight", np.zeros(3, np.float32))])
    with pytest.raises(ValueError, match=rf"{name}' has shape \(2,\)"):
        llm.load_weights([(name, np.zeros(2, np.float32))])


def test_load_weights_stacks_moe_experts_as_the_loader_does(tiny_hf_checkpoint):
    path = tiny_hf_checkpoint("qwen3_moe")
    model = load_model(path)
    tensors = _checkpoint_tensors(path)
    values = params_from_named_tensors(type(model), model.config, tensors.items())
    reference = flat_weights(nnx.state(model))
    assert set(values) == set(reference)
    for key, value in reference.items():
        np.testing.assert_array_equal(values[key], np.asarray(value))
    one_expert = [(k, v) for k, v in tensors.items() if ".experts.3." in k and "layers.0." in k]
    assert one_expert
    with pytest.raises(ValueError, match=r"one slice of the stacked .*all its slices"):
        params_from_named_tensors(type(model), model.config, one_expert)


def test_sleep_hands_back_the_device_memory_and_wake_up_serves_as_before(llm):
    greedy, seeded = _tokens(llm), _tokens(llm, SEEDED)
    compiles = _compiles(llm)
    runner = llm.engine.runner
    held = runner.memory_per_device()
    pool_and_weights = held["weight_bytes_per_device"] + held["kv_cache_bytes_per_device"]
    gc.collect()  # arrays earlier tests dropped
    before = live_bytes()
    llm.sleep(level=1)
    gc.collect()
    asleep = live_bytes()
    assert llm.is_sleeping()
    assert before - asleep >= 0.95 * pool_and_weights, (before, asleep, pool_and_weights)
    with pytest.raises(RuntimeError, match="generate while the engine sleeps"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="get_weights while the engine sleeps"):
        llm.get_weights()
    with pytest.raises(RuntimeError, match="asleep already"):
        llm.sleep()
    llm.wake_up()
    assert not llm.is_sleeping()
    gc.collect()
    assert asleep + 0.95 * pool_and_weights <= live_bytes() <= before
    assert _tokens(llm) == greedy and _tokens(llm, SEEDED) == seeded
    assert _compiles(llm) == compiles


def test_sleep_level_2_needs_new_weights_before_wake_up(llm, live):
    _, original = live
    greedy = _tokens(llm)
    compiles = _compiles(llm)
    llm.sleep(level=2)
    with pytest.raises(RuntimeError, match=r"wake_up after sleep\(level=2\) needs the weights"):
        llm.wake_up()
    with pytest.raises(ValueError, match=r"supplied whole"):
        llm.load_weights([("model.norm.weight", original[("final_norm", "scale")])])
    llm.update_weights(_pure(original))  # straight to the device, while asleep
    llm.wake_up()
    assert _tokens(llm) == greedy
    assert _compiles(llm) == compiles
    with pytest.raises(ValueError, match="level=3 must be 1 or 2"):
        llm.sleep(level=3)


def test_a_scanned_engine_gives_the_same_structure_and_compiles_nothing_after_warm_up(
    model_dir, live
):
    _, original = live
    # One token bucket, two rows: few programs to warm up.
    small = dict(block_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64)
    llm = LLM(str(model_dir), scan_layers="on", **small)
    assert llm.engine.runner.layer_scan is not None  # it serves stacked layers
    # Warm-up compiled the unstack / restack programs too: from here on nothing compiles.
    compiles = _compiles(llm)
    assert llm.get_stats()["num_compiles_after_warmup"] == 0
    got = _host(llm.get_weights())
    assert list(got) == list(original)
    for path, value in original.items():
        np.testing.assert_array_equal(got[path], value)
    greedy = _tokens(llm)
    rng = np.random.default_rng(1)
    perturbed = {k: v + 0.05 * rng.standard_normal(v.shape).astype(v.dtype) for k, v in got.items()}
    llm.update_weights(_pure(perturbed))
    changed = _host(llm.get_weights())
    for path, value in perturbed.items():
        np.testing.assert_array_equal(changed[path], value)
    assert _tokens(llm) != greedy
    tensors = _checkpoint_tensors(model_dir)
    llm.load_weights(tensors.items())  # back to the checkpoint, restacked on the device
    assert _tokens(llm) == greedy
    llm.sleep(level=1)
    llm.wake_up()
    assert _tokens(llm) == greedy
    llm.sleep(level=2)
    llm.update_weights(_pure(original))
    llm.wake_up()
    assert _tokens(llm) == greedy
    assert _compiles(llm) == compiles
    assert llm.get_stats()["num_compiles_after_warmup"] == 0


# Run on 4 forced CPU devices in a subprocess (jax fixes the device count at start-up): the
# tiny Llama's 2 KV heads are repeated to 4 on the mesh, so load_weights must convert
# checkpoint-shaped tensors as loading does and place them with the served shardings.
TP_SCRIPT = """
import json, pathlib, sys
import numpy as np
from safetensors.numpy import load_file
from paged_jax import LLM, SamplingParams
from paged_jax.worker.live_weights import flat_weights

path, out = sys.argv[1], sys.argv[2]
llm = LLM(path, tensor_parallel_size=4, scan_layers="on", block_size=4, max_num_seqs=2,
          max_num_batched_tokens=16, max_model_len=64, num_kv_blocks=32,
          attention_backend="reference")
prompts = [[5, 6, 7, 8, 9, 10], [40, 41, 42]]
greedy = SamplingParams(temperature=0.0, max_tokens=6)
def tokens():
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
before, compiles = tokens(), llm.get_stats()["num_compiles"]
tensors = {}
for f in sorted(pathlib.Path(path).glob("*.safetensors")):
    tensors.update(load_file(f))
name, key = "model.layers.1.self_attn.k_proj.weight", ("layers", 1, "attn", "k_proj", "kernel")
old = flat_weights(llm.get_weights())[key]
llm.load_weights([(name, tensors[name] * 2.0)])
new = flat_weights(llm.get_weights())[key]
changed = tokens()
llm.load_weights(tensors.items())
restored = tokens()
llm.sleep(level=1)
llm.wake_up()
woken = tokens()
json.dump(dict(
    before=before, changed=changed, restored=restored, woken=woken,
    compiles=llm.get_stats()["num_compiles"] - compiles,
    hf_shape=list(tensors[name].shape), served=np.asarray(new).tolist(),
    same_sharding=new.sharding == old.sharding,
    shard_shapes=sorted({tuple(s.data.shape) for s in new.addressable_shards}),
), open(out, "w"))
"""


def test_load_weights_and_sleep_under_tensor_parallelism(tiny_hf_checkpoint, tmp_path):
    import json
    import subprocess
    import sys

    from safetensors.numpy import load_file

    path = tiny_hf_checkpoint("llama")  # 4 heads, 2 KV heads of 16
    env = env_with_cpu_devices(4, cpu_only=True)
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, "-c", TP_SCRIPT, str(path), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard only
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(out.read_text())
    weight = load_file(path / "model.safetensors")["model.layers.1.self_attn.k_proj.weight"]
    assert got["hf_shape"] == [32, 64]  # [2 KV heads x 16, hidden]
    # The kernel [hidden, kv x 16], each KV head's 16 columns repeated for the 4 devices.
    expected = np.repeat((2.0 * weight).T.reshape(64, 2, 1, 16), 2, axis=2).reshape(64, 64)
    np.testing.assert_array_equal(np.asarray(got["served"], np.float32), expected)
    assert got["same_sharding"] and got["shard_shapes"] == [[64, 16]]  # split by KV head
    assert got["changed"] != got["before"]
    assert got["restored"] == got["before"] and got["woken"] == got["before"]
    assert got["compiles"] == 0


def test_a_draft_model_follows_the_targets_sleep_and_wake_up(tiny_hf_checkpoint):
    target = tiny_hf_checkpoint("llama")
    draft = tiny_hf_checkpoint(
        "llama", seed=7, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    llm = LLM(
        str(target),
        speculative_config=spec,
        attention_backend="reference",
        block_size=4,
        max_num_seqs=2,
        max_num_batched_tokens=16,  # one token bucket: few programs to warm up
        max_model_len=64,
    )
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42, 40, 41, 42]]
    greedy, seeded = _tokens(llm, prompts=prompts), _tokens(llm, SEEDED, prompts=prompts)
    compiles = _compiles(llm)
    original = _host(llm.get_weights())
    held = llm.engine.runner.memory_per_device()
    drafter = llm.engine.proposer.runner
    draft_bytes = sum(x.nbytes for x in jax.tree.leaves((drafter.weights, drafter.kv_caches)))
    assert draft_bytes > 0
    everything = held["weight_bytes_per_device"] + held["kv_cache_bytes_per_device"] + draft_bytes
    gc.collect()
    before = live_bytes()
    llm.sleep(level=1)
    gc.collect()
    assert before - live_bytes() >= 0.95 * everything, (before, live_bytes(), everything)
    llm.wake_up()
    assert _tokens(llm, prompts=prompts) == greedy
    assert _tokens(llm, SEEDED, prompts=prompts) == seeded
    # Level 2 drops the target's weights only: the draft's come back from host memory.
    llm.sleep(level=2)
    llm.update_weights(_pure(original))
    llm.wake_up()
    assert _tokens(llm, prompts=prompts) == greedy
    assert _compiles(llm) == compiles
