"""Speculative decoding's contract: SpeculativeConfig and the Proposer protocol (host side).

The engine verifies ``k = num_speculative_tokens`` proposed tokens per decoding request in
one target step. A *proposer* makes those proposals; the engine, scheduler, runner and
rejection sampler do the rest. This module fixes what a proposer receives and returns,
so each method (n-gram prompt lookup, a draft model) is one class behind one seam.
It never imports jax at module level.

Timing (vLLM's): step t runs; its tokens are accepted and appended on the host; then
``Proposer.propose(batch)`` makes the proposals that step t + 1 verifies. With
speculation on, steps run synchronously (proposals need step t's tokens on the host).

What a proposer gets (ProposalBatch, built by the engine after step t's outputs):

    step_input      the StepInput step t ran (host numpy, padded; with speculation
                    the step is synchronous, so feed.token_rows is all -1 and
                    token_ids are the real ids). A draft model runs its own forward
                    over the same token_ids / positions / slot mappings / block
                    tables / copies to write its KV for the same tokens at the same
                    slots. Tokens that were rejected got KV there too; it is stale
                    and is overwritten when those positions are computed again.
                    None when step t ran nothing (no request decodes).
    req_ids[i]      the i-th request that gets proposals (decoding, not finished,
                    not partway through a prefill); all arrays below are in this order.
    rows[i]         its input-batch row (persistent for its stay in the batch).
    token_ids[i]    its whole known token list, prompt + accepted outputs (a live
                    list: read it, never change it). The last entry is the next token.
    next_token_ids  i32[N] the token step t + 1 will feed first (the bonus / sampled
                    token: token_ids[i][-1]).
    next_positions  i32[N] its position (len(token_ids[i]) - 1): the first proposal
                    sits at next_positions + 1.
    num_accepted    i32[N] proposals of step t that were accepted (0 if none were made).
    block_ids[i]    its block ids per KV-cache group (group 0: the table of full
                    attention), the same ids the target uses, block size
                    EngineConfig.block_size. The scheduler holds blocks for
                    num_lookahead_tokens positions past the next token, so a draft can
                    write KV at next_positions .. next_positions + k - 1 (slot =
                    block_ids[0][p // block_size] * block_size + p % block_size).
    sampling        SamplingMetadata-like host arrays over the N proposing rows
                    (temperature, top_k, top_p, min_p, seeds, counters), so a draft can
                    sample from its distribution after the same transforms the target
                    uses (best acceptance). counters[i] = output tokens so far.

What it returns (Proposal, in batch order):

    token_ids       i32[N, k] proposed tokens (anything past num_tokens[i] is ignored).
    num_tokens      i32[N] in [0, k]: proposals of row i (0 = decode one token plainly).
    draft_probs     None (point mass: every proposal was chosen deterministically, as
                    n-gram lookup does), or a device f32[max_num_seqs, k, V] indexed by
                    input-batch row: draft_probs[rows[i], j] is the exact distribution
                    token_ids[i, j] was drawn from. Rejection sampling is exact for any
                    q as long as it is the distribution the token was drawn from, and
                    the draws are independent of the target's (derive draft keys with
                    ``jax.random.fold_in(key, DRAFT_KEY_TAG)``). Greedy rows
                    (temperature 0) accept by argmax and ignore q. A proposer returns
                    None always or an array always (the step's program depends on it).

Engine hooks on every proposer: ``num_lookahead_tokens`` (slots the scheduler holds past
the next token: k for a draft model, 0 for n-gram), ``kv_cache_bytes_per_block()``
(the proposer's own KV bytes per block, per device; the engine sizes the shared pool
by target + draft bytes per block), ``initialize(num_kv_blocks)`` (allocate its caches
once the pool size is known), ``warmup()`` (build every program ahead of serving), and
``num_compiles`` (backend compiles its own programs made; the engine adds it to its
counter, so "0 compiles after warm-up" covers the proposer). Optional: ``sleep()`` and
``wake_up()``, which LLM.sleep / LLM.wake_up call on a proposer that has them (one with
device state hands it back; the draft model's weights go to host memory at every
level, its KV cache is deleted and comes back empty). A proposer class is
built as ``cls(spec_config, context)`` (ProposerContext); the method name maps to its
class in PROPOSER_CLASSES.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Literal, Protocol, get_args, runtime_checkable

import numpy as np

from paged_jax.constants import DTYPES, fail, is_int

SpeculativeMethod = Literal["ngram", "draft_model"]
SPECULATIVE_METHODS: tuple[str, ...] = get_args(SpeculativeMethod)

# The largest k the engine accepts: a step verifies k + 1 tokens per sequence, so the
# token buckets must hold max_num_seqs * (k + 1); beyond this acceptance decays anyway.
MAX_SPECULATIVE_TOKENS = 16

# Draft samplers fold this into their per-request key, so draft draws never reuse the
# target's keys (the rejection sampler's uniforms and resamples).
DRAFT_KEY_TAG = 0x5BD1E995

# method -> "module:Class" of its proposer (imported when an engine builds one).
PROPOSER_CLASSES: dict[str, str] = {
    "ngram": "paged_jax.spec_decode.ngram:NgramProposer",
    "draft_model": "paged_jax.spec_decode.draft_model:DraftModelProposer",
}

# Keys SpeculativeConfig.from_dict reads, per method (vLLM's names).
_KEYS: dict[str, tuple[str, ...]] = {
    "ngram": ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"),
    "draft_model": (
        "method",
        "num_speculative_tokens",
        "model",
        "dtype",
        "revision",
        "max_model_len",
    ),
}


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates (vLLM's speculative_config keys).

    Args:
        method: "ngram" (prompt lookup over the request's own tokens) or "draft_model"
            (a second, smaller checkpoint with the same tokenizer). None with a model
            given means "draft_model".
        num_speculative_tokens: k, the tokens proposed and verified per step and
            sequence (1 <= k <= MAX_SPECULATIVE_TOKENS).
        prompt_lookup_max: ngram: the longest suffix n-gram looked up. None: equal to
            prompt_lookup_min, or 5 when both are None.
        prompt_lookup_min: ngram: the shortest suffix n-gram looked up (>= 1). None:
            equal to prompt_lookup_max.
        model: draft_model: path (or Hugging Face id) of the draft checkpoint.
        dtype: draft_model: the draft's weights dtype ("auto" = the engine's).
        revision: draft_model: checkpoint revision, or None.
        max_model_len: draft_model: the draft's longest context; None = the engine's
            (a smaller value than the engine's is refused: it must see every position).
    """

    method: SpeculativeMethod | None = None
    num_speculative_tokens: int = 0
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    dtype: str = "auto"
    revision: str | None = None
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.method is None and self.model is not None:
            object.__setattr__(self, "method", "draft_model")
        if self.method not in SPECULATIVE_METHODS:
            fail(self, "method", f"one of {SPECULATIVE_METHODS}")
        k = self.num_speculative_tokens
        if not is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            fail(self, "num_speculative_tokens", f"an int in [1, {MAX_SPECULATIVE_TOKENS}]")
        if self.method == "ngram":
            for name in ("model", "revision", "max_model_len"):
                if getattr(self, name) is not None:
                    fail(self, name, "None for method='ngram' (it has no draft model)")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if value is not None and (not is_int(value) or value < 1):
                    fail(self, name, "None or an int >= 1")
            if lo is None and hi is None:
                lo = hi = 5
            lo = hi if lo is None else lo
            hi = lo if hi is None else hi
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
            if lo > hi:
                fail(self, "prompt_lookup_min", f"<= prompt_lookup_max={hi}")
        else:
            for name in ("prompt_lookup_max", "prompt_lookup_min"):
                if getattr(self, name) is not None:
                    fail(self, name, "None for method='draft_model' (an ngram setting)")
            if not isinstance(self.model, str) or not self.model:
                fail(self, "model", "a draft checkpoint path (a non-empty str)")
            if self.dtype not in DTYPES:
                fail(self, "dtype", f"one of {DTYPES}")
            if self.revision is not None and not isinstance(self.revision, str):
                fail(self, "revision", "None or a str")
            n = self.max_model_len
            if n is not None and (not is_int(n) or n < 2):
                fail(self, "max_model_len", "None or an int >= 2")

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> SpeculativeConfig:
        """A config from vLLM's dict form; an unknown key is an error naming it.

        Raises:
            ValueError: not a dict, a key the method does not read, or a bad value.
        """
        if not isinstance(value, dict):
            raise ValueError(
                f"speculative_config={value!r} must be a dict (vLLM's keys) or a SpeculativeConfig"
            )
        method = value.get("method")
        if method is None and value.get("model") is not None:
            method = "draft_model"
        if method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config['method']={method!r} must be one of {SPECULATIVE_METHODS}"
            )
        allowed = _KEYS[method]
        unknown = sorted(set(value) - set(allowed), key=str)
        if unknown:
            raise ValueError(
                f"speculative_config key(s) {unknown} are not read by method={method!r}; "
                f"expected keys among {list(allowed)}"
            )
        return cls(**{**value, "method": method})

    @classmethod
    def coerce(cls, value: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig | None:
        """None, a SpeculativeConfig as it is, or one parsed from a dict."""
        if value is None or isinstance(value, cls):
            return value
        return cls.from_dict(value)

    @property
    def num_lookahead_tokens(self) -> int:
        """Slots the scheduler holds past a request's next token for the proposer's KV."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0


@dataclasses.dataclass(frozen=True)
class ProposalSampling:
    """The proposing rows' sampling settings, host arrays in batch order (length N)."""

    temperature: np.ndarray  # f32[N]; 0 = greedy
    top_k: np.ndarray  # i32[N]; 0 = off
    top_p: np.ndarray  # f32[N]; 1 = off
    min_p: np.ndarray  # f32[N]; 0 = off
    seeds: np.ndarray  # u32[N]
    counters: np.ndarray  # i32[N]; output tokens so far (the target's key fold-in)


@dataclasses.dataclass(frozen=True)
class ProposalBatch:
    """What a proposer reads after step t to propose step t + 1's tokens (module docstring).

    All per-request fields are in one order (length N = len(req_ids)).
    """

    step_input: Any  # StepInput | None: the step just executed (host numpy)
    req_ids: list[str]
    rows: np.ndarray  # i32[N]; input-batch rows
    token_ids: list[list[int]]  # prompt + accepted outputs; last = next token (read only)
    next_token_ids: np.ndarray  # i32[N]
    next_positions: np.ndarray  # i32[N]
    num_accepted: np.ndarray  # i32[N]
    block_ids: list[tuple[list[int], ...]]  # per KV-cache group
    sampling: ProposalSampling

    @property
    def num_requests(self) -> int:
        return len(self.req_ids)


@dataclasses.dataclass(frozen=True)
class Proposal:
    """A proposer's answer, in the batch's order.

    Attributes:
        token_ids: i32[N, k] proposed tokens; entries past num_tokens[i] are ignored.
        num_tokens: i32[N] proposals per request, in [0, k].
        draft_probs: None (point mass) or device f32[max_num_seqs, k, V] indexed by
            input-batch row (see the module docstring).
    """

    token_ids: np.ndarray
    num_tokens: np.ndarray
    draft_probs: Any = None

    @classmethod
    def empty(cls, num_requests: int, k: int) -> Proposal:
        """No proposals for any of num_requests rows."""
        return cls(np.zeros((num_requests, k), np.int32), np.zeros(num_requests, np.int32))


@dataclasses.dataclass(frozen=True)
class ProposerContext:
    """What the engine tells a proposer at construction.

    Attributes:
        engine_config: the resolved EngineConfig (max_model_len set).
        vocab_size: the target's logits width V.
        target_model: the target PagedModel (a draft may reuse its layers or check
            that vocabularies match); do not mutate it.
        dtype: the target's weights dtype as a string ("float32", "bfloat16", ...).
    """

    engine_config: Any
    vocab_size: int
    target_model: Any = None
    dtype: str = "float32"


@runtime_checkable
class Proposer(Protocol):
    """One speculative method behind the engine's seam (module docstring: the contract)."""

    config: SpeculativeConfig
    num_compiles: int

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots past the next token the scheduler must hold (0: needs none)."""
        ...

    def kv_cache_bytes_per_block(self) -> int:
        """The proposer's own KV bytes per block per device (0: it keeps no KV)."""
        ...

    def initialize(self, num_kv_blocks: int) -> None:
        """Allocates the proposer's caches for the engine's pool of num_kv_blocks."""
        ...

    def warmup(self) -> None:
        """Builds every program propose() will run (no compiles while serving)."""
        ...

    def propose(self, batch: ProposalBatch) -> Proposal:
        """Proposes up to k tokens for each request of the batch."""
        ...


def build_proposer(spec: SpeculativeConfig, context: ProposerContext) -> Proposer:
    """The proposer class of ``spec.method`` (PROPOSER_CLASSES), built as cls(spec, context)."""
    module_name, _, class_name = PROPOSER_CLASSES[spec.method].partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    proposer = cls(spec, context)
    missing = [
        name
        for name in (
            "num_lookahead_tokens",
            "kv_cache_bytes_per_block",
            "initialize",
            "warmup",
            "propose",
            "num_compiles",
        )
        if not hasattr(proposer, name)
    ]
    assert not missing, f"{cls.__name__} lacks Proposer members {missing}: a proposer bug"
    return proposer


def check_proposal(proposal: Proposal, num_requests: int, k: int) -> None:
    """Asserts a proposal's host arrays have the contract's shapes and ranges."""
    assert proposal.token_ids.shape == (num_requests, k), (
        f"Proposal.token_ids shape {proposal.token_ids.shape} must be {(num_requests, k)}: "
        "a proposer bug"
    )
    assert proposal.num_tokens.shape == (num_requests,), (
        f"Proposal.num_tokens shape {proposal.num_tokens.shape} must be ({num_requests},)"
    )
    assert num_requests == 0 or (
        proposal.num_tokens.min() >= 0 and proposal.num_tokens.max() <= k
    ), f"Proposal.num_tokens must be in [0, {k}]: a proposer bug"


__all__ = [
    "DRAFT_KEY_TAG",
    "MAX_SPECULATIVE_TOKENS",
    "PROPOSER_CLASSES",
    "SPECULATIVE_METHODS",
    "Proposal",
    "ProposalBatch",
    "ProposalSampling",
    "Proposer",
    "ProposerContext",
    "SpeculativeConfig",
    "SpeculativeMethod",
    "build_proposer",
    "check_proposal",
]
