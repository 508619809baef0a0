"""Compiled step programs: built ahead of time once per shape, kept on disk for the next start.

Each program is traced, lowered and compiled through JAX's AOT API
(``jit(f).trace(*args).lower().compile()``) and, when the cache has a directory, serialized
(``jax.experimental.serialize_executable``) into one file. A later start whose key matches
loads that file instead, skipping tracing, lowering and compiling.

The key is everything that changes the program: the model (class, config, graph
definition and the source files of its classes outside this package), the engine
config fields that shape the step, the program's name (bucket and variant), the argument
tree with every leaf's shape, dtype and sharding, the jax / jaxlib / flax / Python
versions, backend, platform version, devices, host CPU, XLA flags, and a hash of this
package's own sources (paged_jax, models, pallas_kernels), so an edited kernel never runs
a stale program. An entry that is stale (the sources changed), keyed differently or
corrupt (truncated, garbage, a checksum or signature that does not match) is ignored with
a warning and rebuilt; it never raises and never runs.

    <cache dir>/executables/<slot>.exe      slot = hash of the key without the sources' hash
      MAGIC | u32 header length | JSON header {key, sha256, sizes} | executable | out tree

A program whose executable cannot be serialized (one with constants baked in: a model
that is not an NNX module closes over its arrays) is kept in memory only, and so is every
program of a model class that has no source file (python -c, a REPL, exec'd code): its
code is in no file a key could hash, so it is never written or loaded (logged once).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import inspect
import json
import logging
import os
import pathlib
import pickle
import platform
import re
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
from jax.experimental import serialize_executable

from paged_jax.config import EngineConfig
from paged_jax.constants import WARMUP_OTHER_KEY, WARMUP_SUMMARY_KEYS
from paged_jax.distributed import num_processes

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MAGIC = b"PAGEDJAX-EXE\n"
SUFFIX = ".exe"
# The packages whose sources make up the programs (their hash is part of every key).
SOURCE_PACKAGES = ("paged_jax", "models", "pallas_kernels")
# EngineConfig fields that only steer the host (scheduling, hashing, seeds): they never
# change a compiled program, so a change in them keeps the cached executables.
HOST_ONLY_FIELDS = frozenset(
    {
        "seed",
        "hash_algo",
        "enable_prefix_caching",
        "scheduling_policy",
        "preemption_mode",
        "async_scheduling",
        "kv_cache_memory",  # shapes the pool, whose size is keyed as num_kv_blocks
    }
)
# Packages whose classes are keyed by the version program_context records, not by file.
KEYED_BY_VERSION = ("builtins", "flax")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _digest(text: str | bytes) -> str:
    data = text.encode() if isinstance(text, str) else text
    return hashlib.sha256(data).hexdigest()


def _stable_repr(obj: Any) -> str:
    """repr without memory addresses (functions held as static attributes print them)."""
    return _ADDRESS.sub("", repr(obj))


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """sha256 over the .py and .json files of SOURCE_PACKAGES (paths and contents)."""
    h = hashlib.sha256()
    for name in SOURCE_PACKAGES:
        spec = importlib.util.find_spec(name)
        for root in (spec.submodule_search_locations or []) if spec else []:
            root = pathlib.Path(root)
            for path in sorted(root.rglob("*")):
                if path.suffix not in (".py", ".json") or "__pycache__" in path.parts:
                    continue
                h.update(f"{name}/{path.relative_to(root).as_posix()}\0".encode())
                h.update(path.read_bytes())
                h.update(b"\0")
    return h.hexdigest()


def _file_hash(path: str | None) -> str | None:
    try:
        return None if path is None else _digest(pathlib.Path(path).read_bytes())
    except OSError:
        return None


@functools.lru_cache(maxsize=1)
def _host_cpu() -> str:
    """The host CPU's model and feature flags: XLA's CPU code is built for them."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
        wanted = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags")]
        return _digest("\n".join(sorted(set(wanted))))
    except OSError:
        return _digest(f"{platform.machine()} {platform.processor()}")


# Model classes already reported as uncacheable in this process (the warning comes once).
_UNCACHEABLE_REPORTED: set[str] = set()


