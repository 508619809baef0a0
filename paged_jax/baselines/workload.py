"""Synthetic traces: log-normal prompt and output lengths, random token ids; pure numpy.

WorkloadConfig: a ShareGPT-like trace with free parameters (the engine benchmark).
DatasetTraceConfig: the PagedAttention paper's ShareGPT (mean input 161, output 338
tokens) or Alpaca (19 / 58) shapes with every length and max_model_len scaled by one
factor (the serving benchmark); load_jsonl_trace: a user's (prompt_len, output_len).
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


# ------------------------------------------------------------------ dataset-like traces

# The paper's trace shapes (clipped log-normals whose clipped means are its dataset
# means; paged_jax.memory_study.workloads), and the longest context they were served at.
PAPER_MAX_MODEL_LEN = 2048
DATASET_NAMES = ("sharegpt", "alpaca")


@dataclasses.dataclass(frozen=True)
class DatasetTraceConfig:
    """A ShareGPT-like or Alpaca-like trace, every length scaled by one factor.

    The paper's length distributions (mean, spread, clip bounds) and its max_model_len
    of 2,048 are all multiplied by `scale`, so each length's ratio to the others and to
    max_model_len (what decides a reservation's waste) is the paper's; only the absolute
    sizes shrink to what a CPU serves. A request's output is then cut so prompt + output
    fits max_model_len.

    Args:
        dataset: "sharegpt" (long prompts, long outputs) or "alpaca" (short).
        num_requests: requests in the trace.
        scale: factor on every length and on max_model_len (0.25: max_model_len 512).
        vocab_size / first_token_id: prompt tokens are uniform in [first_token_id, vocab).
        seed: numpy seed; the same config gives the same trace.
    """

    dataset: str = "sharegpt"
    num_requests: int = 100
    scale: float = 0.25
    vocab_size: int = 1024
    first_token_id: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dataset not in DATASET_NAMES:
            raise ValueError(
                f"DatasetTraceConfig.dataset={self.dataset!r} must be one of {DATASET_NAMES}"
            )
        if self.num_requests < 1:
            raise ValueError(f"DatasetTraceConfig.num_requests={self.num_requests!r} must be >= 1")
        if not 0 < self.scale <= 1:
            raise ValueError(f"DatasetTraceConfig.scale={self.scale!r} must be in (0, 1]")
        for d in scaled_length_dists(self.dataset, self.scale):
            if not d.lo < d.mean < d.hi:
                raise ValueError(
                    f"DatasetTraceConfig.scale={self.scale!r} is too small for {self.dataset}: "
                    f"a scaled mean length {d.mean:.2f} must lie inside ({d.lo}, {d.hi})"
                )
        if not 0 <= self.first_token_id < self.vocab_size:
            raise ValueError(
                f"DatasetTraceConfig.first_token_id={self.first_token_id!r} must be in "
                f"[0, vocab_size={self.vocab_size})"
            )

    @property
    def max_model_len(self) -> int:
        """The paper's 2,048 scaled: the "max" reservation and every request's bound."""
        return max(2, round(PAPER_MAX_MODEL_LEN * self.scale))


def scaled_length_dists(dataset: str, scale: float):
    """The paper-shaped (input, output) LengthDist of `dataset` with means and bounds x scale."""
    from paged_jax.memory_study.workloads import DATASETS, LengthDist

    def scaled(d: LengthDist) -> LengthDist:
        return LengthDist(d.mean * scale, d.sigma, lo=d.lo, hi=max(d.lo + 1, round(d.hi * scale)))

    inp, out = DATASETS[dataset]
    return scaled(inp), scaled(out)


def _random_prompts(
    rng: np.random.Generator, lengths: list[int], vocab_size: int, first_token_id: int
) -> list[tuple[int, ...]]:
    return [
        tuple(int(t) for t in rng.integers(first_token_id, vocab_size, size=n)) for n in lengths
    ]


def make_dataset_trace(config: DatasetTraceConfig) -> list[TraceRequest]:
    """Draws the trace: lengths first (independent of the vocabulary), then prompt tokens."""
    rng = np.random.default_rng(config.seed)
    in_dist, out_dist = scaled_length_dists(config.dataset, config.scale)
    max_len = config.max_model_len
    inputs = [min(n, max_len - 1) for n in in_dist.sample(rng, config.num_requests)]
    outputs = [
        max(1, min(n, max_len - p))
        for n, p in zip(out_dist.sample(rng, config.num_requests), inputs)
    ]
    prompts = _random_prompts(rng, inputs, config.vocab_size, config.first_token_id)
    return [TraceRequest(f"req-{i}", p, o) for i, (p, o) in enumerate(zip(prompts, outputs))]


def load_jsonl_trace(
    path: str,
    *,
    max_model_len: int,
    num_requests: int | None = None,
    vocab_size: int = 1024,
    first_token_id: int = 3,
    seed: int = 0,
) -> list[TraceRequest]:
    """A user trace: one JSON object a line with "prompt_len" and "output_len" (ints >= 1).

    Prompt tokens are drawn at random (seeded); the first `num_requests` lines are used
    (all when None). A line that is not such an object, or whose lengths do not fit
    max_model_len, raises ValueError naming the line.
    """
    import json

    lengths: list[tuple[int, int]] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                p, o = rec["prompt_len"], rec["output_len"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(
                    f"{path}:{lineno}: {line.strip()!r} must be a JSON object with "
                    f'"prompt_len" and "output_len" ({e})'
                ) from None
            if not (isinstance(p, int) and isinstance(o, int) and p >= 1 and o >= 1):
                raise ValueError(
                    f"{path}:{lineno}: prompt_len={p!r}, output_len={o!r} must be ints >= 1"
                )
            if p + o > max_model_len:
                raise ValueError(
                    f"{path}:{lineno}: prompt_len + output_len = {p + o} must be <= "
                    f"max_model_len={max_model_len}"
                )
            lengths.append((p, o))
            if num_requests is not None and len(lengths) == num_requests:
                break
    if not lengths:
        raise ValueError(f"{path} holds no requests: expected JSON lines with prompt_len")
    rng = np.random.default_rng(seed)
    prompts = _random_prompts(rng, [p for p, _ in lengths], vocab_size, first_token_id)
    return [TraceRequest(f"req-{i}", pr, o) for i, (pr, (_, o)) in enumerate(zip(prompts, lengths))]
