"""Mixture-of-experts families: logits parity with transformers, routing edge cases, the
grouped expert matmul against a per-token loop, expert-parallel parts summing to the whole,
and the engine's greedy tokens against transformers' (chunked prefill, prefix caching,
preemption, fp8 KV cache). Multi-device runs are in tests/worker/test_tensor_parallel.py.
"""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from paged_jax import LLM, SamplingParams
from paged_jax.models import load_model
from paged_jax.models.config import MoEConfig
from paged_jax.models.moe import (
    EXPERT_MATMULS,
    default_expert_matmul,
    expert_forward,
    route,
    set_expert_matmul,
    sort_by_expert,
    tile_rows_and_count,
)
from paged_jax.testing.tiny_models import MOE_FAMILIES

F32_ATOL = 1e-4
PROMPT_LENGTHS = (3, 17)
# One f32 rounding moves a value by at most this fraction of it (2**-24, about 6e-8).
F32_UNIT_ROUNDOFF = 2.0**-24


def max_diff_vs_hf(model, path, hf_logits, *, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    worst = 0.0
    for length in PROMPT_LENGTHS:
        ids = rng.integers(0, model.config.vocab_size, size=(2, length), dtype=np.int32)
        worst = max(worst, float(np.abs(np.asarray(model(ids)) - hf_logits(path, ids)).max()))
    return worst


@pytest.mark.parametrize(
    "family,overrides,sparse",
    [
        ("mixtral", {}, (True, True)),
        ("qwen2_moe", {}, (True, True)),
        ("qwen3_moe", {}, (True, True)),
        # Layer 0 dense (intermediate_size 128), layer 1 sparse with the shared expert.
        ("qwen2_moe", dict(decoder_sparse_step=2), (False, True)),
        ("qwen3_moe", dict(mlp_only_layers=[1], norm_topk_prob=True), (True, False)),
    ],
    ids=["mixtral", "qwen2_moe", "qwen3_moe", "qwen2_moe-sparse-step-2", "qwen3_moe-mlp-only-1"],
)
def test_moe_logits_match_transformers(family, overrides, sparse, tiny_hf_checkpoint, hf_logits):
    path = tiny_hf_checkpoint(family, **overrides)
    model = load_model(path)
    assert model.config.model_type == family
    assert model.config.moe.sparse_layers == sparse
    for matmul in EXPERT_MATMULS:  # both grouped matmuls, whichever the backend picks
        set_expert_matmul(model, matmul)
        assert max_diff_vs_hf(model, path, hf_logits) <= F32_ATOL, matmul


def _skewed_copy(src, dst, family: str):
    """A copy whose router sends every token to expert 0 and none to expert E-1.

    Hidden unit 0 of every token embedding is set large, so after the norms it dominates
    each token's hidden state with one sign; router column 0 then favours expert 0 and
    disfavours the last expert for every token.
    """
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors["model.embed_tokens.weight"][:, 0] = 8.0
    block = "block_sparse_moe" if family == "mixtral" else "mlp"
    for layer in range(2):
        router = tensors[f"model.layers.{layer}.{block}.gate.weight"]  # [E, D]
        router[0, 0], router[-1, 0] = 4.0, -4.0
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_one_hot_expert_and_idle_expert_match_transformers(
    family, tiny_hf_checkpoint, hf_logits, tmp_path
):
    path = _skewed_copy(tiny_hf_checkpoint(family), tmp_path / family, family)
    model = load_model(path)
    ids = np.random.default_rng(1).integers(0, 128, size=(2, 17), dtype=np.int32)
    # The routing of the first MoE layer, from its input as the model computes it.
    layer = model.layers[0]
    x = model.embed(jnp.asarray(ids), jnp.broadcast_to(jnp.arange(17), ids.shape))
    h = x + layer.attn(layer.attn_norm(x), jnp.broadcast_to(jnp.arange(17), ids.shape))
    moe = layer.mlp
    _, experts = route(
        moe.router(layer.mlp_norm(h)), moe.top_k, norm_topk_prob=True, weight_dtype="model"
    )
    experts = np.asarray(experts)
    assert (experts == 0).any(-1).all(), "every token should pick expert 0"
    assert not (experts == moe.experts.gate_proj.shape[0] - 1).any(), "the last expert idles"
    for matmul in EXPERT_MATMULS:
        set_expert_matmul(model, matmul)
        assert max_diff_vs_hf(model, path, hf_logits) <= F32_ATOL, matmul


def _loop_reference(x, weights, experts, gate, up, down):
    """Per token, per chosen expert: the MLP of the dense definition (numpy)."""
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], experts[t]):
            h = x[t] @ gate[e]
            h = h / (1 + np.exp(-h)) * (x[t] @ up[e])
            out[t] += w * (h @ down[e])
    return out


