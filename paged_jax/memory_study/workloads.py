"""Synthetic request traces for the memory study: the trace fixes every output length.

Lengths are clipped log-normals whose clipped means are the PagedAttention paper's
dataset means (ShareGPT input 161.31 / output 337.99 tokens, Alpaca 19.31 / 58.45);
the spreads (sigma) and the clip bounds are ours.
Token ids are random, so unrelated prompts never share a cached block by accident.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

VOCAB_SIZE = 32000


@dataclasses.dataclass(frozen=True)
class LengthDist:
    """A log-normal length distribution clipped to [lo, hi] with a target mean.

    Args:
        mean: mean of the clipped distribution (tokens); the log-normal's location
            is solved for it numerically.
        sigma: standard deviation of log(length).
        lo: smallest length.
        hi: largest length (longer draws are cut to it).
    """

    mean: float
    sigma: float
    lo: int = 1
    hi: int = 1024

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        raw = rng.lognormal(_location(self), self.sigma, size=n)
        return [int(x) for x in np.clip(np.rint(raw), self.lo, self.hi)]


@functools.cache
def _location(dist: LengthDist) -> float:
    """mu with E[clip(rint(exp(mu + sigma Z)), lo, hi)] = dist.mean, by bisection."""
    z = np.random.default_rng(12345).standard_normal(200_000)

    def clipped_mean(mu: float) -> float:
        return float(np.clip(np.rint(np.exp(mu + dist.sigma * z)), dist.lo, dist.hi).mean())

    lo, hi = -10.0, float(np.log(dist.hi)) + 5 * dist.sigma
    if not clipped_mean(lo) < dist.mean < clipped_mean(hi):
        raise ValueError(f"mean={dist.mean!r} must lie strictly inside [lo, hi] of {dist!r}")
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if clipped_mean(mid) < dist.mean else (lo, mid)
    return (lo + hi) / 2


SHAREGPT_INPUT = LengthDist(161.31, 1.0)
SHAREGPT_OUTPUT = LengthDist(337.99, 0.9)
ALPACA_INPUT = LengthDist(19.31, 0.5, hi=256)
ALPACA_OUTPUT = LengthDist(58.45, 0.8, hi=512)
DATASETS = {
    "sharegpt": (SHAREGPT_INPUT, SHAREGPT_OUTPUT),
    "alpaca": (ALPACA_INPUT, ALPACA_OUTPUT),
}


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    """One request of a trace.

    Args:
        req_id: unique id.
        prompt_token_ids: the prompt.
        output_len: tokens it generates (SamplingParams.max_tokens, ignore_eos=True).
        group: requests of one parallel-sampling group share a group id.
    """

    req_id: str
    prompt_token_ids: tuple[int, ...]
    output_len: int
    group: str | None = None

    @property
    def kv_len(self) -> int:
        """KV entries the request ever writes: the last sampled token is never fed back."""
        return len(self.prompt_token_ids) + self.output_len - 1


@dataclasses.dataclass(frozen=True)
class Workload:
    """A trace plus the KV memory budget every allocator gets for it.

    Args:
        name: short id used in file names and tables.
        requests: the trace, all arriving at step 0 (offline batch), served FCFS.
        kv_budget_tokens: KV memory in token slots (paged: usable blocks x block_size).
        max_model_len: longest context; the "max" baseline reserves this much.
        params: how the trace was drawn (for the summary).
    """

    name: str
    requests: tuple[TraceRequest, ...]
    kv_budget_tokens: int
    max_model_len: int
    params: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for r in self.requests:
            if len(r.prompt_token_ids) + r.output_len > self.max_model_len:
                raise ValueError(
                    f"request {r.req_id!r} length {len(r.prompt_token_ids) + r.output_len} "
                    f"must be <= max_model_len={self.max_model_len}"
                )


def _tokens(rng: np.random.Generator, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(3, VOCAB_SIZE, size=n))


def _params(dataset: str, **extra) -> dict:
    inp, out = DATASETS[dataset]
    return {
        "dataset": dataset,
        "input": dataclasses.asdict(inp),
        "output": dataclasses.asdict(out),
        **extra,
    }


def dataset_workload(
    dataset: str,
    num_requests: int,
    *,
    kv_budget_tokens: int,
    max_model_len: int = 2048,
    seed: int = 0,
) -> Workload:
    """Independent requests with `dataset`'s ("sharegpt" or "alpaca") length distributions."""
    if dataset not in DATASETS:
        raise ValueError(f"dataset={dataset!r} must be one of {sorted(DATASETS)}")
    rng = np.random.default_rng(seed)
    inp, out = DATASETS[dataset]
    prompt_lens = inp.sample(rng, num_requests)
    output_lens = out.sample(rng, num_requests)
    reqs = tuple(
        TraceRequest(f"{dataset}-{i}", _tokens(rng, p), o)
        for i, (p, o) in enumerate(zip(prompt_lens, output_lens))
    )
    return Workload(dataset, reqs, kv_budget_tokens, max_model_len, _params(dataset, seed=seed))


def shared_prefix_workload(
    num_requests: int,
    *,
    system_prompt_len: int = 256,
    dataset: str = "alpaca",
    kv_budget_tokens: int,
    max_model_len: int = 2048,
    seed: int = 0,
) -> Workload:
    """Every prompt is one system prompt followed by a `dataset`-like user prompt."""
    rng = np.random.default_rng(seed)
    system = _tokens(rng, system_prompt_len)
    inp, out = DATASETS[dataset]
    prompt_lens = inp.sample(rng, num_requests)
    output_lens = out.sample(rng, num_requests)
    reqs = tuple(
        TraceRequest(f"sys-{i}", system + _tokens(rng, p), o)
        for i, (p, o) in enumerate(zip(prompt_lens, output_lens))
    )
    params = _params(dataset, seed=seed, system_prompt_len=system_prompt_len)
    return Workload(f"shared_prefix_{dataset}", reqs, kv_budget_tokens, max_model_len, params)


def parallel_sampling_workload(
    num_prompts: int,
    n: int,
    *,
    dataset: str = "alpaca",
    kv_budget_tokens: int,
    max_model_len: int = 2048,
    seed: int = 0,
) -> Workload:
    """n completions per prompt: n child requests with one prompt, each its own output length.

    The children are submitted one after another, so they are admitted together and
    share the prompt's full blocks through the prefix cache (how this project serves
    SamplingParams.n > 1).
    """
    if n < 1:
        raise ValueError(f"n={n!r} must be >= 1")
    rng = np.random.default_rng(seed)
    inp, out = DATASETS[dataset]
    prompt_lens = inp.sample(rng, num_prompts)
    output_lens = out.sample(rng, num_prompts * n)
    reqs = []
    for i, p in enumerate(prompt_lens):
        prompt = _tokens(rng, p)
        for j in range(n):
            reqs.append(TraceRequest(f"par{n}-{i}-{j}", prompt, output_lens[i * n + j], f"{i}"))
    params = _params(dataset, seed=seed, n=n, num_prompts=num_prompts)
    return Workload(
        f"parallel_n{n}_{dataset}", tuple(reqs), kv_budget_tokens, max_model_len, params
    )
