"""KQuantTensor: a weight matrix in one of llama.cpp's K-quant formats (Q2_K,
Q3_K, Q4_K, Q5_K, Q6_K), held at the file's own size: the codes at their own
bit width and the two levels of scales as the file stores them, expanded to
floats only inside a kernel's registers (native/kquant_matmul.cc,
native/q8_matmul.cc) or by `dequantize`, the reference every path is held to.

Why not a QuantizedTensor (quant/tensor.py): a K-quant weight's scale is a
float16 super-scale `d` per 256 inputs times a small integer sub-scale per
16 or 32 inputs. Multiplied out into float32 per group (exact, but 4 bytes a
group), and with 5- and 6-bit codes widened to int8, a Q4_K_M model read
308 MiB a decode step where its file holds ~200 MB (BENCHMARKS.md, "K-quant
files"). Here the bytes held are the file's, give or take the sub-scales'
packing (one byte per 6-bit sub-scale: Q4_K +2.8%, Q5_K +2.3%, Q3_K +3.6%;
Q2_K and Q6_K exactly the file's).

Logical value: a matrix [..., in, out] (params store linear weights [in,
out]); `in` runs over super-blocks of 256 inputs, each cut into groups of
`group` inputs (16 or 32):

    code   = low | high << low_bits                      (unsigned, 0 .. 2^bits - 1)
    scale  = float32(d[s]) * float32(sub_scale[g])        s = i // 256, g = i // group
    min    = float32(dmin[s]) * float32(sub_min[g])       (kinds with minimums)
    value  = scale * float32(code - bias) - min

in float32, the operations and their order of gguf.quants.dequantize, so the
values are the file's bit for bit.

kind   low  high  group  bias  sub_scales                     minimums
q2_k   2    -     16     0     uint8: scale | min << 4          the same byte's high nibble, dmin
q3_k   2    1     16     4     int8: the 6-bit scale - 32       none
q4_k   4    -     32     0     uint8: 6-bit scale               sub_mins uint8 (6-bit), dmin
q5_k   4    1     32     0     uint8: 6-bit scale               sub_mins uint8 (6-bit), dmin
q6_k   4    2     16     32    int8                             none

Planes (plain layout; leading axes are stacked layers):
  codes     uint8 [..., in * low / 8, out]: byte row j holds inputs
            (8 / low) * j + b in bits [low * b, low * b + low)
  high      uint8 [..., in * high / 8, out], the same rule with high bits; None where high is 0
  sub_scales [..., in // group, out], sub_mins uint8 the same or None
  d         float16 [..., in // 256, out], dmin the same or None

tile  0: as above. 64: every array's out axis cut into tiles of 64 columns
      stored one after another ([..., out // 64, rows, 64]), so a kernel task
      (64 columns, every input) reads contiguous runs; the two code planes'
      64-byte rows also in nibble order (byte 4d + m holds column 16m + d, as
      quant/tensor.py's int4 tiles), so that a 32-bit shift and a table
      lookup of 16 floats turn 16 columns' codes into floats
      (native/kquant_matmul.cc).

activation_block  0 or, for the "gguf-a8" load, 256: the activations are
      rounded to int8 in blocks of a super-block (quant/schemes.py,
      int8_blocks), as llama.cpp multiplies these formats (its Q8_K), so
      that the integer sub-scales apply to exact integer dot products
      (native/q8_matmul.cc).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

SUPER_BLOCK = 256  # inputs per float16 super-scale, every kind
NIBBLE_LINE = 64   # bytes of a tiled code plane's row put in nibble order


@dataclasses.dataclass(frozen=True)
class KFormat:
    low_bits: int
    high_bits: int
    group: int
    bias: int
    signed_scales: bool  # sub_scales int8 (else uint8)
    minimums: str        # "" (none), "separate" (sub_mins), "packed" (sub_scales' high nibble)


FORMATS = {
    "q2_k": KFormat(2, 0, 16, 0, False, "packed"),
    "q3_k": KFormat(2, 1, 16, 4, True, ""),
    "q4_k": KFormat(4, 0, 32, 0, False, "separate"),
    "q5_k": KFormat(4, 1, 32, 0, False, "separate"),
    "q6_k": KFormat(4, 2, 16, 32, True, ""),
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KQuantTensor:
    codes: jax.Array
    high: jax.Array | None
    sub_scales: jax.Array
    sub_mins: jax.Array | None
    d: jax.Array
    dmin: jax.Array | None
    kind: str = dataclasses.field(metadata=dict(static=True))
    activation_block: int = dataclasses.field(default=0, metadata=dict(static=True))
    tile: int = dataclasses.field(default=0, metadata=dict(static=True))

    @property
    def format(self) -> KFormat:
        return FORMATS[self.kind]

    @property
    def group_size(self) -> int:
        return self.format.group

    @property
    def in_features(self) -> int:
        return self.sub_scales.shape[-2] * self.format.group

    @property
    def out_features(self) -> int:
        return self.sub_scales.shape[-1] * (self.sub_scales.shape[-3] if self.tile else 1)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (dequantized) shape."""
        return (*self.sub_scales.shape[:-3 if self.tile else -2], self.in_features, self.out_features)

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(self))

    def tiled(self, tile: int) -> KQuantTensor:
        """The same weight in tiles of `tile` (64) columns, code planes in
        nibble order (see the module docstring). Done in numpy on concrete
        arrays, as QuantizedTensor.tiled."""
        if self.tile or tile != NIBBLE_LINE or self.out_features % tile:
            raise ValueError(f"cannot tile a {self.kind} tensor of {self.out_features} columns "
                             f"(tile {self.tile}) by {tile}")

        def to_tiles(a, plane=False):  # [..., rows, out] -> [..., out // tile, rows, tile]
            if a is None:
                return None
            a = np.asarray(a)
            a = np.ascontiguousarray(np.swapaxes(a.reshape(*a.shape[:-1], -1, tile), -3, -2))
            if plane:  # column 16m + d of each line to byte 4d + m
                lines = a.reshape(*a.shape[:-1], 4, NIBBLE_LINE // 4)
                a = np.ascontiguousarray(np.swapaxes(lines, -1, -2)).reshape(a.shape)
            return jnp.asarray(a)
        return dataclasses.replace(
            self, codes=to_tiles(self.codes, True), high=to_tiles(self.high, True),
            sub_scales=to_tiles(self.sub_scales), sub_mins=to_tiles(self.sub_mins), d=to_tiles(self.d),
            dmin=to_tiles(self.dmin), tile=tile)

    def untiled(self) -> KQuantTensor:
        """The same weight in the plain layout (itself where it is not tiled)."""
        if not self.tile:
            return self

        def from_tiles(a, plane=False):  # [..., out // tile, rows, tile] -> [..., rows, out]
            if a is None:
                return None
            if plane:  # byte 4d + m of each line back to column 16m + d
                lines = a.reshape(*a.shape[:-1], NIBBLE_LINE // 4, 4)
                a = jnp.swapaxes(lines, -1, -2).reshape(a.shape)
            return jnp.swapaxes(a, -3, -2).reshape(*a.shape[:-3], a.shape[-2], -1)
        return dataclasses.replace(
            self, codes=from_tiles(self.codes, True), high=from_tiles(self.high, True),
            sub_scales=from_tiles(self.sub_scales), sub_mins=from_tiles(self.sub_mins), d=from_tiles(self.d),
            dmin=from_tiles(self.dmin), tile=0)


def pack_bits(values, bits: int):
    """uint8 [..., in, out] of `bits`-bit values -> uint8 [..., in * bits / 8, out]:
    byte row j holds rows (8 / bits) * j + b in bits [bits * b, bits * b + bits)."""
    per_byte = 8 // bits
    values = values.astype(jnp.uint8) if isinstance(values, jax.Array) else np.asarray(values, np.uint8)
    rows = values.reshape(*values.shape[:-2], values.shape[-2] // per_byte, per_byte, values.shape[-1])
    packed = rows[..., 0, :]
    for b in range(1, per_byte):
        packed = packed | (rows[..., b, :] << (bits * b))
    return packed


def unpack_bits(packed, bits: int):
    """The inverse of pack_bits: uint8 [..., rows, out] -> [..., rows * 8 / bits, out]."""
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    parts = jnp.stack([(packed >> (bits * b)) & mask for b in range(per_byte)], axis=-2)
    return parts.reshape(*packed.shape[:-2], packed.shape[-2] * per_byte, packed.shape[-1])


def sub_scale_values(w: KQuantTensor):
    """(sub-scales, sub-minimums or None) of a plain-layout w as float32 [..., in // group, out]."""
    f = w.format
    if f.minimums == "packed":
        return (w.sub_scales & 0x0F).astype(jnp.float32), (w.sub_scales >> 4).astype(jnp.float32)
    minimums = None if w.sub_mins is None else w.sub_mins.astype(jnp.float32)
    return w.sub_scales.astype(jnp.float32), minimums


def dequantize(w: KQuantTensor, dtype=jnp.float32) -> jax.Array:
    """The reference: the logical [..., in, out] matrix, in float32 as
    gguf.quants.dequantize computes it (then cast to `dtype`)."""
    w = w.untiled()
    f = w.format
    codes = unpack_bits(w.codes, f.low_bits)
    if f.high_bits:
        codes = codes | (unpack_bits(w.high, f.high_bits) << f.low_bits)
    q = (codes.astype(jnp.int32) - f.bias).astype(jnp.float32)
    per_group = SUPER_BLOCK // f.group
    sub_scales, sub_mins = sub_scale_values(w)
    scales = jnp.repeat(w.d.astype(jnp.float32), per_group, axis=-2) * sub_scales  # [..., groups, out]
    groups = q.reshape(*q.shape[:-2], -1, f.group, q.shape[-1]) * scales[..., None, :]
    if sub_mins is not None:
        minimums = jnp.repeat(w.dmin.astype(jnp.float32), per_group, axis=-2) * sub_mins
        groups = groups - minimums[..., None, :]
    return groups.reshape(q.shape).astype(dtype)
