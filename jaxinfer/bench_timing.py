"""Device timing for the benchmark scripts (scripts/bench_*.py,
scripts/profile_decode.py): the median of repeated jitted calls, the
device's copy and read bandwidth that kernels are measured against, and the
bytes of weights a decode step reads."""

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


def read_bandwidth_gbs(num_bytes: int) -> float:
    """Memory read bandwidth: a jitted sum over a num_bytes float32 array,
    median of 5 (a copy's fresh output buffer page-faults on the dev VM and
    measures the allocator, not the memory)."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    ms = time_ms(jax.jit(jnp.sum), x, iters=5)
    del x
    return num_bytes / (ms * 1e-3) / 1e9


def weight_bytes_per_step(params: dict) -> int:
    """Bytes of weights a one-row decode step reads: every leaf, except that the
    embedding table is only gathered from (one row per token) where another
    head multiplies: an untied or quantized lm_head, or the few_row_head that
    one row takes (backends/cpu.py, logits)."""
    def nbytes(tree):
        return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(tree))

    total = nbytes(params)
    if "embed" in params and ("lm_head" in params or "few_row_head" in params):
        total -= nbytes(params["embed"])
    return total
