"""DraftModelProposer: speculative proposals from a second, smaller Hugging Face checkpoint.

``{"method": "draft_model", "model": PATH, "num_speculative_tokens": k}``. The draft has
its own paged KV cache (as many blocks as the target's pool, the same block size) and
is addressed by the target's block tables, so the scheduler serves both models. After
target step t the proposer (1) runs step t's tokens through the draft (its KV for the
same tokens at the same slots), then (2) from each decoding request's next token runs
k one-token draft steps in one jitted program, writing draft KV at the lookahead slots
the scheduler holds, and returns the drafted tokens with q, the distribution each was
drawn from (paged_jax.spec_decode.draft_runner).
"""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np

from paged_jax.spec_decode.proposer import (
    Proposal,
    ProposalBatch,
    ProposerContext,
    SpeculativeConfig,
)


def check_draft_model(draft: Any, context: ProposerContext, path: str) -> None:
    """Raises ValueError naming speculative_config['model'] where the draft cannot serve
    the target: another vocabulary width, a shorter context, or windowed KV groups."""
    from paged_jax.model_api import model_kv_cache_groups

    where = f"speculative_config['model']={path!r}"
    vocab = int(draft.config.vocab_size)
    if vocab != int(context.vocab_size):
        raise ValueError(
            f"{where} has vocab_size={vocab}; a draft model must share the target's "
            f"vocabulary (vocab_size={context.vocab_size})"
        )
    limit = int(draft.config.max_position_embeddings)
    max_len = int(context.engine_config.max_model_len)
    if limit < max_len:
        raise ValueError(
            f"{where} has max_position_embeddings={limit}; it must be >= the engine's "
            f"max_model_len={max_len} (the draft sees every position the target does)"
        )
    groups = model_kv_cache_groups(draft)
    if len(groups) != 1 or groups[0].sliding_window is not None:
        raise ValueError(
            f"{where} must be a full-attention model (one KV-cache group, no sliding "
            f"window): its cache is addressed by the target's full-attention block tables"
        )
    if context.target_model is not None:
        target_groups = model_kv_cache_groups(context.target_model)
        if len(target_groups) != 1 or target_groups[0].sliding_window is not None:
            raise ValueError(
                f"{where}: a draft model needs a full-attention target (one KV-cache "
                f"group); the target has {len(target_groups)} group(s)"
            )


