"""GGUF K-quant blocks straight into a KQuantTensor's tiled planes
(kquant_repack.cc), the layout the K-quant kernels read, in one native pass
per tensor: a GGUF load's conversion on CPU. Where the library cannot be
built, `repack` returns None and the loader converts in numpy
(loading/gguf.py, blocks_to_kquant) and the backend tiles after."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import jax
import numpy as np

from jaxinfer.native.build import native_library
from jaxinfer.quant.kquant import FORMATS, SUPER_BLOCK, TILE, KQuantTensor
from jaxinfer.utils import host_empty

SOURCE = Path(__file__).with_suffix(".cc")
KINDS = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")  # kquant_repack.cc's Kind
BLOCK_BYTES = {"q2_k": 84, "q3_k": 110, "q4_k": 144, "q5_k": 176, "q6_k": 210}  # a block of 256 weights, as stored


@functools.cache
def _function():
    library = native_library(str(SOURCE))
    if library is None:
        return None
    function = library.jaxinfer_kquant_repack
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, *[ctypes.c_void_p] * 7]
    return function


def available() -> bool:
    """Whether the library is built and loaded (built on first call, ~2 s)."""
    return _function() is not None


def takes(out_dim: int, in_dim: int) -> bool:
    """Whether an [out, in] matrix goes in whole tiles of super-blocks."""
    return out_dim % TILE == 0 and in_dim % SUPER_BLOCK == 0


def empty(kind: str, out_dim: int, in_dim: int, layers: int | None = None) -> KQuantTensor:
    """An uninitialized tiled KQuantTensor [in, out] (with a leading axis of
    `layers` where given) in aligned host memory (utils.host_empty), for
    `repack` to fill, a layer at a time."""
    if not takes(out_dim, in_dim):
        raise ValueError(f"a {kind} matrix of {out_dim} rows and {in_dim} columns does not tile by {TILE}")
    f = FORMATS[kind]
    lead = () if layers is None else (layers,)

    def plane(rows_per_tile, dtype=np.uint8):
        return host_empty((*lead, out_dim // TILE, rows_per_tile, TILE), dtype)

    supers = in_dim // SUPER_BLOCK
    return KQuantTensor(
        plane(in_dim * f.low_bits // 8), plane(in_dim * f.high_bits // 8) if f.high_bits else None,
        plane(in_dim // f.group, np.int8 if f.signed_scales else np.uint8),
        plane(in_dim // f.group) if f.minimums == "separate" else None,
        plane(supers, np.float16), plane(supers, np.float16) if f.minimums else None, kind, tile=TILE)


def repack(blocks: np.ndarray, kind: str, out_dim: int, in_dim: int, rows: np.ndarray | None = None,
           out: KQuantTensor | None = None):
    """A K-quant [out, in] matrix's blocks (uint8, the file's bytes) -> a
    KQuantTensor [in, out] tiled by TILE, numpy leaves; column j is the
    file's row rows[j] (default j). Written into `out` (one layer of an
    `empty` stack, say) where given, else into new memory. None where the
    library is not available."""
    function = _function()
    if function is None:
        return None
    blocks = np.ascontiguousarray(blocks, np.uint8)  # a view of the mapped file where it already is one
    if blocks.size != out_dim * (in_dim // SUPER_BLOCK) * BLOCK_BYTES[kind]:
        raise ValueError(f"{blocks.size} bytes of {kind} blocks for a matrix [{out_dim}, {in_dim}]")
    if rows is not None and (len(rows) != out_dim or np.min(rows) < 0 or np.max(rows) >= out_dim):
        raise ValueError(f"rows must be {out_dim} row numbers below {out_dim}")
    out = empty(kind, out_dim, in_dim) if out is None else out
    if out.kind != kind or out.tile != TILE or out.shape != (in_dim, out_dim) or not all(
            a.flags.c_contiguous for a in jax.tree.leaves(out)):
        raise ValueError(f"cannot repack a {kind} matrix [{out_dim}, {in_dim}] into {out.kind} {out.shape}")
    order = None if rows is None else np.ascontiguousarray(rows, np.int64)

    def address(a):
        return None if a is None else a.ctypes.data

    status = function(KINDS.index(kind), address(blocks), out_dim, in_dim, address(order), address(out.codes),
                      address(out.high), address(out.sub_scales), address(out.sub_mins), address(out.d),
                      address(out.dmin))
    if status != 0:
        raise ValueError(f"kquant_repack refused a {kind} matrix [{out_dim}, {in_dim}]")
    return out
