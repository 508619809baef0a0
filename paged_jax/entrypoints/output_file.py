"""Streamed, atomic JSONL output: records go to a temporary file as they are made, which
replaces the target only when the run completes.

A crash leaves the old file (if any) untouched and the records written so far in
`<output>.partial`, so a half file is never mistaken for a complete one. Host module.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any


def check_writable(path: str, flag: str) -> pathlib.Path:
    """Fails fast (ValueError naming the flag) when `path` cannot be written as a file."""
    target = pathlib.Path(path)
    if target.is_dir():
        raise ValueError(f"{flag}={path!r} is a directory; expected a file path")
    parent = target.parent
    if not parent.is_dir():
        raise ValueError(f"{flag}={path!r}: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag}={path!r}: directory {str(parent)!r} is not writable")
    if target.exists() and not os.access(target, os.W_OK):
        raise ValueError(f"{flag}={path!r} exists and is not writable")
    return target


class JsonlStream:
    """Appends one JSON line per record to `<target>.partial`; commit() renames it.

    Args:
        path: the final output file.
        flag: the option name used in error messages.

    Raises:
        ValueError: the file cannot be created (checked at construction, before any
            model is loaded).
    """

    def __init__(self, path: str, flag: str = "--output"):
        self.target = check_writable(path, flag)
        self.partial = self.target.with_name(self.target.name + ".partial")
        try:
            self._file = open(self.partial, "w", encoding="utf-8")  # noqa: SIM115
        except OSError as err:
            raise ValueError(f"{flag}={path!r} cannot be written: {err}") from err
        self.num_records = 0

    def write(self, record: dict[str, Any]) -> None:
        """Writes and flushes one record (it is on disk when this returns)."""
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()
        self.num_records += 1

    def commit(self) -> pathlib.Path:
        """Closes the stream and atomically replaces the target with it."""
        self._file.close()
        os.replace(self.partial, self.target)
        return self.target

    def close_partial(self) -> pathlib.Path:
        """Closes the stream after a failure, leaving the records in the .partial file."""
        if not self._file.closed:
            self._file.close()
        return self.partial


def write_json_atomic(path: pathlib.Path, value: Any) -> None:
    """Writes `value` as indented JSON via a temporary file and a rename."""
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