def _rounding_bound(x, weights, experts, gate, up, down):
    """f[T, D]: how far two f32 evaluations of the expert MLP may differ, per output.

    An f32 sum of n terms carries at most about n * u * (sum of the terms' magnitudes) of
    rounding error, u = 2**-24, whatever the summation order (XLA's CPU dot splits its
    sums by thread and block, so the order moves with the machine's load). The MLP chains
    a d-term dot (gate, up), the elementwise silu and product (a few roundings each),
    an f-term dot (down) and the k-term weighted sum; the loop reference evaluated on
    absolute values bounds every term's magnitude along that chain (silu(|h|) >=
    |silu(h)|). Two evaluations each within the bound of the exact value differ by at
    most twice it. With N(0, 1) weights the outputs reach ~100, so a bare atol of 1e-5
    sits at a few units of f32 resolution and fails on summation order alone.
    """
    d, f = gate.shape[1:]
    num_roundings = d + f + experts.shape[1] + 8  # 8: silu (exp, add, divide), products
    magnitude = _loop_reference(
        np.abs(x), np.abs(weights), experts, np.abs(gate), np.abs(up), np.abs(down)
    )
    return 2 * num_roundings * F32_UNIT_ROUNDOFF * magnitude


def _assert_within(got, want, bound, what=""):
    err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), (
        f"{what}: |difference| {err[worst]:.3g} > f32 rounding bound {bound[worst]:.3g} "
        f"at {worst} (value {np.asarray(want)[worst]:.4g})"
    )


@pytest.mark.parametrize("matmul", EXPERT_MATMULS)
def test_grouped_matmul_equals_per_token_loop_and_shards_sum_to_whole(matmul):
    rng = np.random.default_rng(0)
    t, d, f, e, k = 13, 8, 6, 8, 2
    x = rng.normal(size=(t, d)).astype(np.float32)
    gate, up = (rng.normal(size=(e, d, f)).astype(np.float32) for _ in range(2))
    down = rng.normal(size=(e, f, d)).astype(np.float32)
    # Expert 3 gets most tokens, expert 5 none.
    experts = np.stack([np.full(t, 3), rng.choice([0, 1, 2, 4, 6, 7], t)], -1).astype(np.int32)
    weights = rng.uniform(size=(t, k)).astype(np.float32)
    static = dict(hidden_act="silu", precision=jax.lax.Precision.HIGHEST, matmul=matmul)
    whole = np.asarray(expert_forward(x, weights, experts, gate, up, down, **static))
    bound = _rounding_bound(x, weights, experts, gate, up, down)
    _assert_within(whole, _loop_reference(x, weights, experts, gate, up, down), bound, "loop")
    plan = sort_by_expert(jnp.asarray(experts), e)
    assert (
        np.asarray(plan.group_sizes).tolist() == np.bincount(experts.ravel(), minlength=e).tolist()
    )
    # Expert parallelism: 4 devices of 2 experts each; their parts add up to the whole.
    parts = [
        np.asarray(
            expert_forward(
                x,
                weights,
                experts,
                gate[2 * j : 2 * j + 2],
                up[2 * j : 2 * j + 2],
                down[2 * j : 2 * j + 2],
                first_expert=2 * j,
                **static,
            )
        )
        for j in range(4)
    ]
    # Each part is one expert pair's share, so the parts and the whole sum the same terms.
    _assert_within(sum(parts), whole, bound, "expert-parallel parts")
    # Padding rows (any ids, any weights) leave the real rows unchanged.
    pad = 5
    padded = expert_forward(
        np.concatenate([x, rng.normal(size=(pad, d)).astype(np.float32)]),
        np.concatenate([weights, np.ones((pad, k), np.float32)]),
        np.concatenate([experts, np.full((pad, k), 3, np.int32)]),
        gate,
        up,
        down,
        **static,
    )
    # Equal up to float32 rounding: jax 0.12's CPU dot blocks a taller operand differently.
    _assert_within(np.asarray(padded)[:t], whole, bound, "padded")


