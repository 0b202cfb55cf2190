"""Small helpers shared across the package."""

from __future__ import annotations

import os
from pathlib import Path


def bucket_size(n: int, minimum: int = 16) -> int:
    """Smallest power of two >= n (and >= minimum): the padded length of a
    dimension, so that jit compiles one program per bucket, not per length."""
    size = minimum
    while size < n:
        size *= 2
    return size


def powers_of_two(low: int, high: int) -> list[int]:
    """low, 2 low, 4 low, ... up to the first size >= high: every bucket of a dimension."""
    sizes = [low]
    while sizes[-1] < high:
        sizes.append(sizes[-1] * 2)
    return sizes


_cache_enabled = False


def enable_compilation_cache() -> None:
    """Turn on JAX's persistent compilation cache (JAXINFER_CACHE_DIR, default
    ~/.cache/jaxinfer/xla) so a second run skips XLA compilation."""
    global _cache_enabled
    if _cache_enabled or os.environ.get("JAXINFER_DISABLE_COMPILATION_CACHE"):
        return
    import jax

    cache_dir = os.environ.get("JAXINFER_CACHE_DIR") or str(Path.home() / ".cache" / "jaxinfer" / "xla")
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    # Cache even quick compilations: on a 2-core CPU most of ours take < 1 s each.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _cache_enabled = True
