"""x @ w for a quantized weight as a Pallas kernel for the Triton GPU lowering,
beside its plain-jnp reference.

Layout (the one jaxinfer/quant/tensor.py stores; plain arrays here, so the
kernels stay a leaf that imports nothing of jaxinfer):
  x        [M, K] bfloat16 / float16 / float32 (leading axes are flattened)
  data     int8 / float8_e4m3fn [K, N], or uint8 [K // 2, N] for int4 (logical
           row 2j in the low nibble of byte j, row 2j + 1 in the high nibble)
  scales   float32 [K // group_size, N]; offsets the same (int4 only) or None
  out      [M, N] in x.dtype; value[k, n] = q[k, n] * scale[g, n] (+ offset[g, n]),
           g = k // group_size.
With `layer_index`, data, scales and offsets may be stacks [L, ...] of such
weights and the kernel reads layer `layer_index` in place (see "Stacked
layers" below).

Why a kernel: a decode step multiplies a handful of rows by every weight, so
it is bound by reading the weights. XLA's dequantize-then-matmul writes the
dequantized matrix back to memory and reads it again (1 + 2 + 2 bytes per
int8 weight instead of 1); this kernel reads the packed bytes once and
dequantizes in registers.

Algorithm: grid (M tiles, N tiles, K splits). A program owns a [block_m, block_n]
output tile and walks its K split block_k rows at a time:
  * loads the raw weight tile and converts it to x's dtype, which is exact
    (int8 and 0..15 codes are small integers; every e4m3 value is a bf16
    value), so the dot sees exactly the quantized values;
  * int4: the low and high nibbles of a packed [block_k / 2, block_n] tile are
    the even and odd logical rows, so instead of interleaving them back (a
    reshape Triton cannot do in registers) the kernel dots the low nibbles with
    x's even columns and the high nibbles with its odd columns. x arrives
    viewed as [M, K / 2, 2] (a free reshape), whose [..., 0] / [..., 1] are
    those columns;
  * scales and offsets are constant along the rows of one group, so a tile
    that lies inside one group applies them after its dot, in float32:
        tile_out = (x_tile @ q_tile) * scale[g] + rowsum(x_tile) * offset[g]
    (block_k divides group_size for grouped weights); a per-channel weight
    (one group) applies them once after the loop. Accumulation is float32
    throughout, and the scaling is exact algebra, not an approximation;
  * M rows are padded to block_m >= 16 in registers only (masked loads of x,
    masked stores of the output): Triton's dot needs every dim >= 16, and the
    padding rows never touch memory.
Decode has few rows and few N tiles for the narrower projections, so K is
split across programs when the grid would otherwise be too small to keep
enough loads in flight; each split writes a float32 partial [M, N] and the
splits are summed by one small XLA reduction (skipped when there is one split,
where the kernel writes x.dtype directly).

Ragged shapes: N (any), and K for per-channel weights, need not be multiples
of the tiles: the loads past the edge are masked (zeros), and only then, since
unmasked loads vectorize best.

Stacked layers: inside the model's lax.scan a per-layer weight is a dynamic
slice of the stacked [L, K, N] parameter, and XLA may copy that slice before
handing it to a custom call, which would triple the weight traffic. Passing the
whole stack with a (traced) layer_index lets the kernel read the layer in place.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._common import MIN_DOT_DIM, is_power_of_two, next_power_of_two

# Per row count (rows up to the key): (block_m, block_n, block_k, num_warps, num_stages).
# Decode (<= 16 rows) is a weight stream: narrow N tiles (32 columns = one
# 32-byte sector per int8 row, so no wasted DRAM sectors) give many programs,
# and 4 stages of 128-row tiles keep several loads in flight per program.
# As rows grow the dot gets heavier: shorter K tiles and more warps keep the
# [block_m, block_n] float32 accumulator and the staged tiles in registers /
# shared memory. Above 128 rows (prefill) the kernel works but XLA's GEMM is
# the better fit (see supports()).
_DEFAULTS_BY_ROWS = {
    16: (16, 32, 128, 4, 4),
    32: (32, 64, 128, 4, 4),
    64: (64, 64, 64, 4, 3),
    128: (128, 64, 64, 8, 3),
    1 << 62: (64, 128, 64, 8, 3),
}
# Split K until the grid has about this many programs: about two per SM of an
# H100 (132 SMs), which with 4 pipeline stages each keeps roughly the
# 2-3 MB in flight that HBM3's bandwidth-latency product asks for.
_TARGET_PROGRAMS = 256
_MAX_SPLIT_K = 16
# Splits shorter than this many tiles leave the software pipeline nothing to overlap.
_MIN_TILES_PER_SPLIT = 4
# The float32 partials a split writes (and the reduction reads) stay under this
# share of the weight bytes, or splitting costs more traffic than it hides.
_MAX_PARTIAL_SHARE = 1 / 8
# The row count up to which supports() routes a matmul here: the weight-streaming
# regime, where reading the weights once (packed) is what counts.
MAX_ROWS = 128
# The Triton lowering runs float32 dots as TF32 unless told otherwise; HIGHEST
# makes them IEEE float32 (bf16 operands are unaffected).
_DOT_PRECISION = lax.Precision.HIGHEST
SCHEMES = ("int8", "int4", "fp8")


class MatmulTiling(NamedTuple):
    block_m: int
    block_n: int
    block_k: int  # logical rows of w per tile (int4: block_k // 2 packed rows)
    split_k: int
    num_warps: int
    num_stages: int


def _bits(scheme: str) -> int:
    return 4 if scheme == "int4" else 8


def _min_block_k(scheme: str) -> int:
    # int4 dots packed rows: block_k // 2 of them must still be >= 16.
    return 2 * MIN_DOT_DIM if scheme == "int4" else MIN_DOT_DIM


def _largest_power_of_two_dividing(n: int) -> int:
    return n & -n


def _is_grouped(group_size: int, in_features: int) -> bool:
    return group_size != in_features


def in_features_of(data, scheme: str) -> int:
    """Logical input rows of a weight whose values are `data` (int4 packs two rows a byte)."""
    return data.shape[-2] * (2 if scheme == "int4" else 1)


def _unsupported_reason(data, scheme: str, group_size: int, num_rows: int | None,
                        stacked: bool = False) -> str | None:
    if scheme not in SCHEMES:
        return f"unknown scheme {scheme!r}"
    expected_ndim = 3 if stacked else 2
    if data.ndim != expected_ndim:
        what = "a stack [layers, in, out] with layer_index" if stacked else "a 2-D [in, out] weight"
        return f"expected {what}, got data of shape {data.shape}"
    in_features = in_features_of(data, scheme)
    if group_size < 1 or in_features % group_size:
        return f"group_size {group_size} does not divide the {in_features} input rows"
    if _is_grouped(group_size, in_features) and group_size % _min_block_k(scheme):
        return (f"{scheme} group_size {group_size} must be a multiple of {_min_block_k(scheme)} "
                f"(a K tile lies inside one group and feeds a dot of >= {MIN_DOT_DIM} rows)")
    if num_rows is not None and not 1 <= num_rows <= MAX_ROWS:
        return f"{num_rows} rows is outside the kernel's 1..{MAX_ROWS}"
    if scheme == "fp8" and not _fp8_convert_supported():
        return "float8_e4m3fn conversion needs a GPU of compute capability >= 8.9 under Triton"
    return None


def _fp8_convert_supported() -> bool:
    """Triton converts e4m3 only on sm_89+; elsewhere (interpret mode, CPU) always fine."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return True
    capability = getattr(device, "compute_capability", None)
    if capability is None:  # ROCm or an unknown runtime: let the lowering decide
        return True
    major, minor = (int(part) for part in str(capability).split(".")[:2])
    return (major, minor) >= (8, 9)


