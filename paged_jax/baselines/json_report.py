"""A benchmark's JSON report on disk: strict JSON (non-finite floats as null), written
through a temp file and a rename so a reader, or a killed run, never sees half of one.
Plain Python (no jax), for the engine cell and the scripts/bench_* reports alike."""

from __future__ import annotations

import json
import math
import os
import pathlib
import tempfile
from typing import Any


def finite_json(value: Any) -> Any:
    """`value` with every non-finite float as None (strict JSON) and numpy scalars as
    Python numbers."""
    if isinstance(value, dict):
        return {str(k): finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json_atomic(path: str | os.PathLike, report: dict[str, Any]) -> pathlib.Path:
    """Writes `report` to `path` (parents created) through a temp file and a rename: a
    reader (or a kill) sees the previous report or this one, never half of one. Returns
    the path written."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(finite_json(report), indent=2, allow_nan=False) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    return path


__all__ = ["finite_json", "write_json_atomic"]
