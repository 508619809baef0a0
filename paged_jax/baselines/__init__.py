"""Baselines for the engine and serving benchmarks (scripts/bench_engine.py, bench_serving.py).

workload: synthetic traces; contiguous_kv: the pre-PagedAttention JAX baseline;
hf_generate: transformers static batches; harness: runs and compares them; serving:
online Poisson arrivals, latency metrics and the Orca reservation gate. Nothing here is
imported by paged_jax itself.
"""
