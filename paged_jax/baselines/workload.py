"""A ShareGPT-like synthetic trace: log-normal prompt and output lengths, random token ids.

Real ShareGPT conversations have long-tailed lengths (the PagedAttention paper reports
mean input 161 and mean output 338 tokens); this trace keeps the shape of that
distribution and scales it down so a CPU run stays short. Pure numpy, no jax.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class WorkloadConfig:
    """Parameters of the synthetic trace (lengths in tokens).

    Lengths are round(exp(N(log(median), sigma^2))) clipped to [min_len, max_len], so
    `median` is the median before clipping and the mean is median * exp(sigma^2 / 2).

    Args:
        num_requests: requests in the trace.
        input_median / input_sigma / input_min / input_max: prompt length distribution.
        output_median / output_sigma / output_min / output_max: output length distribution
            (every request generates exactly this many tokens: ignore_eos).
        vocab_size: prompt tokens are drawn uniformly from [first_token_id, vocab_size).
        first_token_id: lowest prompt token id (keeps BOS/EOS/pad ids out of prompts).
        seed: numpy seed; the same config gives the same trace.
    """

    num_requests: int = 200
    input_median: float = 32.0
    input_sigma: float = 0.8
    input_min: int = 4
    input_max: int = 256
    output_median: float = 48.0
    output_sigma: float = 0.8
    output_min: int = 4
    output_max: int = 224
    vocab_size: int = 1024
    first_token_id: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_requests", "input_min", "output_min"):
            if getattr(self, name) < 1:
                raise ValueError(f"WorkloadConfig.{name}={getattr(self, name)!r} must be >= 1")
        for low, high in (("input_min", "input_max"), ("output_min", "output_max")):
            if getattr(self, high) < getattr(self, low):
                raise ValueError(
                    f"WorkloadConfig.{high}={getattr(self, high)!r} must be >= {low}="
                    f"{getattr(self, low)!r}"
                )
        if not 0 <= self.first_token_id < self.vocab_size:
            raise ValueError(
                f"WorkloadConfig.first_token_id={self.first_token_id!r} must be in "
                f"[0, vocab_size={self.vocab_size})"
            )

    @property
    def max_total_len(self) -> int:
        """Longest possible prompt + output: max_model_len must be at least this."""
        return self.input_max + self.output_max


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    """One request of the trace: its prompt and the exact number of tokens to generate."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    num_output_tokens: int

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def _lengths(
    rng: np.random.Generator, n: int, median: float, sigma: float, low: int, high: int
) -> np.ndarray:  # i64[n]
    raw = rng.lognormal(mean=np.log(median), sigma=sigma, size=n)
    return np.clip(np.rint(raw), low, high).astype(np.int64)


def make_trace(config: WorkloadConfig) -> list[TraceRequest]:
    """Draws the trace: lengths first (so they do not depend on the vocabulary), then tokens."""
    rng = np.random.default_rng(config.seed)
    n = config.num_requests
    inputs = _lengths(
        rng, n, config.input_median, config.input_sigma, config.input_min, config.input_max
    )
    outputs = _lengths(
        rng, n, config.output_median, config.output_sigma, config.output_min, config.output_max
    )
    trace = []
    for i, (num_in, num_out) in enumerate(zip(inputs, outputs)):
        tokens = rng.integers(config.first_token_id, config.vocab_size, size=int(num_in))
        trace.append(TraceRequest(f"req-{i}", tuple(int(t) for t in tokens), int(num_out)))
    return trace


def trace_summary(trace: list[TraceRequest]) -> dict[str, float]:
    """Mean / median / max of the prompt and output lengths (for the report)."""
    ins = np.array([r.num_prompt_tokens for r in trace])
    outs = np.array([r.num_output_tokens for r in trace])
    return {
        "num_requests": len(trace),
        "input_mean": float(ins.mean()),
        "input_median": float(np.median(ins)),
        "input_max": int(ins.max()),
        "output_mean": float(outs.mean()),
        "output_median": float(np.median(outs)),
        "output_max": int(outs.max()),
        "total_prompt_tokens": int(ins.sum()),
        "total_output_tokens": int(outs.sum()),
    }
