"""8-bit weights (models/quantization.py, models/fp8_checkpoint.py) against transformers.

Exactness is defined against transformers' model whose linear weights are replaced by the
dequantized values; the test computes those values itself, in torch, from the rule as
written in the issue (not from the code under test).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from paged_jax.models import load_model
from paged_jax.models.quantization import (
    QuantizedEmbed,
    QuantizedExperts,
    QuantizedLinear,
    dequantize,
    quantize_columns,
    quantized_matmul,
)
from paged_jax.testing.cpu_devices import env_with_cpu_devices

IDS = np.array([[1, 5, 9, 20, 33, 7, 64, 100], [3, 3, 90, 12, 4, 77, 18, 2]], np.int32)
# The projections the rule quantizes in a Llama-style decoder layer.
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantized_weights(hf_model, embeddings=False):
    """(module name, weight f[..., out, in]) of every weight the rule quantizes: the
    projections' nn.Linear weights, and transformers' fused MoE experts (gate_up_proj
    f[E, 2F, D], down_proj f[E, D, F]: rows are output channels, as in nn.Linear); with
    `embeddings`, the token embedding f[V, D] and an untied lm_head f[V, D] (a tied head
    is the embedding's parameter, listed once): rows are vocab entries."""
    for name, param in hf_model.named_parameters():
        module, leaf = name.rsplit(".", 1)
        linear = leaf == "weight" and module.split(".")[-1] in LINEARS
        fused = module.endswith(".experts") and leaf in ("gate_up_proj", "down_proj")
        table = embeddings and module.split(".")[-1] in ("embed_tokens", "lm_head")
        if (".layers." in name and (linear or fused)) or table:
            yield (module if linear or table else name), param


def _rule_dequantized(weight, method):
    """The issue's rule on a torch weight f32[out, in], one scale per row, dequantized."""
    import torch

    w = weight.float()
    absmax = w.abs().amax(dim=-1)
    bound = 127.0 if method == "int8" else 448.0
    scale = torch.where(absmax > 0, absmax / bound, torch.ones_like(absmax))
    scaled = w / scale[..., None]
    if method == "int8":
        q = torch.clamp(torch.round(scaled), -127, 127)  # round half to even
    else:
        q = scaled.to(torch.float8_e4m3fn).float()
    return q * scale[..., None]


def _hf_logits_with(path, replace, embeddings=False):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        for name, weight in list(_quantized_weights(model, embeddings)):
            weight.copy_(replace(name, weight))
        return model(torch.as_tensor(IDS, dtype=torch.long)).logits.numpy()


def test_rule_by_hand():
    # One output channel (a column of our [in, out] kernel): max|w| = 1 -> scale 1/127;
    # 0.5 * 127 = 63.5 rounds to the even 64, 0.25 * 127 = 31.75 to 32.
    kernel = np.array([[1.0, 0.0], [-0.5, 0.0], [0.25, 0.0]], np.float32)
    q, scale = quantize_columns(kernel, "int8")
    assert q.dtype == np.int8 and q[:, 0].tolist() == [127, -64, 32]
    np.testing.assert_allclose(scale, [1 / 127, 1.0])  # the zero column gets scale 1
    assert q[:, 1].tolist() == [0, 0, 0]
    q8, scale8 = quantize_columns(kernel, "fp8")
    assert q8.dtype == ml_dtypes.float8_e4m3fn
    # max -> 448; 0.5 * 448 = 224 and 0.25 * 448 = 112 are exact in e4m3.
    assert q8[:, 0].astype(np.float32).tolist() == [448.0, -224.0, 112.0]
    np.testing.assert_allclose(scale8, [1 / 448, 1.0])


def test_fused_product_equals_dequantized_product():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 48)).astype(np.float32)
    kernel = rng.standard_normal((48, 40)).astype(np.float32)
    for method in ("int8", "fp8"):
        q, scale = quantize_columns(kernel, method)
        want = x @ dequantize(q, scale)
        got = np.asarray(quantized_matmul(x, q, scale, precision="highest"))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # Block scales: 16 x 16 tiles over a 48 x 40 kernel (ragged last column block).
    block = rng.uniform(0.5, 2.0, (3, 3)).astype(np.float32)
    q8 = (kernel * 10).astype(ml_dtypes.float8_e4m3fn)
    expanded = np.repeat(np.repeat(block, 16, 0), 16, 1)[:48, :40]
    want = x @ (q8.astype(np.float32) * expanded)
    got = np.asarray(quantized_matmul(x, q8, block, block_size=16, precision="highest"))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    "family, method",
    [
        ("llama", "int8"),
        ("llama", "fp8"),
        ("qwen3", "int8"),
        ("qwen3", "fp8"),
        ("qwen3_moe", "int8"),
    ],
)
def test_on_load_logits_equal_dequantized_transformers(tiny_hf_checkpoint, family, method):
    path = tiny_hf_checkpoint(family)
    model = load_model(path, quantization=method)
    layers = [m for _, m in nnx.iter_graph(model) if isinstance(m, QuantizedLinear)]
    experts = [m for _, m in nnx.iter_graph(model) if isinstance(m, QuantizedExperts)]
    dense_mlp = 0 if experts else 3
    assert len(layers) == (4 + dense_mlp) * model.config.num_hidden_layers
    assert len(experts) == (model.config.num_hidden_layers if family == "qwen3_moe" else 0)
    weights = [m.qweight[...] for m in layers] + [w.q for m in experts for w in m.weights()]
    assert {str(w.dtype) for w in weights} == {"int8" if method == "int8" else "float8_e4m3fn"}
    want = _hf_logits_with(path, lambda _name, w: _rule_dequantized(w, method))
    got = np.asarray(model(IDS))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    # ... and the quantization did change the model (the check above could not pass
    # against the float model by accident).
    assert np.abs(np.asarray(load_model(path)(IDS)) - want).max() > 1e-3


