"""A mixture of experts' grouped matmul at decode sizes as a Pallas kernel for
the Triton GPU lowering, beside its plain-jnp reference: each row of x
multiplies its own expert of a stack, reading only that expert.

Layout (plain arrays, so the kernels stay a leaf that imports nothing of jaxinfer):
  x           [R, K] bfloat16 / float16 / float32, rows sorted by expert
  w           [E, K, N] float (one layer's experts)
  expert_ids  int32 [R]
  out         [R, N] in x.dtype: out[r] = x[r] @ w[expert_ids[r]]

Why a kernel: a decode step multiplies a few rows by a few of many experts,
so it is bound by reading those experts' weights. jax.lax.ragged_dot has no
grouped lowering on a GPU here (XLA expands it into a product with every
expert under a mask, reading every expert), and gathering the selected
experts first writes a copy of each. Here each program reads its row's
expert straight from the stack.

Algorithm: grid (rows, N tiles). A program owns one row and block_n output
columns: it loads the row's expert index, then walks K block_k rows at a
time, multiplying the row's block_k inputs into the [block_k, block_n] tile
of that expert's weight and summing over K in float32 registers (elementwise
products and a reduction: Triton's dot needs 16 rows, and a decode row is
one). Rows of the same expert are adjacent (sorted), so their programs read
the same tiles close together in time, the second from L2. Past MAX_ROWS rows
the weight re-reads outgrow the cache and a dense GEMM per group is the
better tool (the backend's reference path). K and N need not be multiples of
the tiles: loads past the edge are masked.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._common import is_power_of_two

# Rows (tokens x experts per token) up to which supports() routes the
# grouped matmul here: the weight-streaming regime of decode. Not yet timed on a GPU.
MAX_ROWS = 64
FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def supports(w, num_rows: int) -> bool:
    """Whether expert_matmul serves a float stack w [E, K, N] for num_rows rows."""
    return w.ndim == 3 and jnp.dtype(w.dtype) in FLOAT_DTYPES and 1 <= num_rows <= MAX_ROWS


def _kernel(ids_ref, x_ref, w_ref, out_ref, *, block_k: int, block_n: int):
    row, n_tile = pl.program_id(0), pl.program_id(1)
    in_features, out_features = w_ref.shape[1], w_ref.shape[2]
    expert = ids_ref[row]
    n0 = n_tile * block_n
    cols = pl.ds(n0, block_n)
    col_live = (n0 + jnp.arange(block_n, dtype=jnp.int32)) < out_features
    k_index = jnp.arange(block_k, dtype=jnp.int32)

    def step(tile, acc):
        k0 = tile * block_k
        k_live = (k0 + k_index) < in_features
        x = plt.load(x_ref.at[row, pl.ds(k0, block_k)], mask=k_live, other=0.0).astype(jnp.float32)
        w = plt.load(w_ref.at[expert, pl.ds(k0, block_k), cols], mask=k_live[:, None] & col_live[None, :],
                     other=0.0).astype(jnp.float32)
        return acc + jnp.sum(x[:, None] * w, axis=0)

    acc = lax.fori_loop(0, pl.cdiv(in_features, block_k), step, jnp.zeros((block_n,), jnp.float32))
    plt.store(out_ref.at[row, cols], acc.astype(out_ref.dtype), mask=col_live)


@functools.partial(jax.jit, static_argnames=("block_k", "block_n", "num_warps", "num_stages", "interpret"))
def expert_matmul(x, w, expert_ids, *, block_k: int = 64, block_n: int = 64, num_warps: int = 4,
                  num_stages: int = 3, interpret: bool = False):
    """x [R, K] @ w[expert_ids[r]] per row -> [R, N] in x.dtype (float32 sums).

    Tuning (static): block_k inputs per step and block_n output columns per
    program (powers of two); num_warps, num_stages: Triton's parameters."""
    if w.ndim != 3 or x.ndim != 2 or x.shape[1] != w.shape[1] or expert_ids.shape != x.shape[:1]:
        raise ValueError(f"expert_matmul: x {x.shape}, w {w.shape}, expert_ids {expert_ids.shape} do not fit")
    if not (is_power_of_two(block_k) and is_power_of_two(block_n)):
        raise ValueError(f"block_k={block_k} and block_n={block_n} must be powers of two")
    num_rows, out_features = x.shape[0], w.shape[2]
    whole = pl.BlockSpec()  # the kernel indexes the whole arrays itself
    return pl.pallas_call(
        functools.partial(_kernel, block_k=block_k, block_n=block_n),
        grid=(num_rows, pl.cdiv(out_features, block_n)),
        in_specs=[whole, whole, whole],
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((num_rows, out_features), x.dtype),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"expert_matmul_k{block_k}n{block_n}",
    )(expert_ids.astype(jnp.int32), x, w)


@jax.jit
def expert_matmul_reference(x, w, expert_ids):
    """The same in plain jnp: the selected experts gathered, then a batched
    product per row in float32 (IEEE)."""
    selected = w[expert_ids].astype(jnp.float32)
    y = jnp.einsum("rk,rkn->rn", x.astype(jnp.float32), selected, precision=lax.Precision.HIGHEST)
    return y.astype(x.dtype)


__all__ = ["MAX_ROWS", "expert_matmul", "expert_matmul_reference", "supports"]
