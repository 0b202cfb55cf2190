"""Device timing for the benchmark scripts (scripts/bench_*.py): the median of
repeated jitted calls, and the device's copy bandwidth that kernels are
measured against."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def time_ms(fn, *args, iters: int) -> float:
    """Median wall time of a jitted call, after one untimed warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def copy_bandwidth_gbs(num_bytes: int, iters: int) -> float:
    """Device-to-device copy: read + write of a num_bytes buffer."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    ms = time_ms(jax.jit(lambda a: a * 1.0 + 0.0), x, iters=iters)  # one fused elementwise pass, not elided
    return 2 * num_bytes / (ms * 1e-3) / 1e9