def _defining_file(klass: type) -> str | None:
    """The source file that defines ``klass``, or None when no file does.

    inspect names the file of the class's module, which for code run by ``exec`` in a
    module that has a file is that module's file, not the class's code. So the class
    must also be found in it (``getsource``: OSError when not) and every function of its
    body must have been compiled from it (exec'd code is compiled from "<string>").
    """
    try:
        inspect.getsource(klass)
        path = inspect.getsourcefile(klass)
    except (OSError, TypeError):  # python -c, a REPL, exec, a compiled extension
        return None
    if path is None:
        return None
    for attr in vars(klass).values():
        fn = attr.fget if isinstance(attr, property) else getattr(attr, "__func__", attr)
        code = getattr(fn, "__code__", None)
        if code is not None and os.path.realpath(code.co_filename) != os.path.realpath(path):
            return None
    return path


def class_source_hashes(cls: type) -> dict[str, str] | None:
    """sha256 of the source file of every class in ``cls``'s MRO outside this package.

    This package's own classes are covered by ``source_hash()``, flax's by its version and
    builtins have no source; every other class (the model's, its user-written bases) must
    come from a readable source file that defines it (``_defining_file``).

    Returns:
        ``{"module.qualname": file digest}``, or None when some class has no such file:
        one defined under ``python -c``, in a plain REPL or notebook, or by ``exec``. Its
        code is then in no file a key could hash, so no key can tell it from another
        class of the same name.
    """
    hashes: dict[str, str] = {}
    for klass in cls.__mro__:
        module = klass.__module__
        if module.split(".")[0] in (*SOURCE_PACKAGES, *KEYED_BY_VERSION):
            continue
        digest = _file_hash(_defining_file(klass))
        if digest is None:
            return None
        hashes[f"{module}.{klass.__qualname__}"] = digest
    return hashes


def model_identity(model: Any) -> dict[str, Any]:
    """What of a model shapes its programs; call before the runner takes the model over.

    Returns:
        class, config and (NNX modules) graph-definition digests, the source file hashes
        of its classes outside this package (``class_source_hashes``), and
        ``cacheable``: whether its programs may be written to and loaded from disk. False
        for a model that is not an NNX module (its arrays are closed over, i.e. baked
        into the program, and are not part of any key) and for a model class without a
        source file (python -c, a REPL, exec'd code: its code is part of no key); its
        programs are then compiled in memory, and the second case is logged once per
        class and process. Never raises for either.
    """
    from flax import nnx

    cls = type(model)
    name = f"{cls.__module__}.{cls.__qualname__}"
    sources = class_source_hashes(cls)
    identity: dict[str, Any] = {
        "class": name,
        "config": _digest(_stable_repr(getattr(model, "config", None))),
        "class_sources": sources,
        "cacheable": isinstance(model, nnx.Module) and sources is not None,
    }
    if sources is None and name not in _UNCACHEABLE_REPORTED:
        _UNCACHEABLE_REPORTED.add(name)
        logger.warning(
            "executable cache: model class %s (or a base class) has no source file that "
            "defines it (python -c, a REPL, exec'd code), so no key can tell its code from "
            "another class's: its step programs are compiled in memory and never written "
            "to or loaded from disk (JAX's own compilation cache, keyed by the program, "
            "still applies)",
            name,
        )
    if isinstance(model, nnx.Module):
        identity["graphdef"] = _digest(_stable_repr(nnx.graphdef(model)))
    return identity


def engine_cache(
    directory: str | os.PathLike | None,
    model: dict[str, Any],
    config: EngineConfig,
    num_kv_blocks: int,
) -> ExecutableCache:
    """The cache of one engine's programs, keyed by ``program_context``. Without a
    directory, or in a job of several processes (each compiles its own part of the job
    at warm-up, never reloading one from disk), the programs stay in memory."""
    if num_processes() > 1:
        directory = None
    return ExecutableCache(directory, program_context(model, config, num_kv_blocks))


