"""Online serving: Poisson arrivals on the wall clock, latency per request, sustained rate.

A driver (`serve_online`) hands each request to a system only once its arrival time has
passed, steps the system while it has work and sleeps until the next arrival when it
has none. Latency = finish - arrival, read on the driver's clock when the system's
step returns the finished request (what a client would see); normalized latency =
latency / output tokens (the PagedAttention paper's metric, seconds per token). Host
logic only: jax is imported by the systems the servers wrap, never here.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from paged_jax.baselines.workload import TraceRequest
from paged_jax.constants import cdiv, is_int


def poisson_arrivals(num_requests: int, rate: float, seed: int) -> np.ndarray:  # f64[n]
    """Arrival offsets (seconds) of a Poisson process at `rate` requests/s; the first at 0.

    Gaps are exponential with mean 1 / rate, drawn from numpy's seeded generator, so one
    (num_requests, rate, seed) always gives the same times.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests={num_requests!r} must be >= 1")
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate={rate!r} must be a finite number > 0 (requests per second)")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num_requests)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def num_output_tokens(tokens: Sequence[Any]) -> int:
    """Output length of a finished request: its tokens, or one sample's when it returns
    one token list per sample or beam (normalized latency divides by a sequence's length,
    as the paper does for parallel sampling and beam search)."""
    if tokens and isinstance(tokens[0], (list, tuple)):
        return max(len(t) for t in tokens)
    return len(tokens)


class Server(Protocol):
    """What the driver needs of a serving system (continuous batching inside step())."""

    def add(self, req: TraceRequest) -> None:
        """Queues an arrived request."""

    def step(self) -> list[tuple[str, list[Any]]]:
        """One scheduling + model step; returns (request id, tokens) of finished requests
        (tokens: one list of ids, or one list per sample / beam)."""

    def has_unfinished(self) -> bool:
        """Whether any added request has not been returned by step() yet."""

    @property
    def num_running(self) -> int:
        """Requests holding KV memory now (for the peak batch size)."""


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    """One served request, times in seconds from the run's start."""

    request_id: str
    arrival_s: float
    finish_s: float
    num_output_tokens: int

    @property
    def latency_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def normalized_latency_s(self) -> float:
        """Seconds per output token: the end-to-end latency over the output length."""
        return self.latency_s / self.num_output_tokens


@dataclasses.dataclass
class OnlineRun:
    """What one online run produced: per-request records, outputs, step counts."""

    records: list[RequestRecord]
    outputs: dict[str, list[int]]
    wall_s: float
    num_steps: int
    max_running: int
    running_s: float = 0.0  # requests running x seconds, summed over steps

    @property
    def mean_running(self) -> float:
        """Time-averaged batch size: requests running, averaged over the wall clock from
        the first arrival to the last finish (idle time counts as 0)."""
        if not self.records:
            return 0.0
        first = min(r.arrival_s for r in self.records)
        last = max(r.finish_s for r in self.records)
        return self.running_s / max(1e-9, last - first)


def serve_online(
    server: Server,
    trace: Sequence[TraceRequest],
    arrivals: Sequence[float],  # f64[len(trace)], non-decreasing seconds from the start
    *,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
) -> OnlineRun:
    """Serves the trace with request i handed to the server once arrivals[i] has passed.

    The invariant: the server never sees a request before its arrival, and the driver
    never idles while the server has work. A request that arrives during a step waits
    for that step to end (as it would queue in a real server's input) and its latency
    still counts from its arrival.
    """
    if len(arrivals) != len(trace):
        raise ValueError(f"len(arrivals)={len(arrivals)} must equal len(trace)={len(trace)}")
    if any(b < a for a, b in zip(arrivals, arrivals[1:])):
        raise ValueError("arrivals must be non-decreasing")
    by_id = {r.request_id: (i, r) for i, r in enumerate(trace)}
    records: list[RequestRecord] = []
    outputs: dict[str, list[int]] = {}
    nxt = num_steps = max_running = 0
    running_s = 0.0
    t0 = clock()
    while nxt < len(trace) or server.has_unfinished():
        now = clock() - t0
        while nxt < len(trace) and arrivals[nxt] <= now:
            server.add(trace[nxt])
            nxt += 1
        if not server.has_unfinished():
            sleep(max(0.0, float(arrivals[nxt]) - (clock() - t0)))
            continue
        began = clock() - t0
        finished = server.step()
        num_steps += 1
        done = clock() - t0
        batch = server.num_running + len(finished)  # the requests this step ran
        max_running = max(max_running, batch)
        running_s += batch * (done - began)
        for request_id, tokens in finished:
            i, req = by_id[request_id]
            outputs[request_id] = list(tokens)
            records.append(
                RequestRecord(request_id, float(arrivals[i]), done, num_output_tokens(tokens))
            )
    return OnlineRun(records, outputs, clock() - t0, num_steps, max_running, running_s)