@pytest.mark.filterwarnings("ignore::paged_jax.models.loader.WeightCastWarning")
def test_layer_bytes_about_half_of_bf16(tiny_hf_checkpoint):
    """Device bytes (scales included) of the decoder layers, the quantized part, and of
    the whole model, which reaches the same ratio with quantize_embeddings."""
    path = tiny_hf_checkpoint(
        "llama", hidden_size=256, intermediate_size=512, num_attention_heads=4, vocab_size=2048
    )

    def nbytes(module):
        return sum(v.get_value().nbytes for _, v in nnx.to_flat_state(nnx.state(module)))

    bf16 = load_model(path, "bfloat16")
    for method in ("int8", "fp8"):
        layers_only = load_model(path, "bfloat16", quantization=method)
        ratio = nbytes(layers_only.layers) / nbytes(bf16.layers)
        assert 0.5 < ratio <= 0.53, ratio
        # The bf16 embedding and head (2 x 2048 x 256) keep the whole model above 0.53x ...
        assert nbytes(layers_only) / nbytes(bf16) > 0.6
        whole = load_model(path, "bfloat16", quantization=method, quantize_embeddings=True)
        ratio = nbytes(whole) / nbytes(bf16)
        assert 0.5 < ratio <= 0.53, ratio  # ... and 8-bit they join the layers' ratio


