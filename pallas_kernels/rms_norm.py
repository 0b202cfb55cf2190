"""RMSNorm of the residual stream in one kernel, for the GPU backend's decode
steps: a row per program, with HF Llama's rounding (statistics in float32,
the normalized row cast back to x's dtype before the weight multiplies it,
as jaxinfer/models/layers.py's rms_norm; the test holds it to that formula
in float64).

  rms_norm      one row. XLA normalizes several rows in one Triton kernel,
                but a single row's sum of squares reduces to a scalar,
                which that fusion does not take: one row costs two kernels.
  add_rms_norm  the residual stream x plus a projection's update, given as
                the float32 partial sums of its split-K GEMM (wo, w_down:
                backends/gpu.py, linear_parts), then the norm: the sum and
                the new stream come out of this kernel too. XLA reduces a
                split-K GEMM's partials in the kernel consuming them, so
                the add was a kernel of its own before the norm's, twice a
                layer; and a custom call cannot be that consumer (XLA
                would reduce the partials in one more kernel first), hence
                the partials as this kernel's input.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._common import next_power_of_two


def _rms_norm_kernel(*refs, eps: float, update: bool):
    if update:
        x_ref, parts_ref, weight_ref, out_ref, sum_ref = refs
    else:
        x_ref, weight_ref, out_ref = refs
    row = pl.program_id(0)
    hidden = x_ref.shape[-1]
    # Triton's blocks are powers of two: the columns past `hidden` are masked.
    cols = jnp.arange(next_power_of_two(hidden), dtype=jnp.int32)
    live = cols < hidden
    x = plt.load(x_ref.at[row, cols], mask=live, other=jnp.zeros((), x_ref.dtype))
    if update:
        # The projection as its GEMM rounds it (float32 sum, x's dtype), then added in x's dtype, as
        # `x + x @ w` rounds in the model.
        y = plt.load(parts_ref.at[0, row, cols], mask=live, other=0.0)
        for k in range(1, parts_ref.shape[0]):
            y = y + plt.load(parts_ref.at[k, row, cols], mask=live, other=0.0)
        x = x + y.astype(x_ref.dtype)
        plt.store(sum_ref.at[row, cols], x, mask=live)
    x = x.astype(jnp.float32)
    weight = plt.load(weight_ref.at[cols], mask=live, other=jnp.zeros((), weight_ref.dtype))
    normed = x * jnp.reciprocal(jnp.sqrt(jnp.sum(x * x) / hidden + eps))
    plt.store(out_ref.at[row, cols], (weight * normed.astype(x_ref.dtype)).astype(out_ref.dtype), mask=live)


def _call(rows, parts, weight, eps: float, interpret: bool):
    """The kernel over rows [R, hidden] (and parts [k, R, hidden]), one program a row."""
    update = parts is not None
    normed = jax.ShapeDtypeStruct(rows.shape, jnp.result_type(weight, rows))
    return pl.pallas_call(
        functools.partial(_rms_norm_kernel, eps=eps, update=update),
        grid=(rows.shape[0],),
        in_specs=[pl.BlockSpec()] * (3 if update else 2),
        out_specs=[pl.BlockSpec()] * 2 if update else pl.BlockSpec(),
        out_shape=[normed, jax.ShapeDtypeStruct(rows.shape, rows.dtype)] if update else normed,
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="add_rms_norm" if update else "rms_norm_row",
    )(*((rows, parts, weight) if update else (rows, weight)))


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def rms_norm(x, weight, eps: float, interpret: bool = False):
    """weight * normalize(x) over the last axis, each row of x [..., hidden]
    by a program of its own; the result in weight's and x's promoted dtype."""
    return _call(x.reshape(-1, x.shape[-1]), None, weight, eps, interpret).reshape(x.shape)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def add_rms_norm(x, parts, weight, eps: float, interpret: bool = False):
    """(x + y, rms_norm(x + y)) where y = parts.sum(0) rounded to x's dtype:
    x [..., hidden], parts float32 [k, ..., hidden] (a split-K GEMM's
    partial sums)."""
    if parts.shape[1:] != x.shape or parts.dtype != jnp.float32:
        raise ValueError(f"parts {parts.shape} {parts.dtype}: expected float32 [k, {', '.join(map(str, x.shape))}]")
    rows = x.reshape(-1, x.shape[-1])
    normed, total = _call(rows, parts.reshape(parts.shape[0], *rows.shape), weight, eps, interpret)
    return total.reshape(x.shape), normed.reshape(x.shape)
