"""Reads Hugging Face safetensors checkpoints (single file or sharded) as numpy, no torch.

Tensor metadata and numpy-native dtypes go through safetensors' numpy API; bf16 (which
numpy lacks) is read from the file's documented byte layout as ml_dtypes.bfloat16.
Only regular files inside the model directory are opened (a shard index cannot point
elsewhere, and a FIFO or device named *.safetensors is refused instead of blocking).
"""

from __future__ import annotations

import json
import os
import pathlib
import stat
import struct

import ml_dtypes
import numpy as np
from safetensors import safe_open

# safetensors dtype names numpy cannot hold natively -> the ml_dtypes type to view them as.
_EXTENDED_DTYPES = {
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}


def check_regular_file(file: pathlib.Path) -> None:
    """Refuses anything but a regular file (after symlinks) as a weights file.

    Opening a FIFO for reading blocks until a writer appears, and a device such as
    /dev/zero never ends: neither may reach safetensors.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: naming the file and what it is instead.
    """
    try:
        mode = os.stat(file).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"weights file {file} does not exist") from None
    if not stat.S_ISREG(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else None
        raise ValueError(
            f"weights file {file} is {kind or 'not a regular file'}: only regular files "
            "are read as weights"
        )


def shard_path(path: pathlib.Path, index: pathlib.Path, key: object, name: object) -> pathlib.Path:
    """The file a shard index entry names, which must lie inside the model directory.

    Raises:
        ValueError: naming the entry when it is not a plain relative path (absolute,
            with "..", empty, or not a string).
    """
    relative = pathlib.PurePosixPath(name) if isinstance(name, str) else None
    if (
        relative is None
        or not name
        or "\\" in name
        or relative.is_absolute()
        or ".." in relative.parts
    ):
        raise ValueError(
            f"shard index {index} entry {key!r}: {name!r} must be a file name inside the "
            "model directory (relative, no '..')"
        )
    return path / relative


def checkpoint_files(path: pathlib.Path) -> list[pathlib.Path]:
    """The safetensors files of a checkpoint directory, via the shard index if present.

    Raises:
        FileNotFoundError: if the directory has no safetensors weights, or the index
            names a file that does not exist.
        ValueError: a malformed index, an index entry outside the directory, or a
            weights file that is not a regular file.
    """
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            entries = sorted(weight_map.items())
        except (
            json.JSONDecodeError,
            UnicodeDecodeError,
            RecursionError,
            KeyError,
            TypeError,
            AttributeError,
        ) as err:
            raise ValueError(
                f"shard index {index} is not a valid model.safetensors.index.json: {err!r}"
            ) from err
        files: dict[pathlib.Path, None] = {}
        for key, name in entries:
            files.setdefault(shard_path(path, index, key, name))
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"shard index {index} names missing weights files: {missing}")
        for file in files:
            check_regular_file(file)
        return sorted(files)
    single = path / "model.safetensors"
    files_found = [single] if single.is_file() else sorted(path.glob("*.safetensors"))
    if not files_found:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    for file in files_found:
        check_regular_file(file)
    return files_found


class SafetensorsCheckpoint:
    """Key -> shape index over a checkpoint's files, reading tensors on demand.

    Args:
        path: the checkpoint directory.
    """

    def __init__(self, path: pathlib.Path):
        self._location: dict[str, pathlib.Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, str] = {}
        duplicates: list[str] = []
        for file in checkpoint_files(path):
            try:
                with safe_open(str(file), framework="np") as f:
                    for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                        tensor = f.get_slice(key)
                        if key in self._location:
                            duplicates.append(f"{key!r} in {self._location[key]} and {file}")
                            continue
                        self._location[key] = file
                        self.shapes[key] = tuple(tensor.get_shape())
                        self._dtypes[key] = tensor.get_dtype()
            except Exception as err:  # safetensors raises its own error types
                raise ValueError(
                    f"weights file {file} is corrupted or not a safetensors file "
                    f"({type(err).__name__}: {err}); re-download or re-save it"
                ) from err
        if duplicates:
            # Which copy would win depends on file order: refuse rather than guess.
            raise ValueError(
                f"checkpoint {path} holds {len(duplicates)} tensor(s) in more than one "
                f"weights file: {'; '.join(duplicates[:5])}"
            )

    def read(self, key: str) -> np.ndarray:
        """The tensor `key` as a numpy array in its stored dtype.

        Raises:
            ValueError: naming the tensor and its file when it cannot be read.
        """
        file = self._location[key]
        check_regular_file(file)  # it may have been replaced since the header was read
        try:
            if self._dtypes[key] in _EXTENDED_DTYPES:
                return _read_raw(file, key, _EXTENDED_DTYPES[self._dtypes[key]])
            with safe_open(str(file), framework="np") as f:
                return f.get_tensor(key)
        except Exception as err:
            raise ValueError(
                f"tensor {key!r} in weights file {file} cannot be read "
                f"({type(err).__name__}: {err})"
            ) from err

    def file_of(self, key: str) -> pathlib.Path:
        """The file that holds tensor `key`."""
        return self._location[key]


def _read_raw(file: pathlib.Path, key: str, dtype: type) -> np.ndarray:
    # Layout: u64 little-endian header length, JSON header, then the data buffer;
    # header[key]["data_offsets"] are byte offsets into the buffer.
    # O_NONBLOCK: should the path have turned into a FIFO, opening it cannot block.
    fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ValueError(f"{file} is not a regular file")
        (header_len,) = struct.unpack("<Q", f.read(8))
        entry = json.loads(f.read(header_len))[key]
        begin, end = entry["data_offsets"]
        f.seek(8 + header_len + begin)
        data = f.read(end - begin)
    return np.frombuffer(data, dtype=dtype).reshape(entry["shape"])
