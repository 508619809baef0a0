"""Reads Hugging Face safetensors checkpoints (single file or sharded) as numpy, no torch.

Tensor metadata and numpy-native dtypes go through safetensors' numpy API; bf16 (which
numpy lacks) is read from the file's documented byte layout as ml_dtypes.bfloat16.
"""

from __future__ import annotations

import json
import pathlib
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


def checkpoint_files(path: pathlib.Path) -> list[pathlib.Path]:
    """The safetensors files of a checkpoint directory, via the shard index if present.

    Raises:
        FileNotFoundError: if the directory has no safetensors weights.
    """
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
            raise ValueError(
                f"shard index {index} is not a valid model.safetensors.index.json: {err!r}"
            ) from err
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"shard index {index} names missing weights files: {missing}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return files


class SafetensorsCheckpoint:
    """Key -> shape index over a checkpoint's files, reading tensors on demand.

    Args:
        path: the checkpoint directory.
    """

    def __init__(self, path: pathlib.Path):
        self._location: dict[str, pathlib.Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, str] = {}
        for file in checkpoint_files(path):
            try:
                with safe_open(str(file), framework="np") as f:
                    for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                        tensor = f.get_slice(key)
                        self._location[key] = file
                        self.shapes[key] = tuple(tensor.get_shape())
                        self._dtypes[key] = tensor.get_dtype()
            except Exception as err:  # safetensors raises its own error types
                raise ValueError(
                    f"weights file {file} is corrupted or not a safetensors file "
                    f"({type(err).__name__}: {err}); re-download or re-save it"
                ) from err

    def read(self, key: str) -> np.ndarray:
        """The tensor `key` as a numpy array in its stored dtype.

        Raises:
            ValueError: naming the tensor and its file when it cannot be read.
        """
        file = self._location[key]
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
    with open(file, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        entry = json.loads(f.read(header_len))[key]
        begin, end = entry["data_offsets"]
        f.seek(8 + header_len + begin)
        data = f.read(end - begin)
    return np.frombuffer(data, dtype=dtype).reshape(entry["shape"])
