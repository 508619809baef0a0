"""Streamed, atomic JSONL output: records go to a temporary file as they are made, which
replaces the target only when the run completes.

A crash leaves the old file (if any) untouched and the records written so far in
`<output>.partial`, so a half file is never mistaken for a complete one. A later run
moves a leftover `.partial` aside (`.partial.1`, `.partial.2`, ...) instead of
truncating it. Files are created without following symlinks (O_EXCL | O_NOFOLLOW), a
symlinked or non-regular target is refused, and a commit fsyncs the file before the
rename and the directory after it. A write that fails (a full disk) is taken back to the
last whole record, so the `.partial` file always holds whole records. Host module.
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


class OutputWriteError(OSError):
    """The output file cannot be written (a full disk, an I/O error): one line naming the
    flag, the file and the system's reason. The records before it are whole on disk."""


class JsonlStream:
    """Appends one JSON line per record to `<target>.partial`; commit() renames it.

    Each record is one unbuffered write of its whole line. When a write fails (a full
    disk cuts it short, then fails), the file is truncated back to the end of the last
    whole record and the stream refuses every later write with the same error: a reader
    of the `.partial` file never meets half a record.

    Args:
        path: the final output file.
        flag: the option name used in error messages.

    Attributes:
        moved_aside: where a leftover `.partial` of an earlier run was moved, or None.
        num_records: whole records in the file.
        error: the OutputWriteError that stopped the stream, or None.

    Raises:
        ValueError: the file cannot be created (checked at construction, before any
            model is loaded).
    """

    def __init__(self, path: str | os.PathLike, flag: str = "--output"):
        self.target = check_writable(path, flag)
        self.flag = flag
        self.partial = self.target.with_name(self.target.name + ".partial")
        try:
            # A previous run's salvage is never truncated; a symlink there is moved too,
            # so its target is never written.
            self.moved_aside = move_aside(self.partial)
            self._fd: int | None = os.open(self.partial, _CREATE_FLAGS, 0o666)
        except OSError as err:
            raise ValueError(f"{flag}={str(path)!r} cannot be written: {err}") from err
        self.num_records = 0
        self.error: OutputWriteError | None = None
        self._num_bytes = 0  # the end of the last whole record

    def write(self, record: dict[str, Any]) -> None:
        """Writes one record (handed to the OS when this returns).

        Raises:
            OutputWriteError: the record could not be written whole; the file keeps the
                records before it (and so does every later call).
        """
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        self._check_open()
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as err:
            with contextlib.suppress(OSError):  # truncating frees space: it can succeed
                os.ftruncate(self._fd, self._num_bytes)
            self._fail(err)
        self._num_bytes += len(data)
        self.num_records += 1

    def commit(self) -> pathlib.Path:
        """Closes the stream and atomically replaces the target with it (fsynced).

        Raises:
            OutputWriteError: the stream failed earlier, or the file could not be
                flushed to the disk or renamed (it stays `.partial`).
        """
        self._check_open()
        try:
            os.fsync(self._fd)
            self._close()
            os.replace(self.partial, self.target)
        except OSError as err:
            self._close()
            self._fail(err)
        fsync_directory(self.target.parent)
        return self.target

    def close_partial(self) -> pathlib.Path | None:
        """Closes the stream after a failure, leaving the records in the .partial file.

        Returns:
            The .partial file, or None when no record was written (the empty file this
            stream created is removed then).
        """
        self._close()
        if self.num_records == 0:
            with contextlib.suppress(OSError):
                self.partial.unlink()
            return None
        return self.partial

    def _check_open(self) -> None:
        if self.error is not None:
            raise self.error
        assert self._fd is not None, "bug: JsonlStream used after commit() or close_partial()"

    def _close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):  # nothing is buffered here to lose
                os.close(fd)

    def _fail(self, err: OSError) -> None:
        reason = err.strerror or str(err) or type(err).__name__
        self.error = OutputWriteError(
            f"{self.flag}={str(self.target)!r}: {self.partial} cannot be written: {reason}"
        )
        self.error.errno = err.errno
        raise self.error from err


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