def serve_unloaded(
    server: Server,
    trace: Sequence[TraceRequest],
    *,
    clock: Callable[[], float] = time.perf_counter,
) -> OnlineRun:
    """The rate -> 0 limit: each request arrives when the one before it has finished.

    Every request is served alone, so its latency is the system's unloaded latency
    (no queueing, no batch to share a step with).
    """
    records: list[RequestRecord] = []
    outputs: dict[str, list[int]] = {}
    num_steps = 0
    t0 = clock()
    for req in trace:
        arrival = clock() - t0
        server.add(req)
        while server.has_unfinished():
            finished = server.step()
            num_steps += 1
            for request_id, tokens in finished:
                outputs[request_id] = list(tokens)
                records.append(
                    RequestRecord(request_id, arrival, clock() - t0, num_output_tokens(tokens))
                )
    busy = sum(r.latency_s for r in records)  # one request running at a time
    return OnlineRun(records, outputs, clock() - t0, num_steps, 1, running_s=busy)


def run_metrics(run: OnlineRun) -> dict[str, Any]:
    """Latency figures of one run (normalized = seconds per output token)."""
    norm = np.array([r.normalized_latency_s for r in run.records])
    lat = np.array([r.latency_s for r in run.records])
    first = min(r.arrival_s for r in run.records)
    last = max(r.finish_s for r in run.records)
    return {
        "num_requests": len(run.records),
        "num_output_tokens": int(sum(r.num_output_tokens for r in run.records)),
        "mean_normalized_latency_s": float(norm.mean()),
        "p50_normalized_latency_s": float(np.percentile(norm, 50)),
        "p90_normalized_latency_s": float(np.percentile(norm, 90)),
        "mean_latency_s": float(lat.mean()),
        "p90_latency_s": float(np.percentile(lat, 90)),
        "served_requests_per_s": len(run.records) / max(1e-9, last - first),
        "wall_s": run.wall_s,
        "num_steps": run.num_steps,
        "max_running": run.max_running,
        "mean_running": run.mean_running,
    }


def latency_bound(unloaded: dict[str, float], factor: float) -> float:
    """The common bound: factor x the largest unloaded normalized latency of any system.

    Taking the largest unloaded figure means every system meets the bound when idle, so
    the rate at which it stops meeting it measures queueing, not a slower step.
    """
    if not unloaded:
        raise ValueError("unloaded must name at least one system's latency")
    if not factor > 1:
        raise ValueError(f"factor={factor!r} must be > 1")
    return factor * max(unloaded.values())


def sustained_rate(
    rates: Sequence[float], latencies: Sequence[float], bound: float
) -> tuple[float, bool]:
    """The highest rate whose latency stays <= bound; (rate, True) when never exceeded.

    Points are taken in rate order; between the last point under the bound and the first
    one over it the rate is interpolated linearly in log latency (latency grows
    roughly exponentially towards saturation). When the first point is already over,
    the rate is 0.0. A True flag says the figure is only a lower bound (the grid ended).
    """
    if len(rates) != len(latencies) or not rates:
        raise ValueError(
            f"rates ({len(rates)}) and latencies ({len(latencies)}) must be equal, non-empty"
        )
    pts = sorted(zip(rates, latencies))
    prev = None
    for rate, lat in pts:
        if lat > bound:
            if prev is None:
                return 0.0, False
            r0, l0 = prev
            frac = (math.log(bound) - math.log(l0)) / (math.log(lat) - math.log(l0))
            return r0 + frac * (rate - r0), False
        prev = (rate, lat)
    return pts[-1][0], True