def _block_quantize(w, b):
    """Block-wise fp8 of w f32[out, in]: (q f8[out, in], scale_inv f32[ceil(out/b), ceil(in/b)])."""
    rows, cols = w.shape
    nr, nc = -(-rows // b), -(-cols // b)
    padded = np.zeros((nr * b, nc * b), np.float32)
    padded[:rows, :cols] = w
    tiles = padded.reshape(nr, b, nc, b)
    absmax = np.abs(tiles).max(axis=(1, 3))
    scale_inv = np.where(absmax > 0, absmax / 448.0, 1.0).astype(np.float32)
    q = (tiles / scale_inv[:, None, :, None]).reshape(nr * b, nc * b)[:rows, :cols]
    return q.astype(ml_dtypes.float8_e4m3fn), scale_inv


def _write_block_fp8(src, dst, block):
    """src's checkpoint quantized block-wise into dst (transformers' fine-grained fp8);
    returns {module name: dequantized weight} of every quantized tensor."""
    import torch
    from safetensors.torch import load_file, save_file

    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    tensors = load_file(src / "model.safetensors")
    out, dequantized = {}, {}
    for key, value in tensors.items():
        name = key.rsplit(".", 1)[0]
        if key.endswith(".weight") and name.split(".")[-1] in LINEARS:
            q, scale_inv = _block_quantize(value.numpy(), block)
            q32 = q.astype(np.float32)
            rows, cols = q.shape
            expanded = np.repeat(np.repeat(scale_inv, block, 0), block, 1)[:rows, :cols]
            dequantized[name] = torch.from_numpy(q32 * expanded)
            out[key] = torch.from_numpy(q32).to(torch.float8_e4m3fn)
            out[f"{name}.weight_scale_inv"] = torch.from_numpy(scale_inv)
        else:
            out[key] = value
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
    }
    (dst / "config.json").write_text(json.dumps(config))
    return dequantized


@pytest.fixture(scope="module")
def block_fp8_checkpoint(tiny_hf_checkpoint, tmp_path_factory):
    """A tiny Llama quantized block-wise (32 x 32 tiles; intermediate 80 leaves ragged
    blocks), saved as transformers' fine-grained fp8 format, plus its dequantized weights."""
    src = tiny_hf_checkpoint("llama", intermediate_size=80)
    dst = tmp_path_factory.mktemp("llama_fp8_block")
    return dst, src, _write_block_fp8(src, dst, 32)


def test_block_fp8_checkpoint_equals_dequantized_transformers(block_fp8_checkpoint):
    path, float_path, dequantized = block_fp8_checkpoint
    model = load_model(path)  # served 8-bit from the checkpoint's own scales
    q_proj = model.layers[0].attn.q_proj
    assert isinstance(q_proj, QuantizedLinear) and q_proj.block_size == 32
    assert str(q_proj.qweight[...].dtype) == "float8_e4m3fn" and q_proj.scale[...].shape == (2, 2)
    # transformers' model of the float checkpoint, its weights set to the dequantized ones.
    want = _hf_logits_with(float_path, lambda name, _w: dequantized[name])
    np.testing.assert_allclose(np.asarray(model(IDS)), want, atol=1e-4, rtol=0)
    from paged_jax.models.loader import check_model_dir

    for refuse in (
        lambda: load_model(path, quantization="int8"),
        lambda: check_model_dir(path, quantization="int8"),
    ):
        with pytest.raises(ValueError, match=r"quantization='int8' cannot apply .*already fp8"):
            refuse()


def test_unsupported_quantization_config_refused_at_preflight(tiny_hf_checkpoint, tmp_path):
    from paged_jax.models.loader import check_model_dir

    src = tiny_hf_checkpoint("llama")
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quant_method='awq' is not supported"):
        check_model_dir(tmp_path)
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 64]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"weight_block_size=\[128, 64\] must be \[b, b\]"):
        check_model_dir(tmp_path)


