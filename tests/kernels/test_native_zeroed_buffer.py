"""The CPU backend's zeroed arrays (native/zeroed_buffer.py): the KV pool's
allocation. They must read as zeros like jnp.zeros, take donated in-place
writes, and stay out of resident memory until written."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.backends.cpu import CpuBackend
from jaxinfer.native import zeroed_buffer

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel")


def resident_anon_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


def test_zeros_read_as_zeros_and_take_in_place_writes():
    assert zeroed_buffer.available()
    shape = (3, 40, 16, 2, 64)  # a small pool: partial pages at both ends
    for dtype in (jnp.float32, jnp.bfloat16, jnp.uint8):
        pool = CpuBackend().zeros(shape, dtype)
        assert pool.shape == shape and pool.dtype == dtype
        np.testing.assert_array_equal(np.asarray(pool), np.zeros(shape, dtype))
    write = jax.jit(lambda pool, i: pool.at[1, i].set(2.0), donate_argnums=0)
    pool = CpuBackend().zeros(shape, jnp.float32)
    address = pool.unsafe_buffer_pointer()
    pool = write(pool, 7)
    expected = np.zeros(shape, np.float32)
    expected[1, 7] = 2.0
    np.testing.assert_array_equal(np.asarray(pool), expected)
    assert pool.unsafe_buffer_pointer() == address  # written in place, not copied


def test_a_pool_is_resident_only_where_written():
    size = 256 * 2**20
    before = resident_anon_bytes()
    pool = CpuBackend().zeros((size // 4,), jnp.float32)
    pool.block_until_ready()
    grown = resident_anon_bytes() - before
    assert grown < size // 8, f"{grown / 2**20:.0f} MiB resident for a {size / 2**20:.0f} MiB pool"
    # jnp.zeros (the reference allocation) writes every page.
    reference = jnp.zeros((size // 4,), jnp.float32)
    reference.block_until_ready()
    assert resident_anon_bytes() - before - grown > size // 2
    del pool, reference
