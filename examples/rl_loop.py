"""A GRPO-style RL loop: the engine samples, the same model's dense forward trains.

One tiny random Llama (paged_jax.models.random_init, no checkpoint) is served by `LLM`
and trained with optax on the weights `LLM.get_weights()` returns:

    each iteration:
        rollouts   LLM.generate: every prompt sampled n times (seeded, logprobs=0)
        reward     rule-based: the fraction of TARGET tokens in a completion
        advantage  group-normalised: (reward - mean) / (std + eps) over a prompt's n samples
        loss       -mean(advantage * log-ratio-weighted sequence logprob), the ratio against
                   the engine's own logprobs (clipped, as PPO / GRPO do)
        update     jax.grad through paged_jax.training.sequence_logprobs, an optax step,
                   LLM.update_weights(new weights): no compile, the prefix cache reset

It prints the mean reward per iteration and checks its own result (exit 1 otherwise):
the engine's logprobs of the first rollouts equal the dense forward's within 1e-4, the
reward rises (last iterations' mean > first ones'), and the engine compiles nothing after
the first iteration (get_stats()["num_compiles"]).

    python examples/rl_loop.py [--iterations 12]
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

from paged_jax import LLM, SamplingParams
from paged_jax.models.random_init import random_model
from paged_jax.training import model_graphdef, sequence_logprobs

TINY_LLAMA = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    vocab_size=32,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
)
TARGET = 7  # the token the reward asks for
ROLLOUT_PROMPTS = [[1, 3, 4, 5], [1, 9, 10, 11], [1, 20, 21, 22], [1, 12, 13, 14]]
SAMPLES = 8  # n completions per prompt: one GRPO group
COMPLETION = 8  # tokens per completion (ignore_eos: every sequence has the same length)
CLIP = 0.2


def reward(token_ids) -> float:
    return float(np.mean(np.asarray(token_ids) == TARGET))


def rollouts(llm: LLM, iteration: int):
    """(ids i32[B, L], mask i32[B, L], engine logprobs f32[B, COMPLETION], rewards f32[B])."""
    params = [
        SamplingParams(
            n=SAMPLES,
            temperature=1.0,
            seed=1000 * iteration + i,
            max_tokens=COMPLETION,
            ignore_eos=True,
            logprobs=0,
        )
        for i in range(len(ROLLOUT_PROMPTS))
    ]
    outs = llm.generate(ROLLOUT_PROMPTS, params, use_tqdm=False)
    ids, mask, old, rewards = [], [], [], []
    for prompt, out in zip(ROLLOUT_PROMPTS, outs):
        for c in out.outputs:
            tokens = list(c.token_ids)
            ids.append(prompt + tokens)
            mask.append([0] * len(prompt) + [1] * len(tokens))
            old.append([c.logprobs[t][tok].logprob for t, tok in enumerate(tokens)])
            rewards.append(reward(tokens))
    return (
        np.asarray(ids, np.int32),
        np.asarray(mask, np.int32),
        np.asarray(old, np.float32),
        np.asarray(rewards, np.float32),
    )


def group_advantages(rewards: np.ndarray) -> np.ndarray:
    groups = rewards.reshape(len(ROLLOUT_PROMPTS), SAMPLES)
    adv = (groups - groups.mean(1, keepdims=True)) / (groups.std(1, keepdims=True) + 1e-4)
    return adv.reshape(-1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--lr", type=float, default=3e-2)
    args = parser.parse_args()

    model = random_model(TINY_LLAMA, dtype="float32", seed=0)
    llm = LLM(
        model,
        block_size=4,
        max_num_seqs=SAMPLES * len(ROLLOUT_PROMPTS),
        max_num_batched_tokens=64,
        max_model_len=32,
    )
    graphdef = model_graphdef(llm)
    tx = optax.adam(args.lr)
    weights = llm.get_weights()
    opt_state = tx.init(weights)

    def loss_fn(w, ids, mask, old, adv):
        # Per-token log-ratio against the engine's logprobs, clipped as PPO / GRPO do.
        new = sequence_logprobs(graphdef, w, ids, mask)
        ratio = jnp.exp(new - old.sum(-1))
        clipped = jnp.clip(ratio, 1 - CLIP, 1 + CLIP)
        return -jnp.mean(jnp.minimum(ratio * adv, clipped * adv))

    @jax.jit
    def train_step(w, opt_state, ids, mask, old, adv):
        loss, grads = jax.value_and_grad(loss_fn)(w, ids, mask, old, adv)
        updates, opt_state = tx.update(grads, opt_state, w)
        return optax.apply_updates(w, updates), opt_state, loss

    history, failures = [], []
    compiles_after_first = None
    for it in range(args.iterations):
        ids, mask, old, rewards = rollouts(llm, it)
        if it == 0:
            # Train/inference agreement: the engine's logprobs are the dense forward's.
            dense = sequence_logprobs(graphdef, weights, ids, mask)
            gap = float(np.abs(np.asarray(dense) - old.sum(-1)).max())
            print(f"engine vs dense sequence logprob: max |diff| {gap:.2e}")
            if not gap < 1e-4:
                failures.append(f"engine logprobs differ from the dense forward by {gap}")
        weights, opt_state, _ = train_step(
            weights, opt_state, ids, mask, old, group_advantages(rewards)
        )
        llm.update_weights(weights)
        history.append(float(rewards.mean()))
        # The GRPO loss is ~0 at the rollout's own weights (ratio 1, zero-mean
        # advantages per group); its gradient is not.
        print(f"iteration {it:2d}: reward {history[-1]:.3f}")
        if it == 0:
            compiles_after_first = llm.get_stats()["num_compiles"]

    new_compiles = llm.get_stats()["num_compiles"] - compiles_after_first
    k = max(1, len(history) // 4)
    first, last = float(np.mean(history[:k])), float(np.mean(history[-k:]))
    print(f"reward: first {k} iterations {first:.3f} -> last {k} {last:.3f}")
    print(f"engine compiles after the first iteration: {new_compiles}")
    if not last > first:
        failures.append(f"the reward did not rise ({first:.3f} -> {last:.3f})")
    if new_compiles:
        failures.append(f"{new_compiles} engine compiles after the first iteration")
    for f in failures:
        print("FAILED:", f, file=sys.stderr)
    if failures:
        return 1
    print("RL loop: reward rose, 0 compiles after the first iteration")
    return 0


if __name__ == "__main__":
    sys.exit(main())
