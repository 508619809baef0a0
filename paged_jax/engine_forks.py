"""Engine.fork_request: a running child request on its parent's KV blocks.

The child joins the batch at the next step with its parent's computed tokens; the
first write into a block the two still share is copied on write inside that step.
Used by parallel sampling (``paged_jax.parallel_sampling``) and beam search
(``paged_jax.beam_search``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from paged_jax.core.request import Request
from paged_jax.sampling_params import SamplingParams

if TYPE_CHECKING:
    from paged_jax.engine import Engine


def fork_request(
    engine: Engine,
    parent_id: str,
    child_id: str,
    *,
    prompt_token_ids: Sequence[int] | None = None,
    output_token_ids: Sequence[int] | None = None,
    sampling_params: SamplingParams | None = None,
) -> None:
    """Starts ``child_id`` as a running request sharing ``parent_id``'s blocks.

    The child's tokens are the parent's prompt and outputs unless given; the tokens
    the parent has computed and the child shares (at most the parent's computed
    ones, and only a common prefix) are not recomputed. A different prompt (for
    example the full prompt when the parent prefilled all but its last token) makes
    the child a new request whose outputs start empty.

    Args:
        engine: the engine.
        parent_id: a running request.
        child_id: a new, unique request id.
        prompt_token_ids: the child's prompt; default the parent's.
        output_token_ids: the child's outputs so far; default the parent's (or none
            with a new prompt).
        sampling_params: the child's; default the parent's.

    Raises:
        ValueError: an unknown or not-running parent, a taken child id, token ids
            outside the vocabulary, a full batch (max_num_seqs), or a child that
            shares no computed token with the parent.
    """
    sched = engine.scheduler
    parent = sched.requests.get(parent_id)
    if parent is None:
        raise ValueError(f"parent_id={parent_id!r} must name a live request")
    if child_id in engine._states:
        raise ValueError(f"child_id={child_id!r} must be unique among live requests")
    params = sampling_params if sampling_params is not None else parent.sampling_params
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params={params!r} must be a SamplingParams")
    if prompt_token_ids is None:
        child = parent.fork(child_id, output_token_ids, sampling_params=params)
    else:
        child = Request(
            child_id,
            prompt_token_ids,
            params,
            cache_salt=parent.cache_salt,
            priority=parent.priority,
            arrival_time=parent.arrival_time,
        )
        if output_token_ids:
            child.append_output_token_ids(list(output_token_ids))
    bad = [t for t in child.all_token_ids if t >= engine.vocab_size]
    if bad:
        raise ValueError(
            f"token id {bad[0]!r} of child {child_id!r} must be < vocab_size={engine.vocab_size}"
        )
    if child.num_tokens > engine.config.max_model_len:
        raise ValueError(
            f"child {child_id!r} has {child.num_tokens} tokens; must be <= max_model_len="
            f"{engine.config.max_model_len}"
        )
    common = 0
    limit = min(parent.num_computed_tokens, child.num_tokens - 1)
    mine, theirs = parent.all_token_ids, child.all_token_ids
    if prompt_token_ids is None:
        common = parent.num_prompt_tokens  # same prompt: compare the outputs only
    while common < limit and mine[common] == theirs[common]:
        common += 1
    common = min(common, limit)
    if common <= 0:
        raise ValueError(
            f"child {child_id!r} must share at least one computed token with {parent_id!r}"
        )
    engine._register(child_id, params)
    try:
        sched.fork_request(parent_id, child, num_tokens=common)
    except ValueError:
        engine._unregister(child_id)
        raise