def test_tiled_and_ragged_dot_matmuls_agree_on_random_routing():
    """The two grouped matmuls on random routings (skewed, uniform, one expert for all,
    decode-sized and prefill-sized token counts), whole and per expert-parallel shard,
    under one jit each: routing is data, so a new routing does not retrace."""
    rng = np.random.default_rng(7)
    d, f, e, k = 16, 12, 8, 2
    gate, up = (rng.normal(size=(e, d, f)).astype(np.float32) for _ in range(2))
    down = rng.normal(size=(e, f, d)).astype(np.float32)
    traces = []

    def run(matmul, shards):
        def fn(x, w, ids):
            traces.append(matmul)
            n = e // shards
            return sum(
                expert_forward(
                    x, w, ids, gate[j * n : (j + 1) * n], up[j * n : (j + 1) * n],
                    down[j * n : (j + 1) * n], first_expert=j * n, hidden_act="silu",
                    precision=jax.lax.Precision.HIGHEST, matmul=matmul,
                )
                for j in range(shards)
            )  # fmt: skip

        return jax.jit(fn)

    fns = {(mm, s): run(mm, s) for mm in EXPERT_MATMULS for s in (1, 4)}
    for t in (1, 40):
        for p in (None, [0.7] + [0.3 / (e - 1)] * (e - 1), [1.0] + [0.0] * (e - 1)):
            x = rng.normal(size=(t, d)).astype(np.float32)
            w = rng.uniform(size=(t, k)).astype(np.float32)
            ids = np.stack([rng.choice(e, size=t, p=p) for _ in range(k)], -1).astype(np.int32)
            out = {key: np.asarray(fn(x, w, ids)) for key, fn in fns.items()}
            ref = _loop_reference(x, w, ids, gate, up, down)
            bound = _rounding_bound(x, w, ids, gate, up, down)
            for key, got in out.items():
                _assert_within(got, ref, bound, str(key))
            _assert_within(out["tiled", 1], out["ragged_dot", 1], bound, "tiled vs ragged_dot")
    assert len(traces) == 2 * len(fns), "one trace per token count, not per routing"


