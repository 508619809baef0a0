"""A linear probe on the residual stream: capture hidden states from a batch of prompts, fit.

One tiny random Llama (no checkpoint) is served with EngineConfig(hidden_state_layers=
(0, 1, -1)); every prompt asks for its rows (SamplingParams(return_hidden_states=True)).
The task: does a prompt draw its tokens from the low half of the vocabulary or the high
half? Each prompt's rows are mean-pooled per layer and standardised, a ridge classifier is
fitted in closed form on half the prompts and scored on the other half.

It prints each layer's held-out accuracy and checks its own result (exit 1 otherwise):
every layer's accuracy >= 0.9, every prompt got one row per token at every layer, and the
engine compiled nothing after its warm-up.

    python examples/linear_probe.py [--prompts 128]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from paged_jax import LLM, SamplingParams
from paged_jax.models.random_init import random_model

PROBE_MODEL = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
)
LAYERS = (0, 1, -1)


def make_prompts(num: int, seed: int) -> tuple[list[list[int]], np.ndarray]:
    """Prompts of 6-20 tokens from [3, 32) (label -1) or [32, 64) (label +1)."""
    rng = np.random.default_rng(seed)
    labels = rng.choice([-1.0, 1.0], num)
    prompts = [
        [int(t) for t in rng.integers(3, 32, rng.integers(6, 21)) + (29 if y > 0 else 0)]
        for y in labels
    ]
    return prompts, labels


def fit_ridge(x: np.ndarray, y: np.ndarray, lam: float = 1.0) -> np.ndarray:
    """w minimising |[x 1] w - y|^2 + lam |w|^2 (closed form)."""
    x1 = np.concatenate([x, np.ones((len(x), 1))], axis=1)
    return np.linalg.solve(x1.T @ x1 + lam * np.eye(x1.shape[1]), x1.T @ y)


def accuracy(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    x1 = np.concatenate([x, np.ones((len(x), 1))], axis=1)
    return float(np.mean(np.sign(x1 @ w) == y))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=128)
    args = parser.parse_args()

    model = random_model(PROBE_MODEL, dtype="float32", seed=0)
    llm = LLM(
        model,
        hidden_state_layers=LAYERS,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        max_model_len=32,
    )
    prompts, labels = make_prompts(args.prompts, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=1, return_hidden_states=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    ok = True
    features = {layer: [] for layer in LAYERS}
    for prompt, out in zip(prompts, outs):
        for layer in LAYERS:
            rows = out.prompt_hidden_states[layer]  # f32[len(prompt), hidden]
            if rows.shape != (len(prompt), PROBE_MODEL["hidden_size"]):
                print(f"FAIL: layer {layer} rows {rows.shape} for a {len(prompt)}-token prompt")
                ok = False
            features[layer].append(rows.mean(axis=0))
    half = len(prompts) // 2
    for layer in LAYERS:
        x = np.stack(features[layer])
        # Standardised with the training half's statistics (random weights are small).
        x = (x - x[:half].mean(axis=0)) / (x[:half].std(axis=0) + 1e-6)
        w = fit_ridge(x[:half], labels[:half])
        acc = accuracy(w, x[half:], labels[half:])
        print(f"layer {layer:>2}: held-out probe accuracy {acc:.3f}")
        if acc < 0.9:
            print(f"FAIL: layer {layer}'s probe accuracy {acc:.3f} < 0.9")
            ok = False
    compiles = llm.get_stats()["num_compiles_after_warmup"]
    print(f"engine compiles after warm-up: {compiles}")
    ok &= compiles == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
