"""The paged KV cache: its storage dtype, allocation, size per block, and the
quantize-on-write math for int8 / fp8 caches.

kv_cache_dtype:
  "auto"  the model's dtype; the cache is (k_pool, v_pool), each
          [layers, num_blocks, block_size, kv_heads, head_dim].
  "int8"  symmetric int8 with one float32 scale per token and KV head:
          scale = absmax over head_dim / 127, q = round(x / scale) in [-127, 127].
  "fp8"   float8_e4m3fn with scale = absmax / 448 (e4m3's largest value),
          q = e4m3(x / scale).
A quantized cache is (k_pool, v_pool, k_scales, v_scales), the scales float32
[layers, num_blocks, block_size, kv_heads]; a row of zeros gets scale 1.
Per-token scales (rather than per-block or per-layer ones) are what lets a
token be written once, when it is computed, without rescaling its neighbours.

An fp8 pool holds float8_e4m3fn, or its bit patterns as uint8 where the
platform cannot scatter fp8 in place (the backend's kv_fp8_dtype says which:
backends/cpu.py). Readers go through `as_fp8`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig

INT8_MAX = 127.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn value
SCALE_DTYPE = jnp.float32

KV_CACHE_DTYPES = ("auto", "int8", "fp8")


def check_kv_cache_dtype(kv_cache_dtype) -> str:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return kv_cache_dtype


def kv_storage_dtype(dtype, kv_cache_dtype: str = "auto", fp8_dtype=jnp.float8_e4m3fn) -> np.dtype:
    """The dtype the K/V pools hold for a model of `dtype`; fp8_dtype: what
    an fp8 pool holds (float8_e4m3fn or uint8 bits: the backend's kv_fp8_dtype)."""
    if check_kv_cache_dtype(kv_cache_dtype) == "auto":
        return np.dtype(dtype)
    if kv_cache_dtype == "int8":
        return np.dtype(jnp.int8)
    return np.dtype(fp8_dtype)


def as_fp8(x):
    """uint8 e4m3fn bit patterns (a CPU fp8 pool or a tile of one) as float8_e4m3fn;
    anything else unchanged."""
    return jax.lax.bitcast_convert_type(x, jnp.float8_e4m3fn) if x.dtype == jnp.uint8 else x


def is_quantized(kv_cache) -> bool:
    """Whether a cache pytree carries scales (int8 / fp8) or is a plain (k_pool, v_pool)."""
    return len(kv_cache) == 4


def kv_block_bytes(config: ModelConfig, block_size: int, dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes one block takes over all layers, K and V, scales included."""
    per_token_head = config.head_dim * kv_storage_dtype(dtype, kv_cache_dtype).itemsize
    if kv_cache_dtype != "auto":
        per_token_head += np.dtype(SCALE_DTYPE).itemsize
    return 2 * config.num_layers * block_size * config.num_kv_heads * per_token_head


def allocate_kv_cache(config: ModelConfig, num_blocks: int, block_size: int, dtype, kv_cache_dtype: str = "auto",
                      mesh=None, fp8_dtype=jnp.float8_e4m3fn, zeros=jnp.zeros):
    """Zeroed cache pytree for all layers (see the module docstring for its two forms).
    fp8_dtype: as in kv_storage_dtype.
    mesh: None (the default device) or a ("model",) mesh: every part is split
    on its KV-head axis (parallel/sharding.py) and each device zeroes only its shard;
    on a ("context", "model") mesh the block axis is split over "context" as well.
    zeros: how the single-device pool is allocated (the backend's `zeros`:
    on CPU, memory that becomes resident only as blocks are written)."""
    shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
    storage = kv_storage_dtype(dtype, kv_cache_dtype, fp8_dtype)

    def pools(zeros):
        pools = (zeros(shape, storage), zeros(shape, storage))
        if kv_cache_dtype == "auto":
            return pools
        return pools + (zeros(shape[:-1], SCALE_DTYPE), zeros(shape[:-1], SCALE_DTYPE))

    if mesh is None:
        return pools(zeros)
    from jaxinfer.parallel.mesh import context_parallel_size
    from jaxinfer.parallel.sharding import kv_cache_specs, named

    specs = kv_cache_specs(kv_cache_dtype != "auto", context_parallel_size(mesh) > 1)
    return jax.jit(lambda: pools(jnp.zeros), out_shardings=named(specs, mesh))()


def kv_cache_shapes(config: ModelConfig, num_blocks: int, block_size: int, dtype, sharding,
                    kv_cache_dtype: str = "auto", fp8_dtype=jnp.float8_e4m3fn):
    """allocate_kv_cache's pytree on one device as shapes placed by
    `sharding`, allocating nothing: what a step is compiled for before its
    pool exists (engine/early_compile.py) or with no device at all
    (scripts/gpu/deviceless.py)."""
    pools = jax.eval_shape(lambda: allocate_kv_cache(config, num_blocks, block_size, dtype, kv_cache_dtype,
                                                     fp8_dtype=fp8_dtype))
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), pools)


def quantize_kv(x, storage_dtype):
    """x [..., head_dim] -> (q [..., head_dim] of storage_dtype, scales [...] float32).
    storage_dtype: int8, float8_e4m3fn, or uint8 (e4m3fn bit patterns)."""
    storage_dtype = jnp.dtype(storage_dtype)
    if storage_dtype == jnp.int8:
        limit = INT8_MAX
    elif storage_dtype in (jnp.float8_e4m3fn, jnp.uint8):
        limit = FP8_MAX
    else:
        raise ValueError(f"no KV quantizer for {storage_dtype}; expected int8, float8_e4m3fn or uint8")
    x = x.astype(jnp.float32)
    scales = jnp.max(jnp.abs(x), axis=-1) / limit
    scales = jnp.where(scales > 0, scales, 1.0)  # an all-zero row: any scale is exact
    # The clip guards the absmax element against x / scale rounding a hair past
    # the limit (e4m3fn has no inf: an overflowing cast gives NaN).
    scaled = jnp.clip(x / scales[..., None], -limit, limit)
    if storage_dtype == jnp.int8:
        return jnp.round(scaled).astype(jnp.int8), scales
    q = scaled.astype(jnp.float8_e4m3fn)
    if storage_dtype == jnp.uint8:
        q = jax.lax.bitcast_convert_type(q, jnp.uint8)
    return q, scales
