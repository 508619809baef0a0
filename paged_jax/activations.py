"""Activations on the host: hidden states out (collected per request) and steering rows in.

A request with SamplingParams.return_hidden_states has every token it runs through the
model captured at the engine's EngineConfig.hidden_state_layers. Rows are kept by
position, like prompt logprobs: a position computed again (after a preemption by
recompute, or a rolled-back step) is skipped, and positions arrive in order from the
first missing one.

    tokens     p0  p1  p2 | g0  g1  g2       (prompt of 3, 3 generated tokens)
    position    0   1   2 |  3   4   (5)     position 3 consumed g0, 4 consumed g1
    rows       prompt: 0..2 | generated: 3..4 (g2 is never fed back: N - 1 rows)

The request never reads the prefix cache (``Request.skip_reading_prefix_cache``), so
every prompt row is computed rather than silently missing. Pure Python and numpy; never
imports jax.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["ActivationCapture", "HiddenStates", "PromptEmbeds", "SteeringRows"]


class HiddenStates:
    """One request's captured rows, in position order, without duplicates or gaps.

    Args:
        layers: the engine's hidden_state_layers (the order of the values' first axis).
        num_prompt_tokens: positions below it are prompt rows, the rest generated rows.
    """

    def __init__(self, layers: Sequence[int], num_prompt_tokens: int):
        self.layers = tuple(layers)
        self.num_prompt_tokens = num_prompt_tokens
        self._parts: list[np.ndarray] = []  # f32[K, n, hidden] in position order
        self.num_positions = 0  # positions [0, num_positions) are recorded

    def wanted(self, start: int, end: int) -> range:
        """The positions of [start, end) (one scheduled chunk) not recorded yet."""
        return range(max(start, self.num_positions), end)

    def add(self, positions: range, values: np.ndarray) -> None:
        """Records f32[K, len(positions), hidden]; positions already held are skipped."""
        skip = max(self.num_positions - positions.start, 0)
        if skip >= len(positions):
            return
        assert positions.start + skip == self.num_positions, (
            f"hidden states of position {positions.start + skip} arrived before position "
            f"{self.num_positions}'s: a position was skipped (a prefix-cache hit on a "
            "request that must not read the cache?)"
        )
        self._parts.append(np.asarray(values[:, skip:], np.float32))
        self.num_positions = positions.stop

    def fork(self, num_prompt_tokens: int, num_shared: int) -> HiddenStates:
        """A forked child's collector: the rows of this request's first ``num_shared``
        positions (what the child shares), its own prompt length."""
        child = HiddenStates(self.layers, num_prompt_tokens)
        keep = min(self.num_positions, num_shared)
        if keep == self.num_positions:
            child._parts = list(self._parts)  # arrays are never written: shared
        elif keep:
            child._parts = [np.concatenate(self._parts, axis=1)[:, :keep]]
        child.num_positions = keep
        return child

    def output(self, num_output_tokens: int) -> tuple[dict[int, Any], dict[int, Any]]:
        """({layer: prompt rows}, {layer: generated rows}) for a request that generated
        ``num_output_tokens`` tokens (N - 1 generated rows: the last is never fed back)."""
        if self._parts:
            rows = np.concatenate(self._parts, axis=1)
        else:
            rows = np.zeros((len(self.layers), 0, 0), np.float32)
        p = self.num_prompt_tokens
        end = p + max(num_output_tokens - 1, 0)
        prompt = {layer: rows[k, :p] for k, layer in enumerate(self.layers)}
        generated = {layer: rows[k, p:end] for k, layer in enumerate(self.layers)}
        return prompt, generated


class ActivationCapture:
    """The engine's hidden-state component: which rows of a step to copy, and where they go.

    Args:
        layers: EngineConfig.hidden_state_layers; () means no request may ask.
    """

    def __init__(self, layers: Sequence[int]):
        self.layers = tuple(layers)
        self.requests: dict[str, HiddenStates] = {}

    def check(self, params: Any) -> None:
        """Raises ValueError when ``params`` asks for hidden states this engine cannot give."""
        if not params.return_hidden_states:
            return
        if not self.layers:
            raise ValueError(
                "SamplingParams.return_hidden_states=True needs an engine built with "
                "EngineConfig.hidden_state_layers (e.g. (0, -1)); this one has ()"
            )

    def add(self, request_id: str, num_prompt_tokens: int) -> None:
        self.requests[request_id] = HiddenStates(self.layers, num_prompt_tokens)

    def fork(self, parent_id: str, child_id: str, num_prompt_tokens: int, num_shared: int) -> None:
        """Starts a forked child's collector from its parent's rows of the ``num_shared``
        positions they share (a parallel-sampling sample forked from its carrier keeps
        the carrier's prompt rows)."""
        self.requests[child_id] = self.requests[parent_id].fork(num_prompt_tokens, num_shared)

    def remove(self, request_id: str) -> HiddenStates | None:
        return self.requests.pop(request_id, None)

    def rows(self, seqs: Sequence[Any]) -> tuple[np.ndarray, list[tuple[HiddenStates, range]]]:
        """The step's token rows some request still lacks, and per request its positions.

        ``seqs`` are the scheduled sequences (req_id, num_computed_tokens,
        num_new_tokens) in the order InputBatch.prepare packs their rows.
        """
        rows: list[int] = []
        parts = []
        start = 0
        for seq in seqs:
            states = self.requests.get(seq.req_id)
            if states is not None:
                first = seq.num_computed_tokens
                wanted = states.wanted(first, first + seq.num_new_tokens)
                if wanted:
                    rows.extend(range(start + wanted.start - first, start + wanted.stop - first))
                    parts.append((states, wanted))
            start += seq.num_new_tokens
        return np.asarray(rows, np.int32), parts

    @staticmethod
    def record(parts: Sequence[tuple[HiddenStates, range]], values: np.ndarray) -> None:
        """Files a read step's rows (f32[K, M, hidden], ``rows``' order) with their requests."""
        i = 0
        for states, positions in parts:
            j = i + len(positions)
            states.add(positions, values[:, i:j])
            i = j

    def attach(self, out: Any) -> Any:
        """Sets a finished EngineOutput's prompt_hidden_states and hidden_states (when its
        request asked) and forgets the request."""
        states = self.remove(out.request_id)
        if states is not None:
            out.prompt_hidden_states, out.hidden_states = states.output(len(out.token_ids))
        return out


class SteeringRows:
    """The engine's steering component: checks requests' vectors and packs a step's rows.

    Args:
        layers: EngineConfig.steering_layers; () means no request may steer.
        hidden_size: the model's (every vector's length).
    """

    def __init__(self, layers: Sequence[int], hidden_size: int):
        self.layers = tuple(layers)
        self.hidden_size = hidden_size
        self._rows: dict[Any, np.ndarray] = {}  # SamplingParams -> f32[J, hidden]

    def check(self, params: Any) -> None:
        """Raises ValueError naming the layer or the length this engine cannot steer."""
        vectors = params.steering_vectors
        if vectors is None:
            return
        for layer, vector in vectors:
            if layer not in self.layers:
                raise ValueError(
                    f"SamplingParams.steering_vectors layer {layer!r} must be one of the "
                    f"engine's EngineConfig.steering_layers={self.layers!r}"
                )
            if len(vector) != self.hidden_size:
                raise ValueError(
                    f"SamplingParams.steering_vectors[{layer}] has length {len(vector)}; "
                    f"expected hidden_size={self.hidden_size}"
                )

    @staticmethod
    def cache_salt(cache_salt: str | None, params: Any) -> str | None:
        """``cache_salt`` with a digest of the request's vectors (enters the first block's
        hash, hence every block's by chaining): steered and unsteered KV never meet."""
        vectors = params.steering_vectors
        if vectors is None:
            return cache_salt
        h = hashlib.sha256()
        for layer, vector in vectors:
            h.update(layer.to_bytes(4, "little", signed=True))
            h.update(np.asarray(vector, np.float32).tobytes())
        return f"{cache_salt or ''}\x00steering:{h.hexdigest()}"

    def rows_of(self, params: Any) -> np.ndarray:  # f32[J, hidden]
        rows = self._rows.get(params)
        if rows is None:
            if len(self._rows) > 1024:  # params of long-gone requests
                self._rows.clear()
            rows = np.zeros((len(self.layers), self.hidden_size), np.float32)
            for layer, vector in params.steering_vectors:
                rows[self.layers.index(layer)] = vector
            self._rows[params] = rows
        return rows

    def apply(self, step: Any, requests: Sequence[Any]) -> Any:
        """The StepInput with its steering rows f32[J, S, hidden] (unchanged when no
        scheduled request steers: the runner passes its resident zeros).
        ``requests``: the step's Requests in row order."""
        steered = [
            (s, req.sampling_params)
            for s, req in enumerate(requests)
            if req.sampling_params.steering_vectors is not None
        ]
        if not steered:
            return step
        vectors = np.zeros((len(self.layers), step.bucket[1], self.hidden_size), np.float32)
        for s, params in steered:
            vectors[:, s] = self.rows_of(params)
        return dataclasses.replace(step, steering=vectors)


class PromptEmbeds:
    """The engine's prompt-embeddings component: checks them, keeps them per request and
    packs a step's rows (positions below the prompt length take the request's rows).

    Args:
        enabled: EngineConfig.enable_prompt_embeds.
        embed_dim: the embedding table's width.
    """

    def __init__(self, enabled: bool, embed_dim: int):
        self.enabled = enabled
        self.embed_dim = embed_dim
        self.requests: dict[str, np.ndarray] = {}  # request id -> f32[P, embed]

    def check(self, prompt_embeds: Any) -> np.ndarray:
        """f32[P, embed] of ``prompt_embeds``; ValueError naming what is wrong."""
        if not self.enabled:
            raise ValueError(
                "prompt_embeds needs an engine built with EngineConfig.enable_prompt_embeds=True"
            )
        try:
            rows = np.asarray(prompt_embeds, np.float32)
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"prompt_embeds must be a float array [T, hidden_size] ({err})"
            ) from err
        if rows.ndim != 2 or rows.shape[0] < 1 or rows.shape[1] != self.embed_dim:
            raise ValueError(
                f"prompt_embeds.shape={rows.shape} must be (T >= 1, hidden_size={self.embed_dim})"
            )
        if not np.isfinite(rows).all():
            raise ValueError("prompt_embeds must hold finite values only")
        return rows

    @staticmethod
    def block_keys(rows: np.ndarray, block_size: int) -> list[bytes]:
        """Request.block_extra_keys of an embedded prompt: per block, a digest of its
        rows' bytes (the last block's rows may be fewer). The placeholder token ids of two
        embedding prompts share a block only when its rows (and, by the hash chain,
        every row before it) are equal: a shared prefix of rows hits the cache."""
        data = np.ascontiguousarray(rows, np.float32)
        return [
            b"prompt_embeds:" + hashlib.sha256(data[i : i + block_size].tobytes()).digest()
            for i in range(0, len(data), block_size)
        ]

    def add(self, request_id: str, rows: np.ndarray) -> None:
        self.requests[request_id] = rows

    def remove(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def apply(self, step: Any, seqs: Sequence[Any]) -> Any:
        """The StepInput with its prompt-embedding rows (f32[T, embed], bool[T]); unchanged
        when none of its tokens is a prompt position given as an embedding."""
        rows = mask = None
        start = 0
        for seq in seqs:
            embeds = self.requests.get(seq.req_id)
            first = seq.num_computed_tokens
            if embeds is not None and first < len(embeds):
                if rows is None:
                    num_tokens = step.token_ids.shape[0]
                    rows = np.zeros((num_tokens, self.embed_dim), np.float32)
                    mask = np.zeros(num_tokens, bool)
                end = min(first + seq.num_new_tokens, len(embeds))
                rows[start : start + end - first] = embeds[first:end]
                mask[start : start + end - first] = True
            start += seq.num_new_tokens
        if rows is None:
            return step
        return dataclasses.replace(step, prompt_embeds=(rows, mask))
