"""One benchmark system in its own process (scripts/bench_engine.py starts one per system).

    python -m paged_jax.baselines.bench_worker '<json spec>'

Builds and warms the system, prints one JSON line {"ready": ...}, then serves one timed
run per JSON line read from stdin ({"op": "run"}, for HF {"op": "run", "batch_size": B,
"threads": N}, or {"op": "quit"}),
printing one JSON line per run: the summary and the outputs. The HF system imports only
torch, the others only jax, so the two frameworks never share a process (or its thread
pools) while a run is timed; a waiting worker blocks on stdin and uses no CPU.
"""

from __future__ import annotations

import json
import os
import sys

from paged_jax.baselines.workload import WorkloadConfig, make_trace


def build_system(spec: dict):
    """Builds and warms one system from its JSON spec (jax or torch imported here only)."""
    system = spec["system"]
    if system != "hf" and spec.get("compile_cache_dir"):
        # Shared by the sweep's workers: a setting whose step shapes an earlier one
        # compiled loads them instead (warm-up only; no timed run compiles).
        from paged_jax.compile_cache import enable_compile_cache

        enable_compile_cache(spec["compile_cache_dir"])
    if system == "hf":
        from paged_jax.baselines.harness import HFSystem

        return HFSystem(spec["model_dir"], dtype=spec["dtype"], num_threads=spec["threads"])
    tp = spec.get("tensor_parallel_size", 1)
    if tp > 1:
        import jax

        # On a CPU host, fake the devices (before jax's first device query); GPUs keep theirs.
        jax.config.update("jax_num_cpu_devices", tp)
    from paged_jax.baselines.harness import ContiguousSystem, PagedSystem
    from paged_jax.models import load_model

    if system == "paged" and tp > 1:
        from paged_jax.worker.sharding import make_mesh

        model = load_model(spec["model_dir"], dtype=spec["dtype"], mesh=make_mesh(tp))
        return PagedSystem(model, **spec["paged"], tensor_parallel_size=tp)
    model = load_model(spec["model_dir"], dtype=spec["dtype"])
    if system == "paged":
        return PagedSystem(model, **spec["paged"])
    if system.startswith("contiguous-"):
        return ContiguousSystem(model, policy=system.split("-", 1)[1], **spec["contiguous"])
    raise ValueError(f"system={system!r} must be paged, contiguous-<policy> or hf")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(argv[0])
    trace = make_trace(WorkloadConfig(**spec["workload"]))
    system = build_system(spec)
    ready = {"ready": True, "pid": os.getpid(), "warmup_s": getattr(system, "warmup_s", 0.0)}
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if spec["system"] == "hf":
            result = system.run(trace, cmd["batch_size"], num_threads=cmd.get("threads"))
        else:
            result = system.run(trace)
        print(json.dumps({"summary": result.summary(), "outputs": result.outputs}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
