"""Tuned kernel configs per GPU: the table the attention kernels read their defaults from.

The table (``tuned_configs.json`` beside this file) is written by
``scripts/autotune_kernels.py`` on a real GPU and holds, per (kernel, device kind, cache
dtype, head_dim, group, block_size), the fastest config that matched the reference. A
lookup that finds nothing returns None and the kernel keeps its reasoned defaults. The
file is read once per path and cached; importing this module does not import jax.

Nearest match: a key missing from the table uses the entry whose group and head_dim
have the same next power of two (the kernels pad a KV head's q heads and head_dim to
powers of two, so those tiles have the same shape), preferring the exact value, then
the padded one. Nothing else is approximated: another device kind, dtype or block_size
is a miss.
"""

from __future__ import annotations

import functools
import json
import math
import os
import pathlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

TABLE_PATH = pathlib.Path(__file__).with_name("tuned_configs.json")
TABLE_FORMAT = 1
# Kernel name (the pallas_call name) -> the config keys an entry must hold.
CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "paged_decode_attention": ("block_k", "num_stages", "num_warps"),
    "ragged_paged_attention": ("block_q", "block_k", "num_warps", "num_stages"),
}
# Keys that Triton needs as powers of two (tile extents, warps per program).
POWER_OF_TWO_KEYS = ("block_q", "block_k", "num_warps")
KEY_FIELDS = ("kernel", "device_kind", "dtype", "head_dim", "group", "block_size")


def _next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(n)))


def dtype_name(dtype: Any) -> str:
    """The canonical name of a cache dtype ("bfloat16", "float8_e4m3fn", ...)."""
    import jax.numpy as jnp  # function-level: the table itself stays jax-free

    return jnp.dtype(dtype).name


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class TunedEntry:
    """One measured best config for one shape key on one device kind.

    Attributes:
        kernel: "paged_decode_attention" or "ragged_paged_attention".
        device_kind: ``jax.devices()[0].device_kind``, e.g. "NVIDIA H200".
        dtype: Cache dtype name (``jnp.dtype(...).name``).
        head_dim, group, block_size: The shape key (group = q heads per KV head).
        config: The kernel's tuning knobs (``CONFIG_KEYS[kernel]``), all ints.
        measured: How it was measured (us, fraction_of_peak, jax_version, command, ...).
    """

    kernel: str
    device_kind: str
    dtype: str
    head_dim: int
    group: int
    block_size: int
    config: Mapping[str, int]
    measured: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        check_entry(self.to_json())

    @property
    def key(self) -> tuple:
        return tuple(getattr(self, name) for name in KEY_FIELDS)

    def to_json(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in KEY_FIELDS}
        out["config"] = dict(self.config)
        out["measured"] = dict(self.measured)
        return out

    @classmethod
    def from_json(cls, obj: Any, where: str = "entry") -> TunedEntry:
        check_entry(obj, where)
        return cls(
            **{k: obj[k] for k in KEY_FIELDS},
            config=obj["config"],
            measured=obj.get("measured", {}),
        )


def check_entry(obj: Any, where: str = "entry") -> None:
    """Raises ValueError naming the field when `obj` is not a valid table entry."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"{where}={obj!r} must be a JSON object")
    missing = [k for k in (*KEY_FIELDS, "config") if k not in obj]
    if missing:
        raise ValueError(f"{where} is missing field(s) {missing}")
    unknown = sorted(set(obj) - {*KEY_FIELDS, "config", "measured"})
    if unknown:
        raise ValueError(f"{where} has unknown field(s) {unknown}")
    kernel = obj["kernel"]
    if kernel not in CONFIG_KEYS:
        raise ValueError(f"{where}.kernel={kernel!r} must be one of {sorted(CONFIG_KEYS)}")
    for name in ("device_kind", "dtype"):
        if not isinstance(obj[name], str) or not obj[name]:
            raise ValueError(f"{where}.{name}={obj[name]!r} must be a non-empty string")
    for name in ("head_dim", "group", "block_size"):
        if not _positive_int(obj[name]):
            raise ValueError(f"{where}.{name}={obj[name]!r} must be a positive int")
    config = obj["config"]
    if not isinstance(config, Mapping):
        raise ValueError(f"{where}.config={config!r} must be a JSON object")
    want = set(CONFIG_KEYS[kernel])
    if set(config) != want:
        raise ValueError(
            f"{where}.config keys {sorted(config)} must be exactly {sorted(want)} for {kernel}"
        )
    for name, value in config.items():
        if not _positive_int(value):
            raise ValueError(f"{where}.config.{name}={value!r} must be a positive int")
        if name in POWER_OF_TWO_KEYS and value & (value - 1):
            raise ValueError(f"{where}.config.{name}={value!r} must be a power of two")
    if not isinstance(obj.get("measured", {}), Mapping):
        raise ValueError(f"{where}.measured={obj['measured']!r} must be a JSON object")


@dataclass(frozen=True)
class TunedTable:
    """A loaded table: its note and entries (at most one per key)."""

    entries: tuple[TunedEntry, ...]
    note: str = ""

    def lookup(
        self, kernel: str, device_kind: str, dtype: str, head_dim: int, group: int, block_size: int
    ) -> TunedEntry | None:
        """The exact entry, else the nearest one by the module docstring's rule, else None."""
        candidates = [
            e
            for e in self.entries
            if (e.kernel, e.device_kind, e.dtype, e.block_size)
            == (kernel, device_kind, dtype, block_size)
            and _next_pow2(e.group) == _next_pow2(group)
            and _next_pow2(e.head_dim) == _next_pow2(head_dim)
        ]
        if not candidates:
            return None

        def distance(e: TunedEntry) -> tuple:
            # Exact first; then the padded value (the tile the kernel really runs); then closest.
            return (
                e.group != group,
                e.group != _next_pow2(group),
                abs(e.group - group),
                e.head_dim != head_dim,
                e.head_dim != _next_pow2(head_dim),
                abs(e.head_dim - head_dim),
            )

        return min(candidates, key=distance)

    def to_json(self) -> dict[str, Any]:
        return dict(
            format=TABLE_FORMAT,
            note=self.note,
            entries=[e.to_json() for e in sorted(self.entries, key=lambda e: e.key)],
        )


