"""8-bit weights (W8A16): bytes, CPU decode step time, compiled temporaries, accuracy.

    python scripts/bench_quantization.py --output docs/quantization.json

Four parts, each side by side in one run:

* weight_bytes: device bytes of the params (scales included) of Llama-3-8B and 70B
  shapes, bf16 vs int8 / fp8, from the modules' own abstract params (nothing allocated),
  for the decoder layers (the quantized part) and the whole model (embeddings and LM
  head bf16, or 8-bit too with quantize_embeddings: the "*_embeddings" rows); plus the
  demo model's loaded arrays.
* cpu_decode: the demo model served by LLM (CPU, f32 activations): one greedy decode
  step's wall time (a batch of requests decoding together; total time / steps),
  quantized vs unquantized, median of rounds.
* compiled_temporaries: the engine's step for a 32-layer Llama-3-8B-shaped model with
  int8 weights (scanned layers, decode at batch 64), compiled for CPU from abstract
  weights: memory_analysis temporaries vs the 8-bit weight bytes.
* block_moe_temporaries: one Qwen3-30B-A3B-shaped expert MLP (128 experts of 2048 x 768,
  top 8) with block-wise scales (128 x 128 tiles), decode at batch 64, compiled for CPU
  (f32): temporaries vs the 8-bit expert weights and one dequantized matrix, with int8
  and fp8 codes (XLA's CPU backend computes fp8 in f16: it converts whole fp8 stacks).
* accuracy: the demo model, quantized vs f32 weights on the demo prompts: greedy
  agreement (identical continuations, first divergence) and, teacher-forced along the
  unquantized greedy path, max |logit diff| and top-1 agreement.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from paged_jax.models import LlamaForCausalLM, load_model
from paged_jax.models.quantized_model import replace_linears
from paged_jax.models.random_init import LLAMA3_8B_CONFIG

METHODS = ("int8", "fp8")
LLAMA3_70B = dict(
    LLAMA3_8B_CONFIG,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
)


def _bytes(tree: Any) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def abstract_llama(hf: dict, quantization: str | None, embeddings: bool = False):
    config = LlamaForCausalLM.config_from_hf(hf, {}, "bfloat16")
    model = nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
    if quantization:
        replace_linears(model, quantization, embeddings=embeddings)
    return model


def weight_bytes() -> dict:
    out = {}
    for name, hf in (("llama3_8b", LLAMA3_8B_CONFIG), ("llama3_70b", LLAMA3_70B)):
        row = {}
        for method, embeddings in ((None, False), *((m, e) for m in METHODS for e in (0, 1))):
            model = abstract_llama(hf, method, bool(embeddings))
            key = (method or "bfloat16") + ("_embeddings" if embeddings else "")
            row[key] = dict(layers=_bytes(nnx.state(model.layers)), total=_bytes(nnx.state(model)))
        for method in METHODS:
            row[f"{method}_ratio_layers"] = row[method]["layers"] / row["bfloat16"]["layers"]
            row[f"{method}_ratio_total"] = row[method]["total"] / row["bfloat16"]["total"]
            row[f"{method}_embeddings_ratio_total"] = (
                row[f"{method}_embeddings"]["total"] / row["bfloat16"]["total"]
            )
        out[name] = row
    return out


def demo_loaded_bytes(path: pathlib.Path) -> dict:
    row = {}
    for method in (None, *METHODS):
        model = load_model(path, "bfloat16", quantization=method)
        row[method or "bfloat16"] = dict(
            layers=_bytes(nnx.state(model.layers)), total=_bytes(nnx.state(model))
        )
    for method in METHODS:
        row[f"{method}_ratio_layers"] = row[method]["layers"] / row["bfloat16"]["layers"]
    return row


def cpu_decode(path: pathlib.Path, batch: int, steps: int, rounds: int) -> dict:
    from paged_jax.llm import LLM
    from paged_jax.sampling_params import SamplingParams

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, 16).tolist() for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    engines = {
        method or "float32": LLM(
            str(path),
            quantization=method,
            max_num_seqs=batch,
            max_num_batched_tokens=max(64, batch * 16),
            max_model_len=16 + steps + 8,
        )
        for method in (None, *METHODS)
    }
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):  # interleaved, so load drifts hit every engine alike
        for name, llm in engines.items():
            llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times[name].append((time.perf_counter() - t0) / steps)
    out = {name: dict(step_s_median=statistics.median(t), step_s=t) for name, t in times.items()}
    for method in METHODS:
        out[f"{method}_ratio"] = out[method]["step_s_median"] / out["float32"]["step_s_median"]
    out.update(batch=batch, steps=steps, rounds=rounds, dtype="float32")
    return out


def compiled_temporaries(num_layers: int, batch: int) -> dict:
    """The engine's decode step of a Llama-3-8B-shaped model, compiled for CPU from
    abstract weights: per dtype, unquantized at full depth, int8 at 2 and at full depth
    (temporaries that do not grow with depth hold no per-layer dequantized copies)."""
    from paged_jax.config import EngineConfig
    from paged_jax.worker.input_batch import InputBatch
    from paged_jax.worker.runner import Runner

    out: dict[str, Any] = {}
    for dtype in ("float32", "bfloat16"):
        for method, layers in ((None, num_layers), ("int8", 2), ("int8", num_layers)):
            hf = dict(LLAMA3_8B_CONFIG, num_hidden_layers=layers)
            config = LlamaForCausalLM.config_from_hf(hf, {}, dtype)
            model = nnx.eval_shape(lambda c=config: LlamaForCausalLM(c, rngs=nnx.Rngs(0)))
            if method:
                replace_linears(model, method)
            engine = EngineConfig(
                block_size=16,
                num_kv_blocks=64,
                max_num_seqs=batch,
                max_num_batched_tokens=batch,
                max_model_len=1024,
                attention_backend="reference",
                dtype=dtype,
                scan_layers="on",
                quantization=method,
            )
            runner = Runner(model, engine)
            step = InputBatch(engine).dummy_step_input(batch, batch, decode_only=True)
            args = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), runner.step_args(step)
            )
            t0 = time.perf_counter()
            stats = runner.jitted_step.lower(*args).compile().memory_analysis()
            weights = _bytes(args[0])
            temp = int(stats.temp_size_in_bytes)
            out[f"{dtype}/{method or 'unquantized'}/{layers}l"] = dict(
                weight_bytes=weights,
                temp_bytes=temp,
                temp_over_weights=temp / weights,
                compile_s=round(time.perf_counter() - t0, 1),
            )
            print(f"{dtype} {method} {layers} layers: temp {temp / 2**20:.0f} MiB", flush=True)
        itemsize = np.dtype(dtype).itemsize
        out[f"{dtype}/one_dequantized_mlp_matrix_bytes"] = 4096 * 14336 * itemsize
        out[f"{dtype}/lm_head_bytes"] = 4096 * 128256 * itemsize
    out.update(batch=batch, backend=jax.default_backend())
    return out


def block_moe_temporaries(batch: int) -> dict:
    """One Qwen3-30B-A3B-shaped expert MLP with 128 x 128 block scales, compiled for CPU."""
    import functools

    import jax.numpy as jnp

    from paged_jax.models.moe import expert_forward
    from paged_jax.models.quantization import QuantizedExpertWeight

    e, d, f, b, k = 128, 2048, 768, 128, 8
    out: dict[str, Any] = {}
    for codes in ("int8", "float8_e4m3fn"):

        def weight(rows, cols, codes=codes):
            return QuantizedExpertWeight(
                jax.ShapeDtypeStruct((e, rows, cols), jnp.dtype(codes)),
                jax.ShapeDtypeStruct((e, rows // b, cols // b), jnp.float32),
                b,
            )

        weights = (weight(d, f), weight(d, f), weight(f, d))
        args = (
            jax.ShapeDtypeStruct((batch, d), jnp.float32),
            jax.ShapeDtypeStruct((batch, k), jnp.float32),
            jax.ShapeDtypeStruct((batch, k), jnp.int32),
            *weights,
        )
        for matmul in ("tiled", "ragged_dot"):
            forward = functools.partial(
                expert_forward, hidden_act="silu", precision=None, matmul=matmul
            )
            stats = jax.jit(forward).lower(*args).compile().memory_analysis()
            temp, weight_bytes = int(stats.temp_size_in_bytes), _bytes(weights)
            out[f"{codes}/{matmul}"] = dict(
                weight_bytes=weight_bytes, temp_bytes=temp, temp_over_weights=temp / weight_bytes
            )
            print(f"block moe {codes} {matmul}: temp {temp / 2**20:.1f} MiB", flush=True)
    out.update(
        one_dequantized_matrix_bytes=d * f * 4,
        every_expert_dequantized_bytes=e * d * f * 4,
        fp8_stacks_as_f16_bytes=3 * e * d * f * 2,
        experts=e,
        hidden=d,
        intermediate=f,
        top_k=k,
        block=b,
        batch=batch,
        dtype="float32",
        backend=jax.default_backend(),
    )
    return out


def accuracy(path: pathlib.Path, num_prompts: int, max_new: int) -> dict:
    from paged_jax.entrypoints.demo import build_byte_tokenizer
    from paged_jax.entrypoints.demo_prompts import builtin_prompts
    from paged_jax.llm import LLM
    from paged_jax.sampling_params import SamplingParams

    tokenizer = build_byte_tokenizer()
    prompts = [tokenizer.encode(p).ids[:32] for p in builtin_prompts(num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    engine = dict(max_num_seqs=num_prompts, max_num_batched_tokens=512, max_model_len=128)
    base_llm = LLM(str(path), **engine)
    base = [o.outputs[0].token_ids for o in base_llm.generate(prompts, params, use_tqdm=False)]
    del base_llm
    dense = load_model(path)
    out = {}
    for method in METHODS:
        llm = LLM(str(path), quantization=method, **engine)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
        quantized = load_model(path, quantization=method)
        max_diff, top1, positions = 0.0, 0, 0
        for prompt, cont in zip(prompts, base):
            ids = np.array([prompt + cont[:-1]], np.int32)
            a, b = np.asarray(dense(ids))[0], np.asarray(quantized(ids))[0]
            tail = slice(len(prompt) - 1, None)  # the generated positions
            max_diff = max(max_diff, float(np.abs(a[tail] - b[tail]).max()))
            top1 += int((a[tail].argmax(-1) == b[tail].argmax(-1)).sum())
            positions += a[tail].shape[0]
        firsts = [
            next((i for i, (x, y) in enumerate(zip(g, r)) if x != y), len(r))
            for g, r in zip(got, base)
        ]
        out[method] = dict(
            identical_continuations=sum(g == r for g, r in zip(got, base)) / len(base),
            mean_first_divergence=statistics.mean(firsts),
            max_abs_logit_diff=max_diff,
            top1_agreement=top1 / positions,
        )
    out.update(num_prompts=num_prompts, max_new_tokens=max_new, dtype="float32")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", type=pathlib.Path, default=pathlib.Path("quantization.json"))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--compile-layers", type=int, default=32)
    p.add_argument(
        "--parts",
        default="weight_bytes,compiled_temporaries,block_moe_temporaries,cpu_decode,accuracy",
        help="comma-separated subset of the parts",
    )
    args = p.parse_args(argv)
    from paged_jax.entrypoints.demo import ensure_demo_model

    demo = ensure_demo_model()
    parts = args.parts.split(",")
    report: dict[str, Any] = dict(
        command="python scripts/bench_quantization.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        jax=jax.__version__,
        machine=platform.machine(),
        backend=jax.default_backend(),
    )
    if "weight_bytes" in parts:
        report["weight_bytes"] = weight_bytes()
        report["weight_bytes"]["demo_loaded"] = demo_loaded_bytes(demo)
        print(json.dumps(report["weight_bytes"], indent=1), flush=True)
    if "compiled_temporaries" in parts:
        report["compiled_temporaries"] = compiled_temporaries(args.compile_layers, 64)
        print(json.dumps(report["compiled_temporaries"], indent=1), flush=True)
    if "block_moe_temporaries" in parts:
        report["block_moe_temporaries"] = block_moe_temporaries(64)
        print(json.dumps(report["block_moe_temporaries"], indent=1), flush=True)
    if "cpu_decode" in parts:
        report["cpu_decode"] = cpu_decode(demo, args.batch, args.steps, args.rounds)
        print(json.dumps(report["cpu_decode"], indent=1), flush=True)
    if "accuracy" in parts:
        report["accuracy"] = accuracy(demo, args.num_prompts, args.max_new_tokens)
        print(json.dumps(report["accuracy"], indent=1), flush=True)
    args.output.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
