"""Baselines for the engine benchmark (scripts/bench_engine.py).

workload: ShareGPT-like synthetic trace; contiguous_kv: the pre-PagedAttention JAX
baseline; hf_generate: transformers static batches; harness: runs and compares them.
Nothing here is imported by paged_jax itself.
"""