_TP_SCRIPT = """
import json, sys
import numpy as np
from paged_jax.models import load_model
from paged_jax.worker.sharding import make_mesh
path, moe_path, ids = sys.argv[1], sys.argv[2], np.array(json.loads(sys.argv[3]), np.int32)
one = load_model(path, quantization="int8")
two = load_model(path, quantization="int8", mesh=make_mesh(2))
attn, mlp = two.layers[0].attn, two.layers[0].mlp
specs = {
    name: [list(layer.qweight[...].sharding.spec), list(layer.scale[...].sharding.spec)]
    for name, layer in [("q", attn.q_proj), ("o", attn.o_proj), ("down", mlp.down_proj)]
}
diff = float(np.abs(np.asarray(one(ids)) - np.asarray(two(ids))).max())
moe_one = load_model(moe_path, quantization="int8")
moe_two = load_model(moe_path, quantization="int8", mesh=make_mesh(2))
experts = moe_two.layers[0].mlp.experts
specs["experts"] = [list(experts.up_proj[...].sharding.spec), list(experts.up_proj_scale[...].sharding.spec)]
moe_diff = float(np.abs(np.asarray(moe_one(ids)) - np.asarray(moe_two(ids))).max())
one = load_model(path, quantization="int8", quantize_embeddings=True)
two = load_model(path, quantization="int8", quantize_embeddings=True, mesh=make_mesh(2))
table, head = two.embed_tokens, two.lm_head
specs["embed"] = [list(table.qembedding[...].sharding.spec), list(table.scale[...].sharding.spec)]
specs["head"] = [list(head.qweight[...].sharding.spec), list(head.scale[...].sharding.spec)]
embed_diff = float(np.abs(np.asarray(one(ids)) - np.asarray(two(ids))).max())
print(json.dumps({"specs": specs, "diff": diff, "moe_diff": moe_diff, "embed_diff": embed_diff}))
"""


def test_scales_shard_with_their_weights(tiny_hf_checkpoint):
    path, moe_path = tiny_hf_checkpoint("llama"), tiny_hf_checkpoint("qwen3_moe")
    env = env_with_cpu_devices(2, cpu_only=True)
    done = subprocess.run(
        [sys.executable, "-c", _TP_SCRIPT, str(path), str(moe_path), json.dumps(IDS.tolist())],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # Column-parallel q: weight columns and their scales split; row-parallel o / down:
    # weight rows split, the per-output-column scales replicated.
    assert result["specs"]["q"] == [[None, "tp"], ["tp"]]
    assert result["specs"]["o"] == [["tp", None], [None]]
    assert result["specs"]["down"] == [["tp", None], [None]]
    # Expert parallelism: each device holds its experts' 8-bit weights and their scales.
    assert result["specs"]["experts"] == [["tp", None, None], ["tp", None]]
    # quantize_embeddings: vocab-parallel table and head, each scale with its vocab row.
    assert result["specs"]["embed"] == [["tp", None], ["tp"]]
    assert result["specs"]["head"] == [[None, "tp"], ["tp"]]
    assert result["diff"] < 1e-5 and result["moe_diff"] < 1e-5 and result["embed_diff"] < 1e-5


_ENGINE_TP_SCRIPT = """
import json, sys
from paged_jax import LLM, SamplingParams
params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, ignore_eos=True)
prompts = [[1, 5, 9, 20, 33, 7, 64, 100], [3, 3, 90, 12, 4, 77, 18]]
result = {}
for name, path, kwargs in json.loads(sys.argv[1]):
    for tp in (1, 2):
        llm = LLM(path, tensor_parallel_size=tp, max_model_len=32, block_size=4,
                  max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=32, **kwargs)
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        result[f"{name}/{tp}"] = [
            [c.token_ids, [e[t].logprob for t, e in zip(c.token_ids, c.logprobs)]] for c in outs
        ]
        result[f"{name}/{tp}/compiles"] = llm.engine.get_stats()["num_compiles_after_warmup"]
        del llm
print(json.dumps(result))
"""


def test_engine_serves_8bit_weights_with_tensor_parallelism(
    tiny_hf_checkpoint, block_fp8_moe_checkpoint
):
    """LLM(tensor_parallel_size=2) over 8-bit weights, on-load int8 (Llama) and a
    block-wise fp8 MoE checkpoint (experts split across devices with their block scales):
    the engine places the 8-bit params and scales by the quantized partition rules, and
    its greedy tokens and logprobs equal the one-device engine's."""
    cases = [
        ["int8", str(tiny_hf_checkpoint("llama")), {"quantization": "int8"}],
        ["fp8block_moe", str(block_fp8_moe_checkpoint[0]), {}],
    ]
    env = env_with_cpu_devices(2, cpu_only=True)
    done = subprocess.run(
        [sys.executable, "-c", _ENGINE_TP_SCRIPT, json.dumps(cases)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for name, _, _ in cases:
        one, two = result[f"{name}/1"], result[f"{name}/2"]
        assert [t for t, _ in two] == [t for t, _ in one], name
        for (_, lp1), (_, lp2) in zip(one, two):
            np.testing.assert_allclose(lp2, lp1, atol=1e-4, rtol=0, err_msg=name)
        assert result[f"{name}/2/compiles"] == 0


@pytest.mark.parametrize("method, embeddings", [("int8", False), ("fp8", True)])
def test_engine_8bit_weights_with_fp8_kv_cache(tiny_hf_checkpoint, method, embeddings):
    """Both 8-bit features in one engine (layers scanned over stacked 8-bit weights):
    greedy decode runs on int8 weights (fp8 weights with an 8-bit embedding and head)
    over an fp8 KV pool, and its prompt logprobs match the dense forward of the same
    8-bit model within fp8 KV error."""
    from paged_jax.llm import LLM
    from paged_jax.sampling_params import SamplingParams

    path = tiny_hf_checkpoint("llama")
    llm = LLM(
        path,
        quantization=method,
        quantize_embeddings=embeddings,
        kv_cache_dtype="fp8",
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=32,
        attention_backend="reference",
        scan_layers="on",  # the 8-bit weights stacked by layer and scanned
    )
    assert llm.config.quantization == method
    assert isinstance(llm.model.embed_tokens, QuantizedEmbed) == embeddings
    prompt = IDS[0].tolist()
    out = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=0), use_tqdm=False
    )[0]
    assert len(out.outputs[0].token_ids) == 4
    dense = load_model(path, quantization=method, quantize_embeddings=embeddings)
    dense = np.asarray(dense(IDS[:1]))[0]
    shifted = dense - dense.max(-1, keepdims=True)
    logprobs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    got = [lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], prompt[1:])]
    want = [logprobs[i, t] for i, t in enumerate(prompt[1:])]
    # e4m3 KV values carry a 3-bit mantissa: docs/fp8_kv_cache.md measures up to ~0.1
    # max |dlogit| on these tiny families; a broken weight or cache path is off by > 1.
    np.testing.assert_allclose(got, want, atol=0.2)
    with pytest.raises(ValueError, match=r"update_weights: the engine serves 8-bit weights"):
        llm.update_weights({})


