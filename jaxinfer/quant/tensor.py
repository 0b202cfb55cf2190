"""QuantizedTensor: a weight matrix stored quantized, as a pytree that flows
through jit, lax.scan (stacked layers) and sharding like any array.

Logical value: a matrix [..., in, out] (our params store linear weights
[in, out], activations multiply from the left; leading axes are stacked
layers). Quantization groups run along `in`, `group_size` rows per scale:

    value[..., i, o] = q[..., i, o] * scales[..., i // group_size, o]
                       (+ offsets[..., i // group_size, o]   where offsets is not None)

scheme  data                                          q                       scales / offsets
int8    int8 [..., in, out]                           data                    symmetric; per channel
                                                                              (group_size = in) or grouped
                                                                              (GGUF Q8_0: 32, Q6_K: 16);
                                                                              offsets only from
                                                                              as_int8_groups
int4    uint8 [..., in // 2, out]: row 2j in the      0..15                   scales and offsets (the zero
        low nibble of byte j, row 2j + 1 in the                               point folded in: offset =
        high nibble                                                           -zero * scale; GGUF Q4_0:
                                                                              -8 * d, Q4_1: m, Q4_K: -dmin*m)
fp8     float8_e4m3fn [..., in, out]                  data                    symmetric, per channel
w8a8    int8 [..., in, out], stored as int8 per       data                    symmetric, per channel
        channel; what differs is how it multiplies:
        activations are quantized to int8 per row on
        the fly (quant/linear.py), so the value of
        x @ w is not the float product (opt-in)

scales and offsets are float32 [..., in // group_size, out] (float16 where
that is exact and the weight multiplies int8 activations: quant/params.py,
with_int8_activations); offsets is None except for int4 and regrouped int8.

activation_block  0: the weight multiplies the activations as they are (its
        value above, exactly). N > 0: the activations are first quantized to
        int8 in blocks of N inputs (quant/schemes.py, int8_blocks: how
        llama.cpp multiplies a GGUF's blocks), so x @ w is int8_blocks(x) @
        value; the CPU kernel (native/matmul.py) then multiplies int8 by
        int8 / int4 codes. Set by the "gguf-a8" load (loading/params.py).

tile  0: data, scales and offsets as above. T > 0 (int8 / int4 only): the
        out axis cut into tiles of T columns stored one after another, data
        [..., out // T, in(/2), T] and scales / offsets [..., out // T,
        in // group_size, T]: a native CPU kernel's task (T columns, every
        input) then streams one contiguous run of memory instead of T bytes
        from every row, which on the dev VM read 2x faster from memory
        (the CPU backend, backends/cpu.py, tiles the stacked layer weights
        for the kernels of native/matmul.py). int4 data is also in nibble order: within each
        64 bytes of a tile's row, byte 4d + m holds column 16m + d, so that
        the kernel turns 16 codes into floats with a shift and a table
        lookup instead of widening bytes across the register
        (native/matmul.cc, NibbleFloats). untiled() gives the plain layout,
        which every other path takes.

`scheme`, `group_size`, `activation_block` and `tile` are static (pytree metadata).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

SCHEMES = ("int8", "int4", "fp8", "w8a8")
NIBBLE_LINE = 64  # bytes of tiled int4 codes put in nibble order together (one AVX-512 register, two AVX2)


def _as_jnp(a):
    return None if a is None else jnp.asarray(a)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
    data: jax.Array
    scales: jax.Array
    offsets: jax.Array | None
    scheme: str = dataclasses.field(metadata=dict(static=True))
    group_size: int = dataclasses.field(metadata=dict(static=True))
    activation_block: int = dataclasses.field(default=0, metadata=dict(static=True))
    tile: int = dataclasses.field(default=0, metadata=dict(static=True))

    @property
    def in_features(self) -> int:
        return self.data.shape[-2] * (2 if self.scheme == "int4" else 1)

    @property
    def out_features(self) -> int:
        return self.data.shape[-1] * (self.data.shape[-3] if self.tile else 1)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (dequantized) shape."""
        return (*self.data.shape[:-3 if self.tile else -2], self.in_features, self.out_features)

    def tiled(self, tile: int) -> QuantizedTensor:
        """The same weight stored in tiles of `tile` columns (see the module
        docstring). A storage step on concrete arrays, done in numpy: as jnp
        it compiled one XLA program per weight shape into a machine's first
        start."""
        if self.tile or self.scheme not in ("int8", "int4") or self.out_features % tile:
            raise ValueError(f"cannot tile a {self.scheme} tensor of {self.out_features} columns "
                             f"(tile {self.tile}) by {tile}")

        if self.scheme == "int4" and tile % NIBBLE_LINE:
            raise ValueError(f"int4 tiles are whole lines of {NIBBLE_LINE} bytes, not {tile}")

        def to_tiles(a):  # [..., rows, out] -> [..., out // tile, rows, tile]
            if a is None:
                return None
            a = np.asarray(a)
            return np.ascontiguousarray(np.swapaxes(a.reshape(*a.shape[:-1], -1, tile), -3, -2))
        data = to_tiles(self.data)
        if self.scheme == "int4":  # column 16m + d of each line to byte 4d + m
            lines = data.reshape(*data.shape[:-1], -1, 4, NIBBLE_LINE // 4)
            data = np.ascontiguousarray(np.swapaxes(lines, -1, -2)).reshape(data.shape)
        return dataclasses.replace(self, data=jnp.asarray(data), scales=_as_jnp(to_tiles(self.scales)),
                                   offsets=_as_jnp(to_tiles(self.offsets)), tile=tile)

    def untiled(self) -> QuantizedTensor:
        """The same weight in the plain layout (itself where it is not tiled)."""
        if not self.tile:
            return self

        def from_tiles(a):  # [..., out // tile, rows, tile] -> [..., rows, out]
            return None if a is None else jnp.swapaxes(a, -3, -2).reshape(*a.shape[:-3], a.shape[-2], -1)
        data = self.data
        if self.scheme == "int4":  # byte 4d + m of each line back to column 16m + d
            lines = data.reshape(*data.shape[:-1], -1, NIBBLE_LINE // 4, 4)
            data = jnp.swapaxes(lines, -1, -2).reshape(data.shape)
        return dataclasses.replace(self, data=from_tiles(data), scales=from_tiles(self.scales),
                                   offsets=from_tiles(self.offsets), tile=0)

    def columns(self, indices) -> jax.Array:
        """Columns `indices` (int [...]) of a 2-D weight with one code a byte
        (int8, w8a8, fp8), dequantized: float32 [..., in], the same numbers
        `dequantize` gives them, read from the plain or the tiled layout
        without touching the others (a tied model's embeddings taken from
        its quantized head)."""
        if self.scheme == "int4" or len(self.shape) != 2:
            raise ValueError(f"columns of a 2-D weight of one code a byte, not a {self.scheme} one of shape "
                             f"{self.shape}")
        indices = jnp.asarray(indices)
        if self.tile:  # [out // tile, rows, tile]: column c is [c // tile, :, c % tile]
            def pick(a):
                return a[indices // self.tile, :, indices % self.tile]
        else:  # [rows, out]
            def pick(a):
                return jnp.moveaxis(jnp.take(a, indices, axis=-1), 0, -1)
        value = pick(self.data).astype(jnp.float32) * jnp.repeat(pick(self.scales), self.group_size, axis=-1)
        if self.offsets is not None:
            value = value + jnp.repeat(pick(self.offsets), self.group_size, axis=-1)
        return value

    @property
    def nbytes(self) -> int:
        parts = [self.data, self.scales] + ([self.offsets] if self.offsets is not None else [])
        return sum(p.size * p.dtype.itemsize for p in parts)


def unpack_int4(packed: jax.Array) -> jax.Array:
    """uint8 [..., in // 2, out] -> uint8 [..., in, out] with values 0..15 (rows interleaved back)."""
    low = packed & 0x0F
    high = packed >> 4
    stacked = jnp.stack([low, high], axis=-2)  # [..., in // 2, 2, out]
    return stacked.reshape(*packed.shape[:-2], packed.shape[-2] * 2, packed.shape[-1])


def pack_int4(values: jax.Array) -> jax.Array:
    """uint8 [..., in, out] with values 0..15 (in even) -> uint8 [..., in // 2, out]."""
    values = values.astype(jnp.uint8)
    return values[..., 0::2, :] | (values[..., 1::2, :] << 4)


def as_int8_groups(w: QuantizedTensor, group_size: int) -> QuantizedTensor:
    """The same values as an int8 QuantizedTensor with offsets and `group_size`
    rows per scale (a divisor of w's): int4 codes 0..15 fit int8, and each
    scale and offset is repeated over the smaller groups, so every element is
    the same q * scale (+ offset) as before. Lets layers stored in different
    GGUF block types stack into one tensor."""
    w = w.untiled()
    if w.scheme not in ("int8", "int4") or w.group_size % group_size:
        raise ValueError(f"cannot regroup a {w.scheme} tensor of {w.group_size}-row groups into {group_size}-row ones")
    repeat = w.group_size // group_size
    data = unpack_int4(w.data).astype(jnp.int8) if w.scheme == "int4" else w.data
    scales = jnp.repeat(w.scales, repeat, axis=-2)
    offsets = jnp.zeros_like(scales) if w.offsets is None else jnp.repeat(w.offsets, repeat, axis=-2)
    return QuantizedTensor(data, scales, offsets, "int8", group_size)


def dequantize(w: QuantizedTensor, dtype=jnp.float32) -> jax.Array:
    """The reference: the logical [..., in, out] matrix in `dtype`."""
    w = w.untiled()
    q = unpack_int4(w.data) if w.scheme == "int4" else w.data
    q = q.astype(jnp.float32)
    scales = jnp.repeat(w.scales, w.group_size, axis=-2)
    value = q * scales
    if w.offsets is not None:
        value = value + jnp.repeat(w.offsets, w.group_size, axis=-2)
    return value.astype(dtype)