def program_context(model: dict[str, Any], config: EngineConfig, num_kv_blocks: int) -> dict:
    """The key fields every program of one engine shares (see the module docstring).

    Args:
        model: ``model_identity(model)``.
        config: the resolved EngineConfig.
        num_kv_blocks: the runner's pool size (the KV caches' leading dimension).
    """
    import flax
    import jaxlib

    devices = jax.devices()
    engine = {k: v for k, v in dataclasses.asdict(config).items() if k not in HOST_ONLY_FIELDS}
    engine["num_kv_blocks"] = num_kv_blocks
    return {
        "format": FORMAT_VERSION,
        "model": model,
        "engine": engine,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "python": platform.python_version(),
        "backend": jax.default_backend(),
        "platform_version": str(devices[0].client.platform_version),
        "devices": [d.device_kind for d in devices],
        "host_cpu": _host_cpu(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "jax_flags": {
            "x64": bool(jax.config.jax_enable_x64),
            "matmul_precision": str(jax.config.jax_default_matmul_precision),
        },
        "sources": source_hash(),
    }


def arg_signature(args: tuple) -> tuple[Any, list[tuple]]:
    """(pytree structure of (args, {}), per leaf (shape, dtype, weak type, sharding))."""
    leaves, tree = jax.tree_util.tree_flatten((args, {}))
    sig = []
    for x in leaves:
        sharding = getattr(x, "sharding", None)
        placed = (
            "host"
            if sharding is None
            else f"{sharding!r} {sorted(d.id for d in sharding.device_set)}"
        )
        weak = bool(getattr(getattr(x, "aval", None), "weak_type", False))
        sig.append((tuple(x.shape), str(x.dtype), weak, placed))
    return tree, sig


@dataclasses.dataclass
class ProgramRecord:
    """How one program came to be: "compiled" or "loaded", with its seconds per phase."""

    name: str
    how: str
    trace_s: float = 0.0
    lower_s: float = 0.0
    compile_s: float = 0.0
    load_s: float = 0.0  # read + deserialize
    save_s: float = 0.0  # serialize + write
    run_s: float = 0.0  # its one warm-up run
    cached: bool = False  # the executable is on disk (saved now or loaded)


PROGRAM_PHASES = ("trace_s", "lower_s", "compile_s", "load_s", "save_s", "run_s")


@dataclasses.dataclass
class WarmupReport:
    """What warm-up built: its programs, and the seconds of each phase summed over them.

    ``start`` is "warm" when every program was loaded from the cache, "cold" when every
    one was compiled, "partial" otherwise; ``problems`` holds the warnings (stale,
    mismatched or corrupt entries, entries that could not be written).
    """

    programs: list[ProgramRecord]
    cache_dir: str | None
    problems: list[str] = dataclasses.field(default_factory=list)
    other_s: float = 0.0  # warm-up work outside the step programs (swaps)

    @property
    def num_compiled(self) -> int:
        return sum(p.how == "compiled" for p in self.programs)

    @property
    def num_loaded(self) -> int:
        return sum(p.how == "loaded" for p in self.programs)

    @property
    def start(self) -> str:
        if self.programs and self.num_loaded == len(self.programs):
            return "warm"
        return "cold" if self.num_loaded == 0 else "partial"

    def phase_seconds(self) -> dict[str, float]:
        """Seconds per phase (PROGRAM_PHASES) summed over the programs."""
        return {k: sum(getattr(p, k) for p in self.programs) for k in PROGRAM_PHASES}

    def summary(self) -> dict[str, Any]:
        """Flat, JSON-ready figures (seconds rounded to ms) for a run summary."""
        phases = self.phase_seconds()
        return {
            "start": self.start,
            "programs": len(self.programs),
            "programs_compiled": self.num_compiled,
            "programs_loaded": self.num_loaded,
            **{WARMUP_SUMMARY_KEYS[k]: round(v, 3) for k, v in phases.items()},
            WARMUP_OTHER_KEY: round(self.other_s, 3),
            "executable_cache_problems": len(self.problems),
        }


# An executable that JAX's persistent cache handed back (itself deserialized) serializes
# without its code on CPU: it runs in this process but fails to load in the next one
# ("Function ... not found"). So a program bound for this cache is always compiled by
# XLA: it carries a compiler option at its default value (the code is unchanged) that
# keys it apart from every other compile in JAX's cache, and JAX does not write it there.
_OWN_COMPILE_OPTIONS = {"xla_embed_ir_in_executable": False}
_MIN_COMPILE_TIME_FLAG = "jax_persistent_cache_min_compile_time_secs"


def _own_compile(lowered: Any) -> Any:
    """lowered.compile(), by XLA itself and never written to JAX's persistent cache."""
    min_time = getattr(jax.config, _MIN_COMPILE_TIME_FLAG)
    jax.config.update(_MIN_COMPILE_TIME_FLAG, float("inf"))
    try:
        return lowered.compile(compiler_options=_OWN_COMPILE_OPTIONS)
    finally:
        jax.config.update(_MIN_COMPILE_TIME_FLAG, min_time)


class CacheEntryError(Exception):
    """A cache file that must not be used; the message says why."""


def write_entry(path: pathlib.Path, key: dict, executable: bytes, out_tree: bytes) -> None:
    """Writes one entry atomically (a temporary file renamed over the old one)."""
    header = json.dumps(
        {
            "key": key,
            "sha256": _digest(executable + out_tree),
            "executable_bytes": len(executable),
            "out_tree_bytes": len(out_tree),
        },
        sort_keys=True,
    ).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<I", len(header)) + header + executable + out_tree)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_entry(path: pathlib.Path, key: dict) -> tuple[bytes, bytes]:
    """(executable, out tree) bytes of a file whose key equals ``key``, checked whole.

    Raises:
        CacheEntryError: with "stale: ..." (the package sources changed), "mismatched
            key: ..." or "corrupt: ..." (unreadable, truncated, bad checksum).
    """
    try:
        data = path.read_bytes()
    except OSError as err:
        raise CacheEntryError(f"corrupt: cannot be read ({err})") from err
    start = len(MAGIC) + 4
    if not data.startswith(MAGIC) or len(data) < start:
        raise CacheEntryError("corrupt: not an executable-cache file")
    (header_len,) = struct.unpack("<I", data[len(MAGIC) : start])
    try:
        header = json.loads(data[start : start + header_len])
        stored_key = header["key"]
        n_exe, n_tree = int(header["executable_bytes"]), int(header["out_tree_bytes"])
        checksum = header["sha256"]
    except (ValueError, KeyError, TypeError) as err:
        raise CacheEntryError(f"corrupt: unreadable header ({type(err).__name__})") from err
    if stored_key != key:
        differ = sorted(
            k
            for k in set(stored_key) | set(key)
            if not isinstance(stored_key, dict) or stored_key.get(k) != key.get(k)
        )
        if differ == ["sources"]:
            raise CacheEntryError("stale: the package sources changed since it was built")
        raise CacheEntryError(f"mismatched key: {', '.join(differ)} differ")
    body = data[start + header_len :]
    if len(body) != n_exe + n_tree:
        raise CacheEntryError(f"corrupt: {len(body)} bytes of {n_exe + n_tree} (truncated)")
    if _digest(body) != checksum:
        raise CacheEntryError("corrupt: checksum mismatch")
    return body[:n_exe], body[n_exe:]


class ExecutableCache:
    """Builds (or loads) the compiled programs of one engine.

    Args:
        directory: where entries live (``<compile cache>/executables``); None keeps
            every program in memory only.
        context: ``program_context(...)``; None (no model identity) keeps programs in
            memory only too.
    """

    def __init__(self, directory: str | os.PathLike | None = None, context: dict | None = None):
        cacheable = context is not None and context["model"].get("cacheable", False)
        self.directory = pathlib.Path(directory) if directory is not None and cacheable else None
        self.context = context
        self.problems: list[str] = []

    def key(self, name: str, args: tuple) -> tuple[dict, Any]:
        """(the program's full key, the args' pytree structure)."""
        tree, sig = arg_signature(args)
        key = {
            **(self.context or {}),
            "program": name,
            "args": _digest(f"{_stable_repr(tree)}\n{sig!r}"),
        }
        return json.loads(json.dumps(key, sort_keys=True, default=str)), tree

    def path(self, key: dict) -> pathlib.Path:
        assert self.directory is not None, "path() of a cache without a directory"
        slot = {k: v for k, v in key.items() if k != "sources"}
        return self.directory / (_digest(json.dumps(slot, sort_keys=True))[:40] + SUFFIX)

    def report_problem(self, name: str, message: str) -> None:
        """Logs a warning about program ``name``'s entry and keeps it in ``problems``."""
        text = f"executable cache: {name}: {message}; rebuilding it"
        self.problems.append(text)
        logger.warning(text)

    def lookup(self, name: str, args: tuple) -> tuple[dict, Any, tuple[bytes, bytes] | None]:
        """(key, tree, the entry's bytes or None). A bad entry is reported, not raised."""
        key, tree = self.key(name, args)
        if self.directory is None:
            return key, tree, None
        path = self.path(key)
        if not path.exists():
            return key, tree, None
        try:
            return key, tree, read_entry(path, key)
        except CacheEntryError as err:
            self.report_problem(name, f"{path.name} is {err}")
            return key, tree, None

    def build(
        self,
        name: str,
        jitted: Any,
        args: tuple,
        on_start: Callable[[str], None] | None = None,
        *,
        load: bool = True,
    ) -> tuple[Any, ProgramRecord]:
        """The compiled program for ``jitted(*args)``: loaded when a valid entry exists,
        else traced, lowered, compiled and (with a directory) saved.

        Args:
            on_start: called with "loading" or "compiling" before the work starts.
            load: False compiles even when an entry exists (it is then overwritten).
        """
        key, tree, entry = self.lookup(name, args) if load else (*self.key(name, args), None)
        if entry is not None:
            if on_start is not None:
                on_start("loading")
            t0 = time.perf_counter()
            try:
                compiled = self._load(entry, tree, args)
            except CacheEntryError as err:
                self.report_problem(name, str(err))
            else:
                return compiled, ProgramRecord(
                    name, "loaded", load_s=time.perf_counter() - t0, cached=True
                )
        if on_start is not None:
            on_start("compiling")
        record = ProgramRecord(name, "compiled")
        t0 = time.perf_counter()
        traced = jitted.trace(*args)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        compiled = lowered.compile() if self.directory is None else _own_compile(lowered)
        t3 = time.perf_counter()
        record.trace_s, record.lower_s, record.compile_s = t1 - t0, t2 - t1, t3 - t2
        if self.directory is not None:
            record.cached = self._save(name, key, tree, compiled)
            record.save_s = time.perf_counter() - t3
        return compiled, record

    def _load(self, entry: tuple[bytes, bytes], tree: Any, args: tuple) -> Any:
        executable, out_tree_bytes = entry
        try:
            out_tree = pickle.loads(out_tree_bytes)
            compiled = serialize_executable.deserialize_and_load(executable, tree, out_tree)
        except Exception as err:  # noqa: BLE001 - any failure to load means: rebuild
            raise CacheEntryError(
                f"corrupt: cannot be deserialized ({type(err).__name__}: {err})"[:300]
            ) from err
        # The loaded program's own argument types must be the args' (the key says so; a
        # mismatch here is a bad entry, never a program run on the wrong shapes).
        want = [(tuple(x.shape), str(x.dtype)) for x in jax.tree_util.tree_leaves((args, {}))]
        info = jax.tree_util.tree_leaves(compiled.args_info)
        got = [(tuple(i.shape), str(i.dtype)) for i in info]
        if got != want:
            raise CacheEntryError("mismatched key: the executable's argument types differ")
        return compiled

    def _save(self, name: str, key: dict, tree: Any, compiled: Any) -> bool:
        try:
            executable, in_tree, out_tree = serialize_executable.serialize(compiled)
            if in_tree != tree:
                raise ValueError("its input tree differs from the arguments'")
            write_entry(self.path(key), key, executable, pickle.dumps(out_tree))
        except (NotImplementedError, ValueError, TypeError, pickle.PicklingError) as err:
            logger.info("executable cache: %s is kept in memory only (%s)", name, err)
            return False
        except OSError as err:
            text = f"executable cache: {name} could not be written ({err})"
            self.problems.append(text)
            logger.warning(text)
            return False
        return True