def test_executable_cache_key_tells_quantizations_apart(tiny_hf_checkpoint):
    """A program compiled for int8 weights is never loaded for fp8 or float ones: the
    engine field, the graph (QuantizedLinear vs Linear) and the weights' dtypes differ."""
    from paged_jax.config import EngineConfig
    from paged_jax.worker.executable_cache import arg_signature, model_identity, program_context

    path = tiny_hf_checkpoint("llama")
    models = {m: load_model(path, quantization=m) for m in (None, "int8", "fp8")}
    contexts = {
        m: program_context(model_identity(model), EngineConfig(quantization=m, max_model_len=32), 8)
        for m, model in models.items()
    }
    assert len({json.dumps(c["engine"], sort_keys=True) for c in contexts.values()}) == 3
    assert len({c["model"]["graphdef"] for c in contexts.values()}) == 3
    signatures = {m: str(arg_signature((nnx.state(model),))[1]) for m, model in models.items()}
    assert len(set(signatures.values())) == 3


@pytest.fixture(scope="module")
def block_fp8_moe_checkpoint(tiny_hf_checkpoint, tmp_path_factory):
    """A tiny Qwen3-MoE quantized block-wise (16 x 16 tiles) as transformers' fine-grained
    fp8: (its path, the float checkpoint's, the dequantized weights)."""
    pytest.importorskip("torch", reason="the checkpoint is written from torch tensors")
    src = tiny_hf_checkpoint("qwen3_moe")
    dst = tmp_path_factory.mktemp("qwen3_moe_fp8_block")
    return dst, src, _write_block_fp8(src, dst, 16)


