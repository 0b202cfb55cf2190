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

K-quant weights (KQuantTensor, quant/kquant.py: a GGUF's Q2_K .. Q6_K at the
file's size): dequantized to x.dtype (gguf's values exactly in float32), then
a matmul; a MixedStack's layer (LayerOf) under a switch on its block type.

Weights with activation_block (the "gguf-a8" load, quant/tensor.py): the
activations are quantized to int8 blocks first (schemes.int8_blocks) and
multiplied in float, which is the product the CPU backend's int8 kernel
computes in integers.

`grouped_linear(x, w, group_sizes)` is the same for a stack of experts
[experts, in, out] and rows sorted by expert (a MoE, models/moe.py): one
jax.lax.ragged_dot, with a quantized stack dequantized first (w8a8: the
rows quantized and the dot in int32, exact as above).

This is the plain XLA path of every platform: the reference each backend's
kernels are tested against, and what they fall back to where they do not
serve a weight (jaxinfer/backends/: the CPU backend's native kernels for
stacked layer weights, the GPU backend's Pallas kernel at a few rows).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxinfer.quant import kquant
from jaxinfer.quant.input_order import InputOrdered
from jaxinfer.quant.kquant import KQuantTensor
from jaxinfer.quant.layer_weights import LayerOf
from jaxinfer.quant.schemes import absmax_int8, int8_blocks
from jaxinfer.quant.tensor import QuantizedTensor, dequantize, unpack_int4


def linear(x: jax.Array, w) -> jax.Array:
    """x [..., in] @ w [in, out] -> [..., out] in x.dtype.

    w: an array, a QuantizedTensor or KQuantTensor [in, out] (or with leading
    layer axes, which broadcast like `x @ w`), or one layer of a stack
    (LayerOf, the form a MixedStack reaches the layer loop in), or one
    matrix whose rows are stored permuted (InputOrdered)."""
    if isinstance(w, InputOrdered):  # rows stored permuted (quant/input_order.py): the inputs follow them
        return linear(jnp.take(x, w.order, axis=-1), w.weight)
    if isinstance(w, LayerOf):  # a MixedStack's layer under a switch on its format
        return w.apply(lambda stacked, index: linear(x, LayerOf(stacked, index).layer()))
    if isinstance(w, KQuantTensor):
        # The reference: the file's values in float, then a float matmul.
        if w.activation_block:
            x = int8_blocks(x, w.activation_block)
        return jnp.matmul(x, kquant.dequantize(w, x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    if not isinstance(w, QuantizedTensor):
        return x @ w
    if w.activation_block:  # the quantized activations, multiplied in float: the same numbers
        x = int8_blocks(x, w.activation_block)
    w = w.untiled()
    if x.shape[-1] != w.in_features:
        raise ValueError(f"linear: x has {x.shape[-1]} features but the weight expects {w.in_features}")
    if w.scheme == "w8a8":
        return _w8a8_linear(x, w).astype(x.dtype)
    if w.data.ndim != 2:
        return jnp.matmul(x, dequantize(w, x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    rows = math.prod(x.shape[:-1])
    y = _xla_linear(x.reshape(rows, w.in_features), w)
    return y.astype(x.dtype).reshape(*x.shape[:-1], w.out_features)


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
    """x [rows, in] @ a plain-layout QuantizedTensor [in, out] -> float32 [rows, out]."""
    f32 = jnp.float32
    if w.group_size == w.in_features and w.scheme in ("int8", "fp8"):
        # One group a column: scale (and offset) after the matmul, no float
        # copy of the weight; an offset o adds o * sum(x) to every column.
        y = jnp.matmul(x, w.data.astype(x.dtype), preferred_element_type=f32) * w.scales[0]
        if w.offsets is not None:
            y = y + jnp.sum(x, axis=-1, keepdims=True, dtype=f32) * w.offsets[0]
        return y
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


def grouped_linear(x: jax.Array, w, group_sizes) -> jax.Array:
    """x [rows, in], sorted into consecutive groups of group_sizes[e] rows for
    expert e, times w [experts, in, out] (an array or a QuantizedTensor):
    row r of group e -> x[r] @ w[e]; [rows, out] in x.dtype."""
    if not isinstance(w, QuantizedTensor):
        return jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes,
                                  preferred_element_type=jnp.float32).astype(x.dtype)
    if w.activation_block:
        x = int8_blocks(x, w.activation_block)
    w = w.untiled()
    if w.scheme == "w8a8":
        xq, x_scale = absmax_int8(x, axis=-1)
        acc = jax.lax.ragged_dot(xq, w.data, group_sizes, preferred_element_type=jnp.int32)
        # Each row's per-channel scales: its expert's.
        expert_of_row = jnp.repeat(jnp.arange(w.data.shape[0]), group_sizes, total_repeat_length=x.shape[0])
        return (acc.astype(jnp.float32) * x_scale * w.scales[expert_of_row, 0]).astype(x.dtype)
    return jax.lax.ragged_dot(x, dequantize(w, x.dtype), group_sizes,
                              preferred_element_type=jnp.float32).astype(x.dtype)
