"""Streamed, atomic JSONL output: records go to a temporary file as they are made, which
replaces the target only when the run completes.

A crash leaves the old file (if any) untouched and the records written so far in
`<output>.partial`, so a half file is never mistaken for a complete one. A later run
moves a leftover `.partial` aside (`.partial.1`, `.partial.2`, ...) instead of
truncating it. Files are created without following symlinks (O_EXCL | O_NOFOLLOW), a
symlinked or non-regular target is refused, and a commit fsyncs the file before the
rename and the directory after it. Host module.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import pathlib
import secrets
from collections.abc import Mapping
from typing import Any

# Create, never open an existing file or a symlink (O_EXCL refuses both; O_NOFOLLOW
# states the intent where O_EXCL would not apply).
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC


def check_writable(path: str | os.PathLike, flag: str) -> pathlib.Path:
    """Fails fast (ValueError naming the flag) when `path` cannot be written as a file.

    A symbolic link is refused rather than replaced (the rename at commit would put a
    regular file in its place) or followed.
    """
    target = pathlib.Path(path)
    if target.is_symlink():
        raise ValueError(
            f"{flag}={str(path)!r} is a symbolic link; give the path of a regular file "
            "(the link is neither followed nor replaced)"
        )
    if target.is_dir():
        raise ValueError(f"{flag}={str(path)!r} is a directory; expected a file path")
    if target.exists() and not target.is_file():
        raise ValueError(f"{flag}={str(path)!r} exists and is not a regular file")
    parent = target.parent
    if not parent.is_dir():
        raise ValueError(f"{flag}={str(path)!r}: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag}={str(path)!r}: directory {str(parent)!r} is not writable")
    if target.exists() and not os.access(target, os.W_OK):
        raise ValueError(f"{flag}={str(path)!r} exists and is not writable")
    return target


def check_distinct_paths(paths: Mapping[str, str | os.PathLike | None]) -> None:
    """Refuses two flags that name one file (however spelled, hard links included).

    Args:
        paths: flag -> path; None and "-" (standard input) are skipped. An --output's
            `.partial` file counts as the output.

    Raises:
        ValueError: "{flag} and {flag} name the same file ...".
    """
    seen: dict[str, str] = {}
    for flag, path in paths.items():
        if path is None or str(path) == "-":
            continue
        names = [os.path.realpath(path)]
        if flag == "--output":
            names.append(names[0] + ".partial")
        for name in names:
            for other_name, other_flag in seen.items():
                if name == other_name or _same_existing_file(name, other_name):
                    raise ValueError(
                        f"{other_flag} and {flag} name the same file {other_name!r}; "
                        "give each its own path"
                    )
        seen.update(dict.fromkeys(names, flag))


def _same_existing_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist yet
        return False


def move_aside(path: pathlib.Path) -> pathlib.Path | None:
    """Renames an existing `path` (a symlink itself, not its target) to the first free
    `path.N`; returns the new name, or None when nothing was there."""
    if not os.path.lexists(path):
        return None
    for n in itertools.count(1):
        aside = path.with_name(f"{path.name}.{n}")
        if not os.path.lexists(aside):
            os.rename(path, aside)
            return aside
    raise AssertionError("unreachable: itertools.count never ends")


def fsync_directory(directory: pathlib.Path) -> None:
    """Makes a rename inside `directory` durable (where the platform can open directories)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class JsonlStream:
    """Appends one JSON line per record to `<target>.partial`; commit() renames it.

    Args:
        path: the final output file.
        flag: the option name used in error messages.

    Attributes:
        moved_aside: where a leftover `.partial` of an earlier run was moved, or None.

    Raises:
        ValueError: the file cannot be created (checked at construction, before any
            model is loaded).
    """

    def __init__(self, path: str | os.PathLike, flag: str = "--output"):
        self.target = check_writable(path, flag)
        self.partial = self.target.with_name(self.target.name + ".partial")
        try:
            # A previous run's salvage is never truncated; a symlink there is moved too,
            # so its target is never written.
            self.moved_aside = move_aside(self.partial)
            fd = os.open(self.partial, _CREATE_FLAGS, 0o666)
        except OSError as err:
            raise ValueError(f"{flag}={str(path)!r} cannot be written: {err}") from err
        self._file = os.fdopen(fd, "w", encoding="utf-8")
        self.num_records = 0

    def write(self, record: dict[str, Any]) -> None:
        """Writes and flushes one record (it is on disk when this returns)."""
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()
        self.num_records += 1

    def commit(self) -> pathlib.Path:
        """Closes the stream and atomically replaces the target with it (fsynced)."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.partial, self.target)
        fsync_directory(self.target.parent)
        return self.target

    def close_partial(self) -> pathlib.Path | None:
        """Closes the stream after a failure, leaving the records in the .partial file.

        Returns:
            The .partial file, or None when no record was written (the empty file this
            stream created is removed then).
        """
        if not self._file.closed:
            self._file.close()
        if self.num_records == 0:
            with contextlib.suppress(OSError):
                self.partial.unlink()
            return None
        return self.partial


def write_json_atomic(path: str | os.PathLike, value: Any, flag: str = "--summary-json") -> None:
    """Writes `value` as indented JSON via a fresh temporary file, fsync and a rename.

    Raises:
        ValueError: `path` is a symlink, a directory or cannot be written (naming `flag`).
    """
    target = check_writable(path, flag)
    while True:  # a fresh name (mode from the umask, unlike mkstemp's 0600)
        tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, _CREATE_FLAGS, 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(value, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_directory(target.parent)
