"""The CPU backend's zeroed arrays (native/zeroed_buffer.py): the KV pool's
allocation. They must read as zeros like jnp.zeros, take donated in-place
writes, and stay out of resident memory until written."""

import ctypes
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.backends.cpu import CpuBackend
from jaxinfer.native import zeroed_buffer

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel")
LIBC = ctypes.CDLL(None, use_errno=True)


def resident_bytes(array) -> int:
    """The bytes of the pages under `array`'s buffer that are resident
    (mincore(2)): the array's own pages, whatever else the process (other
    tests' engines, their compile threads) allocates or frees meanwhile."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = array.unsafe_buffer_pointer()
    first = start - start % page
    length = start + array.nbytes - first
    flags = (ctypes.c_ubyte * -(-length // page))()
    if LIBC.mincore(ctypes.c_void_p(first), ctypes.c_size_t(length), flags) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(flag & 1 for flag in bytes(flags)) * page


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
    pool = CpuBackend().zeros((size // 4,), jnp.float32)
    pool.block_until_ready()
    resident = resident_bytes(pool)
    assert resident < size // 8, f"{resident / 2**20:.0f} MiB resident for a {size / 2**20:.0f} MiB pool"
    write = jax.jit(lambda pool: pool.at[: size // 16].set(1.0), donate_argnums=0)
    pool = write(pool)  # a quarter of it written, in place
    pool.block_until_ready()
    assert size // 4 <= resident_bytes(pool) < size // 4 + size // 8
    # jnp.zeros (the reference allocation) writes every page.
    reference = jnp.zeros((size // 4,), jnp.float32)
    reference.block_until_ready()
    assert resident_bytes(reference) > size // 2
    del pool, reference
