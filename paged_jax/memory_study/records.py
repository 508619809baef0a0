"""Per-step memory accounting shared by the paged runner and the contiguous baselines.

Every step splits the KV budget (token slots) into five disjoint parts, measured after
scheduling (the state the step's forward pass runs in):

    budget = token_states + reserved + internal_frag + external_frag + free

token_states: slots holding a token's KV (a shared block counts once).
reserved: allocated slots the owner fills later (future tokens of its true length).
internal_frag: allocated slots the owner never fills (beyond its true length).
external_frag: free slots that the next waiting request cannot use because no single
    free hole fits its reservation (contiguous only: any free block fits a paged request).
free: the rest (paged: free-queue blocks, cached-but-free ones included).
"""

from __future__ import annotations

import dataclasses

import numpy as np

CATEGORIES = ("token_states", "reserved", "internal_frag", "external_frag", "free")
_FIELDS = (
    *CATEGORIES,
    "batch_size",
    "waiting",
    "logical_tokens",
    "logical_blocks",
    "used_blocks",
    "max_tail_waste",
)


class StepLog:
    """Column-wise per-step records; `finish` freezes them into a RunResult."""

    def __init__(self) -> None:
        self.cols: dict[str, list[int]] = {f: [] for f in _FIELDS}

    def add(self, **values: int) -> None:
        """Records one step; every field of _FIELDS must be given."""
        assert values.keys() == set(_FIELDS), f"step record fields {sorted(values)} are incomplete"
        for k, v in values.items():
            self.cols[k].append(int(v))

    def finish(self, **meta) -> RunResult:
        arrays = {k: np.asarray(v, dtype=np.int64) for k, v in self.cols.items()}
        return RunResult(arrays=arrays, **meta)


@dataclasses.dataclass
class RunResult:
    """One allocator on one workload.

    Attributes:
        workload: workload name.
        allocator: e.g. "paged-16", "contig-max", "contig-pow2", "contig-oracle".
        kv_budget_tokens: the budget every category is a share of.
        block_size: paged block size in tokens (None for contiguous).
        arrays: per-step int64 columns, see records.CATEGORIES and _FIELDS.
        num_preemptions: scheduler preemptions (recompute) over the run.
        num_requests: requests in the trace (all finished at the end).
        occupancy: optional i8[steps, num_blocks] block states (see sim.BLOCK_STATES).
        block_table: optional snapshot of one request's block table.
        extra: anything else worth reporting (prefix-cache hits, checks).
    """

    workload: str
    allocator: str
    kv_budget_tokens: int
    arrays: dict[str, np.ndarray]
    block_size: int | None = None
    num_preemptions: int = 0
    num_requests: int = 0
    occupancy: np.ndarray | None = None
    block_table: dict | None = None
    extra: dict = dataclasses.field(default_factory=dict)

    @property
    def num_steps(self) -> int:
        return len(self.arrays["batch_size"])

    def window(self, which: str) -> np.ndarray:
        """Boolean step mask: "busy" = every step (requests running or waiting);
        "load" = steps with a request waiting (memory or budget is the limit)."""
        if which == "busy":
            return np.ones(self.num_steps, dtype=bool)
        if which == "load":
            return self.arrays["waiting"] > 0
        raise ValueError(f"which={which!r} must be 'busy' or 'load'")

    def breakdown(self, which: str = "load") -> dict[str, float]:
        """Mean share of the budget per category over the window's steps."""
        mask = self.window(which)
        if not mask.any():
            mask = self.window("busy")
        return {c: float(self.arrays[c][mask].mean() / self.kv_budget_tokens) for c in CATEGORIES}

    def summary(self) -> dict:
        """The numbers the report prints, JSON-ready."""
        a = self.arrays
        load = self.window("load")
        logical = a["logical_blocks"].astype(float)
        saved = a["logical_blocks"] - a["used_blocks"]
        out = {
            "workload": self.workload,
            "allocator": self.allocator,
            "block_size": self.block_size,
            "kv_budget_tokens": self.kv_budget_tokens,
            "num_requests": self.num_requests,
            "num_steps": self.num_steps,
            "num_load_steps": int(load.sum()),
            "utilization_busy": self.breakdown("busy")["token_states"],
            "utilization_load": self.breakdown("load")["token_states"],
            "logical_utilization_load": float(
                a["logical_tokens"][load if load.any() else slice(None)].mean()
                / self.kv_budget_tokens
            ),
            "breakdown_load": self.breakdown("load"),
            "breakdown_busy": self.breakdown("busy"),
            "mean_batch_size": float(a["batch_size"].mean()),
            "mean_batch_size_load": float(a["batch_size"][load].mean()) if load.any() else None,
            "max_batch_size": int(a["batch_size"].max()),
            "num_preemptions": self.num_preemptions,
            "max_tail_waste_tokens": int(a["max_tail_waste"].max()),
        }
        if self.block_size is not None:
            out["mean_blocks_saved_by_sharing"] = float(saved.mean())
            out["max_blocks_saved_by_sharing"] = int(saved.max())
            out["mean_logical_blocks"] = float(logical.mean())
            out["mean_used_blocks"] = float(a["used_blocks"].mean())
            total = logical.sum()
            out["share_saved_by_sharing"] = float(saved.sum() / total) if total else 0.0
        out.update(self.extra)
        return out
