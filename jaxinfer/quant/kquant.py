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
      stored one after another, so that a kernel task (64 columns, every
      input) reads contiguous runs. The scales as [..., out // 64, rows, 64].
      The code planes in 32-bit words, one word per column holding 32 / bits
      inputs: uint8 [..., out // 64, in * bits / 8, 64], where 64-byte line
      4c + q holds word c of columns 16q .. 16q + 15 (a run of 32 / bits
      inputs for each). In a low word input u sits at bit low * u; in a
      high word, which spans one or more runs of low words, input u of its
      run h at bit 8 * (u / per_byte) + high * (h * per_byte + u % per_byte),
      per_byte = 8 / low (_word_positions). Why: a 32-bit shift then leaves
      any input's code of 16 columns in the low bits of their lanes, where a
      table lookup of 16 floats turns it into floats
      (native/kquant_matmul.cc); and one shift and mask of a low word and of
      its high word gives each byte the whole code of one input, 4 inputs a
      column, as the int8 dot product (vpdpbusd) multiplies them
      (native/q8_matmul.cc).

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
TILE = 64          # columns per tile (the kernels' only layout)


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
        """The same weight in tiles of `tile` (64) columns, the code planes in
        32-bit words (see the module docstring). Done in numpy on concrete
        arrays, as QuantizedTensor.tiled."""
        if self.tile or tile != TILE or self.out_features % tile:
            raise ValueError(f"cannot tile a {self.kind} tensor of {self.out_features} columns "
                             f"(tile {self.tile}) by {tile}")
        f = self.format

        def to_tiles(a):  # [..., rows, out] -> [..., out // tile, rows, tile]
            if a is None:
                return None
            a = np.asarray(a)
            return jnp.asarray(np.ascontiguousarray(np.swapaxes(a.reshape(*a.shape[:-1], -1, tile), -3, -2)))

        def words_to_tiles(word_bytes):  # [..., words, 4, out] -> [..., tiles, words * 4, tile] (the layout)
            *lead, words, _, out = word_bytes.shape
            lines = word_bytes.reshape(*lead, words, 4, out // tile, 4, tile // 4)  # [.., c, byte, tiles, q, m]
            lines = np.moveaxis(lines, (-5, -4, -3), (-4, -1, -5))  # [.., tiles, c, q, m, byte]
            return jnp.asarray(np.ascontiguousarray(lines).reshape(*lead, out // tile, words * 4, tile))

        def low_words(packed):
            # Byte k of word c holds inputs 32 / low * c + 8 / low * k + j at
            # bits low * j: byte row 4c + k of the packed plane, as it is.
            packed = np.asarray(packed)
            return words_to_tiles(packed.reshape(*packed.shape[:-2], -1, 4, packed.shape[-1]))

        def high_words(packed):
            # Byte k of a word holds, for each run h of 32 / low inputs and
            # each i < 8 / low, input h * run + 8 / low * k + i at bits
            # high * (h * 8 / low + i) (_word_positions).
            bits, per_byte = f.high_bits, 8 // f.low_bits
            runs = f.low_bits // f.high_bits
            values = _unpack_bits_np(np.asarray(packed), bits)  # [..., in, out]
            values = values.reshape(*values.shape[:-2], -1, runs, 4, per_byte, values.shape[-1])
            word_bytes = np.zeros(values.shape[:-4] + (4, values.shape[-1]), np.uint8)
            for h in range(runs):
                for i in range(per_byte):
                    word_bytes |= values[..., h, :, i, :] << np.uint8(bits * (h * per_byte + i))
            return words_to_tiles(word_bytes)
        high = None if self.high is None else high_words(self.high)
        return dataclasses.replace(
            self, codes=low_words(self.codes), high=high,
            sub_scales=to_tiles(self.sub_scales), sub_mins=to_tiles(self.sub_mins), d=to_tiles(self.d),
            dmin=to_tiles(self.dmin), tile=tile)

    def untiled(self) -> KQuantTensor:
        """The same weight in the plain layout (itself where it is not tiled)."""
        if not self.tile:
            return self
        f = self.format

        def from_tiles(a):  # [..., out // tile, rows, tile] -> [..., rows, out]
            if a is None:
                return None
            return jnp.swapaxes(a, -3, -2).reshape(*a.shape[:-3], a.shape[-2], -1)

        def words_to_plane(tiles, bits, positions):
            words = jax.lax.bitcast_convert_type(_lines(tiles), jnp.uint32)  # [..., tiles, words, q, 16]
            values = _word_inputs(words, bits, positions, axis=-3)
            # [..., tiles, words, u, q, 16] -> [..., words, u, tiles, q, 16] -> [..., in, out]
            values = jnp.moveaxis(values, -5, -3)
            values = values.reshape(*values.shape[:-5], -1, values.shape[-3] * values.shape[-2] * values.shape[-1])
            return pack_bits(values.astype(jnp.uint8), bits)
        high = None if self.high is None else words_to_plane(self.high, f.high_bits, _word_positions(f, True))
        return dataclasses.replace(
            self, codes=words_to_plane(self.codes, f.low_bits, _word_positions(f, False)), high=high,
            sub_scales=from_tiles(self.sub_scales), sub_mins=from_tiles(self.sub_mins), d=from_tiles(self.d),
            dmin=from_tiles(self.dmin), tile=0)


    def columns(self, indices) -> jax.Array:
        """Columns `indices` (int [...]) of a 2-D weight, dequantized: float32
        [..., in], the numbers `dequantize` gives them (a tied model's
        embeddings taken from its head's blocks, with no float table). Only
        the columns asked for are read and dequantized: each index's whole
        tile would be 64 times the work, 8% of a 512-token prefill step."""
        if len(self.shape) != 2:
            raise ValueError(f"columns of a 2-D weight, not one of shape {self.shape}")
        indices = jnp.asarray(indices)
        flat = indices.reshape(-1)
        if self.tile:
            picked = self._tile_columns(flat // self.tile, flat % self.tile)
        else:  # every array [rows, out]
            picked = jax.tree.map(lambda a: a[:, flat], self)
        return dequantize(picked).T.reshape(*indices.shape, self.in_features)

    def _tile_columns(self, tiles, columns) -> KQuantTensor:
        """Column columns[i] of tile tiles[i] for each i, as a plain-layout
        weight of that many columns (a tiled 2-D self)."""
        f = self.format

        def pick(a):  # [out // tile, rows, tile] -> [rows, n]
            return None if a is None else a[tiles, :, columns].T

        def pick_plane(plane, bits, positions):  # a code plane's words of each column -> plain [in * bits / 8, n]
            word_bytes = _lines(plane)[tiles, :, columns // (TILE // 4), columns % (TILE // 4)]  # [n, words, 4]
            values = _word_inputs(jax.lax.bitcast_convert_type(word_bytes, jnp.uint32), bits, positions, axis=-1)
            return pack_bits(values.reshape(values.shape[0], -1).T, bits)  # [n, words, u] -> [in, n]

        high = None if self.high is None else pick_plane(self.high, f.high_bits, _word_positions(f, True))
        return dataclasses.replace(
            self, codes=pick_plane(self.codes, f.low_bits, _word_positions(f, False)), high=high,
            sub_scales=pick(self.sub_scales), sub_mins=pick(self.sub_mins), d=pick(self.d), dmin=pick(self.dmin),
            tile=0)


def _lines(plane):
    """A tiled code plane uint8 [..., tiles, words * 4, TILE] as [..., tiles,
    words, q, TILE / 4, 4]: the 4 bytes of word c of column 16q + d at [c, q, d]."""
    return plane.reshape(*plane.shape[:-2], -1, 4, TILE // 4, 4)


def _word_inputs(words, bits: int, positions: list[int], axis: int):
    """The `bits`-bit inputs of uint32 words at their `positions`, stacked at `axis`."""
    mask = jnp.uint32((1 << bits) - 1)
    return jnp.stack([(words >> jnp.uint32(int(pos))) & mask for pos in positions], axis=axis)


def _word_positions(f: KFormat, high: bool) -> list[int]:
    """The bit of each input of a tiled plane's 32-bit word (module docstring)."""
    if not high:
        return [f.low_bits * u for u in range(32 // f.low_bits)]
    run, per_byte = 32 // f.low_bits, 8 // f.low_bits
    positions = []
    for j in range(32 // f.high_bits):
        h, u = divmod(j, run)
        positions.append(8 * (u // per_byte) + f.high_bits * (h * per_byte + u % per_byte))
    return positions


def _unpack_bits_np(packed: np.ndarray, bits: int) -> np.ndarray:
    per_byte = 8 // bits
    parts = np.stack([(packed >> (bits * b)) & ((1 << bits) - 1) for b in range(per_byte)], axis=-2)
    return parts.reshape(*packed.shape[:-2], packed.shape[-2] * per_byte, packed.shape[-1])


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
