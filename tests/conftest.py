"""Shared fixtures: tiny seeded random-weight Hugging Face checkpoints and their reference logits.

    def test_x(tiny_hf_checkpoint, hf_logits):
        path = tiny_hf_checkpoint("llama", num_key_value_heads=1)   # cached per arguments
        ref = hf_logits(path, input_ids)                            # f32[B, L, V] numpy

    def test_y(small_llm):      # one warmed-up LLM on model_dir shared by the LLM API tests
        small_llm.generate(...)  # its prefix cache is empty at the start of every test

transformers/torch are imported inside the fixtures only, so test modules that do not use
them never pay for the import; where they are not installed (the Python 3.12 newest-jax
venv of scripts/test_newest_jax.sh), every test using these fixtures skips with a reason.

Every test process (both pytest-xdist workers, both CI Python stages, and the subprocesses
tests spawn, through the environment) shares one persistent XLA compilation cache: see
pytest_configure. PAGED_JAX_TEST_XLA_CACHE=0 turns it off; a path moves it.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
from typing import Any

import numpy as np
import pytest

# The suite compiles thousands of small XLA programs that each run for milliseconds, so on
# the CPU backend LLVM's optimization passes cost more CPU than the runs they speed up:
# every test process compiles at XLA's backend optimization level 0 (through XLA_FLAGS,
# set here before jax starts a backend, so the subprocesses tests spawn inherit it),
# except where a GPU may serve the tests (_may_run_on_a_gpu).
# Measured on tests/engine/test_async_scheduling.py, one process, cold test cache:
# 79.0 -> 53.8 CPU s (docs/ci.md). Every comparison keeps its tolerance and passes.
# PAGED_JAX_TEST_XLA_OPT_LEVEL=default keeps XLA's own level; a number sets that level;
# an XLA_FLAGS that already names the level wins.
TEST_XLA_OPT_LEVEL_ENV = "PAGED_JAX_TEST_XLA_OPT_LEVEL"


def _may_run_on_a_gpu() -> bool:
    """A jax CUDA plugin is installed and JAX_PLATFORMS does not pin the CPU (the device
    run's tests): those keep XLA's own level, as every program served on a GPU does."""
    import importlib.util

    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return False
    for name in (
        "jax_cuda13_plugin",
        "jax_cuda12_plugin",
        "jax_plugins.xla_cuda13",
        "jax_plugins.xla_cuda12",
    ):
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ModuleNotFoundError:  # jax_plugins itself is absent
            pass
    return False


def _set_test_xla_opt_level() -> None:
    level = os.environ.get(TEST_XLA_OPT_LEVEL_ENV, "0")
    flags = os.environ.get("XLA_FLAGS", "")
    if level == "default" or "xla_backend_optimization_level" in flags:
        return
    if TEST_XLA_OPT_LEVEL_ENV not in os.environ and _may_run_on_a_gpu():
        return
    if not level.isdigit():
        raise ValueError(
            f"{TEST_XLA_OPT_LEVEL_ENV}={level!r} must be 'default' or an XLA optimization "
            "level (0-3)"
        )
    extra = f" --xla_backend_optimization_level={level}"
    emitters = os.environ.get(TEST_CPU_EMITTERS_ENV, "default")
    if emitters not in ("legacy", "default"):
        raise ValueError(f"{TEST_CPU_EMITTERS_ENV}={emitters!r} must be 'legacy' or 'default'")
    if level == "0" and emitters == "legacy" and _has_legacy_cpu_emitters():
        extra += f" {LEGACY_CPU_EMITTERS_FLAG}"
    os.environ["XLA_FLAGS"] = f"{flags}{extra}".strip()


# PAGED_JAX_TEST_CPU_EMITTERS=legacy (scripts/test.sh's main pass sets it): with level 0,
# XLA's CPU backend up to jaxlib 0.10 also takes its element-wise fusion emitters instead
# of the MLIR-based ones, which cost more to compile than these programs run:
# tests/engine/test_engine_hf.py, one process, cold: 93.4 -> 64.4 CPU s (docs/ci.md).
# jaxlib 0.11 removed the flag (XLA refuses unknown flags), so it is set only below that.
# Those emitters do not keep the batch-invariant mode's bits from one batch composition
# to the next, and gave one Gemma 2 prompt-logprob rank transformers' logprobs rule out,
# so those tests (marker xla_default_cpu_codegen) skip under them, saying so, and
# scripts/test.sh runs them in a second pass under XLA's own emitters. A plain `pytest`
# keeps XLA's own emitters ("default").
LEGACY_CPU_EMITTERS_FLAG = "--xla_cpu_use_fusion_emitters=false"
TEST_CPU_EMITTERS_ENV = "PAGED_JAX_TEST_CPU_EMITTERS"
DEFAULT_CODEGEN_MARKER = "xla_default_cpu_codegen"


def _has_legacy_cpu_emitters() -> bool:
    """jaxlib < 0.11: its XLA still has the --xla_cpu_use_fusion_emitters switch."""
    import importlib.metadata

    try:
        version = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return False
    parts = version.split(".")
    try:
        return (int(parts[0]), int(parts[1])) < (0, 11)
    except (IndexError, ValueError):
        return False


_set_test_xla_opt_level()


from paged_jax.compile_cache import default_cache_root  # noqa: E402
from paged_jax.testing.tiny_models import build_tiny_hf_checkpoint  # noqa: E402

TEST_XLA_CACHE_ENV = "PAGED_JAX_TEST_XLA_CACHE"
# PAGED_JAX_TEST_CPU_DURATIONS=N: print the N tests that took the most CPU seconds (setup,
# call and teardown; the test process plus the subprocesses it waited for). On a shared,
# loaded machine wall times swing several-fold while CPU seconds stay close to the wall
# time of an idle 2-core CI machine; docs/ci.md's slowest tests were measured so.
CPU_DURATIONS_ENV = "PAGED_JAX_TEST_CPU_DURATIONS"
_cpu_seconds: dict[str, float] = {}


def _process_cpu_seconds() -> float:
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


_CPU_START = pytest.StashKey[float]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if os.environ.get(CPU_DURATIONS_ENV):
        item.stash[_CPU_START] = _process_cpu_seconds()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_makereport(item, call):
    # The teardown report carries the test's CPU seconds as a user property, so that
    # pytest-xdist workers hand it to the controller with the report.
    if call.when == "teardown" and _CPU_START in item.stash:
        spent = _process_cpu_seconds() - item.stash[_CPU_START]
        item.user_properties.append(("cpu_s", round(spent, 2)))


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        for name, value in report.user_properties:
            if name == "cpu_s":
                _cpu_seconds[report.nodeid] = value


def pytest_terminal_summary(terminalreporter):
    count = int(os.environ.get(CPU_DURATIONS_ENV) or 0)
    if count <= 0 or not _cpu_seconds:
        return
    slowest = sorted(_cpu_seconds.items(), key=lambda kv: -kv[1])[:count]
    total = sum(_cpu_seconds.values())
    terminalreporter.write_sep("=", f"{len(slowest)} most CPU seconds (all: {total:.1f} s)")
    for nodeid, seconds in slowest:
        terminalreporter.write_line(f"{seconds:8.2f}s cpu  {nodeid}")


def _legacy_cpu_emitters_on() -> bool:
    return LEGACY_CPU_EMITTERS_FLAG in os.environ.get("XLA_FLAGS", "")


def pytest_collection_modifyitems(config, items):
    """Under the legacy CPU emitters, tests marked xla_default_cpu_codegen skip with why."""
    if not _legacy_cpu_emitters_on():
        return
    skip = pytest.mark.skip(
        reason=(
            f"checks what XLA's legacy CPU emitters do not keep (batch-invariant bits, a "
            f"rank; {TEST_CPU_EMITTERS_ENV}=legacy: {LEGACY_CPU_EMITTERS_FLAG}); "
            f"runs with XLA's own emitters (scripts/test.sh's second pass, or plain pytest)"
        )
    )
    for item in items:
        if item.get_closest_marker(DEFAULT_CODEGEN_MARKER) is not None:
            item.add_marker(skip)


def shared_xla_cache_dir() -> pathlib.Path | None:
    """<$PAGED_JAX_TEST_XLA_CACHE or <user cache dir>/test-xla-cache>/<key>, None when off.

    JAX's own cache key covers the HLO, the compile options, the devices and the jaxlib
    version, so a stale entry is never loaded; the folder name also carries the Python,
    jax and jaxlib versions and the backend so that each CI stage (Python 3.11 and 3.12,
    different jax) keeps its own folder and an old one can be deleted whole. The user
    cache dir is $PAGED_JAX_CACHE or ~/.cache/paged_jax, which a cold CI run removes.
    """
    setting = os.environ.get(TEST_XLA_CACHE_ENV, "")
    if setting.strip().lower() in ("0", "off", "false", "no"):
        return None
    import jax
    import jaxlib

    key = (
        f"py{sys.version_info.major}.{sys.version_info.minor}-jax{jax.__version__}"
        f"-jaxlib{jaxlib.__version__}-{jax.default_backend()}"
    )
    root = pathlib.Path(setting) if setting else default_cache_root() / "test-xla-cache"
    return root / key


def pytest_configure(config):
    """Turns on the shared test compilation cache, in-process and for spawned processes.

    Test programs are small: most compile in well under JAX's default one-second
    threshold for caching, so both thresholds are zero and every compile is cached.
    Programs the engine serializes itself (paged_jax.worker.executable_cache) are kept
    out of this cache by the engine, as in any other run.
    """
    path = shared_xla_cache_dir()
    if path is None:
        return
    path.mkdir(parents=True, exist_ok=True)
    settings = {
        "jax_compilation_cache_dir": str(path),
        "jax_persistent_cache_min_compile_time_secs": 0.0,
        "jax_persistent_cache_min_entry_size_bytes": 0,
    }
    import jax

    for name, value in settings.items():
        jax.config.update(name, value)
        # jax reads JAX_<NAME> at import: subprocesses that start python get the same cache.
        os.environ[name.upper()] = str(value)
    # jax opens its cache at the first compile and keeps that directory for the process's
    # life; compile once now so that a test calling enable_compile_cache(tmp_path) first
    # does not move the whole worker's cache into its temporary directory.
    jax.jit(lambda: 0)()


def _require_torch_and_transformers() -> None:
    for name in ("torch", "transformers"):
        pytest.importorskip(name, reason=f"needs {name} (not installed in the torch-free venv)")


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(tmp_path_factory):
    """Factory `(family, *, seed=0, max_shard_size=None, **config_overrides) -> Path`.

    family is one of FAMILIES. Checkpoints are built once per
    distinct arguments and shared by the session: copy one before changing its files.
    """
    cache: dict[str, pathlib.Path] = {}

    def make(family: str, **kwargs: Any) -> pathlib.Path:
        _require_torch_and_transformers()
        key = json.dumps([family, kwargs], sort_keys=True)
        if key not in cache:
            directory = tmp_path_factory.mktemp(f"hf_{family}")
            cache[key] = build_tiny_hf_checkpoint(family, directory, **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def hf_logits():
    """Callable `(path, input_ids i32[B, L], dtype="float32") -> f32[B, L, V]` from transformers.

    Runs the checkpoint's eager-attention torch model (CPU); models are cached per (path, dtype).
    """
    models: dict[tuple[str, str], Any] = {}

    def run(path: pathlib.Path, input_ids: np.ndarray, dtype: str = "float32") -> np.ndarray:
        _require_torch_and_transformers()
        import torch
        import transformers

        key = (str(path), dtype)
        if key not in models:
            models[key] = transformers.AutoModelForCausalLM.from_pretrained(
                path, attn_implementation="eager", dtype=getattr(torch, dtype)
            ).eval()
        with torch.no_grad():
            out = models[key](torch.as_tensor(np.asarray(input_ids), dtype=torch.long))
        return out.logits.float().numpy()

    return run


@pytest.fixture(scope="session")
def hf_greedy():
    """Callable `(path, prompt ids, max_new) -> generated ids`: transformers' greedy generate.

    Stops at EOS like the engine; models are cached per path.
    """
    models: dict[str, Any] = {}

    def run(path: pathlib.Path, prompt: list[int], max_new: int) -> list[int]:
        _require_torch_and_transformers()
        import torch
        import transformers

        if str(path) not in models:
            models[str(path)] = transformers.AutoModelForCausalLM.from_pretrained(
                path, attn_implementation="eager", dtype=torch.float32
            ).eval()
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = models[str(path)].generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
            )
        return out[0, len(prompt) :].tolist()

    return run


@pytest.fixture(scope="session")
def model_dir(tiny_hf_checkpoint, tmp_path_factory):
    """A tiny Llama whose vocabulary covers the byte tokenizer, with tokenizer.json beside it."""
    import shutil

    from paged_jax.entrypoints.demo import build_byte_tokenizer

    src = tiny_hf_checkpoint("llama", vocab_size=259)
    dst = tmp_path_factory.mktemp("llama_tok")
    shutil.copytree(src, dst, dirs_exist_ok=True)
    build_byte_tokenizer().save(str(dst / "tokenizer.json"))
    return dst


# The engine settings of the LLM API tests (tests/llm): one shape, so one set of step
# programs; every test that only needs "an LLM on the tiny byte-tokenizer Llama" shares it.
SMALL_LLM = dict(block_size=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128)


@pytest.fixture(scope="session")
def _shared_small_llm(model_dir):
    from paged_jax.llm import LLM

    return LLM(str(model_dir), **SMALL_LLM)


@pytest.fixture
def small_llm(_shared_small_llm):
    """The session's LLM(model_dir, **SMALL_LLM), warmed up, with an empty prefix cache.

    Built once per test process (about 10 CPU s of loading and warm-up compiles saved per
    sharing module). Tests must not depend on what earlier tests ran: each starts with no
    request in flight and no cached prefix, so a prefix-cache hit comes from the test itself.
    Counters in get_stats() are cumulative: compare against a value read in the test.
    """
    llm = _shared_small_llm
    assert not llm.engine.has_unfinished(), "an earlier test left a request in the shared LLM"
    assert llm.engine.kv_cache_manager.reset_prefix_cache(), "blocks still held by a request"
    return llm
