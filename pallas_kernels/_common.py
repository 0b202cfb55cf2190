"""What the Pallas kernels share: Triton's shape limits, the per-head_dim
tuning-table lookup, and the checks on the paged KV pool they all read."""

from __future__ import annotations

import jax.numpy as jnp

# Smallest dimension Triton accepts for either operand of a dot.
MIN_DOT_DIM = 16

QUANTIZED_KV_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def defaults_for(table: dict[int, tuple], head_dim: int) -> tuple:
    """The tuning row for head_dim, or the nearest head_dim's row."""
    return table[min(table, key=lambda d: abs(d - head_dim))]


def check_kv_pool(q_heads: int, q_head_dim: int, k_pool, v_pool, k_scales, v_scales) -> bool:
    """Validate the pool [layers, blocks, block_size, kv_heads, head_dim] (and
    per-token scales) against the queries; returns whether it is quantized."""
    num_kv_heads, head_dim = k_pool.shape[3], k_pool.shape[4]
    if v_pool.shape != k_pool.shape:
        raise ValueError(f"k_pool {k_pool.shape} and v_pool {v_pool.shape} differ")
    if head_dim != q_head_dim or q_heads % num_kv_heads:
        raise ValueError(f"{q_heads} query heads of size {q_head_dim} do not match pool {k_pool.shape}")
    if (k_scales is None) != (v_scales is None):
        raise ValueError("give both k_scales and v_scales or neither")
    quantized = jnp.dtype(k_pool.dtype) in QUANTIZED_KV_DTYPES
    if quantized != (k_scales is not None):
        raise ValueError(f"scales are required exactly for int8/fp8 pools, got {k_pool.dtype}")
    if k_scales is not None and (k_scales.shape != k_pool.shape[:-1] or v_scales.shape != k_pool.shape[:-1]):
        raise ValueError(f"scales {k_scales.shape} must be {k_pool.shape[:-1]}")
    if not (is_power_of_two(head_dim) and head_dim >= MIN_DOT_DIM):
        raise ValueError(f"head_dim {head_dim} must be a power of two >= {MIN_DOT_DIM}")
    return quantized
