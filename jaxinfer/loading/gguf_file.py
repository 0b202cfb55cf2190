"""The GGUF container: metadata values and tensor descriptions read from the
file's header, tensor bytes as memory-mapped views.

Written here rather than taken from `gguf.GGUFReader` for start-up time: the
reader builds numpy views for every element of every metadata array, which for
the default model's 49,152-token vocabulary and 48,900 merges took 1.7 s of a
3 s warm start; this reads the same header in a few tens of milliseconds. The
format's constants (value types, block sizes) still come from the `gguf`
package, and tests/loading/test_gguf.py checks every field and tensor against
GGUFReader on real files.

Format (GGUF v2/v3, little-endian): magic, u32 version, u64 tensor count, u64
metadata count; metadata as (string key, u32 type, value), arrays as (u32
element type, u64 length, elements); tensor infos as (string name, u32 dims,
u64 dims fastest-first, u32 ggml type, u64 offset); tensor data from the next
multiple of `general.alignment` (default 32).
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np
from jaxinfer.loading.gguf_package import gguf

GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC = gguf.GGML_QUANT_SIZES, gguf.GGUF_DEFAULT_ALIGNMENT, gguf.GGUF_MAGIC
GGMLQuantizationType, GGUFValueType = gguf.GGMLQuantizationType, gguf.GGUFValueType
quant_shape_to_byte_shape = gguf.quants.quant_shape_to_byte_shape

V = GGUFValueType
_SCALARS = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
            V.FLOAT32: "<f", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d", V.BOOL: "<?"}
_LENGTH = struct.Struct("<Q")  # a string's byte count, before its bytes
_ARRAY_DTYPES = {V.UINT8: "<u1", V.INT8: "<i1", V.UINT16: "<u2", V.INT16: "<i2", V.UINT32: "<u4", V.INT32: "<i4",
                 V.FLOAT32: "<f4", V.UINT64: "<u8", V.INT64: "<i8", V.FLOAT64: "<f8", V.BOOL: "?"}
# Tensor types stored as plain numbers; every other type is blocks of bytes.
_PLAIN_TENSORS = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                  GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                  GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                  GGMLQuantizationType.I64: np.int64}


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order: fastest dimension first
    data: np.ndarray  # numbers in numpy order (slowest first), or uint8 blocks [..., bytes per row]


class GGUFFile:
    """fields: {key: str | int | float | bool | list}; tensors: [GGUFTensor] in file order."""

    def __init__(self, path: str | Path):
        with open(path, "rb") as file:
            self._mmap = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        self._data = np.frombuffer(self._mmap, np.uint8)  # the arrays below hold the mapping
        self._buffer = memoryview(self._data)
        self._offset = 0
        magic, version = self._unpack("<II")
        if magic != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        if version not in (2, 3):
            hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
            raise ValueError(f"GGUF version {version} is not supported{hint}")
        num_tensors, num_fields = self._unpack("<QQ")
        self.fields: dict = {}
        for _ in range(num_fields):
            key = self._string()
            if key in self.fields:
                raise ValueError(f"duplicate metadata key {key}")
            self.fields[key] = self._value(V(self._unpack("<I")[0]))
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = self.fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("duplicate tensor names")

    def release(self, data: np.ndarray) -> None:
        """Drop the whole pages under `data` (a tensor's bytes, a view of the
        mapping) from this process's resident memory once the loader has
        converted them: the kernel keeps them in its page cache, and a later
        read maps them back. Without it every page of the file read stays
        counted in the process (an 8B file's 4.5 GB beside its converted
        copy, through the whole load)."""
        page = mmap.PAGESIZE
        begin = data.ctypes.data - self._data.ctypes.data
        start, end = -(-begin // page) * page, (begin + data.nbytes) // page * page
        if hasattr(mmap, "MADV_DONTNEED") and end > start:
            self._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._buffer, self._offset)
        self._offset += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        return self._strings(1)[0]

    def _value(self, kind: V):
        if kind == V.STRING:
            return self._string()
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])[0]
        if kind != V.ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        element, length = V(self._unpack("<I")[0]), self._unpack("<Q")[0]
        if element in _ARRAY_DTYPES:
            values = np.frombuffer(self._buffer, _ARRAY_DTYPES[element], length, self._offset)
            self._offset += values.nbytes
            return values.tolist()
        if element == V.STRING:
            return self._strings(length)
        return [self._value(element) for _ in range(length)]

    def _strings(self, count: int) -> list[str]:
        """`count` strings one after another (each a u64 byte count, then its
        UTF-8 bytes; a vocabulary, its merges): their spans first, then one
        comprehension decoding the mapping's bytes. A tokenizer's ~100,000
        strings are most of a header; read one at a time (calls and a
        struct format per string) they took twice as long."""
        mapping, offset, length_at = self._mmap, self._offset, _LENGTH.unpack_from
        spans = []
        for _ in range(count):
            (length,) = length_at(mapping, offset)
            spans.append((offset + 8, offset + 8 + length))
            offset += 8 + length
        self._offset = offset
        return [mapping[start:end].decode("utf-8") for start, end in spans]

    def _tensor_info(self) -> tuple:
        name = self._string()
        (num_dims,) = self._unpack("<I")
        shape = self._unpack(f"<{num_dims}Q")
        kind, offset = self._unpack("<IQ")
        return name, GGMLQuantizationType(kind), shape, offset

    def _tensor(self, start: int, name: str, kind: GGMLQuantizationType, shape: tuple, offset: int) -> GGUFTensor:
        numpy_shape = tuple(reversed(shape))
        count = int(np.prod(shape, dtype=np.int64))
        if kind in _PLAIN_TENSORS:
            dtype, byte_shape = np.dtype(_PLAIN_TENSORS[kind]), numpy_shape
            nbytes = count * dtype.itemsize
        else:
            block_size, type_size = GGML_QUANT_SIZES[kind]
            dtype, byte_shape = np.dtype(np.uint8), quant_shape_to_byte_shape(numpy_shape, kind)
            nbytes = count // block_size * type_size
        begin = start + offset
        if begin + nbytes > len(self._data):
            raise ValueError(f"tensor {name} runs past the end of the file")
        data = self._data[begin:begin + nbytes].view(dtype).reshape(byte_shape)
        return GGUFTensor(name, kind, shape, data)