def supports(data, scheme: str, group_size: int, num_rows: int) -> bool:
    """Whether quantized_matmul handles this 2-D weight for `num_rows` rows of x
    and is the right tool for it (rows up to MAX_ROWS; larger batches are
    compute bound and better served by XLA's dequantize + GEMM)."""
    return _unsupported_reason(data, scheme, group_size, num_rows) is None


def matmul_tiling(
    scheme: str,
    group_size: int,
    in_features: int,
    out_features: int,
    num_rows: int,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> MatmulTiling:
    """The static tiling the kernel uses: defaults from the per-row-count table,
    narrowed to the problem, with requested values checked (and split_k lowered
    where a split would be empty)."""
    table_key = min(k for k in _DEFAULTS_BY_ROWS if k >= num_rows)
    d_block_m, d_block_n, d_block_k, d_warps, d_stages = _DEFAULTS_BY_ROWS[table_key]
    grouped = _is_grouped(group_size, in_features)
    min_block_k = _min_block_k(scheme)

    if block_m is None:
        block_m = min(d_block_m, max(MIN_DOT_DIM, next_power_of_two(num_rows)))
    if block_n is None:
        block_n = min(d_block_n, max(MIN_DOT_DIM, next_power_of_two(out_features)))
    if block_k is None:
        if grouped:
            # The largest power of two dividing the group, so that no tile crosses a group.
            block_k = min(d_block_k, _largest_power_of_two_dividing(group_size))
        else:
            block_k = min(d_block_k, max(min_block_k, next_power_of_two(in_features)))
    for name, value, low in (("block_m", block_m, MIN_DOT_DIM), ("block_n", block_n, MIN_DOT_DIM),
                             ("block_k", block_k, min_block_k)):
        if not (is_power_of_two(value) and value >= low):
            raise ValueError(f"{name}={value} must be a power of two >= {low} for {scheme}")
    if grouped and group_size % block_k:
        raise ValueError(f"block_k={block_k} must divide group_size {group_size} (a tile lies inside one group)")

    k_tiles = pl.cdiv(in_features, block_k)
    programs = pl.cdiv(num_rows, block_m) * pl.cdiv(out_features, block_n)
    if split_k is None:
        weight_bytes = in_features * out_features * _bits(scheme) // 8
        partial_bytes_per_split = num_rows * out_features * 4
        split_k = 1
        while (programs * split_k < _TARGET_PROGRAMS and 2 * split_k <= _MAX_SPLIT_K
               and k_tiles // (2 * split_k) >= _MIN_TILES_PER_SPLIT
               and 2 * split_k * partial_bytes_per_split <= _MAX_PARTIAL_SHARE * weight_bytes):
            split_k *= 2
    if split_k < 1:
        raise ValueError(f"split_k={split_k} must be >= 1")
    tiles_per_split = pl.cdiv(k_tiles, min(split_k, k_tiles))
    split_k = pl.cdiv(k_tiles, tiles_per_split)  # no split left without tiles
    return MatmulTiling(block_m, block_n, block_k, split_k,
                        d_warps if num_warps is None else num_warps,
                        d_stages if num_stages is None else num_stages)


def _matmul_kernel(
    layer_ref,  # [1] int32
    x_ref,  # [M, K] or, for int4, [M, K // 2, 2]
    w_ref,  # [L, K or K // 2, N] int8 / fp8 / uint8
    scales_ref,  # [L, groups, N] float32
    offsets_ref,  # [L, groups, N] float32 or None
    out_ref,  # [M, N] x.dtype (one split) or [splits, M, N] float32
    *,
    scheme: str,
    group_size: int,
    in_features: int,
    tiling: MatmulTiling,
    compute_dtype,
):
    m_tile, n_tile, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block_m, block_n, block_k = tiling.block_m, tiling.block_n, tiling.block_k
    num_rows, out_features = out_ref.shape[-2], out_ref.shape[-1]
    int4 = scheme == "int4"
    grouped = _is_grouped(group_size, in_features)
    k_tiles = pl.cdiv(in_features, block_k)
    tiles_per_split = pl.cdiv(k_tiles, tiling.split_k)
    # Rows of w (packed rows for int4) and of x's K axis per tile.
    tile_rows = block_k // 2 if int4 else block_k
    w_rows = in_features // 2 if int4 else in_features
    ragged_k = in_features % block_k != 0
    ragged_n = out_features % block_n != 0

    layer = layer_ref[0]
    m0, n0 = m_tile * block_m, n_tile * block_n
    rows = pl.ds(m0, block_m)
    cols = pl.ds(n0, block_n)
    row_live = (m0 + jnp.arange(block_m, dtype=jnp.int32)) < num_rows
    col_live = (n0 + jnp.arange(block_n, dtype=jnp.int32)) < out_features
    tile_row_index = jnp.arange(tile_rows, dtype=jnp.int32)
    # A zero of the weight's own dtype: the lowering cannot cast an int 0 to fp8.
    w_zero = jnp.zeros((), w_ref.dtype)
    x_zero = jnp.zeros((), x_ref.dtype)

    def load_x(k_row0, column):
        """x[rows, k_row0 : k_row0 + tile_rows] (int4: that range of even/odd columns)."""
        live = row_live[:, None] & ((k_row0 + tile_row_index)[None, :] < w_rows)
        if int4:
            tile = plt.load(x_ref.at[rows, pl.ds(k_row0, tile_rows), jnp.asarray(column, jnp.int32)], mask=live, other=x_zero)
        else:
            tile = plt.load(x_ref.at[rows, pl.ds(k_row0, tile_rows)], mask=live, other=x_zero)
        return tile.astype(compute_dtype)

    def load_w(k_row0):
        ref = w_ref.at[layer, pl.ds(k_row0, tile_rows), cols]
        if not (ragged_k or ragged_n):
            return ref[...]
        live = ((k_row0 + tile_row_index)[:, None] < w_rows) & col_live[None, :]
        return plt.load(ref, mask=live, other=w_zero)

    def load_group_row(ref, group):
        group = jnp.asarray(group, jnp.int32)  # interpret mode rejects plain ints among slices
        if ragged_n:
            return plt.load(ref.at[layer, group, cols], mask=col_live, other=0.0)
        return ref[layer, group, cols]

    def dot(a, b):
        return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=_DOT_PRECISION,
                               preferred_element_type=jnp.float32)

    def to_compute(q):
        if q.dtype == jnp.float8_e4m3fn:
            q = q.astype(jnp.bfloat16)  # the conversion Triton has for e4m3; exact, as is bf16 -> f32
        return q.astype(compute_dtype)

    def tile_product(tile):
        """(x_tile @ q_tile in float32 [block_m, block_n], row sums of x_tile [block_m])."""
        k_row0 = tile * tile_rows
        packed = load_w(k_row0)
        if int4:
            x_even, x_odd = load_x(k_row0, 0), load_x(k_row0, 1)
            product = dot(x_even, to_compute(packed & 0x0F)) + dot(x_odd, to_compute(packed >> 4))
            row_sum = x_even.astype(jnp.float32).sum(axis=1) + x_odd.astype(jnp.float32).sum(axis=1)
        else:
            x_tile = load_x(k_row0, None)
            product = dot(x_tile, to_compute(packed))
            row_sum = x_tile.astype(jnp.float32).sum(axis=1)
        return product, row_sum

    def grouped_step(i, acc):
        tile = first_tile + i
        product, row_sum = tile_product(tile)
        group = tile * block_k // group_size
        out = product * load_group_row(scales_ref, group)[None, :]
        if offsets_ref is not None:
            out += row_sum[:, None] * load_group_row(offsets_ref, group)[None, :]
        return acc + out

    def per_channel_step(i, carry):
        acc, x_sum = carry
        product, row_sum = tile_product(first_tile + i)
        return acc + product, x_sum + row_sum

    first_tile = split * tiles_per_split
    if k_tiles % tiles_per_split == 0:
        num_tiles = tiles_per_split  # static: every split is full
    else:
        num_tiles = jnp.minimum(tiles_per_split, k_tiles - first_tile)
    acc = jnp.zeros((block_m, block_n), jnp.float32)
    if grouped:
        acc = lax.fori_loop(0, num_tiles, grouped_step, acc)
    else:
        acc, x_sum = lax.fori_loop(0, num_tiles, per_channel_step, (acc, jnp.zeros((block_m,), jnp.float32)))
        acc = acc * load_group_row(scales_ref, 0)[None, :]
        if offsets_ref is not None:
            acc += x_sum[:, None] * load_group_row(offsets_ref, 0)[None, :]

    live = row_live[:, None] & col_live[None, :]
    if tiling.split_k == 1:
        plt.store(out_ref.at[rows, cols], acc.astype(out_ref.dtype), mask=live)
    else:
        plt.store(out_ref.at[split, rows, cols], acc, mask=live)


