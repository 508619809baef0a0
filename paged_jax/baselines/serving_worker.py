"""One serving system in its own process (scripts/bench_serving.py starts one per system).

    python -m paged_jax.baselines.serving_worker '<json spec>'

Builds and warms the system (as bench_worker does), draws every trace the spec names,
prints one JSON line {"ready": ...}, then serves one online run per JSON line read from
stdin ({"op": "serve", "trace": NAME, "rate": R, "seed": S, "n": N}: the trace's first N
requests, at rate 0 one at a time; optional "kind": "parallel" or "beam" with "fanout": K
serves each request as K samples or K beams (paged engine and orca-* only); or
{"op": "quit"}), printing
one JSON line per run: its metrics, its per-request records and its outputs. A waiting
worker blocks on stdin and uses no CPU, so the others' runs are timed undisturbed.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

from paged_jax.baselines.bench_worker import build_system
from paged_jax.baselines.serving import (
    ReservationServer,
    Server,
    StaticBatchServer,
    make_fanout_server,
    make_server,
    poisson_arrivals,
    run_metrics,
    serve_online,
    serve_unloaded,
)
from paged_jax.baselines.workload import (
    DatasetTraceConfig,
    TraceRequest,
    load_jsonl_trace,
    make_dataset_trace,
)


def build_trace(spec: dict[str, Any]) -> list[TraceRequest]:
    """A trace spec: DatasetTraceConfig's fields, or {"jsonl": path, ...load_jsonl_trace}."""
    if "jsonl" in spec:
        kwargs = dict(spec)
        return load_jsonl_trace(kwargs.pop("jsonl"), **kwargs)
    return make_dataset_trace(DatasetTraceConfig(**spec))


def build_serving_system(spec: dict[str, Any]) -> tuple[Any, Callable[..., Server]]:
    """The system and a factory of fresh servers over it (one per run).

    The factory takes (kind, fanout): "plain" (one sequence a request), "parallel"
    (fanout samples) or "beam" (fanout beams). "orca-<policy>" is the paged engine behind
    a ReservationServer (buddy placement, the paper's Orca): spec["orca"] holds the
    engine's keywords and the reservation budget in tokens (the pool's usable blocks x
    block_size), one run per sample or beam. "static" is the same engine behind a
    StaticBatchServer (FasterTransformer-style batches); "paged-control" is the paged
    engine again, a second arm whose ratio to the first is the measurement's noise.
    """
    name = spec["system"]
    if name == "paged-control":  # the paged engine again: a second arm shows the noise
        name = "paged"
        spec = {**spec, "system": "paged"}
    if name == "static":
        orca = dict(spec["orca"])
        budget_tokens = orca.pop("reservation_budget_tokens")
        system = build_system({**spec, "system": "paged", "paged": orca})

        def static(kind: str = "plain", fanout: int = 1) -> Server:
            if kind != "plain":
                raise ValueError(f"kind={kind!r}: the static batch serves plain requests only")
            return StaticBatchServer(
                make_server(system), budget_tokens, orca["max_model_len"], orca["max_num_seqs"]
            )

        return system, static
    if not name.startswith("orca-"):
        system = build_system(spec)

        def plain(kind: str = "plain", fanout: int = 1) -> Server:
            if kind == "plain":
                return make_server(system)
            if not hasattr(system, "engine"):
                raise ValueError(f"kind={kind!r} needs the paged engine, not {name!r}")
            return make_fanout_server(system, kind, fanout)

        return system, plain
    orca = dict(spec["orca"])
    budget_tokens = orca.pop("reservation_budget_tokens")
    system = build_system({**spec, "system": "paged", "paged": orca})
    policy = name.split("-", 1)[1]

    def factory(kind: str = "plain", fanout: int = 1) -> Server:
        inner = make_fanout_server(system, kind, fanout)
        return ReservationServer(
            inner,
            policy,
            budget_tokens,
            orca["max_model_len"],
            copies=1 if kind == "plain" else fanout,
            extra_kv_tokens=1 if kind == "beam" else 0,
            granularity=orca["block_size"],
        )

    return system, factory


def serve(
    new_server: Callable[..., Server],
    trace: list[TraceRequest],
    rate: float,
    seed: int,
    kind: str = "plain",
    fanout: int = 1,
) -> dict[str, Any]:
    """One online run at `rate`: metrics, per-request (arrival, finish, tokens) and outputs.

    rate 0 is the unloaded run: the requests one at a time.
    """
    server = new_server(kind, fanout)
    if rate == 0:
        run = serve_unloaded(server, trace)
    else:
        run = serve_online(server, trace, poisson_arrivals(len(trace), rate, seed))
    records = [[r.request_id, r.arrival_s, r.finish_s, r.num_output_tokens] for r in run.records]
    summary = {"rate": rate, "seed": seed, **run_metrics(run), **server.extra()}
    return {"summary": summary, "records": records, "outputs": run.outputs}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(argv[0])
    traces = {name: build_trace(t) for name, t in spec["traces"].items()}
    system, new_server = build_serving_system(spec)
    ready = {"ready": True, "pid": os.getpid(), "warmup_s": getattr(system, "warmup_s", 0.0)}
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        trace = traces[cmd["trace"]][: cmd.get("n")]
        kind, fanout = cmd.get("kind", "plain"), int(cmd.get("fanout", 1))
        result = serve(new_server, trace, float(cmd["rate"]), int(cmd["seed"]), kind, fanout)
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
