"""The compile cache: where it lives and how to turn it on or off.

It holds JAX's persistent compilation cache and, in its ``executables`` folder, the
engine's serialized step programs (paged_jax.worker.executable_cache), so a second run of
the same model and engine settings loads every program instead of tracing, lowering and
compiling it (see README: cold vs warm start). PAGED_JAX_COMPILE_CACHE=0 (or
off/false/no) turns both off; any other value but 1/on is taken as the directory.
Default: <user cache dir>/jax_compile_cache, where the user cache dir is
$PAGED_JAX_CACHE or ~/.cache/paged_jax.
"""

from __future__ import annotations

import os
import pathlib

ENV_VAR = "PAGED_JAX_COMPILE_CACHE"
EXECUTABLES_SUBDIR = "executables"
_OFF = ("0", "off", "false", "no")
_ON = ("1", "on", "true", "yes")
_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_MISS_EVENT = "/jax/compilation_cache/cache_misses"
_counts = {"hits": 0, "misses": 0}
_listening = False


def _on_event(event: str, *_args: object, **_kwargs: object) -> None:
    if event == _HIT_EVENT:
        _counts["hits"] += 1
    elif event == _MISS_EVENT:
        _counts["misses"] += 1


def cache_counts() -> dict[str, int]:
    """Persistent-cache hits and misses in this process since the cache was enabled.

    (The engine's compile counter counts a cache hit as a compile: jax reports both
    under the same backend-compile event.)
    """
    return dict(_counts)


def default_cache_root() -> pathlib.Path:
    """$PAGED_JAX_CACHE, else ~/.cache/paged_jax (shared with the demo model)."""
    root = os.environ.get("PAGED_JAX_CACHE") or pathlib.Path.home() / ".cache" / "paged_jax"
    return pathlib.Path(root)


def resolve_compile_cache_dir(
    setting: bool | str | os.PathLike | None = True,
) -> pathlib.Path | None:
    """The cache directory to use, or None when the cache is off.

    Args:
        setting: False turns it off, True/None uses the environment or the default,
            a path chooses the directory. PAGED_JAX_COMPILE_CACHE=0 wins over all.
    """
    env = os.environ.get(ENV_VAR)
    if env is not None and env.strip().lower() in _OFF:
        return None
    if setting is False:
        return None
    if setting is not None and setting is not True:
        return pathlib.Path(setting)
    if env and env.strip().lower() not in _ON:
        return pathlib.Path(env)
    return default_cache_root() / "jax_compile_cache"


def enable_compile_cache(path: str | os.PathLike) -> pathlib.Path:
    """Points JAX's persistent compilation cache at `path` and caches every executable.

    JAX skips entries that compiled in under a second by default; the engine's step
    buckets compile in well under that on CPU, so both thresholds are set to zero.

    Raises:
        ValueError: the directory cannot be created (naming it).
    """
    import jax

    path = pathlib.Path(path).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"compile cache directory {str(path)!r} cannot be created: {err}") from err
    global _listening
    if not _listening:
        jax.monitoring.register_event_listener(_on_event)
        _listening = True
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def executable_cache_dir(cache_dir: str | os.PathLike | None) -> pathlib.Path | None:
    """Where the serialized step programs of a compile cache directory live (None: off)."""
    return None if cache_dir is None else pathlib.Path(cache_dir) / EXECUTABLES_SUBDIR
