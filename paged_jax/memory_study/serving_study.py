"""The simulated serving comparison: sustained rates by bisection, ratios beside the paper's.

For each trace, every system of serving_sim is served at the rates a bisection picks;
the sustained rate is the highest rate whose mean normalized latency stays within
factor x the unloaded one (baselines.serving.latency_bound). Host code only.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from paged_jax.baselines.serving import latency_bound
from paged_jax.memory_study import serving_sim as sim
from paged_jax.memory_study.allocators import static_batch_size

# The PagedAttention paper, Sec. 6.2, Figure 12 (paged = vLLM): request rates sustained
# at similar normalized latency. ShareGPT: ranges over OPT-13B/66B/175B; Alpaca: the
# paper's one figure for OPT-13B (Sec. 6.3: 1.3x over Orca (Oracle) in basic sampling);
# None = the paper states no number for that pair.
PAPER_RATIOS = {
    "sharegpt": {
        "orca-oracle": (1.7, 2.7),
        "orca-pow2": None,
        "orca-max": (2.7, 8.0),
        "fastertransformer": (None, 22.0),  # "up to 22x"
    },
    "alpaca": {
        "orca-oracle": (1.3, 1.3),
        "orca-pow2": None,  # "less pronounced" than ShareGPT, no number
        "orca-max": None,
        "fastertransformer": None,
    },
}
# The paper's Figure 13: mean batched requests, OPT-13B, ShareGPT at 2 req/s and Alpaca
# at 30 req/s (the bar labels); FasterTransformer is not in the figure.
PAPER_BATCH = {
    "sharegpt": {"rate": 2.0, "paged": 30.42, "orca-oracle": 13.62, "orca-pow2": 9.81,
                 "orca-max": 7.00},
    "alpaca": {"rate": 30.0, "paged": 132.44, "orca-oracle": 72.75, "orca-pow2": 43.24,
               "orca-max": 7.00},
}  # fmt: skip


def bisect_rate(
    latency_at: Callable[[float], float],
    bound: float,
    start: float,
    *,
    rel_tol: float = 0.04,
    max_rate: float = 1e4,
    min_rate: float = 1e-3,
) -> tuple[float, list[tuple[float, float]]]:
    """The highest rate whose latency stays <= bound, by bracketing then bisection.

    From `start`, the rate is doubled (or halved) until one rate meets the bound and a
    higher one does not; the bracket [lo, hi] is then halved in log space until
    hi / lo <= 1 + rel_tol. Assumes latency rises with rate.

    Returns:
        (rate, points): the bracket's lower end (0.0 when even min_rate misses the
        bound, max_rate when max_rate meets it: then only a lower bound) and every (rate, latency) evaluated,
        in evaluation order.
    """
    if not (bound > 0 and start > 0 and rel_tol > 0):
        raise ValueError(f"bound={bound!r}, start={start!r}, rel_tol={rel_tol!r} must be > 0")
    points: list[tuple[float, float]] = []

    def meets(rate: float) -> bool:
        lat = latency_at(rate)
        points.append((rate, lat))
        return lat <= bound

    rate = min(start, max_rate)
    if meets(rate):
        lo, hi = rate, None
        while hi is None:
            if rate >= max_rate:
                return max_rate, points
            rate = min(2 * rate, max_rate)
            lo, hi = (rate, None) if meets(rate) else (lo, rate)
    else:
        lo, hi = None, rate
        while lo is None:
            rate /= 2
            if rate < min_rate:
                return 0.0, points
            lo, hi = (rate, hi) if meets(rate) else (None, rate)
    while hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return lo, points


@dataclasses.dataclass(frozen=True)
class SimStudySettings:
    """What scripts/sim_serving.py runs (defaults: the published run).

    Args:
        datasets: traces to serve.
        systems: serving_sim.SYSTEMS to compare; "paged" is the numerator of the ratios.
        duration_s: simulated seconds of arrivals per rate (the driver then drains).
        factor: the main latency bound, x the unloaded normalized latency.
        other_factors: bounds also reported.
        overhead_scales: multipliers of the step overhead for the sensitivity rows
            (main factor only).
        flops_scales: multipliers of the peak FLOPs for more sensitivity rows (0.25: the
            GEMMs reach a quarter of the datasheet's peak).
        rel_tol: the bisection stops when hi / lo <= 1 + rel_tol.
        sensitivity_rel_tol: the same for the sensitivity rows (started from the main
            rates, a coarser bracket: they show a trend).
        num_unloaded: requests served one at a time for the unloaded latency.
        trace_requests: requests drawn per trace; the highest rate a bisection may try
            is what they cover in duration_s.
        seed: trace seed.
    """

    datasets: tuple[str, ...] = ("sharegpt", "alpaca")
    systems: tuple[str, ...] = sim.SYSTEMS
    duration_s: float = 900.0
    factor: float = 4.0
    other_factors: tuple[float, ...] = (2.0, 8.0)
    overhead_scales: tuple[float, ...] = (0.5, 2.0)
    flops_scales: tuple[float, ...] = (0.25,)
    rel_tol: float = 0.04
    sensitivity_rel_tol: float = 0.08
    num_unloaded: int = 200
    trace_requests: dict = dataclasses.field(
        default_factory=lambda: {"sharegpt": 30_000, "alpaca": 150_000}
    )
    seed: int = 0


class _Runs:
    """Simulated runs of one trace under one step-time model, memoized by (system, rate);
    each request served as `mode` with `width` samples / beams (serving_sim.FORK_MODES)."""

    def __init__(self, trace: sim.SimTrace, model: sim.StepTimeModel, budget: int,
                 duration_s: float, progress: Callable[[str], None], *,
                 mode: str = "basic", width: int = 1,
                 max_num_seqs: int = sim.MAX_NUM_SEQS) -> None:  # fmt: skip
        self.trace, self.model, self.budget = trace, model, budget
        self.duration_s, self.progress = duration_s, progress
        self.mode, self.width, self.max_num_seqs = mode, width, max_num_seqs
        self.cache: dict[tuple[str, float], dict[str, Any]] = {}

    def run(self, system: str, rate: float) -> dict[str, Any]:
        key = (system, float(f"{rate:.6g}"))
        if key not in self.cache:
            t0 = time.perf_counter()
            reqs, arrivals = self.trace.at_rate(key[1], self.duration_s)
            res = sim.simulate(system, reqs, arrivals, self.model, budget_tokens=self.budget,
                               mode=self.mode, width=self.width,
                               max_num_seqs=self.max_num_seqs)  # fmt: skip
            res["rate"] = key[1]
            res["sim_wall_s"] = time.perf_counter() - t0
            self.cache[key] = res
            cell = "" if self.mode == "basic" else f" {self.mode} {self.width}"
            self.progress(
                f"  {self.trace.dataset}{cell} {system} {key[1]:.4g} req/s: "
                f"{res['mean_normalized_latency_s'] * 1e3:.1f} ms/token, "
                f"batch {res['time_avg_batch_size']:.1f} ({res['sim_wall_s']:.1f} s)"
            )
        return self.cache[key]

    def start_rate(self, system: str) -> float:
        """A first guess for the bisection: what batch the budget holds for this system's
        reservation of a mean request, decoding in lockstep; only a starting point."""
        reqs = self.trace.requests[:2000]
        w = self.width
        if system == "fastertransformer":
            batch = static_batch_size(self.budget, sim.MAX_MODEL_LEN, self.max_num_seqs)
        elif system == "paged":
            slots = np.mean([r.num_prompt_tokens + w * r.num_output_tokens for r in reqs])
            batch = self.budget / slots
        else:
            orca = sim.OrcaSim(self.model, sim.VirtualClock(), system[5:],
                               budget_tokens=self.budget)  # fmt: skip
            batch = self.budget / np.mean(
                [w * orca.space.chunk_size(orca.reservation(r)) for r in reqs]
            )
        batch = min(float(batch), self.max_num_seqs / w)
        mean_out = float(np.mean([r.num_output_tokens for r in reqs]))
        mean_ctx = float(np.mean([r.num_prompt_tokens + r.num_output_tokens / 2 for r in reqs]))
        cost = sim.StepCost()
        cost.add(int(mean_ctx), 1, True, rows=max(1, int(batch * w)))
        return 0.5 * batch / (cost.time(self.model) * mean_out)


def _study_trace(
    trace: sim.SimTrace,
    model: sim.StepTimeModel,
    settings: SimStudySettings,
    factors: tuple[float, ...],
    progress: Callable[[str], None],
    *,
    rel_tol: float,
    starts: dict[str, float] | None = None,
    mode: str = "basic",
    width: int = 1,
) -> dict[str, Any]:
    budget = sim.kv_budget_tokens(model)
    seqs = getattr(settings, "max_num_seqs", sim.MAX_NUM_SEQS)
    runs = _Runs(trace, model, budget, settings.duration_s, progress, mode=mode, width=width,
                 max_num_seqs=seqs)  # fmt: skip
    sample = list(trace.requests[: settings.num_unloaded])
    unloaded = {
        s: sim.unloaded_latency(
            s, sample, model, budget_tokens=budget, mode=mode, width=width, max_num_seqs=seqs
        )  # fmt: skip
        for s in settings.systems
    }
    by_factor = {}
    for f in factors:
        bound = latency_bound(unloaded, f)
        sustained = {}
        for s in settings.systems:
            if by_factor:
                start = by_factor[factors[0]]["sustained"][s]
            elif starts:
                start = starts[s]
            else:
                start = runs.start_rate(s)
            rate, _ = bisect_rate(
                lambda r, s=s: runs.run(s, r)["mean_normalized_latency_s"],
                bound,
                max(start, 1e-2),
                rel_tol=rel_tol,
                max_rate=0.99 * trace.max_rate(settings.duration_s),
            )
            sustained[s] = rate
        ratios = {
            s: (sustained["paged"] / sustained[s] if sustained[s] > 0 else None)
            for s in settings.systems
            if s != "paged"
        }
        by_factor[f] = {"bound_s_per_token": bound, "sustained": sustained, "paged_over": ratios}
        cell = "" if mode == "basic" else f" {mode} {width}"
        progress(f"{trace.dataset}{cell} {f:g}x: {sustained} ratios {ratios}")
    points = {
        s: sorted((v for (name, _), v in runs.cache.items() if name == s), key=lambda v: v["rate"])
        for s in settings.systems
    }
    return {
        "kv_budget_tokens": budget,
        "unloaded_s_per_token": unloaded,
        "bounds": [{"factor": f, **by_factor[f]} for f in factors],
        "points": points,
        "runs": runs,
    }


def run_study(
    settings: SimStudySettings = SimStudySettings(),
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """The whole study: per trace, the bisections at every bound, the time-averaged batch
    sizes at Figure 13's rates, and the overhead sensitivity rows."""
    if "paged" not in settings.systems:
        raise ValueError(f"systems={settings.systems!r} must include 'paged'")
    model = sim.StepTimeModel()
    out: dict[str, Any] = {
        "settings": dataclasses.asdict(settings),
        "model": model.constants(),
        "kv_budget_bytes": sim.KV_BUDGET_BYTES,
        "block_size": sim.BLOCK_SIZE,
        "max_model_len": sim.MAX_MODEL_LEN,
        "max_num_seqs": sim.MAX_NUM_SEQS,
        "max_num_batched_tokens": sim.MAX_NUM_BATCHED_TOKENS,
        "paper_ratios": PAPER_RATIOS,
        "paper_batch": PAPER_BATCH,
        "traces": {},
    }
    factors = (settings.factor, *settings.other_factors)
    for dataset in settings.datasets:
        trace = sim.make_trace(dataset, settings.trace_requests[dataset], seed=settings.seed)
        res = _study_trace(trace, model, settings, factors, progress, rel_tol=settings.rel_tol)
        runs = res.pop("runs")
        rate = PAPER_BATCH[dataset]["rate"]
        res["fig13_rate"] = rate
        res["fig13_batch"] = {}
        for s in settings.systems:
            r = runs.run(s, rate)
            res["fig13_batch"][s] = {
                "time_avg_batch_size": r["time_avg_batch_size"],
                "mean_normalized_latency_s": r["mean_normalized_latency_s"],
            }
        res["sensitivity"] = []
        variants = [("overhead_s", x) for x in settings.overhead_scales]
        variants += [("peak_flops_per_s", x) for x in settings.flops_scales]
        for field, scale in variants:
            m2 = dataclasses.replace(model, **{field: getattr(model, field) * scale})
            sub = _study_trace(
                trace, m2, settings, (settings.factor,), progress,
                rel_tol=settings.sensitivity_rel_tol, starts=res["bounds"][0]["sustained"],
            )  # fmt: skip
            sub.pop("runs")
            res["sensitivity"].append(
                {
                    "changed": field,
                    "scale": scale,
                    "overhead_s": m2.overhead_s,
                    "peak_flops_per_s": m2.peak_flops_per_s,
                    "unloaded_s_per_token": sub["unloaded_s_per_token"],
                    **sub["bounds"][0],
                }  # fmt: skip
            )
        res["trace"] = {
            "num_requests_drawn": len(trace.requests),
            "mean_prompt_tokens": float(np.mean([r.num_prompt_tokens for r in trace.requests])),
            "mean_output_tokens": float(np.mean([r.num_output_tokens for r in trace.requests])),
        }
        out["traces"][dataset] = res
    return out


# ------------------------------------------------------------------ figures and tables
_STYLE = {
    "paged": ("tab:red", "o", "paged (vLLM)"),
    "orca-oracle": ("tab:blue", "s", "Orca (Oracle)"),
    "orca-pow2": ("tab:green", "^", "Orca (Pow2)"),
    "orca-max": ("tab:purple", "D", "Orca (Max)"),
    "fastertransformer": ("tab:gray", "x", "FasterTransformer"),
}


def plot_latency(summary: dict[str, Any], path: Any) -> None:
    """Figure 12 redrawn: one panel per trace, mean normalized latency against rate, every
    bisection point of each system, the bounds dashed, sustained rates in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = summary["traces"]
    fig, axes = plt.subplots(1, len(traces), figsize=(6.2 * len(traces), 4.4), dpi=120)
    axes = np.atleast_1d(axes)
    for ax, (dataset, res) in zip(axes, traces.items()):
        main = res["bounds"][0]
        cap = 2.5 * max(b["bound_s_per_token"] for b in res["bounds"])
        for s, pts in res["points"].items():
            color, marker, label = _STYLE.get(s, ("black", ".", s))
            xs = [p["rate"] for p in pts]
            ys = [min(p["mean_normalized_latency_s"], cap * 1.05) for p in pts]
            label = f"{label}: {main['sustained'][s]:.2f} req/s"
            ax.plot(xs, ys, color=color, marker=marker, ms=4, lw=1.2, label=label)
        for b in res["bounds"]:
            ax.axhline(b["bound_s_per_token"], color="black", lw=0.8,
                       ls="--" if b is main else ":")  # fmt: skip
            ax.text(ax.get_xlim()[1], b["bound_s_per_token"], f"{b['factor']:g}x ",
                    ha="right", va="bottom", fontsize=7)  # fmt: skip
        ax.set_xscale("log")
        ax.set_ylim(0, cap * 1.08)
        ax.set_xlabel("request rate (requests/s, log scale)")
        ax.set_ylabel("mean normalized latency (s/token)")
        ax.set_title(
            f"{dataset}: OPT-13B on A100-40GB, simulated clock "
            f"({summary['settings']['duration_s'] / 60:g}-min traces)",
            fontsize=9,
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, title=f"sustained at {main['factor']:g}x unloaded",
                  title_fontsize=7)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _paper(pair) -> str:
    if pair is None:
        return "-"
    lo, hi = pair
    if lo is None:
        return f"up to {hi:g}x"
    return f"{lo:g}x" if lo == hi else f"{lo:g}-{hi:g}x"


def _variant(row: dict[str, Any]) -> str:
    if row["changed"] == "overhead_s":
        return f"4x, overhead {row['overhead_s'] * 1e3:g} ms"
    return f"4x, peak FLOPs x{row['scale']:g}"


def markdown_tables(summary: dict[str, Any]) -> str:
    """The doc's tables: sustained rates and ratios per bound, sensitivity, batch sizes."""
    systems = summary["settings"]["systems"]
    others = [s for s in systems if s != "paged"]
    lines = []
    head = "| trace | bound | " + " | ".join(f"{s} req/s" for s in systems) + " | "
    head += " | ".join(f"paged / {s}" for s in others) + " |"
    lines += [head, "|" + "---|" * (2 + len(systems) + len(others))]
    for dataset, res in summary["traces"].items():
        rows = [(f"{b['factor']:g}x", b) for b in res["bounds"]]
        rows += [(_variant(s), s) for s in res["sensitivity"]]
        for label, b in rows:
            rates = " | ".join(f"{b['sustained'][s]:.2f}" for s in systems)
            ratios = " | ".join(
                "-" if b["paged_over"][s] is None else f"{b['paged_over'][s]:.2f}x" for s in others
            )
            lines.append(f"| {dataset} | {label} | {rates} | {ratios} |")
        paper = " | ".join(_paper(PAPER_RATIOS[dataset].get(s)) for s in others)
        lines.append(f"| {dataset} | paper | " + " | ".join("" for _ in systems) + f" | {paper} |")
    lines += ["", "| trace | rate | " + " | ".join(systems) + " |",
              "|" + "---|" * (2 + len(systems))]  # fmt: skip
    for dataset, res in summary["traces"].items():
        ours = " | ".join(f"{res['fig13_batch'][s]['time_avg_batch_size']:.2f}" for s in systems)
        paper = " | ".join(
            f"{PAPER_BATCH[dataset][s]:.2f}" if s in PAPER_BATCH[dataset] else "-" for s in systems
        )
        lines.append(f"| {dataset} (simulated) | {res['fig13_rate']:g} req/s | {ours} |")
        lines.append(f"| {dataset} (paper, Fig. 13) | {res['fig13_rate']:g} req/s | {paper} |")
        own = " | ".join(f"{batch_at_sustained(res, s):.2f}" for s in systems)
        lines.append(f"| {dataset} (simulated) | each system's 4x sustained rate | {own} |")
    return "\n".join(lines) + "\n"


def batch_at_sustained(res: dict[str, Any], system: str) -> float:
    """Time-averaged batch size of the run at the system's sustained rate (main bound)."""
    rate = res["bounds"][0]["sustained"][system]
    pts = res["points"][system]
    return min(pts, key=lambda p: abs(p["rate"] - rate))["time_avg_batch_size"]


# ------------------------------------------------------------------ Figure 14: forks
# The PagedAttention paper, Sec. 6.3 (OPT-13B, Alpaca): paged (vLLM) over Orca (Oracle)
# "from 1.3x in basic sampling to 2.3x in beam search with a width of 6"; no other cell
# of its Figure 14 has a number in the text. Memory saved by sharing: forks.PAPER_SAVINGS.
PAPER_FORK_RATIOS = {("alpaca", "basic", 1): 1.3, ("alpaca", "beam", 6): 2.3}
FORK_CELLS = (("basic", 1), ("parallel", 2), ("parallel", 4), ("parallel", 6),
              ("beam", 2), ("beam", 4), ("beam", 6))  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ForkServingSettings:
    """What `scripts/sim_serving.py --figure14` runs (defaults: the published run).

    Args:
        datasets: traces to serve.
        systems: "paged" (the ratios' numerator) and Orca policies; FasterTransformer
            is not in the paper's Figure 14.
        cells: (mode, width) pairs, serving_sim.FORK_MODES; ("basic", 1) is the
            reference the paper's 1.3x refers to.
        duration_s: simulated seconds of arrivals per rate (the driver then drains).
        factor, other_factors: latency bounds, x the unloaded normalized latency.
        rel_tol: the bisection stops when hi / lo <= 1 + rel_tol.
        num_unloaded: requests served one at a time for the unloaded latency.
        trace_requests: requests drawn per trace.
        seed: trace seed (a beam search's synthetic candidates are seeded by it and the
            request id).
        max_num_seqs: sequences (samples / beams) a step may run, paged and Orca alike
            (vLLM's default 256; raised in a sensitivity run to lift the cap off paged's
            beams).
    """

    datasets: tuple[str, ...] = ("alpaca",)
    systems: tuple[str, ...] = ("paged", "orca-oracle", "orca-pow2", "orca-max")
    cells: tuple[tuple[str, int], ...] = FORK_CELLS
    duration_s: float = 30.0
    factor: float = 4.0
    other_factors: tuple[float, ...] = (2.0, 8.0)
    rel_tol: float = 0.08
    num_unloaded: int = 100
    trace_requests: dict = dataclasses.field(
        default_factory=lambda: {"sharegpt": 6_000, "alpaca": 40_000}
    )
    seed: int = 0
    max_num_seqs: int = sim.MAX_NUM_SEQS


def _nearest(points: list[dict[str, Any]], rate: float) -> dict[str, Any]:
    return min(points, key=lambda p: abs(p["rate"] - rate))


def run_fork_study(
    settings: ForkServingSettings = ForkServingSettings(),
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Figure 14 on the simulated clock: per trace and (mode, width) cell, the sustained
    rates by bisection at every bound, the ratios and paged's saving from sharing."""
    from paged_jax.memory_study.forks import PAPER_SAVINGS

    if "paged" not in settings.systems or "fastertransformer" in settings.systems:
        raise ValueError(f"systems={settings.systems!r} must include 'paged', not FT")
    model = sim.StepTimeModel()
    out: dict[str, Any] = {
        "settings": dataclasses.asdict(settings),
        "model": model.constants(),
        "kv_budget_bytes": sim.KV_BUDGET_BYTES,
        "block_size": sim.BLOCK_SIZE,
        "max_model_len": sim.MAX_MODEL_LEN,
        "max_num_seqs": settings.max_num_seqs,
        "max_num_batched_tokens": sim.MAX_NUM_BATCHED_TOKENS,
        "beam_model": dataclasses.asdict(sim.BEAM_MODEL),
        "paper_ratios_over_oracle": [
            {"dataset": d, "mode": m, "width": w, "ratio": r}
            for (d, m, w), r in PAPER_FORK_RATIOS.items()
        ],
        "paper_savings": [
            {"mode": m, "dataset": d, "range": list(r)} for (m, d), r in PAPER_SAVINGS.items()
        ],
        "traces": {},
    }
    factors = (settings.factor, *settings.other_factors)
    for dataset in settings.datasets:
        trace = sim.make_trace(dataset, settings.trace_requests[dataset], seed=settings.seed)
        cells = []
        for mode, width in settings.cells:
            t0 = time.perf_counter()
            res = _study_trace(trace, model, settings, factors, progress,
                               rel_tol=settings.rel_tol, mode=mode, width=width)  # fmt: skip
            res.pop("runs")
            main = res["bounds"][0]
            at_sustained = {
                s: _nearest(res["points"][s], main["sustained"][s]) for s in settings.systems
            }
            res.update(
                mode=mode,
                width=width,
                paper_over_oracle=PAPER_FORK_RATIOS.get((dataset, mode, width)),
                paper_saving=None if mode == "basic" else list(PAPER_SAVINGS[(mode, dataset)]),
                paged_saving_at_sustained=at_sustained["paged"]["blocks_saved_by_sharing"],
                batch_at_sustained={s: p["time_avg_batch_size"] for s, p in at_sustained.items()},
                cell_wall_s=time.perf_counter() - t0,
            )
            cells.append(res)
        out["traces"][dataset] = {
            "cells": cells,
            "mean_prompt_tokens": float(np.mean([r.num_prompt_tokens for r in trace.requests])),
            "mean_output_tokens": float(np.mean([r.num_output_tokens for r in trace.requests])),
        }
    return out


def plot_fork_latency(summary: dict[str, Any], path: Any, dataset: str = "alpaca") -> None:
    """Figure 14 redrawn: one row per mode (parallel sampling, beam search), one panel per
    width; mean normalized latency against rate for every system, 4x bound dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in summary["traces"][dataset]["cells"] if c["mode"] != "basic"]
    modes = list(dict.fromkeys(c["mode"] for c in cells))
    widths = sorted({c["width"] for c in cells})
    fig, axes = plt.subplots(len(modes), len(widths), figsize=(4.3 * len(widths),
                             3.6 * len(modes)), dpi=120, squeeze=False)  # fmt: skip
    for c in cells:
        ax = axes[modes.index(c["mode"]), widths.index(c["width"])]
        main = c["bounds"][0]
        cap = 2.5 * main["bound_s_per_token"]
        for s, pts in c["points"].items():
            color, marker, label = _STYLE.get(s, ("black", ".", s))
            ax.plot([p["rate"] for p in pts],
                    [min(p["mean_normalized_latency_s"], cap * 1.05) for p in pts],
                    color=color, marker=marker, ms=3.5, lw=1.1,
                    label=f"{label}: {main['sustained'][s]:.3g}")  # fmt: skip
        ax.axhline(main["bound_s_per_token"], color="black", lw=0.8, ls="--")
        ax.set_xscale("log")
        ax.set_ylim(0, cap * 1.08)
        name = "parallel size" if c["mode"] == "parallel" else "beam width"
        ax.set_title(f"{dataset}, {name} {c['width']}", fontsize=9)
        ax.set_xlabel("request rate (req/s, log)", fontsize=8)
        ax.set_ylabel("normalized latency (s/token)", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, title=f"req/s at {main['factor']:g}x unloaded", title_fontsize=6)
    fig.suptitle(
        f"Figure 14 on the simulated clock: OPT-13B, A100-40GB, "
        f"{summary['settings']['duration_s']:g}-s traces",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def fork_headline_table(summary: dict[str, Any]) -> str:
    """One row per cell at the main bound: paged / Oracle beside the paper's, that ratio
    over the same trace's basic-sampling ratio (the paper: 2.3 / 1.3 = 1.77 at beam
    width 6), paged's batch against Oracle's and the blocks sharing saved."""
    lines = [
        "| trace | cell | paged / Oracle | / Pow2 | / Max | paged / Oracle over basic's "
        "| paper paged / Oracle | batch paged / Oracle | paged blocks saved (paper) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for dataset, res in summary["traces"].items():
        basic = next((c for c in res["cells"] if c["mode"] == "basic"), None)
        base = basic["bounds"][0]["paged_over"].get("orca-oracle") if basic else None
        for c in res["cells"]:
            over = c["bounds"][0]["paged_over"]
            ratio = over.get("orca-oracle")
            rel = "-" if ratio is None or not base else f"{ratio / base:.2f}"
            cell = "basic" if c["mode"] == "basic" else f"{c['mode']} {c['width']}"
            paper = "-" if c["paper_over_oracle"] is None else f"{c['paper_over_oracle']:g}x"
            batch = c["batch_at_sustained"]
            saved = f"{100 * c['paged_saving_at_sustained']:.1f}%"
            if c["paper_saving"]:
                saved += f" ({100 * c['paper_saving'][0]:.1f}-{100 * c['paper_saving'][1]:.1f}%)"
            fmt = {s: "-" if over.get(s) is None else f"{over[s]:.2f}x"
                   for s in ("orca-oracle", "orca-pow2", "orca-max")}  # fmt: skip
            lines.append(
                f"| {dataset} | {cell} | {fmt['orca-oracle']} | {fmt['orca-pow2']} | "
                f"{fmt['orca-max']} | {rel} | {paper} | {batch['paged']:.1f} / "
                f"{batch['orca-oracle']:.1f} | {saved} |"
            )
    return "\n".join(lines) + "\n"


def fork_markdown_tables(summary: dict[str, Any]) -> str:
    """The headline table, then sustained rates and paged / Orca ratios per cell and
    bound, beside the paper's."""
    systems = summary["settings"]["systems"]
    others = [s for s in systems if s != "paged"]
    lines = [
        fork_headline_table(summary),
        "| trace | mode | n / width | bound | "
        + " | ".join(f"{s} req/s" for s in systems)
        + " | "
        + " | ".join(f"paged / {s}" for s in others)
        + " | paper paged / orca-oracle | paged blocks saved (paper) |",
        "|" + "---|" * (4 + len(systems) + len(others) + 2),
    ]
    for dataset, res in summary["traces"].items():
        for c in res["cells"]:
            paper = "-" if c["paper_over_oracle"] is None else f"{c['paper_over_oracle']:g}x"
            saved = f"{100 * c['paged_saving_at_sustained']:.1f}%"
            if c["paper_saving"]:
                lo, hi = c["paper_saving"]
                saved += f" ({100 * lo:.1f}-{100 * hi:.1f}%)"
            for i, b in enumerate(c["bounds"]):
                rates = " | ".join(f"{b['sustained'][s]:.3g}" for s in systems)
                ratios = " | ".join(
                    "-" if b["paged_over"][s] is None else f"{b['paged_over'][s]:.2f}x"
                    for s in others
                )
                tail = f" | {paper} | {saved} |" if i == 0 else " | | |"
                lines.append(
                    f"| {dataset} | {c['mode']} | {c['width']} | {b['factor']:g}x | {rates} | "
                    f"{ratios}{tail}"
                )
    return "\n".join(lines) + "\n"
