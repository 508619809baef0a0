"""The study's figures (PNG). matplotlib is imported inside the functions (the `plots` extra)."""

from __future__ import annotations

import pathlib

import numpy as np

from paged_jax.memory_study.records import CATEGORIES, RunResult
from paged_jax.memory_study.report import (
    PAPER_PARALLEL_SAMPLING_SAVING,
    PAPER_TOKEN_STATES,
    Study,
)
from paged_jax.memory_study.sim import BLOCK_STATES

CATEGORY_COLORS = {
    "token_states": "#2e7d32",
    "reserved": "#f9a825",
    "internal_frag": "#c62828",
    "external_frag": "#6a1b9a",
    "free": "#e0e0e0",
}
CATEGORY_LABELS = {
    "token_states": "token states",
    "reserved": "reserved (filled later)",
    "internal_frag": "internal fragmentation",
    "external_frag": "external fragmentation",
    "free": "free",
}
STATE_COLORS = ("#f5f5f5", "#90caf9", "#ef6c00", "#6a1b9a")  # free, cached-free, owned, shared
FIGURES = ("breakdown", "batch_size", "occupancy", "block_table", "sharing")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _paper_key(allocator: str) -> str:
    return "paged" if allocator.startswith("paged") else allocator


def plot_breakdown(study: Study, path: pathlib.Path) -> None:
    """Figure-2-style stacked bars: mean share of the KV budget per category, under load."""
    plt = _plt()
    names = list(study.base)
    rows = max(len(r) for r in study.base.values())
    fig, axes = plt.subplots(len(names), 1, figsize=(9, 2.2 + 0.55 * rows * len(names)))
    axes = np.atleast_1d(axes)
    for ax, name in zip(axes, names):
        runs = study.base[name]
        labels = [r.allocator for r in runs]
        y = np.arange(len(runs))[::-1]
        left = np.zeros(len(runs))
        for cat in CATEGORIES:
            vals = np.array([100 * r.breakdown("load")[cat] for r in runs])
            ax.barh(y, vals, left=left, color=CATEGORY_COLORS[cat], label=CATEGORY_LABELS[cat])
            left += vals
        for yi, r in zip(y, runs):
            u = 100 * r.breakdown("load")["token_states"]
            ax.text(1, yi, f"{u:.1f}%", va="center", ha="left", color="white", fontsize=9)
            paper = PAPER_TOKEN_STATES.get(_paper_key(r.allocator))
            if paper is not None:
                ax.plot([100 * paper], [yi], marker="D", color="black", ms=6, ls="none")
        ax.set_yticks(y, labels)
        ax.set_xlim(0, 100)
        wl = runs[0]
        ax.set_title(
            f"{name}: {wl.num_requests} requests, KV budget {wl.kv_budget_tokens} token slots "
            "(mean over steps with requests waiting)",
            fontsize=10,
        )
    axes[-1].set_xlabel("share of KV memory (%)    black diamond: paper's token-state share")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_batch_size(study: Study, path: pathlib.Path) -> None:
    """Running batch size per step for every allocator."""
    plt = _plt()
    names = list(study.base)
    fig, axes = plt.subplots(1, len(names), figsize=(6.5 * len(names), 4.2))
    axes = np.atleast_1d(axes)
    for ax, name in zip(axes, names):
        for r in study.base[name]:
            style = "-" if r.allocator.startswith("paged") else "--"
            mean = r.summary()["mean_batch_size"]
            ax.plot(r.arrays["batch_size"], style, lw=1.2, label=f"{r.allocator} (mean {mean:.0f})")
        ax.set_title(f"{name}: running requests per step", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("running batch size")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_occupancy(runs: list[RunResult], path: pathlib.Path) -> None:
    """Block-pool occupancy maps: physical blocks (rows) x steps, coloured by block state."""
    plt = _plt()
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    runs = [r for r in runs if r.occupancy is not None]
    fig, axes = plt.subplots(1, len(runs), figsize=(6.5 * len(runs), 5.2), squeeze=False)
    cmap = ListedColormap(STATE_COLORS)
    for ax, r in zip(axes[0], runs):
        occ = r.occupancy.T  # [num_blocks, steps]
        ax.imshow(
            occ,
            aspect="auto",
            interpolation="nearest",
            cmap=cmap,
            vmin=-0.5,
            vmax=3.5,
            origin="lower",
            extent=(-0.5, occ.shape[1] - 0.5, 0.5, occ.shape[0] + 0.5),
        )
        ax.set_title(
            f"{r.workload}, {r.allocator}, caching={'on' if r.extra['prefix_caching'] else 'off'}",
            fontsize=10,
        )
        ax.set_xlabel("step")
        ax.set_ylabel("physical block id")
    handles = [Patch(color=c, label=s) for c, s in zip(STATE_COLORS, BLOCK_STATES)]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=9, frameon=True)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_block_table(snapshot: dict, path: pathlib.Path) -> None:
    """One request's block table, logical -> physical blocks (the paper's Figure 6 idea)."""
    plt = _plt()
    from matplotlib.patches import Rectangle

    ids = snapshot["block_ids"]
    bs = snapshot["block_size"]
    n = len(ids)
    phys = sorted(set(ids))
    fig_h = max(3.0, 0.32 * n + 1.6)
    fig, ax = plt.subplots(figsize=(10, fig_h))
    row = {pid: len(phys) - 1 - k for k, pid in enumerate(phys)}  # physical: ascending ids
    for i, (pid, filled, ref) in enumerate(zip(ids, snapshot["filled"], snapshot["ref_cnts"])):
        y = n - 1 - i
        shared = ref >= 2
        color = STATE_COLORS[3] if shared else STATE_COLORS[2]
        # Logical block: filled slots solid, empty slots hatched.
        ax.add_patch(Rectangle((0, y + 0.1), filled / bs * 2.4, 0.8, color=color))
        ax.add_patch(Rectangle((0, y + 0.1), 2.4, 0.8, fill=False, ec="black", lw=0.8))
        if filled < bs:
            ax.add_patch(
                Rectangle(
                    (filled / bs * 2.4, y + 0.1),
                    (bs - filled) / bs * 2.4,
                    0.8,
                    fill=False,
                    hatch="///",
                    ec="grey",
                    lw=0,
                )
            )
        ax.text(-0.1, y + 0.5, f"logical {i}", ha="right", va="center", fontsize=8)
        ax.text(2.5, y + 0.5, f"{filled}/{bs}", ha="left", va="center", fontsize=8)
        py = row[pid] * n / max(len(phys), 1)
        ax.annotate(
            "",
            xy=(6.0, py + 0.5),
            xytext=(3.2, y + 0.5),
            arrowprops=dict(arrowstyle="->", color="grey", lw=0.7),
        )
        ax.add_patch(Rectangle((6.0, py + 0.1), 2.4, 0.8, color=color))
        label = f"#{pid}" + (f"  ref {ref}" if shared else "")
        ax.text(8.5, py + 0.5, label, ha="left", va="center", fontsize=8)
    ax.set_xlim(-1.6, 10.2)
    ax.set_ylim(-0.2, n + 0.6)
    ax.axis("off")
    ax.text(1.2, n + 0.2, "logical blocks (#filled)", ha="center", fontsize=9)
    ax.text(7.2, n + 0.2, "physical blocks (pool ids)", ha="center", fontsize=9)
    ax.set_title(
        f"block table of {snapshot['request_id']} at step {snapshot['step']}: "
        f"{snapshot['num_computed_tokens']} tokens ({snapshot['num_prompt_tokens']} prompt), "
        f"block_size {bs}; purple = shared via prefix cache, orange = owned",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sharing(study: Study, path: pathlib.Path) -> None:
    """KV blocks saved by sharing and the batch size it buys, per sharing workload."""
    plt = _plt()
    names = list(study.sharing)
    on = [study.sharing[n][0].summary() for n in names]
    off = [study.sharing[n][1].summary() for n in names]
    x = np.arange(len(names))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.4))
    saved = [100 * s["share_saved_by_sharing"] for s in on]
    a1.bar(x, saved, color=STATE_COLORS[3])
    for xi, v, s in zip(x, saved, on):
        a1.text(
            xi,
            v,
            f"{v:.1f}%\n({s['mean_blocks_saved_by_sharing']:.0f} blk)",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    lo, hi = (100 * v for v in PAPER_PARALLEL_SAMPLING_SAVING)
    a1.axhspan(lo, hi, color="grey", alpha=0.25, label="paper: parallel sampling saves 6.1-9.8%")
    a1.set_xticks(x, names, rotation=15, fontsize=8)
    a1.set_ylabel("blocks saved (% of unshared need)")
    a1.set_ylim(0, max(saved + [hi]) * 1.3 + 1)
    a1.legend(fontsize=8)
    a1.set_title("memory saved by sharing (time average, ref counts)", fontsize=10)
    w = 0.38
    a2.bar(
        x - w / 2,
        [s["mean_batch_size"] for s in on],
        w,
        label="prefix caching on",
        color=STATE_COLORS[3],
    )
    a2.bar(
        x + w / 2,
        [s["mean_batch_size"] for s in off],
        w,
        label="prefix caching off",
        color=STATE_COLORS[2],
    )
    a2.set_xticks(x, names, rotation=15, fontsize=8)
    a2.set_ylabel("mean running batch size")
    a2.legend(fontsize=8)
    a2.set_title("batch size at the same KV budget", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def make_all(study: Study, out_dir: str | pathlib.Path) -> dict[str, pathlib.Path]:
    """Writes every figure into out_dir; returns figure name -> path."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / f"{name}.png" for name in FIGURES}
    plot_breakdown(study, paths["breakdown"])
    plot_batch_size(study, paths["batch_size"])
    occ_runs = [r for runs in study.base.values() for r in runs if r.occupancy is not None]
    occ_runs += [p[0] for p in study.sharing.values() if p[0].occupancy is not None]
    plot_occupancy(occ_runs, paths["occupancy"])
    snap = next(p[0].block_table for p in study.sharing.values() if p[0].block_table)
    plot_block_table(snap, paths["block_table"])
    plot_sharing(study, paths["sharing"])
    return paths
