"""Paged decode attention on CPU as a native XLA FFI kernel
(cpu_decode_attention.cc), built from source with the machine's C++ compiler
the first time it is needed and cached under ~/.cache/jaxinfer/kernels.

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

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".cc")
TARGET_NAME = "jaxinfer_paged_decode_attention"
# -march=native: the library is built on, and cached for, the machine that runs it.
CXXFLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd")
POOL_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.int8), np.dtype(np.uint8))


def _cpu_flags() -> str:
    """The CPU's feature flags: part of the cache key, since the library is
    compiled for them (a cache directory may outlive the machine)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _library_path(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(CXXFLAGS), version, _cpu_flags(),
                                    jax.ffi.include_dir(), jax.__version__]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("JAXINFER_KERNEL_CACHE_DIR") or Path.home() / ".cache" / "jaxinfer" / "kernels")
    return cache / f"cpu_decode_attention-{key}.so"


def _build(compiler: str) -> Path:
    path = _library_path(compiler)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Compile to a temporary name and rename: processes building at once never
    # load a half-written library.
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        subprocess.run([compiler, *CXXFLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(out)],
                       capture_output=True, text=True, check=True)
        os.replace(out, path)
    return path


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered with XLA (built on first call)."""
    if os.environ.get("JAXINFER_CPU_KERNELS", "1") == "0":
        return False
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        logger.warning("no C++ compiler found: CPU decode attention runs in jnp (slower); install g++")
        return False
    try:
        library = ctypes.cdll.LoadLibrary(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or str(error)
        logger.warning("could not build the CPU decode attention kernel; running it in jnp (slower):\n%s",
                       detail[-2000:])
        return False
    jax.ffi.register_ffi_target(TARGET_NAME, jax.ffi.pycapsule(library.JaxinferPagedDecodeAttention),
                                platform="cpu")
    return True


def supports(q, k_pool) -> bool:
    """Whether the kernel serves this call (on the CPU backend; shapes as in
    paged_decode_attention)."""
    return (jax.default_backend() == "cpu" and np.dtype(k_pool.dtype) in POOL_DTYPES and k_pool.ndim == 5
            and q.shape[-1] <= 512 and available())


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
