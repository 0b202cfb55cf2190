"""`linear(x, w)`: x @ w for a plain weight or a QuantizedTensor.

XLA path (every backend), float32 accumulation, result in x.dtype:

  per channel (int8, fp8)  y = (x @ q) * scales: the matmul runs on the raw
                           values cast to x.dtype (integers up to 127 and
                           e4m3 values are exact in bf16), and the scales
                           multiply the output, an exact rewrite.
  grouped (int8, int4)     dequantize to x.dtype with the scales broadcast
                           over [groups, group_size, out], then matmul. int4
                           never interleaves its nibbles back into rows: the
                           low-nibble plane holds the even input rows and the
                           high-nibble plane the odd ones, so
                           y = x[:, 0::2] @ deq(low) + x[:, 1::2] @ deq(high).

Measured on a 2-core CPU (default model shapes, 30 layers of the seven
projections under lax.scan, one row, int4 groups of 32, one run): this form
91 ms per pass, float32 weights 88 ms, per-group partial matmuls (einsum over
[groups, group_size], offsets as a group-sum term) 125 ms, and
quant/tensor.py's reference dequantize (whose interleave and jnp.repeat XLA
does not fuse into the loop body) 369 ms. XLA:CPU also rejects the batched
per-group dots for bf16 inputs with a float32 result.

  w8a8                     y = ((q(x) @ q) as int32) * x_scale * scales,
                           q(x) = round(x / x_scale) with x_scale =
                           absmax(row) / 127: every row of activations is
                           quantized to int8 on the fly and the dot is an
                           exact int8 x int8 -> int32 one. XLA:CPU hands such
                           dots to YNNPACK (VNNI kernels), which never sees a
                           float copy of the weight; mixed-type dots (float x
                           int8 cast) are not YNNPACK's, and XLA writes the
                           cast weight out whole. YNNPACK takes dots of >= 2
                           rows only (one row goes to XLA's own loop, ~50x
                           slower for int8), so a single row is padded to two.
                           Because the int32 accumulation is exact, a row's
                           result does not depend on the rows beside it.

CPU decode (up to cpu_matmul.max_rows() rows, int8 / int4 grouped): the native kernel in
quant/cpu_matmul.py, for weights handed over as LayerOf (one layer of the
stacked weights, read in place; models/llama.py does so on one device);
`linears` hands it several weights on the same input (q, k, v) in one call.

Weights with activation_block (the "gguf-a8" load, quant/tensor.py): the
activations are quantized to int8 blocks first. On CPU, for LayerOf, the
int8-activation kernel (quant/cpu_matmul.py) does that and multiplies
int8 by the codes at any row count; every other path multiplies the
quantized-and-rescaled activations (schemes.int8_blocks) in float, which is
the same product.

GPU decode (few rows): the fused Pallas kernel in
pallas_kernels/quantized_matmul.py where it supports the weight, chosen at
trace time.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxinfer.quant import cpu_matmul
from jaxinfer.quant.schemes import absmax_int8, int8_blocks
from jaxinfer.quant.tensor import LayerOf, QuantizedTensor, dequantize, unpack_int4

# Rows up to which the fused kernel is used on GPU (decode batches). A matmul
# of `rows` rows does 2 * rows flops per weight; the kernel reads 0.5 (int4)
# or 1 (int8) byte per weight, so it stays memory bound until rows reaches
# roughly 35 (int4) / 70 (int8) on an H100/H200 (~150 flops per byte), while
# XLA's dequantize + GEMM moves about 4 extra bytes per weight (writing and
# re-reading the dequantized copy). Past 64 rows the dot's efficiency
# decides, where XLA's GEMM is the safer choice. Not yet timed on a GPU.
PALLAS_MAX_ROWS = 64


def linear(x: jax.Array, w) -> jax.Array:
    """x [..., in] @ w [in, out] -> [..., out] in x.dtype.

    w: an array, a QuantizedTensor [in, out] (or with leading layer axes,
    which broadcast like `x @ w`), or one layer of stacked ones (LayerOf)."""
    rows = math.prod(x.shape[:-1])
    quantized = w.stacked if isinstance(w, LayerOf) else w
    block = quantized.activation_block if isinstance(quantized, QuantizedTensor) else 0
    if isinstance(w, LayerOf):
        # Only single-device programs hand over LayerOf (models/llama.py): GSPMD
        # cannot split the kernel's custom call and would gather the weight.
        if block and cpu_matmul.supports_q8(rows, w.stacked):
            y = cpu_matmul.q8_matmul(x.reshape(rows, -1), w.stacked, w.index)
            return y.astype(x.dtype).reshape(*x.shape[:-1], w.stacked.out_features)
    if block:  # every other path multiplies the quantized activations in float: the same numbers
        x = int8_blocks(x, block)
    if isinstance(w, LayerOf):
        if cpu_matmul.supports(rows, w.stacked):
            y = cpu_matmul.quantized_matmul(x.reshape(rows, -1), w.stacked, w.index)
            return y.astype(x.dtype).reshape(*x.shape[:-1], w.stacked.out_features)
        w = w.layer()
    if not isinstance(w, QuantizedTensor):
        return x @ w
    w = w.untiled()
    if x.shape[-1] != w.in_features:
        raise ValueError(f"linear: x has {x.shape[-1]} features but the weight expects {w.in_features}")
    if w.scheme == "w8a8":
        return _w8a8_linear(x, w).astype(x.dtype)
    if w.data.ndim != 2:
        return jnp.matmul(x, dequantize(w, x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    lead = x.shape[:-1]
    x2d = x.reshape(rows, w.in_features)
    y = None
    if jax.default_backend() == "gpu" and rows <= PALLAS_MAX_ROWS:
        from pallas_kernels import quantized_matmul

        if quantized_matmul.supports(w.data, w.scheme, w.group_size, rows):
            y = quantized_matmul.quantized_matmul(x2d, w.data, w.scales, w.offsets, scheme=w.scheme,
                                                  group_size=w.group_size)
    if y is None:
        y = _xla_linear(x2d, w)
    return y.astype(x.dtype).reshape(*lead, w.out_features)


def linears(x: jax.Array, ws: list) -> list[jax.Array]:
    """[linear(x, w) for w in ws], as one native kernel call where the CPU
    kernel takes them all together (one layer each of stacked weights, the
    same layer: a layer's q, k and v, or gate and up;
    cpu_matmul.supports_together)."""
    rows = math.prod(x.shape[:-1])
    if (len(ws) > 1 and all(isinstance(w, LayerOf) and w.index is ws[0].index for w in ws)
            and not any(w.stacked.activation_block for w in ws)
            and cpu_matmul.supports_together(rows, [w.stacked for w in ws])):
        ys = cpu_matmul.quantized_matmuls(x.reshape(rows, -1), [w.stacked for w in ws], ws[0].index)
        return [y.astype(x.dtype).reshape(*x.shape[:-1], w.stacked.out_features) for y, w in zip(ys, ws)]
    return [linear(x, w) for w in ws]


def _w8a8_linear(x, w: QuantizedTensor) -> jax.Array:
    """x [..., in] -> float32 [..., out] (see the module docstring); w [..., in, out] per channel."""
    one_row = x.ndim == 2 and x.shape[0] == 1
    if one_row:
        x = jnp.concatenate([x, x])
    xq, x_scale = absmax_int8(x, axis=-1)
    acc = jnp.matmul(xq, w.data, preferred_element_type=jnp.int32)
    y = acc.astype(jnp.float32) * x_scale * w.scales[..., 0, :][..., None, :]
    return y[:1] if one_row else y


def _xla_linear(x, w: QuantizedTensor) -> jax.Array:
    """x [rows, in] -> float32 [rows, out]."""
    f32 = jnp.float32
    if w.group_size == w.in_features and w.scheme in ("int8", "fp8"):
        return jnp.matmul(x, w.data.astype(x.dtype), preferred_element_type=f32) * w.scales[0]
    groups = w.in_features // w.group_size

    def dequant(q):
        """[in or in / 2, out] values of whole groups -> x.dtype, scaled (and offset)."""
        q = q.reshape(groups, -1, w.out_features).astype(f32) * w.scales[:, None, :]
        if w.offsets is not None:
            q = q + w.offsets[:, None, :]
        return q.reshape(-1, w.out_features).astype(x.dtype)

    if w.scheme == "int4" and w.group_size % 2 == 0:
        y = jnp.matmul(x[:, 0::2], dequant(w.data & 0x0F), preferred_element_type=f32)
        return y + jnp.matmul(x[:, 1::2], dequant(w.data >> 4), preferred_element_type=f32)
    # An odd int4 group splits a byte's two rows across groups (none of our
    # quantizers or GGUF types make one): unpack the rows first.
    q = unpack_int4(w.data) if w.scheme == "int4" else w.data
    return jnp.matmul(x, dequant(q), preferred_element_type=f32)