def test_tile_count_bounds_every_routing_and_backend_choice():
    for rows, groups in ((1, 8), (2, 8), (32, 8), (512, 8), (4096, 128), (7, 3)):
        m, tiles = tile_rows_and_count(rows, groups)
        assert m & (m - 1) == 0 and 1 <= m <= 128
        # the worst case: as many non-empty groups as possible, each one row past a tile
        busy = min(groups, rows)
        worst = [1] * busy
        worst[0] += rows - busy
        assert sum(-(-n // m) for n in worst) <= tiles
    assert default_expert_matmul("tpu") == "ragged_dot"
    assert default_expert_matmul("cpu") == default_expert_matmul("cuda") == "tiled"
    with pytest.raises(ValueError, match="matmul='dense'"):
        set_expert_matmul(None, "dense")


def test_router_semantics_per_family():
    logits = jnp.asarray([[1.0, 3.0, 2.0, 0.0]], jnp.bfloat16)
    probs = np.exp([1.0, 3.0, 2.0, 0.0]) / np.exp([1.0, 3.0, 2.0, 0.0]).sum()
    raw, ids = route(logits, 2, norm_topk_prob=False, weight_dtype="model")
    assert np.asarray(ids).tolist() == [[1, 2]] and raw.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(raw, np.float32), [probs[[1, 2]]], rtol=1e-2)
    normed, _ = route(logits, 2, norm_topk_prob=True, weight_dtype="float32")
    assert normed.dtype == jnp.float32  # Mixtral keeps float32 weights
    np.testing.assert_allclose(np.asarray(normed), [probs[[1, 2]] / probs[[1, 2]].sum()], rtol=1e-6)


def test_moe_config_rejects_bad_fields():
    good = dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        norm_topk_prob=True,
        sparse_layers=(True,),
    )
    with pytest.raises(
        ValueError, match=r"MoEConfig.num_experts_per_tok=5 must be <= num_experts=4"
    ):
        MoEConfig(**{**good, "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match=r"MoEConfig.router_weight_dtype='f16' must be one of"):
        MoEConfig(**good, router_weight_dtype="f16")


# Engine runs: one (num_tokens, num_seqs) bucket, so each LLM compiles its step once.
SMALL = dict(
    block_size=4,
    max_num_seqs=4,
    max_num_batched_tokens=16,
    max_model_len=64,
    attention_backend="reference",
)
MAX_NEW = 6


def _prompts():
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 128, 12).tolist()  # 3 full blocks: a prefix-cache hit
    return [
        shared + rng.integers(3, 128, 3).tolist(),
        rng.integers(3, 128, 9).tolist(),
        shared + rng.integers(3, 128, 5).tolist(),
        rng.integers(3, 128, 30).tolist(),  # > 16 tokens: prefilled in chunks
    ]


@pytest.mark.parametrize(
    "family,engine,check",
    [
        ("mixtral", dict(enable_prefix_caching=False), "chunked"),
        ("qwen2_moe", dict(enable_prefix_caching=True), "prefix"),
        ("qwen3_moe", dict(num_kv_blocks=16, preemption_mode="recompute"), "preempt"),
    ],
)
def test_engine_greedy_equals_transformers(family, engine, check, tiny_hf_checkpoint, hf_greedy):
    path = tiny_hf_checkpoint(family)
    prompts = _prompts()
    llm = LLM(str(path), **SMALL, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == [hf_greedy(path, p, MAX_NEW) for p in prompts]
    stats = llm.get_stats()
    assert stats["num_compiles_after_warmup"] == 0
    if check == "prefix":
        assert stats["prefix_cache_hits"] > 0
    if check == "preempt":
        assert stats["num_preemptions"] > 0


def test_fp8_kv_cache_serves_moe(tiny_hf_checkpoint, hf_logits):
    """fp8 e4m3 KV: the first token's logprobs stay near transformers' (the dense
    families' bound, tests/engine/test_kv_cache_dtype.py)."""
    path = tiny_hf_checkpoint("qwen2_moe")
    llm = LLM(str(path), kv_cache_dtype="fp8_e4m3", warmup=False, **SMALL)
    runner = llm.engine.runner
    assert runner.kv_caches[0][0].dtype == jnp.float8_e4m3fn
    # KV memory is attention's alone: 2 layers x (K, V) x 2 KV heads x 4 tokens x head_dim
    # 16 x 1 byte, whatever the experts weigh.
    assert runner.bytes_per_block == 2 * 2 * 2 * 4 * 16
    prompts = _prompts()[1:2]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=5)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        ref = hf_logits(path, np.asarray([prompt]))[0, -1].astype(np.float64)
        ref = ref - ref.max() - np.log(np.exp(ref - ref.max()).sum())
        for token, logprob in out.outputs[0].logprobs[0].items():
            assert abs(logprob.logprob - ref[token]) < 0.5, token


def test_tensor_parallel_size_must_divide_num_experts():
    from paged_jax.models.config import ModelConfig
    from paged_jax.models.partitioning import check_tensor_parallel

    moe = MoEConfig(
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        norm_topk_prob=True,
        sparse_layers=(True,),
    )
    config = ModelConfig(
        model_type="mixtral",
        vocab_size=16,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        intermediate_size=8,
        max_position_embeddings=32,
        moe=moe,
    )
    check_tensor_parallel(config, 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 must divide num_experts=6"):
        check_tensor_parallel(config, 4)