@functools.partial(
    jax.jit,
    static_argnames=("scheme", "group_size", "block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages",
                     "interpret"),
)
def quantized_matmul(
    x,
    data,
    scales,
    offsets=None,
    *,
    scheme: str,
    group_size: int,
    layer_index=None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
):
    """x [..., in] @ w [in, out] -> [..., out] in x.dtype, float32 accumulation.

    w: the arrays of the module docstring's layout (int8 per channel or
    grouped, int4 grouped or per channel with offsets, fp8 per channel;
    group_size == in for per channel); with layer_index (int or traced int32
    scalar), stacks [layers, ...] read at that layer in place.
    Any number of rows works; supports() says where the kernel is the better
    choice.

    Tuning (static; defaults from a per-row-count table, see matmul_tiling):
      block_m, block_n: output tile (powers of two >= 16; rows pad to block_m
        in registers only).
      block_k: logical weight rows per step (power of two >= 16, >= 32 for
        int4; must divide group_size for grouped weights).
      split_k: K splits across programs, summed afterwards (1: no partials).
      num_warps, num_stages: Triton compiler parameters.
    """
    stacked = layer_index is not None
    reason = _unsupported_reason(data, scheme, group_size, None, stacked=stacked)
    if reason is not None:
        raise ValueError(f"quantized_matmul: {reason}")
    in_features, out_features = in_features_of(data, scheme), data.shape[-1]
    if x.shape[-1] != in_features:
        raise ValueError(f"quantized_matmul: x has {x.shape[-1]} features but the weight expects {in_features}")
    lead_shape = x.shape[:-1]
    num_rows = math.prod(lead_shape)
    if num_rows == 0:
        return jnp.zeros((*lead_shape, out_features), x.dtype)
    tiling = matmul_tiling(
        scheme, group_size, in_features, out_features, num_rows, block_m=block_m, block_n=block_n,
        block_k=block_k, split_k=split_k, num_warps=num_warps, num_stages=num_stages,
    )

    x2d = x.reshape(num_rows, in_features)
    if scheme == "int4":
        x2d = x2d.reshape(num_rows, in_features // 2, 2)  # [..., 0]: even columns, [..., 1]: odd; no copy
    if not stacked:
        # A leading layer axis of 1 by reshape (a bitcast in XLA, never a copy).
        data, scales = data.reshape(1, *data.shape), scales.reshape(1, *scales.shape)
        offsets = None if offsets is None else offsets.reshape(1, *offsets.shape)
        layer_index = 0
    layer_index = jnp.asarray(layer_index, jnp.int32).reshape(1)

    if tiling.split_k == 1:
        out_shape = jax.ShapeDtypeStruct((num_rows, out_features), x.dtype)
    else:
        out_shape = jax.ShapeDtypeStruct((tiling.split_k, num_rows, out_features), jnp.float32)
    kernel = functools.partial(
        _matmul_kernel, scheme=scheme, group_size=group_size, in_features=in_features, tiling=tiling,
        compute_dtype=x.dtype,
    )
    whole = pl.BlockSpec()  # no block_shape: the kernel indexes the whole array itself
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(num_rows, tiling.block_m), pl.cdiv(out_features, tiling.block_n), tiling.split_k),
        in_specs=[whole, whole, whole, whole, whole if offsets is not None else None],
        out_specs=whole,
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages),
        interpret=interpret,
        name=(f"quantized_matmul_{scheme}_g{group_size}_m{tiling.block_m}n{tiling.block_n}"
              f"k{tiling.block_k}s{tiling.split_k}"),
    )(layer_index, x2d, data, scales, offsets)
    if tiling.split_k > 1:
        out = out.sum(axis=0).astype(x.dtype)
    return out.reshape(*lead_shape, out_features)


@functools.partial(jax.jit, static_argnames=("scheme", "group_size"))
def quantized_matmul_reference(x, data, scales, offsets=None, *, scheme: str, group_size: int):
    """x @ w in float32 (IEEE), cast to x.dtype, with w dequantized in plain
    jnp from the layout of the module docstring (one 2-D weight)."""
    q = data.astype(jnp.float32)
    if scheme == "int4":  # byte j holds logical rows 2j (low nibble) and 2j + 1 (high)
        q = jnp.stack([data & 0x0F, data >> 4], axis=1).reshape(-1, data.shape[-1]).astype(jnp.float32)
    groups = q.shape[0] // group_size
    w = q.reshape(groups, group_size, -1) * scales[:, None, :]
    if offsets is not None:
        w = w + offsets[:, None, :]
    y = jnp.matmul(x.astype(jnp.float32), w.reshape(q.shape), precision=lax.Precision.HIGHEST)
    return y.astype(x.dtype)


__all__ = ["MAX_ROWS", "SCHEMES", "MatmulTiling", "in_features_of", "matmul_tiling", "quantized_matmul",
           "quantized_matmul_reference", "supports"]
