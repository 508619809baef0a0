"""The host modules must never import jax (DESIGN.md: testable without a device)."""

from __future__ import annotations

import subprocess
import sys

HOST_MODULES = [
    "paged_jax",
    "paged_jax.request",
    "paged_jax.hashing",
    "paged_jax.kv_cache_block",
    "paged_jax.block_pool",
    "paged_jax.single_type_kv_cache_manager",
    "paged_jax.kv_cache_coordinator",
    "paged_jax.kv_cache_blocks",
    "paged_jax.kv_cache_manager",
    "paged_jax.config",
    "paged_jax.sampling_params",
    "paged_jax.input_batch",
    "paged_jax.scheduler",
    "paged_jax.outputs",
    "paged_jax.demo",
    "paged_jax.demo_prompts",
    "paged_jax.generate_cli",
]


def test_importing_host_modules_leaves_jax_unimported():
    code = (
        "import importlib, sys\n"
        f"for name in {HOST_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "from paged_jax import KVCacheManager, Request\n"
        "m = KVCacheManager(8, 4, max_model_len=32)\n"
        "r = Request('r', [1, 2, 3, 4, 5])\n"
        "m.allocate_slots(r, 5, *m.get_computed_blocks(r)[::-1])\n"
        "m.free(r)\n"
        "bad = sorted(k for k in sys.modules if k == 'jax' or k.startswith(('jax.', 'jaxlib')))\n"
        "print(bad)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"