def median_by_rate(points: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """Median of `key` over the repeats at each rate: (rates ascending, medians)."""
    by: dict[float, list[float]] = {}
    for p in points:
        by.setdefault(float(p["rate"]), []).append(float(p[key]))
    rates = sorted(by)
    return rates, [statistics.median(by[r]) for r in rates]


PAGED = "paged-jax"


def system_curves(points: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per system, per rate (ascending): the median, min and max mean normalized latency.

    Args:
        points: one dict per run with "system", "rate" and "mean_normalized_latency_s".
    """
    by: dict[str, dict[float, list[float]]] = {}
    for p in points:
        by.setdefault(p["system"], {}).setdefault(float(p["rate"]), []).append(
            float(p["mean_normalized_latency_s"])
        )
    return {
        name: [
            {
                "rate": rate,
                "median": statistics.median(runs),
                "min": min(runs),
                "max": max(runs),
                "runs": runs,
            }
            for rate, runs in sorted(rates.items())
        ]
        for name, rates in by.items()
    }


def analyze_curves(
    curves: dict[str, list[dict[str, Any]]],
    factor: float,
    sensitivity: Sequence[float] = (2.0, 8.0),
) -> dict[str, Any]:
    """Unloaded latency, the common bound, each system's sustained rate and paged's ratios.

    A system's unloaded latency is its median at its lowest rate (the grid starts where
    queues stay empty). The bound is `latency_bound(unloaded, factor)`; the same is
    repeated for the `sensitivity` factors, so a reader sees how much the ratios hang
    on the choice. A ratio is None when the other system sustains no measured rate, and
    flagged as a bound when either rate is censored by the grid's end.
    """
    unloaded = {name: pts[0]["median"] for name, pts in curves.items()}

    def at(f: float) -> dict[str, Any]:
        bound = latency_bound(unloaded, f)
        rates = {}
        for name, pts in curves.items():
            rate, censored = sustained_rate(
                [p["rate"] for p in pts], [p["median"] for p in pts], bound
            )
            rates[name] = {"rate": rate, "lower_bound_only": censored}
        ratios = {}
        if PAGED in rates:
            mine = rates[PAGED]
            for name, other in rates.items():
                if name == PAGED:
                    continue
                ratios[name] = {
                    "ratio": mine["rate"] / other["rate"] if other["rate"] > 0 else None,
                    "censored": mine["lower_bound_only"] or other["lower_bound_only"],
                }
        return {"factor": f, "bound_s_per_token": bound, "sustained": rates, "paged_over": ratios}

    return {
        "unloaded_s_per_token": unloaded,
        "main": at(factor),
        "sensitivity": [at(f) for f in sensitivity if f != factor],
    }


_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
         9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131}  # fmt: skip


def ratio_interval(ratios: Sequence[float]) -> dict[str, Any]:
    """Geometric mean of paired ratios with a 95% t interval (on log ratios).

    With n ratios the interval is exp(mean(log r) +- t(0.975, n - 1) x sd / sqrt(n));
    one ratio has no interval (None bounds). Ratios must be > 0.
    """
    if not ratios or min(ratios) <= 0:
        raise ValueError(f"ratios={list(ratios)!r} must be a non-empty list of numbers > 0")
    logs = np.log(np.asarray(ratios, dtype=float))
    n = len(logs)
    center = float(np.exp(logs.mean()))
    if n == 1:
        return {"n": 1, "geomean": center, "low": None, "high": None}
    t = _T975.get(n - 1, 1.96)
    half = t * float(logs.std(ddof=1)) / math.sqrt(n)
    return {
        "n": n,
        "geomean": center,
        "low": float(np.exp(logs.mean() - half)),
        "high": float(np.exp(logs.mean() + half)),
    }


def paired_analysis(
    points: Sequence[dict[str, Any]], bound: float, reference: str = PAGED
) -> dict[str, Any]:
    """Per repeat, every system against `reference` on the same arrivals (paired).

    For repeat k each system's curve is its run at every rate of that repeat (rate 0:
    the unloaded run); its sustained rate under `bound` is read as sustained_rate does.
    Per system: the per-repeat ratios reference / system of sustained rates (censored
    ones flagged, left out of the interval), and at every loaded rate the per-repeat
    ratios system / reference of mean normalized latency, each with ratio_interval; and
    the time-averaged batch size (mean_running) per rate, median over the repeats.

    Args:
        points: one dict per run with "system", "repeat", "rate",
            "mean_normalized_latency_s" and optionally "mean_running".
        bound: the latency bound (s per token) the sustained rates are read under.
        reference: the system every other is compared with.
    """
    runs: dict[str, dict[int, dict[float, dict[str, Any]]]] = {}
    for p in points:
        runs.setdefault(p["system"], {}).setdefault(int(p["repeat"]), {})[float(p["rate"])] = p
    if reference not in runs:
        return {}
    out: dict[str, Any] = {}
    for name, reps in runs.items():
        sustained = {}
        for rep, by_rate in sorted(reps.items()):
            rates = sorted(by_rate)
            rate, censored = sustained_rate(
                rates, [by_rate[r]["mean_normalized_latency_s"] for r in rates], bound
            )
            sustained[rep] = {"rate": rate, "lower_bound_only": censored}
        batch = {}
        for rate in sorted({r for by_rate in reps.values() for r in by_rate}):
            vals = [
                b[rate]["mean_running"] for b in reps.values() if "mean_running" in b.get(rate, {})
            ]
            if vals:
                batch[str(rate)] = statistics.median(vals)
        out[name] = {"sustained_per_repeat": sustained, "mean_running_median": batch}
    mine = runs[reference]
    for name, reps in runs.items():
        if name == reference:
            continue
        common = sorted(set(reps) & set(mine))
        per_repeat = []
        for rep in common:
            a, b = (
                out[reference]["sustained_per_repeat"][rep],
                out[name]["sustained_per_repeat"][rep],
            )
            ratio = a["rate"] / b["rate"] if b["rate"] > 0 else None
            per_repeat.append(
                {
                    "repeat": rep,
                    "ratio": ratio,
                    "censored": a["lower_bound_only"] or b["lower_bound_only"],
                }
            )
        clean = [r["ratio"] for r in per_repeat if r["ratio"] is not None and not r["censored"]]
        latency = {}
        for rate in sorted({r for rep in common for r in reps[rep]} - {0.0}):
            ratios = [
                reps[rep][rate]["mean_normalized_latency_s"]
                / mine[rep][rate]["mean_normalized_latency_s"]
                for rep in common
                if rate in reps[rep] and rate in mine[rep]
            ]
            if ratios:
                latency[str(rate)] = {"per_repeat": ratios, **ratio_interval(ratios)}
        out[name]["vs_reference"] = {
            "sustained_ratio_per_repeat": per_repeat,
            "sustained_ratio": ratio_interval(clean) if clean else None,
            "latency_ratio_by_rate": latency,
        }
    return out


def plot_latency_curves(
    curves: dict[str, list[dict[str, Any]]],
    analysis: dict[str, Any],
    path: Any,
    *,
    title: str,
    cap_factor: float = 2.5,
) -> None:
    """The paper's Figure 12 layout: rate on x, mean normalized latency on y, one curve a
    system with min-max bars over the repeats, each ending at its first point above the
    y cap (where it saturated); the bound dashed, sustained rates marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bound = analysis["main"]["bound_s_per_token"]
    cap = cap_factor * bound
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    styles = {
        PAGED: ("tab:red", "o"),
        "orca-oracle": ("tab:blue", "s"),
        "orca-pow2": ("tab:green", "^"),
        "orca-max": ("tab:purple", "D"),
        "contiguous-oracle": ("tab:cyan", "s"),
        "contiguous-pow2": ("tab:olive", "^"),
        "contiguous-max": ("tab:pink", "D"),
    }
    labels = {
        PAGED: "paged (vLLM-style)",
        "orca-oracle": "Orca (Oracle): exact reservation",
        "orca-pow2": "Orca (Pow2): next power of two",
        "orca-max": "Orca (Max): max_model_len",
        "contiguous-oracle": "dense-cache engine, Oracle",
        "contiguous-pow2": "dense-cache engine, Pow2",
        "contiguous-max": "dense-cache engine, Max",
    }
    for name, pts in curves.items():
        shown = []
        for p in pts:
            shown.append(p)
            if p["median"] > cap:
                break
        color, marker = styles.get(name, ("tab:gray", "x"))
        xs = [p["rate"] for p in shown]
        ys = [min(p["median"], cap * 1.05) for p in shown]
        lo = [y - min(p["min"], cap * 1.05) for p, y in zip(shown, ys)]
        hi = [min(p["max"], cap * 1.05) - y for p, y in zip(shown, ys)]
        sustained = analysis["main"]["sustained"][name]
        more = "+" if sustained["lower_bound_only"] else ""
        label = f"{labels.get(name, name)}: {sustained['rate']:.2f}{more} req/s"
        ax.errorbar(xs, ys, yerr=[lo, hi], color=color, marker=marker, ms=5, capsize=3, label=label)
    ax.axhline(bound, color="black", ls="--", lw=1)
    ax.text(
        ax.get_xlim()[0], bound, f" bound {analysis['main']['factor']:g}x unloaded",
        va="bottom", ha="left", fontsize=8,
    )  # fmt: skip
    ax.set_ylim(0, cap * 1.08)
    ax.set_xlim(left=0)
    ax.set_xlabel("request rate (requests/s)")
    ax.set_ylabel("mean normalized latency (s/token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, title="sustained rate under the bound", title_fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_fanout_curves(
    kinds: dict[str, dict[str, dict[str, Any]]],
    path: Any,
    *,
    title: str,
    cap_factor: float = 2.5,
) -> None:
    """The paper's Figure 14 layout: one panel per (workload, n), rows parallel sampling
    and beam search, columns n; in each, mean normalized latency against request rate for
    every system, its bound dashed and its sustained rates and paged / Oracle ratio in
    the legend.

    Args:
        kinds: {kind: {str(n): {"curves": ..., "analysis": ...}}}, as bench_serving
            writes under "fanout".
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [k for k in ("parallel", "beam") if k in kinds]
    cols = sorted({int(n) for k in rows for n in kinds[k]})
    fig, axes = plt.subplots(
        len(rows), len(cols), figsize=(3.6 * len(cols), 3.2 * len(rows)), dpi=120, squeeze=False
    )
    styles = {PAGED: ("tab:red", "o", "paged"), "orca-oracle": ("tab:blue", "s", "Orca (Oracle)")}
    heading = {"parallel": "Parallel sampling, n = {}", "beam": "Beam search, width {}"}
    for r, kind in enumerate(rows):
        for c, n in enumerate(cols):
            ax = axes[r][c]
            entry = kinds[kind].get(str(n))
            if not entry or not entry.get("analysis"):
                ax.set_axis_off()
                continue
            main = entry["analysis"]["main"]
            bound = main["bound_s_per_token"]
            cap = cap_factor * bound
            for name, pts in entry["curves"].items():
                shown = []
                for p in pts:
                    shown.append(p)
                    if p["median"] > cap:
                        break
                color, marker, label = styles.get(name, ("tab:gray", "x", name))
                ys = [min(p["median"], cap * 1.05) for p in shown]
                lo = [y - min(p["min"], cap * 1.05) for p, y in zip(shown, ys)]
                hi = [min(p["max"], cap * 1.05) - y for p, y in zip(shown, ys)]
                sus = main["sustained"][name]
                more = "+" if sus["lower_bound_only"] else ""
                ax.errorbar(
                    [p["rate"] for p in shown], ys, yerr=[lo, hi], color=color, marker=marker,
                    ms=4, capsize=2, label=f"{label}: {sus['rate']:.1f}{more} req/s",
                )  # fmt: skip
            ax.axhline(bound, color="black", ls="--", lw=1)
            ratio = main["paged_over"].get("orca-oracle", {}).get("ratio")
            extra = "" if ratio is None else f"  (paged / Oracle {ratio:.2f}x)"
            ax.set_title(heading[kind].format(n) + extra, fontsize=9)
            ax.set_ylim(0, cap * 1.08)
            ax.set_xlim(left=0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, title="sustained rate", title_fontsize=7, loc="upper left")
            if r == len(rows) - 1:
                ax.set_xlabel("request rate (requests/s)", fontsize=8)
            if c == 0:
                ax.set_ylabel("normalized latency (s/token)", fontsize=8)
            ax.tick_params(labelsize=7)
    fig.suptitle(title + "; dashed: the latency bound", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---------------------------------------------------------------------- system adapters


class PagedServer:
    """The paged engine (a harness.PagedSystem) behind the Server protocol; greedy, no EOS.

    The prefix cache is reset at construction so no run reuses another run's blocks.
    """

    def __init__(self, system: Any):
        self.engine = system.engine
        self.engine.kv_cache_manager.reset_prefix_cache()
        stats = self.engine.get_stats()
        self._start = (self.engine.scheduler.num_preemptions, stats["num_compiles_after_warmup"])
        self.blocks = dict.fromkeys(
            ("logical_block_steps", "physical_block_steps", "peak_logical_blocks",
             "peak_physical_blocks"), 0
        )  # fmt: skip

    def add(self, req: TraceRequest) -> None:
        from paged_jax.sampling_params import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=req.num_output_tokens, ignore_eos=True)
        self.engine.add_request(req.request_id, list(req.prompt_token_ids), params)

    def step(self) -> list[tuple[str, list[Any]]]:
        finished = [(o.request_id, o.token_ids) for o in self.engine.step()]
        self.count_blocks()
        return finished

    def count_blocks(self) -> None:
        """Adds this step's blocks to the sharing tally: the blocks the running sequences
        point at (each counted once per sequence: what they would hold unshared) and the
        blocks the pool has handed out (shared ones once)."""
        kv = self.engine.kv_cache_manager
        logical = sum(kv.get_num_blocks(r) for r in self.engine.scheduler.running)
        physical = kv.num_usable_blocks - kv.num_free_blocks
        self.blocks["logical_block_steps"] += logical
        self.blocks["physical_block_steps"] += physical
        self.blocks["peak_logical_blocks"] = max(self.blocks["peak_logical_blocks"], logical)
        self.blocks["peak_physical_blocks"] = max(self.blocks["peak_physical_blocks"], physical)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    def extra(self) -> dict[str, Any]:
        """Preemptions and compiles during this server's run, the KV peak, and how many
        blocks sharing saved (1 - held / pointed-at, over all steps)."""
        stats = self.engine.get_stats()
        b = self.blocks
        saved = (
            1 - b["physical_block_steps"] / b["logical_block_steps"]
            if b["logical_block_steps"]
            else 0.0
        )
        return {
            "num_preemptions": self.engine.scheduler.num_preemptions - self._start[0],
            "num_compiles_after_warmup": None  # an engine that never warmed up counts none
            if self._start[1] is None
            else stats["num_compiles_after_warmup"] - self._start[1],
            "kv_cache_usage_peak": stats["kv_cache_usage_peak"],
            **b,
            "blocks_saved_by_sharing": saved,
        }


def request_seed(request_id: str) -> int:
    """The sampling seed of a request, from its id alone, so every system draws the same
    samples for it (sample j then uses seed + j, the engine's rule)."""
    return zlib.crc32(request_id.encode())


class ParallelSamplingServer(PagedServer):
    """Parallel sampling: each request asks for n samples (SamplingParams(n=n)), random
    sampling at temperature 1 with a seed from its id; the engine prefills the prompt once
    and forks the samples, which share the prompt's blocks (copy on write). Returns the
    n samples' tokens, in sample order."""

    def __init__(self, system: Any, n: int):
        if not (is_int(n) and n >= 1):
            raise ValueError(f"n={n!r} must be an int >= 1 (samples per request)")
        super().__init__(system)
        self.n = n

    def add(self, req: TraceRequest) -> None:
        from paged_jax.sampling_params import SamplingParams

        params = SamplingParams(
            n=self.n,
            temperature=1.0,
            seed=request_seed(req.request_id),
            max_tokens=req.num_output_tokens,
            ignore_eos=True,
        )
        self.engine.add_request(req.request_id, list(req.prompt_token_ids), params)

    def step(self) -> list[tuple[str, list[Any]]]:
        finished = []
        for o in self.engine.step():
            samples = o.samples if o.samples else [o]
            finished.append((o.request_id, [list(s.token_ids) for s in samples]))
        self.count_blocks()
        return finished


@dataclasses.dataclass
class _OnlineSearch:
    search: Any  # paged_jax.beam_search.BeamSearch
    prompt: list[int]
    request_ids: list[str]  # one engine request per running beam
    step: int = 0


class BeamSearchServer(PagedServer):
    """Beam search served online: each arrived request starts a search of `width` beams
    (paged_jax.beam_search.BeamSearch: HF semantics, EOS ignored, exactly the trace's
    output length), searches that arrived at different times share the engine's steps.

    Every step each live beam is one engine request that computes one token and reports
    its top candidates; the search picks the next beams; each survivor is a fork of its
    parent (sharing its blocks, the prompt's and every common output token's, copy on
    write) and each loser is aborted. Steps run synchronously (a fork needs the step's
    candidates before the next step). At most (max_num_seqs - 1) // width searches run
    at once (a fork needs a free row: width beams each, plus one parent while it forks);
    later ones wait in arrival order. Returns each search's beams' generated tokens,
    best first.
    """

    def __init__(self, system: Any, width: int):
        from paged_jax.beam_search import BeamSearchParams

        BeamSearchParams(beam_width=width, max_tokens=1)  # checks width
        super().__init__(system)
        self.width = width
        self.searches: dict[str, _OnlineSearch] = {}
        self.logprobs: dict[str, list[dict[int, float]]] = {}  # finished beams' logprobs
        self.pending: collections.deque[TraceRequest] = collections.deque()
        self.max_searches = max(1, (self.engine.config.max_num_seqs - 1) // width)

    def _engine_params(self, search: Any) -> Any:
        from paged_jax.sampling_params import SamplingParams

        # The search decides every token; the engine computes the candidates.
        return SamplingParams(
            temperature=0.0,
            max_tokens=search.max_tokens + 1,
            ignore_eos=True,
            logprobs=search.num_candidates,
        )

    def add(self, req: TraceRequest) -> None:
        self.pending.append(req)
        self._start_pending()

    def _start_pending(self) -> None:
        while self.pending and len(self.searches) < self.max_searches:
            self._begin(self.pending.popleft())

    def _begin(self, req: TraceRequest) -> None:
        from paged_jax.beam_search import BeamSearch, BeamSearchParams

        params = BeamSearchParams(
            beam_width=self.width, max_tokens=req.num_output_tokens, ignore_eos=True
        )
        prompt = list(req.prompt_token_ids)
        search = BeamSearch(len(prompt), params, self.engine.eos_token_ids)
        rid = f"{req.request_id}#0-0"
        self.engine.add_request(rid, prompt, self._engine_params(search))
        self.searches[req.request_id] = _OnlineSearch(search, prompt, [rid])

    def step(self) -> list[tuple[str, list[Any]]]:
        with self.engine.synchronous():
            outs = self.engine.step()
        self.count_blocks()
        for o in outs:
            self.logprobs[o.request_id] = o.logprobs or []
        finished = []
        for request_id in list(self.searches):
            state = self.searches[request_id]
            entries = [self._first_entry(rid) for rid in state.request_ids]
            if any(e is None for e in entries):
                continue  # a beam is still prefilling (or was preempted): wait for it
            self._advance(request_id, state, entries)
            if state.search.done:
                beams = state.search.results(state.prompt, lambda ids: "").sequences
                finished.append((request_id, [b.output_token_ids for b in beams]))
                del self.searches[request_id]
        self._start_pending()
        return finished

    def _first_entry(self, rid: str) -> dict[int, float] | None:
        logprobs = self.logprobs[rid] if rid in self.logprobs else self.engine.get_logprobs(rid)
        return logprobs[0] if logprobs else None

    def _advance(self, request_id: str, state: _OnlineSearch, entries: list) -> None:
        """One search step: losers aborted, each survivor forked from its parent."""
        from paged_jax.beam_search import top_candidates
        from paged_jax.core.request import RequestStatus

        k = state.search.num_candidates
        parents = state.request_ids
        new_beams = state.search.step([top_candidates(e, k) for e in entries])
        state.step += 1
        children: dict[int, list[int]] = {}
        for j, beam in enumerate(new_beams):
            children.setdefault(beam.parent, []).append(j)
        for b, rid in enumerate(parents):
            if b not in children and self.engine.is_live(rid):
                self.engine.abort_request(rid)
        ids = [""] * len(new_beams)
        for b, js in children.items():
            parent = parents[b]
            req = self.engine.get_request(parent)
            for j in js:
                rid = f"{request_id}#{state.step}-{j}"
                tokens = state.prompt + new_beams[j].tokens
                if req is not None and req.status == RequestStatus.RUNNING:
                    self.engine.fork_request(
                        parent, rid, output_token_ids=tokens[req.num_prompt_tokens :]
                    )
                else:  # the parent was preempted: recompute the beam
                    self.engine.add_request(rid, tokens, self._engine_params(state.search))
                ids[j] = rid
            if self.engine.is_live(parent):
                self.engine.abort_request(parent)
        for rid in parents:
            self.logprobs.pop(rid, None)
        state.request_ids = ids

    def has_unfinished(self) -> bool:
        return bool(self.searches or self.pending) or self.engine.has_unfinished()


class ContiguousServer:
    """A contiguous-KV baseline (a harness.ContiguousSystem) behind the Server protocol.

    Each server owns a fresh engine (empty address space) over the system's compiled
    runner; its reservation policy applies when a request is admitted, which happens
    only after the driver added it, i.e. after it arrived.
    """

    def __init__(self, system: Any):
        self.engine = system.new_engine()

    def add(self, req: TraceRequest) -> None:
        self.engine.add_request(req)

    def step(self) -> list[tuple[str, list[int]]]:
        return [(o.request_id, o.token_ids) for o in self.engine.step()]

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    def extra(self) -> dict[str, Any]:
        return {"kv_utilization": self.engine.kv_utilization, "policy": self.engine.policy}


class ReservationServer:
    """Orca-style admission in front of another server: contiguous reservations, no paging.

    A request enters the inner server only once a contiguous run of token slots sized by
    the policy (max_model_len, its prompt plus the next power of two of its output
    length, or exactly its KV length) fits in an address space of `budget_tokens`,
    placed by a buddy allocator (the paper's Orca: the run is rounded up to a power of
    two) or first-fit (`placement`); FCFS with head-of-line blocking, as
    ContiguousKVEngine admits. The reservation is released when the inner
    server returns the request. Wrapped around the paged engine with the same pool, in
    whole blocks (granularity = block_size, so the admitted requests' blocks always fit
    and it never preempts), this is the contiguous design on the same compute: one
    forward per step, the same kernels, so any difference from the paged engine is the
    memory policy alone.

        space:  |r0 ........|r1 ..|   hole   |r2 ......|   r3 waits for a big enough hole

    With copies = n a request holds n such runs (parallel sampling's n samples or beam
    search's n beams, each reserving its prompt + output: nothing shared), admitted only
    when all n fit; extra_kv_tokens adds to each run's KV length (a beam's engine request
    computes one token more than a plain request).
    """

    def __init__(
        self,
        inner: Server,
        policy: str,
        budget_tokens: int,
        max_model_len: int,
        *,
        granularity: int = 1,
        copies: int = 1,
        extra_kv_tokens: int = 0,
        placement: str = "buddy",
    ):
        from paged_jax.memory_study.allocators import POLICIES, make_space

        if granularity < 1 or budget_tokens % granularity:
            raise ValueError(
                f"granularity={granularity!r} must be >= 1 and divide "
                f"budget_tokens={budget_tokens!r}"
            )
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r} must be one of {POLICIES}")
        if max_model_len > budget_tokens:
            raise ValueError(
                f"budget_tokens={budget_tokens!r} must hold one max_model_len="
                f"{max_model_len} reservation"
            )
        if not (is_int(copies) and copies >= 1):
            raise ValueError(f"copies={copies!r} must be an int >= 1 (reservations per request)")
        self.inner, self.policy, self.max_model_len = inner, policy, max_model_len
        self.granularity = granularity
        self.copies, self.extra_kv_tokens = copies, extra_kv_tokens
        self.placement = placement
        self.space = make_space(placement, budget_tokens)
        self.gate: collections.deque[TraceRequest] = collections.deque()
        self.starts: dict[str, list[int]] = {}
        self.max_reserved = 0

    def reservation(self, req: TraceRequest) -> int:
        """Token slots the policy reserves for the request's K/V (prompt + output - 1),
        rounded up to the granularity (the inner pool's block: the reservations then
        never need more blocks than the pool holds)."""
        from paged_jax.memory_study.allocators import reservation_size

        kv_len = req.num_prompt_tokens + req.num_output_tokens - 1 + self.extra_kv_tokens
        size = reservation_size(
            self.policy, kv_len, self.max_model_len, output_len=req.num_output_tokens
        )
        return cdiv(size, self.granularity) * self.granularity

    def _place_copies(self, space: Any, size: int) -> list[int] | None:
        """One run of `size` slots per sample / beam in `space`, all or none: their
        starts, or None with the space as it was."""
        starts = []
        for _ in range(self.copies):
            start = space.alloc(size)
            if start is None:
                for s in starts:
                    space.free(s)
                return None
            starts.append(start)
        return starts

    def _admit(self) -> None:
        while self.gate:
            starts = self._place_copies(self.space, self.reservation(self.gate[0]))
            if starts is None:
                self.max_reserved = max(self.max_reserved, self.space.num_allocated)
                return  # head-of-line blocking
            req = self.gate.popleft()
            self.starts[req.request_id] = starts
            self.inner.add(req)
        self.max_reserved = max(self.max_reserved, self.space.num_allocated)

    def add(self, req: TraceRequest) -> None:
        if req.num_prompt_tokens + req.num_output_tokens > self.max_model_len:
            raise ValueError(
                f"request {req.request_id!r} needs {req.num_prompt_tokens} + "
                f"{req.num_output_tokens} tokens: must be <= max_model_len={self.max_model_len}"
            )
        self._check_fits_alone(req)
        self.gate.append(req)
        self._admit()

    def _check_fits_alone(self, req: TraceRequest) -> None:
        """Refuses a request whose `copies` runs do not fit even in the empty space (a
        buddy allocator rounds each run up to a power of two, and a budget that is not
        one is split into root blocks that never merge): admitted later it would wait
        forever at the head of the gate."""
        from paged_jax.memory_study.allocators import make_space

        size = self.reservation(req)
        if self._place_copies(make_space(self.placement, self.space.size), size) is not None:
            return
        raise ValueError(
            f"request {req.request_id!r}: copies={self.copies} reservations of {size} slots "
            f"do not fit in an empty {self.placement} space of budget_tokens="
            f"{self.space.size}; expected a budget that holds them"
        )

    def step(self) -> list[tuple[str, list[int]]]:
        assert self.inner.has_unfinished(), "a gated request waits on an empty space: a leak"
        finished = self.inner.step()
        for request_id, _ in finished:
            for start in self.starts.pop(request_id):
                self.space.free(start)
        self._admit()
        return finished

    def has_unfinished(self) -> bool:
        return bool(self.gate) or self.inner.has_unfinished()

    @property
    def num_running(self) -> int:
        return self.inner.num_running

    def extra(self) -> dict[str, Any]:
        inner = self.inner.extra() if hasattr(self.inner, "extra") else {}
        return {
            **inner,
            "policy": self.policy,
            "placement": self.placement,
            "max_reserved_tokens": self.max_reserved,
        }


class StaticBatchServer:
    """FasterTransformer-style static batching in front of another server: no
    iteration-level scheduling.

    At a step with the inner server idle, the earliest arrived requests, up to `batch_size`
    (memory_study.allocators.static_batch_size: as many max_model_len reservations as
    the budget holds, at most max_num_seqs), enter it together; no other request enters
    until every one of them has finished and been returned. A finished request's slot
    stays idle meanwhile.

        time ->   batch 1: a b c (c the longest) | batch 2: d e f ...
                  d arrives while b runs: it waits for c to finish
    """

    def __init__(
        self, inner: Server, budget_tokens: int, max_model_len: int, max_num_seqs: int
    ) -> None:
        from paged_jax.memory_study.allocators import static_batch_size

        self.inner, self.max_model_len = inner, max_model_len
        self.batch_size = static_batch_size(budget_tokens, max_model_len, max_num_seqs)
        self.gate: collections.deque[TraceRequest] = collections.deque()
        self.num_batches = 0

    def _admit(self) -> None:
        if self.inner.has_unfinished() or not self.gate:
            return
        for _ in range(min(self.batch_size, len(self.gate))):
            self.inner.add(self.gate.popleft())
        self.num_batches += 1

    def add(self, req: TraceRequest) -> None:
        if req.num_prompt_tokens + req.num_output_tokens > self.max_model_len:
            raise ValueError(
                f"request {req.request_id!r} needs {req.num_prompt_tokens} + "
                f"{req.num_output_tokens} tokens: must be <= max_model_len={self.max_model_len}"
            )
        self.gate.append(req)  # the batch forms at the next step, from all arrived

    def step(self) -> list[tuple[str, list[int]]]:
        self._admit()
        assert self.inner.has_unfinished(), "step() called with nothing to serve"
        return self.inner.step()

    def has_unfinished(self) -> bool:
        return bool(self.gate) or self.inner.has_unfinished()

    @property
    def num_running(self) -> int:
        return self.inner.num_running

    def extra(self) -> dict[str, Any]:
        inner = self.inner.extra() if hasattr(self.inner, "extra") else {}
        return {**inner, "static_batch_size": self.batch_size, "num_batches": self.num_batches}


FANOUT_KINDS = ("plain", "parallel", "beam")


def make_fanout_server(system: Any, kind: str, n: int) -> PagedServer:
    """The paged engine serving each request as one sequence, n samples or n beams."""
    if kind == "plain":
        return PagedServer(system)
    if kind == "parallel":
        return ParallelSamplingServer(system, n)
    if kind == "beam":
        return BeamSearchServer(system, n)
    raise ValueError(f"kind={kind!r} must be one of {FANOUT_KINDS}")


def make_server(system: Any) -> PagedServer | ContiguousServer:
    """The adapter for a harness system: paged when it has an engine, else contiguous."""
    return PagedServer(system) if hasattr(system, "engine") else ContiguousServer(system)


__all__ = [
    "FANOUT_KINDS",
    "PAGED",
    "BeamSearchServer",
    "ParallelSamplingServer",
    "make_fanout_server",
    "num_output_tokens",
    "request_seed",
    "analyze_curves",
    "paired_analysis",
    "ratio_interval",
    "plot_fanout_curves",
    "plot_latency_curves",
    "system_curves",
    "ContiguousServer",
    "OnlineRun",
    "PagedServer",
    "RequestRecord",
    "ReservationServer",
    "Server",
    "StaticBatchServer",
    "latency_bound",
    "make_server",
    "median_by_rate",
    "poisson_arrivals",
    "run_metrics",
    "serve_online",
    "serve_unloaded",
    "sustained_rate",
]
