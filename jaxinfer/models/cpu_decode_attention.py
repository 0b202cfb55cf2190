"""Paged decode attention on CPU as a native XLA FFI kernel
(cpu_decode_attention.cc), built from source with the machine's C++ compiler
the first time it is needed (jaxinfer/utils.py, native_library).

Why native code: in jnp (models/paged_attention.py) each tile of keys is
gathered into a new array and transposed for a batched dot; XLA:CPU runs
those copies at ~10 GB/s and they were ~70% of attention's time, which was
the largest part of a batch-32 decode step of the default model. No library
offers paged attention for XLA:CPU; the kernel is ~250 lines of plain C++
that reads each key and value once from the pool.

It serves steps where every sequence has the same number of query rows at
the end of its context: decode (1 row) and speculative verification (1 + K
rows). Where it cannot be built (no compiler, JAXINFER_CPU_KERNELS=0), the
jnp reference runs instead, with a warning once.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.utils import native_ffi_target

SOURCE = Path(__file__).with_suffix(".cc")
TARGET_NAME = "jaxinfer_paged_decode_attention"
MAX_HEAD_DIM = 512  # kMaxHeadDim in the .cc: the size of its per-row buffers
POOL_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.int8), np.dtype(np.uint8))


def available() -> bool:
    """Whether the kernel is built and registered with XLA (built on first call)."""
    return native_ffi_target(str(SOURCE), "JaxinferPagedDecodeAttention", TARGET_NAME)


def supports(q, k_pool) -> bool:
    """Whether the kernel serves this call (on the CPU backend; shapes as in
    paged_decode_attention)."""
    return (jax.default_backend() == "cpu" and np.dtype(k_pool.dtype) in POOL_DTYPES and k_pool.ndim == 5
            and q.shape[-1] <= MAX_HEAD_DIM and available())


def paged_decode_attention(q, k_pool, v_pool, layer_index, block_tables, context_lens, *, k_scales=None,
                           v_scales=None, sliding_window=None):
    """q [S, R, H, D] -> float32 [S, R, H, D]: R query rows per sequence,
    row i at position context_len - R + i, over pools [layers, blocks,
    block_size, KV, D] (the engine's, read in place) with per-token scales
    [layers, blocks, block_size, KV] for an int8 / fp8-bits pool.
    The same contract as models/paged_attention.multi_query_attention_reference."""
    if (k_scales is None) != (np.dtype(k_pool.dtype) in (np.dtype(np.float32), np.dtype(jnp.bfloat16))):
        raise ValueError("give scales exactly for an int8 / fp8 pool")
    if not available():
        raise RuntimeError("the CPU decode attention kernel is not available here (see the warning above)")
    if k_scales is None:
        k_scales = v_scales = jnp.zeros((1,), jnp.float32)
    call = jax.ffi.ffi_call(TARGET_NAME, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q.astype(jnp.float32), k_pool, v_pool, k_scales, v_scales, jnp.asarray(layer_index, jnp.int32),
                block_tables.astype(jnp.int32), context_lens.astype(jnp.int32),
                sliding_window=np.int64(sliding_window or 0))