def parse_table(data: Any, source: str = "table") -> TunedTable:
    """Validates a decoded table file; ValueError names the file and the field."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{source}: top level must be a JSON object, got {type(data).__name__}")
    if data.get("format") != TABLE_FORMAT:
        raise ValueError(f"{source}: format={data.get('format')!r} must be {TABLE_FORMAT}")
    entries = data.get("entries")
    if not isinstance(entries, list):
        raise ValueError(f"{source}: entries={entries!r} must be a list")
    note = data.get("note", "")
    if not isinstance(note, str):
        raise ValueError(f"{source}: note={note!r} must be a string")
    parsed = [TunedEntry.from_json(e, f"{source}: entries[{i}]") for i, e in enumerate(entries)]
    seen: dict[tuple, int] = {}
    for i, e in enumerate(parsed):
        if e.key in seen:
            raise ValueError(
                f"{source}: entries[{i}] repeats the key of entries[{seen[e.key]}]: {e.key}"
            )
        seen[e.key] = i
    return TunedTable(tuple(parsed), note)


@functools.lru_cache(maxsize=8)
def _read(path: str) -> TunedTable:
    p = pathlib.Path(path)
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e})") from e
    return parse_table(data, str(p))


def load_table(path: str | os.PathLike | None = None) -> TunedTable:
    """The table at `path` (default: the packaged ``tuned_configs.json``), read once and cached."""
    return _read(str(pathlib.Path(path or TABLE_PATH).resolve()))


def write_entries(
    entries: Iterable[TunedEntry | Mapping[str, Any]],
    path: str | os.PathLike | None = None,
    *,
    note: str | None = None,
) -> TunedTable:
    """Merges `entries` into the table at `path` (same key: replaced) and rewrites it atomically.

    A missing file starts an empty table. Returns the new table; later lookups see it.
    """
    target = pathlib.Path(path or TABLE_PATH).resolve()
    old = _read(str(target)) if target.exists() else TunedTable(())
    new = [e if isinstance(e, TunedEntry) else TunedEntry.from_json(e) for e in entries]
    merged = {e.key: e for e in old.entries}
    merged.update({e.key: e for e in new})
    table = TunedTable(tuple(merged.values()), old.note if note is None else note)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(table.to_json(), indent=1) + "\n")
    tmp.replace(target)
    _read.cache_clear()
    return table


@functools.lru_cache(maxsize=1)
def current_device_kind() -> str | None:
    """``jax.devices()[0].device_kind`` on a GPU backend, else None (cached: one query)."""
    import jax

    if jax.default_backend() != "gpu":
        return None
    return jax.devices()[0].device_kind


def tuned_config(
    kernel: str,
    *,
    device_kind: str | None,
    dtype: Any,
    head_dim: int,
    group: int,
    block_size: int,
    path: str | os.PathLike | None = None,
) -> dict[str, int] | None:
    """The tuned knobs for one kernel call's static shape, or None (keep the defaults).

    Args:
        kernel: "paged_decode_attention" or "ragged_paged_attention".
        device_kind: ``current_device_kind()``; None (not on a GPU) always misses.
        dtype: The cache dtype (anything ``jnp.dtype`` accepts).
        head_dim, group, block_size: Head size, q heads per KV head, tokens per block.
        path: Another table file (tests, the autotuner); default the packaged one.

    Returns:
        e.g. {"block_k": 64, "num_stages": 4, "num_warps": 4} for decode, or None.
    """
    if kernel not in CONFIG_KEYS:
        raise ValueError(f"kernel={kernel!r} must be one of {sorted(CONFIG_KEYS)}")
    if device_kind is None:
        return None
    entry = load_table(path).lookup(
        kernel, device_kind, dtype_name(dtype), head_dim, group, block_size
    )
    return None if entry is None else dict(entry.config)
