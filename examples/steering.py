"""Activation steering: a contrastive vector from captured states, added to a tiny model.

One tiny random Llama with tied embeddings (no checkpoint) is served with
EngineConfig(hidden_state_layers=(0,), steering_layers=(0,)). The steering vector is the
difference of the mean layer-0 states of prompts drawn from the high half of the
vocabulary and of prompts from the low half (contrastive activation addition); added
after layer 0 with SamplingParams(steering_vectors={0: alpha * v}), it should pull
generation toward high-half tokens.

It prints the fraction of high-half tokens generated, unsteered and steered, and checks its
own result (exit 1 otherwise): steering raises the fraction by at least 0.3, a zero vector
changes no token, and the engine compiled nothing after its warm-up.

    python examples/steering.py [--alpha 8]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from paged_jax import LLM, SamplingParams
from paged_jax.models.random_init import random_model

STEERED_MODEL = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)
HIGH = 32  # tokens >= HIGH are the "high half"


def prompts_from(lo: int, hi: int, num: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(lo, hi, 12)] for _ in range(num)]


def high_fraction(outs) -> float:
    tokens = np.concatenate([o.outputs[0].token_ids for o in outs])
    return float(np.mean(tokens >= HIGH))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--alpha", type=float, default=8.0)
    args = parser.parse_args()

    model = random_model(STEERED_MODEL, dtype="float32", seed=0)
    llm = LLM(
        model,
        hidden_state_layers=(0,),
        steering_layers=(0,),
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        max_model_len=64,
    )
    capture = SamplingParams(temperature=0.0, max_tokens=1, return_hidden_states=True)

    def mean_state(prompts):
        outs = llm.generate(prompts, capture, use_tqdm=False)
        return np.mean([o.prompt_hidden_states[0].mean(axis=0) for o in outs], axis=0)

    v = mean_state(prompts_from(HIGH, 64, 16, 1)) - mean_state(prompts_from(3, HIGH, 16, 2))
    v = v / np.linalg.norm(v)
    test = prompts_from(3, 64, 16, 3)

    def run(vector):
        params = SamplingParams(
            temperature=0.0,
            max_tokens=8,
            ignore_eos=True,
            steering_vectors=None if vector is None else {0: vector},
        )
        return llm.generate(test, params, use_tqdm=False)

    plain, zero, steered = run(None), run(np.zeros_like(v)), run(args.alpha * v)
    before, after = high_fraction(plain), high_fraction(steered)
    print(f"high-half tokens generated: unsteered {before:.3f}, steered {after:.3f}")
    ok = True
    if after < before + 0.3:
        print(f"FAIL: steering moved the high-half fraction by {after - before:.3f} < 0.3")
        ok = False
    same = all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(plain, zero))
    print(f"zero vector == unsteered: {same}")
    ok &= same
    compiles = llm.get_stats()["num_compiles_after_warmup"]
    print(f"engine compiles after warm-up: {compiles}")
    ok &= compiles == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
