"""Zeroed arrays on CPU whose memory becomes resident only where written
(zeroed_buffer.cc): the KV pool, which jnp.zeros would write in full before
the first token (the CPU default pool is 512 MiB) and keep resident however
little of it the requests use. Where the kernel cannot be built, jnp.zeros."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxinfer.native.build import native_ffi_target

SOURCE = Path(__file__).with_suffix(".cc")
TARGET_NAME = "jaxinfer_zeroed_buffer"


def available() -> bool:
    """Whether the kernel is built and registered with XLA (built on first call)."""
    return native_ffi_target(str(SOURCE), "JaxinferZeroedBuffer", TARGET_NAME)


def zeros(shape: tuple, dtype) -> jax.Array:
    """jnp.zeros(shape, dtype) on the default CPU device, its pages left unallocated."""
    if not available():
        return jnp.zeros(shape, dtype)
    return _zeros(tuple(shape), jnp.dtype(dtype))()


@functools.cache
def _zeros(shape: tuple, dtype):
    return jax.jit(jax.ffi.ffi_call(TARGET_NAME, jax.ShapeDtypeStruct(shape, dtype)))
