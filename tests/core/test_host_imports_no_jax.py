"""The host side must never import jax, so it is testable without a device.

The rule is on the folder: every module under paged_jax/core/ is found by walking the
package, so a new host module is covered the moment it is added. A few jax-free modules
outside core/ (the API configs, the input batch, the CLI front end) are checked too.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import paged_jax

CORE_DIR = pathlib.Path(paged_jax.__file__).parent / "core"

# Outside core/ but also jax-free: the package root, its configs and the CLI front end.
OTHER_HOST_MODULES = [
    "paged_jax",
    "paged_jax.config",
    "paged_jax.sampling_params",
    "paged_jax.outputs",
    "paged_jax.model_api",
    "paged_jax.worker.input_batch",
    "paged_jax.entrypoints.demo",
    "paged_jax.entrypoints.demo_prompts",
    "paged_jax.entrypoints.generate_cli",
    "paged_jax.memory_study.serving_study",  # imports serving_sim and baselines.serving
]


def _core_modules() -> list[str]:
    names = ["paged_jax.core"]
    for path in sorted(CORE_DIR.rglob("*.py")):
        rel = path.relative_to(CORE_DIR.parent.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts))
    return sorted(set(names))


def _jax_modules_after_importing(names: list[str], extra: str = "") -> list[str]:
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        f"{extra}"
        "bad = sorted(k for k in sys.modules if k == 'jax' or k.startswith(('jax.', 'jaxlib')))\n"
        "print(bad)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return eval(proc.stdout.strip())  # a printed list of str


def test_core_folder_is_walked_not_listed():
    names = _core_modules()
    # The walk must find the modules the folder is known to hold (guards a broken walk).
    for expected in ("block_pool", "kv_cache_manager", "scheduler", "request", "hashing"):
        assert f"paged_jax.core.{expected}" in names
    assert len(names) == len(list(CORE_DIR.rglob("*.py")))


def test_every_core_module_leaves_jax_unimported():
    exercise = (
        "from paged_jax.core.kv_cache_manager import KVCacheManager\n"
        "from paged_jax.core.request import Request\n"
        "m = KVCacheManager(8, 4, max_model_len=32)\n"
        "r = Request('r', [1, 2, 3, 4, 5])\n"
        "m.allocate_slots(r, 5, *m.get_computed_blocks(r)[::-1])\n"
        "m.free(r)\n"
    )
    assert _jax_modules_after_importing(_core_modules(), exercise) == []


def test_api_configs_and_cli_front_end_leave_jax_unimported():
    assert _jax_modules_after_importing(OTHER_HOST_MODULES) == []