def test_block_fp8_moe_checkpoint_equals_dequantized_transformers(block_fp8_moe_checkpoint):
    """Qwen3-MoE in block-wise fp8 (16 x 16 tiles): experts kept 8-bit with their block
    scales; transformers' fused experts (gate_up_proj f[E, 2F, D]: gate rows, then up)
    get the dequantized per-expert weights."""
    torch = pytest.importorskip("torch", reason="transformers' model is the reference")

    dst, src, dequantized = block_fp8_moe_checkpoint
    model = load_model(dst)
    experts = model.layers[0].mlp.experts
    assert isinstance(experts, QuantizedExperts) and experts.block_size == 16
    assert str(experts.up_proj[...].dtype) == "float8_e4m3fn"

    def replace(name, weight):
        if not name.endswith(("gate_up_proj", "down_proj")) or ".experts." not in name + ".":
            return dequantized[name]
        base = name.rsplit(".", 1)[0]
        num_experts = weight.shape[0]
        if name.endswith("down_proj"):
            return torch.stack([dequantized[f"{base}.{e}.down_proj"] for e in range(num_experts)])
        return torch.stack(
            [
                torch.cat(
                    [dequantized[f"{base}.{e}.gate_proj"], dequantized[f"{base}.{e}.up_proj"]]
                )
                for e in range(num_experts)
            ]
        )

    want = _hf_logits_with(src, replace)
    np.testing.assert_allclose(np.asarray(model(IDS)), want, atol=1e-4, rtol=0)


def test_scanned_block_fp8_experts_index_the_layer_stack(block_fp8_moe_checkpoint):
    """With the layers scanned, block-wise fp8 experts enter the scan whole ([L, E, ...])
    and each row tile slices its expert out of that stack: the scan never slices out one
    layer's expert stack, which XLA copied whole to feed the loop over tiles (576 MiB a
    layer at Qwen3-30B-A3B's shape; docs/quantization.md). Greedy decode and prompt
    logprobs equal the unrolled engine's."""
    import re

    from paged_jax.llm import LLM
    from paged_jax.models.layer_scan import _stack_indexing_paths
    from paged_jax.sampling_params import SamplingParams
    from paged_jax.worker.input_batch import InputBatch

    path = block_fp8_moe_checkpoint[0]
    kw = dict(
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=32,
        attention_backend="reference",
    )
    llms = {scan: LLM(path, scan_layers=scan, **kw) for scan in ("on", "off")}
    runner = llms["on"].engine.runner
    stacked = runner.layer_scan
    assert stacked is not None and runner.config.quantization is None  # the checkpoint's fp8
    paths = [_stack_indexing_paths(g, s) for g, s in zip(stacked.graphdefs, stacked.stacked)]
    assert paths == [(("mlp", "experts"),)]
    # The lowered step slices only single experts ([1, 1, in, out]) out of the 8-bit expert
    # stacks, never a layer's [1, E, in, out] (the tiny model: E = 8, in/out 64 and 32).
    step = InputBatch(runner.config).dummy_step_input(8, 4, decode_only=True)
    text = runner.jitted_step.lower(*runner.step_args(step)).as_text()
    f8 = r"tensor<(\d+)x(\d+)x(?:64x32|32x64)xf8E4M3FN>"
    slices = re.findall(r"stablehlo\.dynamic_slice.*-> " + f8, text)
    assert slices and set(slices) == {("1", "1")}, set(slices)

    prompt = IDS[0].tolist()
    params = SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=0)
    outs = {s: llm.generate([prompt], params, use_tqdm=False)[0] for s, llm in llms.items()}
    assert outs["on"].outputs[0].token_ids == outs["off"].outputs[0].token_ids
    got, want = (
        [lp[t].logprob for lp, t in zip(outs[s].prompt_logprobs[1:], prompt[1:])]
        for s in ("on", "off")
    )
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


