"""Attention over the paged KV cache on CPU as a native XLA FFI kernel
(paged_attention.cc), built from source with the machine's C++ compiler
the first time it is needed (native/build.py).

Why native code: in jnp (models/paged_attention.py's reference) each tile of keys is
gathered into a new array and transposed for a batched dot; XLA:CPU runs
those copies at ~10 GB/s and they were ~70% of a decode step's attention,
the largest part of a batch-32 step of the default model. A prompt's rows in
jnp are multiplied by all of the step's new keys, the half the causal mask
hides included. No library offers paged attention for XLA:CPU; the kernel is
plain C++ that reads the keys and values each row sees from the pool.

It serves every step layout: a flattened step whose sequences' rows are
contiguous (decode rows and prompt chunks, paged_attention), and steps with
the same number of rows per sequence (decode, speculative verification:
paged_decode_attention). Where it cannot be built (no compiler,
JAXINFER_CPU_KERNELS=0), the jnp reference runs instead, with a warning once.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.native.build import native_ffi_target

SOURCE = Path(__file__).with_suffix(".cc")
TARGET_NAME = "jaxinfer_paged_attention"
MAX_HEAD_DIM = 512  # kMaxHeadDim in the .cc: the size of its per-row buffers
POOL_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.int8), np.dtype(np.uint8))


def available() -> bool:
    """Whether the kernel is built and registered with XLA (built on first call)."""
    return native_ffi_target(str(SOURCE), "JaxinferPagedAttention", TARGET_NAME)


def supports(q, k_pool) -> bool:
    """Whether the kernel takes this call (shapes as in paged_attention):
    its pool dtypes and head sizes, once built."""
    return (np.dtype(k_pool.dtype) in POOL_DTYPES and k_pool.ndim == 5 and q.shape[-1] <= MAX_HEAD_DIM
            and available())


def paged_attention(q, k_pool, v_pool, layer_index, block_tables, context_lens, query_start, *, k_scales=None,
                    v_scales=None, sliding_window=None):
    """q [T, H, D] -> float32 [T, H, D]: sequence s's rows are
    query_start[s]:query_start[s + 1], row i of them at position
    context_len - q_len + i; rows after query_start[-1] are padding (zeros).
    Pools [layers, blocks, block_size, KV, D] (the engine's, read in place,
    the step's own K/V already written) with per-token scales [layers,
    blocks, block_size, KV] for an int8 / fp8-bits pool. The contract of
    models/paged_attention.paged_attention_reference."""
    if (k_scales is None) != (np.dtype(k_pool.dtype) in (np.dtype(np.float32), np.dtype(jnp.bfloat16))):
        raise ValueError("give scales exactly for an int8 / fp8 pool")
    if not available():
        raise RuntimeError("the CPU paged attention kernel is not available here (see the warning above)")
    if k_scales is None:
        k_scales = v_scales = jnp.zeros((1,), jnp.float32)
    call = jax.ffi.ffi_call(TARGET_NAME, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q.astype(jnp.float32), k_pool, v_pool, k_scales, v_scales, jnp.asarray(layer_index, jnp.int32),
                block_tables.astype(jnp.int32), context_lens.astype(jnp.int32), query_start.astype(jnp.int32),
                sliding_window=np.int64(sliding_window or 0))


def paged_decode_attention(q, k_pool, v_pool, layer_index, block_tables, context_lens, *, k_scales=None,
                           v_scales=None, sliding_window=None):
    """q [S, R, H, D] -> float32 [S, R, H, D]: R query rows per sequence,
    row i at position context_len - R + i (decode, verification). The
    contract of models/paged_attention.multi_query_attention_reference."""
    num_seqs, rows = q.shape[:2]
    query_start = jnp.arange(num_seqs + 1, dtype=jnp.int32) * rows
    out = paged_attention(q.reshape(num_seqs * rows, *q.shape[2:]), k_pool, v_pool, layer_index, block_tables,
                          context_lens, query_start, k_scales=k_scales, v_scales=v_scales,
                          sliding_window=sliding_window)
    return out.reshape(q.shape)
