"""RMSNorm of one row in one kernel, for the GPU backend's batch-1 decode step.

XLA normalizes several rows in one Triton kernel, but a single row's sum of
squares reduces to a scalar, which that fusion does not take: one row costs
two kernels (the sum, then the scaling), and a decode step runs two norms a
layer. This kernel does the row in one program, with HF Llama's rounding:
statistics in float32, the normalized row cast back to x's dtype before the
weight multiplies it, as jaxinfer/models/layers.py's rms_norm (the test holds
it to that formula in float64).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._common import next_power_of_two


def _rms_norm_kernel(x_ref, weight_ref, out_ref, *, eps: float):
    row = pl.program_id(0)
    hidden = x_ref.shape[-1]
    # Triton's blocks are powers of two: the columns past `hidden` are masked.
    cols = jnp.arange(next_power_of_two(hidden), dtype=jnp.int32)
    live = cols < hidden
    x = plt.load(x_ref.at[row, cols], mask=live, other=jnp.zeros((), x_ref.dtype)).astype(jnp.float32)
    weight = plt.load(weight_ref.at[cols], mask=live, other=jnp.zeros((), weight_ref.dtype))
    normed = x * jnp.reciprocal(jnp.sqrt(jnp.sum(x * x) / hidden + eps))
    plt.store(out_ref.at[row, cols], (weight * normed.astype(x_ref.dtype)).astype(out_ref.dtype), mask=live)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def rms_norm(x, weight, eps: float, interpret: bool = False):
    """weight * normalize(x) over the last axis, each row of x [..., hidden]
    by a program of its own; the result in weight's and x's promoted dtype."""
    rows = x.reshape(-1, x.shape[-1])
    out = pl.pallas_call(
        functools.partial(_rms_norm_kernel, eps=eps),
        grid=(rows.shape[0],),
        in_specs=[pl.BlockSpec(), pl.BlockSpec()],
        out_specs=pl.BlockSpec(),
        out_shape=jax.ShapeDtypeStruct(rows.shape, jnp.result_type(weight, x)),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="rms_norm_row",
    )(rows, weight)
    return out.reshape(x.shape)
