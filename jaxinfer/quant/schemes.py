"""Round-to-nearest quantizers: float [..., in, out] -> QuantizedTensor.

int8  symmetric, scale = absmax / 127 per output channel (or per group of
      `group_size` input rows), q = round(w / scale) in [-127, 127].
int4  asymmetric per group of input rows: the group's [min, max] is split into
      15 steps, q = round((w - min) / scale) in [0, 15], offset = min, so the
      group's extremes are represented exactly.
fp8   e4m3 with a per-output-channel scale = absmax / 448 (the largest e4m3
      value), q = e4m3(w / scale).
w8a8  the weights of int8 per channel; the scheme name tells quant/linear.py
      to quantize the activations too (per row, on the fly).
All scales are computed in float32; groups run along `in` (see tensor.py).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from jaxinfer.quant.tensor import SCHEMES, QuantizedTensor, pack_int4

FP8_MAX = 448.0  # largest finite float8_e4m3fn value


def _grouped(w, group_size: int):
    """[..., in, out] -> [..., in // group, group, out] float32, checking the group divides `in`."""
    in_features = w.shape[-2]
    if group_size < 1 or in_features % group_size:
        raise ValueError(f"group_size {group_size} must divide the {in_features} input rows")
    return w.astype(jnp.float32).reshape(*w.shape[:-2], in_features // group_size, group_size, w.shape[-1])


def absmax_int8(x, axis: int):
    """Symmetric int8 along `axis`: scale = absmax / 127, q = round(x / scale)
    in [-127, 127] -> (q int8, scale float32 with `axis` kept as 1). The rule
    for weights (quantize_int8) and for w8a8's activations (quant/linear.py)."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=axis, keepdims=True) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0)  # all zero: any scale is exact
    return jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8), scale


ACTIVATION_BLOCK = 32  # inputs per int8 activation scale: llama.cpp's Q8 block


def activation_block(group_size: int) -> int:
    """The activation block for a weight of `group_size`-row groups: 32 inputs,
    or fewer where the weight's groups are smaller (GGUF Q6_K: 16), so that a
    block never spans two weight scales."""
    return math.gcd(ACTIVATION_BLOCK, group_size)


def int8_blocks(x, block: int):
    """x [..., in] rounded to int8 in blocks of `block` inputs (absmax_int8
    per block) and scaled back: the activations a weight with
    activation_block = block multiplies (quant/tensor.py)."""
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    q, scale = absmax_int8(blocks, axis=-1)
    return (q.astype(jnp.float32) * scale).reshape(x.shape).astype(x.dtype)


def quantize_int8(w, group_size: int | None = None) -> QuantizedTensor:
    group_size = group_size or w.shape[-2]
    q, scales = absmax_int8(_grouped(w, group_size), axis=-2)
    return QuantizedTensor(q.reshape(w.shape), scales[..., 0, :], None, "int8", group_size)


def quantize_int4(w, group_size: int = 128) -> QuantizedTensor:
    if w.shape[-2] % 2:
        raise ValueError(f"int4 packs two rows per byte: {w.shape[-2]} input rows is odd")
    g = _grouped(w, group_size)
    low, high = jnp.min(g, axis=-2), jnp.max(g, axis=-2)
    scales = (high - low) / 15.0
    scales = jnp.where(scales > 0, scales, 1.0)  # a constant group: offset alone is exact
    q = jnp.clip(jnp.round((g - low[..., None, :]) / scales[..., None, :]), 0, 15).astype(jnp.uint8)
    return QuantizedTensor(pack_int4(q.reshape(w.shape)), scales, low, "int4", group_size)


def quantize_fp8(w) -> QuantizedTensor:
    g = _grouped(w, w.shape[-2])
    scales = jnp.max(jnp.abs(g), axis=-2) / FP8_MAX
    scales = jnp.where(scales > 0, scales, 1.0)
    q = (g / scales[..., None, :]).astype(jnp.float8_e4m3fn)
    return QuantizedTensor(q.reshape(w.shape), scales, None, "fp8", w.shape[-2])


def quantize(w, scheme: str, group_size: int | None = None) -> QuantizedTensor:
    """Dispatch by scheme name; group_size applies to int8 (default per channel) and int4 (default 128)."""
    if scheme == "int8":
        return quantize_int8(w, group_size)
    if scheme == "int4":
        return quantize_int4(w, group_size or 128)
    if scheme == "fp8":
        return quantize_fp8(w)
    if scheme == "w8a8":
        if group_size not in (None, w.shape[-2]):
            raise ValueError(f"w8a8 is per output channel only; got group_size {group_size}")
        return dataclasses.replace(quantize_int8(w), scheme="w8a8")
    raise ValueError(f"unknown quantization scheme {scheme!r}; expected one of {SCHEMES}")
