"""Lazy, memory-mapped reading of (sharded) safetensors checkpoints.

The `safetensors` package's numpy backend cannot return bfloat16 tensors
(numpy has no such dtype), and most checkpoints are bfloat16. The format is a
little-endian u64 header length, a JSON header mapping each tensor name to
{dtype, shape, data_offsets}, then the raw bytes; so we parse the header and
memory-map each tensor with numpy, using ml_dtypes for bfloat16 and
float8_e4m3fn. Nothing is
read from disk until a tensor is asked for, and then only that tensor.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxinfer.errors import CheckpointError

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    # fp8 weights come with their scales in other tensors: only a quantized
    # checkpoint's reader (loading/prequantized/) makes numbers of them.
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_COMPUTE_DTYPES = ("F64", "F32", "F16", "BF16")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class SafetensorsFile:
    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                if header_len > self.path.stat().st_size:
                    raise ValueError("header length exceeds file size")
                self.header = json.loads(f.read(header_len))
        except FileNotFoundError:
            raise CheckpointError(f"{self.path} not found") from None
        except (struct.error, ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.path} is not a valid safetensors file ({e})") from None
        self.header.pop("__metadata__", None)
        self.data_start = 8 + header_len
        self.file_size = self.path.stat().st_size

    def names(self):
        return self.header.keys()

    def get(self, name: str) -> np.ndarray:
        entry = self.header[name]
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise CheckpointError(f"{self.path}: tensor {name} has unsupported dtype {entry['dtype']}")
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if self.data_start + end > self.file_size or end - begin != np.dtype(dtype).itemsize * int(np.prod(shape)):
            raise CheckpointError(f"{self.path}: tensor {name} lies outside the file (truncated or corrupt checkpoint)")
        return np.memmap(self.path, dtype=dtype, mode="r", offset=self.data_start + begin, shape=shape)


class SafetensorsCheckpoint:
    """All tensors of a HF model directory, single-file or sharded with an index."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        index_path = directory / INDEX_FILE
        self._file_of: dict[str, SafetensorsFile] = {}
        if index_path.exists():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index_path} is not a valid safetensors index ({e})") from None
            files = {name: SafetensorsFile(directory / name) for name in sorted(set(weight_map.values()))}
            for tensor, file_name in weight_map.items():
                if tensor not in files[file_name].header:
                    raise CheckpointError(f"{index_path} places {tensor} in {file_name}, which does not hold it")
                self._file_of[tensor] = files[file_name]
        elif (directory / SINGLE_FILE).exists():
            single = SafetensorsFile(directory / SINGLE_FILE)
            self._file_of = {name: single for name in single.names()}
        else:
            raise CheckpointError(f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE}")
        self.description = str(directory)

    def names(self):
        return self._file_of.keys()

    def get(self, name: str) -> np.ndarray:
        return self._file_of[name].get(name)

    @property
    def stored_dtype(self) -> np.dtype | None:
        """The dtype the float weights are stored in (the embedding table's),
        which dtype="auto" loads them as where the platform allows; None
        where that is no float type to compute in (fp8, integers)."""
        name = "model.embed_tokens.weight"
        file = self._file_of.get(name)
        stored = file and file.header[name]["dtype"]
        return np.dtype(_DTYPES[stored]) if stored in _COMPUTE_DTYPES else None