class DraftModelProposer:
    """The draft-model method behind the Proposer protocol (paged_jax.spec_decode.proposer).

    Args:
        config: a SpeculativeConfig with method "draft_model".
        context: the engine's ProposerContext (its EngineConfig, vocabulary, target).

    Raises:
        ValueError: the draft path is not a checkpoint directory, or the draft does not
            fit the target (check_draft_model); each error names the config key.
    """

    def __init__(self, config: SpeculativeConfig, context: ProposerContext):
        from paged_jax.models import load_model

        path = pathlib.Path(str(config.model))
        if not (path / "config.json").is_file():
            raise ValueError(
                f"speculative_config['model']={config.model!r} must be a Hugging Face "
                "checkpoint directory (config.json + *.safetensors) of the draft model"
            )
        self.config = config
        self.context = context
        self.engine_config = engine = context.engine_config
        self.k = int(config.num_speculative_tokens)
        dtype = config.dtype
        if dtype == "auto":  # the target's weights dtype
            dtype = context.dtype
        if dtype == "auto" and context.target_model is not None:
            dtype = str(context.target_model.config.dtype)
        if dtype == "auto":
            import jax

            dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
        self.draft = load_model(path, dtype=dtype, attention_backend=engine.attention_backend)
        check_draft_model(self.draft, context, str(config.model))
        self.runner: Any = None  # a DraftRunner once initialize() knows the pool size
        self._zero_probs: Any = None

    # ------------------------------------------------------------------ engine hooks
    @property
    def num_lookahead_tokens(self) -> int:
        """k: the draft writes KV at the next token's position and k - 1 past it."""
        return self.k

    @property
    def num_compiles(self) -> int:
        """Backend compiles the draft's own programs made."""
        return 0 if self.runner is None else self.runner.num_compiles

    def kv_cache_bytes_per_block(self) -> int:
        """The draft cache's bytes per block on each device (it is replicated under TP)."""
        return int(self.draft.kv_bytes_per_block(self.engine_config.block_size))

    def initialize(self, num_kv_blocks: int) -> None:
        """Builds the draft's device state: weights and a cache of num_kv_blocks blocks."""
        from paged_jax.spec_decode.draft_runner import DraftRunner

        replicated = None
        tp = int(self.engine_config.tensor_parallel_size)
        if tp > 1:  # same devices as the target's mesh; the draft whole on each
            from jax.sharding import NamedSharding, PartitionSpec

            from paged_jax.worker.sharding import make_mesh

            replicated = NamedSharding(make_mesh(tp), PartitionSpec())
        self.runner = DraftRunner(
            self.draft, self.engine_config, num_kv_blocks, self.k, replicated=replicated
        )

    def warmup(self) -> None:
        """Builds the catch-up program of every step bucket, the copy and propose."""
        from paged_jax.worker.input_batch import InputBatch

        assert self.runner is not None, "warmup() before initialize(): an engine bug"
        batch = InputBatch(self.engine_config)
        steps = [batch.dummy_step_input(t, s) for t, s in self.engine_config.step_shapes()]
        self.runner.warmup(steps)
        self._zero_probs = self.runner.propose(*self.runner.padding_propose_args()).probs

    def sleep(self) -> None:
        """LLM.sleep: the draft's weights to host memory, its KV cache deleted."""
        if self.runner is not None:
            self.runner.sleep()

    def wake_up(self) -> None:
        """LLM.wake_up: the draft's weights back on the device and an empty KV cache."""
        if self.runner is not None:
            self.runner.wake_up()

    # ------------------------------------------------------------------ propose
    def propose(self, batch: ProposalBatch) -> Proposal:
        """Catches the draft up on the batch's step, then drafts k tokens per request.

        Every request gets k proposals, fewer only where they would pass max_model_len.
        draft_probs is the device f32[max_num_seqs, k, V] of q per input-batch row.
        """
        runner = self.runner
        assert runner is not None, "propose() before initialize(): an engine bug"
        if batch.step_input is not None:
            runner.catch_up(batch.step_input)
        n, k = batch.num_requests, self.k
        if n == 0:
            return Proposal(np.zeros((0, k), np.int32), np.zeros(0, np.int32), self._zero_probs)
        from paged_jax.spec_decode.draft_runner import DraftSampling

        r = runner.num_rows
        rows = np.asarray(batch.rows, np.intp)
        tokens = np.zeros(r, np.int32)
        tokens[rows] = batch.next_token_ids
        positions = np.zeros(r, np.int32)
        positions[rows] = batch.next_positions
        active = np.zeros(r, bool)
        active[rows] = True
        table = np.zeros((r, self.engine_config.max_blocks_per_seq), np.int32)
        for row, ids in zip(rows.tolist(), batch.block_ids):
            group = ids[0]
            table[row, : len(group)] = group
        s = batch.sampling

        def by_row(values: np.ndarray, fill: Any, dtype: Any) -> np.ndarray:
            out = np.full(r, fill, dtype)
            out[rows] = values
            return out

        sampling = DraftSampling(
            by_row(s.temperature, 0.0, np.float32),
            by_row(s.top_k, 0, np.int32),
            by_row(s.top_p, 1.0, np.float32),
            by_row(s.min_p, 0.0, np.float32),
            by_row(s.seeds, 0, np.uint32),
        )
        proposal = runner.propose(tokens, positions, table, active, sampling)
        token_ids = np.asarray(proposal.token_ids)[rows]
        # Proposal j sits at next_position + 1 + j, which must stay below max_model_len.
        room = self.engine_config.max_model_len - 1 - np.asarray(batch.next_positions)
        num_tokens = np.clip(room, 0, k).astype(np.int32)
        return Proposal(token_ids.astype(np.int32), num_tokens, proposal.probs)


__all__ = ["DraftModelProposer", "check_draft_model"]
