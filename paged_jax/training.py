"""The serving model's dense forward as a function of its weights, for training loops.

``LLM.get_weights()`` returns the served parameters as the model's ``nnx.State``; the
dense forward ``nnx.merge(graphdef, weights)(input_ids)`` (models/decoder.py
``CausalLM.__call__``) is differentiable over exactly those parameters, so a trainer
takes ``jax.grad`` of a loss built on these helpers and hands the updated State to
``LLM.update_weights`` (docs/research_integration.md, "Training loops")::

    graphdef = model_graphdef(llm)
    weights = llm.get_weights()
    grads = jax.grad(lambda w: -sequence_logprobs(graphdef, w, ids, mask).sum())(weights)
    llm.update_weights(optax.apply_updates(weights, updates))

The log-probabilities here are the engine's "raw_logprobs" (SamplingParams.logprobs_mode)
at temperature 1; ``temperature`` divides the logits first, as "processed_logprobs" does
for a request without top-k / top-p / min-p / penalties.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["dense_logits", "model_graphdef", "sequence_logprobs", "token_logprobs"]


def model_graphdef(model: Any) -> Any:
    """The nnx GraphDef of an LLM's model (``llm.model``), of an nnx.Module, or a GraphDef
    as it is; with get_weights()'s State it rebuilds the model: ``nnx.merge(graphdef, w)``.

    Raises:
        TypeError: anything else (naming its type).
    """
    if isinstance(model, nnx.GraphDef):
        return model
    inner = getattr(model, "model", None)  # an LLM: its public model attribute
    if isinstance(inner, nnx.Module) and not isinstance(model, nnx.Module):
        model = inner
    if isinstance(model, nnx.Module):
        return nnx.graphdef(model)
    raise TypeError(
        f"model={type(model).__name__} must be an LLM, an nnx.Module or an nnx.GraphDef"
    )


def dense_logits(model: Any, weights: Any, input_ids: jax.Array) -> jax.Array:
    """f32[B, L, V] the dense causal forward of ``input_ids`` i32[B, L] under ``weights``.

    Args:
        model: an LLM, its model or their GraphDef (see model_graphdef).
        weights: the State get_weights() returns (or one of its structure: an optax
            update of it, a traced value inside jax.grad).
        input_ids: i32[B, L]; every row starts at position 0 (no padding on the left).
    """
    input_ids = jnp.asarray(input_ids)
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids has shape {input_ids.shape}; expected [batch, seq]")
    return nnx.merge(model_graphdef(model), weights)(input_ids)


def token_logprobs(
    model: Any, weights: Any, input_ids: jax.Array, temperature: float = 1.0
) -> jax.Array:
    """f32[B, L - 1] log-probability of each token ``input_ids[:, t + 1]`` given the ones
    before it: log_softmax(logits / temperature) read at the next token."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be > 0")
    logits = dense_logits(model, weights, input_ids)[:, :-1] / temperature
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logprobs, jnp.asarray(input_ids)[:, 1:, None], axis=-1)[..., 0]


def sequence_logprobs(
    model: Any,
    weights: Any,
    input_ids: jax.Array,
    mask: jax.Array,
    temperature: float = 1.0,
) -> jax.Array:
    """f32[B] the summed log-probability of the tokens ``mask`` selects.

    Args:
        input_ids: i32[B, L] prompt then completion (right-padded with any id).
        mask: [B, L] 1 where a token counts (the completion's), 0 elsewhere; position 0
            cannot count (nothing predicts it).
    """
    mask = jnp.asarray(mask)
    if mask.shape != jnp.shape(input_ids):
        raise ValueError(f"mask has shape {mask.shape}; expected input_ids' {jnp.shape(input_ids)}")
    per_token = token_logprobs(model, weights, input_ids, temperature)
    return jnp.sum(per_token * mask[:, 1:].astype(per_token.dtype), axis=-1)