_LAYER_OF_STACK_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from paged_jax.models.moe import expert_forward, expert_parallel_forward
from paged_jax.models.quantization import QuantizedExpertWeight
from paged_jax.worker.sharding import make_mesh
mesh = make_mesh(2)
L, E, D, F, b, T, k = 2, 8, 64, 32, 16, 6, 2
rng = np.random.default_rng(0)
def stacks(rows, cols):
    q = jnp.asarray(rng.integers(-127, 128, (L, E, rows, cols)), jnp.int8)
    return q, jnp.asarray(rng.random((L, E, rows // b, cols // b)) * 0.01, jnp.float32)
ws = [stacks(D, F), stacks(D, F), stacks(F, D)]
x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
weights = jnp.asarray(rng.random((T, k)), jnp.float32)
experts = jnp.asarray(rng.integers(0, E, (T, k)), jnp.int32)
static = dict(hidden_act="silu", precision="highest", matmul="tiled")
put = lambda a: jax.device_put(a, NamedSharding(mesh, P(None, "tp")))
for layer in range(L):
    sliced = [QuantizedExpertWeight(q[layer], s[layer], b) for q, s in ws]
    want = np.asarray(expert_forward(x, weights, experts, *sliced, **static))
    layered = [QuantizedExpertWeight(put(q), put(s), b, jnp.int32(layer)) for q, s in ws]
    one = jax.jit(lambda *w: expert_forward(x, weights, experts, *w, **static))(*layered)
    split = jax.jit(lambda *w: expert_parallel_forward(mesh, x, weights, experts, *w, **static))
    np.testing.assert_array_equal(np.asarray(one), want)
    np.testing.assert_array_equal(np.asarray(split(*layered)), want)
print("ok")
"""


def test_layer_of_block_scaled_expert_stack_equals_its_slice():
    """A block-wise QuantizedExpertWeight bound to a layer of whole stacks (what a layer
    scan passes, ExpertStackLayer) gives exactly what that layer's slice gives, on one
    device and with its experts split over two (int8 codes, 16 x 16 block scales)."""
    env = env_with_cpu_devices(2, cpu_only=True)
    done = subprocess.run(
        [sys.executable, "-c", _LAYER_OF_STACK_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_block_scales_must_split_on_block_edges(block_fp8_checkpoint):
    """Tensor parallelism over a block-wise checkpoint: each device must own whole scale
    blocks (checked before any tensor is read or placed)."""
    from paged_jax.models.fp8_checkpoint import block_fp8_weight_rules, check_block_sharding
    from paged_jax.models.loader import abstract_model, family_config
    from paged_jax.models.quantized_model import quantized_linear_paths, quantized_partition_rules

    path, _, _ = block_fp8_checkpoint
    cls, config = family_config(path)
    paths = quantized_linear_paths(nnx.merge(*abstract_model(cls, config, "reference")))
    rules = block_fp8_weight_rules(cls.weight_rules(config), paths, 32)
    partition = quantized_partition_rules(cls.partition_rules, block_scales=True)
    # 2 devices x 8-wide blocks: k/v's 32 columns, q's 64, the MLP's 80 all split on edges.
    check_block_sharding(rules, partition, 8, 2)
    with pytest.raises(ValueError, match=r"k_proj.weight \[32, 64\] splits a dim of 32 .* 2 x"):
        check_block_sharding(rules, partition, 32, 2)


@pytest.mark.parametrize("family, method", [("llama", "int8"), ("gemma2", "fp8")])
def test_quantized_embeddings_equal_dequantized_transformers(tiny_hf_checkpoint, family, method):
    """quantize_embeddings: the embedding table (and an untied head) 8-bit too, one scale
    per vocab row. Llama's head is untied (its own QuantizedLinear); Gemma 2 ties it, so
    its one 8-bit table serves the scaled lookup and the soft-capped head."""
    from paged_jax.models.quantized_model import quantize_model

    path = tiny_hf_checkpoint(family)
    model = load_model(path, quantization=method, quantize_embeddings=True)
    vocab = model.config.vocab_size
    table = model.embed_tokens
    assert isinstance(table, QuantizedEmbed) and table.scale[...].shape == (vocab,)
    assert str(table.qembedding[...].dtype) == ("int8" if method == "int8" else "float8_e4m3fn")
    if family == "llama":
        assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.scale[...].shape == (
            vocab,
        )
    else:
        assert model.lm_head is None  # tied: the one table
    want = _hf_logits_with(path, lambda _name, w: _rule_dequantized(w, method), embeddings=True)
    got = np.asarray(model(IDS))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    # The embedding's quantization shows: the layers-only model is off the reference.
    assert np.abs(np.asarray(load_model(path, quantization=method)(IDS)) - want).max() > 1e-3
    # An in-memory model (LLM(model=..., quantization=..., quantize_embeddings=True)).
    copy = quantize_model(load_model(path), method, embeddings=True)
    np.testing.assert_allclose(np.asarray(copy(IDS)), got, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"quantize_embeddings=True needs quantization"):
        load_model(path, quantize_embeddings=True)
    from paged_jax.config import EngineConfig

    with pytest.raises(ValueError, match=r"quantize_embeddings=True must be False without quant"):
        EngineConfig(quantize_embeddings=True)


@pytest.mark.parametrize("matmul", ["tiled", "ragged_dot"])
def test_block_scaled_experts_hold_one_dequantized_matrix(matmul):
    """Block scales vary along the contraction, so block-wise experts are dequantized one
    row tile's expert at a time (whichever grouped matmul is asked). The compiled expert
    MLP (CPU, f32) of 32 experts of 1024 x 1024 with 128 x 128 block scales: with int8
    codes its temporaries stay under 10% of the 8-bit weights (one dequantized f32 matrix
    is 4 MiB; every expert's, the former ragged_dot path, 128 MiB). With fp8 codes XLA's
    CPU backend, which computes fp8 in f16, converts each whole fp8 stack to f16 before
    the loop: the temporaries are that copy plus the same loop's."""
    import functools

    import jax
    import jax.numpy as jnp

    from paged_jax.models.moe import expert_forward
    from paged_jax.models.quantization import QuantizedExpertWeight

    e, d, f, b, t, k = 32, 1024, 1024, 128, 8, 2
    temps = {}
    for dtype in (jnp.int8, jnp.float8_e4m3fn):

        def weight(rows, cols, dtype=dtype):
            return QuantizedExpertWeight(
                jax.ShapeDtypeStruct((e, rows, cols), dtype),
                jax.ShapeDtypeStruct((e, rows // b, cols // b), jnp.float32),
                b,
            )

        weights = (weight(d, f), weight(d, f), weight(f, d))
        args = (
            jax.ShapeDtypeStruct((t, d), jnp.float32),
            jax.ShapeDtypeStruct((t, k), jnp.float32),
            jax.ShapeDtypeStruct((t, k), jnp.int32),
            *weights,
        )
        forward = functools.partial(
            expert_forward, hidden_act="silu", precision=None, matmul=matmul
        )
        stats = jax.jit(forward).lower(*args).compile().memory_analysis()
        temps[jnp.dtype(dtype).name] = stats.temp_size_in_bytes
    weight_bytes = 3 * e * d * f + 3 * e * (d // b) * (f // b) * 4
    assert temps["int8"] < 0.1 * weight_bytes, (temps, weight_bytes)
    f16_stacks = 3 * e * d * f * 2
    assert temps["float8_e4m3fn"] - f16_stacks < 0.1 * weight_bytes, (temps, weight_bytes)
