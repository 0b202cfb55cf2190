"""Small helpers shared across the package: shape buckets and the persistent
compilation cache's directory."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
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
# Source fingerprints whose caches are kept under the cache root (the most
# recently used; a development tree makes a new one at every edit).
KEPT_FINGERPRINTS = 4


# The alignment at which jax.device_put on CPU adopts a numpy array's memory
# instead of copying it (XLA's minimum; numpy's large allocations sit 16 bytes
# past a page).
HOST_ALIGNMENT = 64


def host_empty(shape: tuple, dtype):
    """An uninitialized numpy array starting on a HOST_ALIGNMENT boundary: one a
    loader fills and hands to jax.device_put, which on CPU then keeps these
    bytes rather than a copy of them (a second copy of every weight while an
    8B model loads)."""
    import numpy as np

    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buffer = np.empty(nbytes + HOST_ALIGNMENT, np.uint8)
    start = -buffer.ctypes.data % HOST_ALIGNMENT
    return buffer[start:start + nbytes].view(dtype).reshape(shape)


def compilation_cache_dir() -> Path | None:
    """Where this process's compiled programs are cached, or None where that
    is off (JAXINFER_DISABLE_COMPILATION_CACHE, set by the test suite): a
    directory per source fingerprint under JAXINFER_CACHE_DIR (default
    ~/.cache/jaxinfer/xla). JAX's persistent cache (<dir>/xla) and the
    engine's executable cache (engine/executable_cache.py, <dir>/executables)
    both live there, so a new jaxinfer version or an edited tree starts both
    afresh together: the executable cache stores only programs XLA compiled
    in the process (see there), so JAX's cache must not already hold them."""
    root = _cache_root()
    return None if root is None else root / source_fingerprint()


def autotune_cache_dir() -> Path | None:
    """Where XLA keeps its GPU autotuner's results across processes (the
    fastest kernel it timed for each fusion), or None where caching is off:
    under the cache root, one directory per XLA build (jaxlib's version and
    its GPU plugin's), shared by every source fingerprint. XLA keys a result
    by the fusion's HLO and the GPU model, so whatever jaxinfer's sources
    change is in the key already: a new jaxinfer or an edited tree compiles
    its programs afresh but times again only the fusions no earlier one had.
    JAX's default (jax_persistent_cache_enable_xla_caches) puts them in its
    own cache directory, under the fingerprint, where they went with it.
    The GPU backend passes this to XLA (GpuBackend.compiler_options). A
    build's directory stays until the root is cleared: results are small
    text, and builds change only when JAX is upgraded."""
    root = _cache_root()
    if root is None:
        return None
    directory = root / "autotune" / _xla_build()
    directory.mkdir(parents=True, exist_ok=True)  # XLA writes only into a directory that exists
    return directory


def _cache_root() -> Path | None:
    if os.environ.get("JAXINFER_DISABLE_COMPILATION_CACHE"):
        return None
    return Path(os.environ.get("JAXINFER_CACHE_DIR") or Path.home() / ".cache" / "jaxinfer" / "xla")


@functools.cache
def _xla_build() -> str:
    """jaxlib's version and every installed GPU plugin's: the XLA that compiles."""
    from importlib import metadata

    import jaxlib

    plugins = sorted({f"{name}-{dist.version}" for dist in metadata.distributions()
                      if (name := (dist.metadata["Name"] or "").lower().replace("_", "-")).startswith(
                          ("jax-cuda", "jax-rocm"))})
    return "-".join([f"jaxlib-{jaxlib.__version__}", *plugins])


@functools.cache
def source_fingerprint() -> str:
    """A hash of the jaxinfer sources (every .py, .cc and .h of the package and
    of pallas_kernels/) and the JAX and jaxlib versions: what any compiled
    program may depend on besides its own shapes and options."""
    import jax
    import jaxlib

    digest = hashlib.sha256(f"{jax.__version__} {jaxlib.__version__}".encode())
    package = Path(__file__).parent
    for tree in (package, package.parent / "pallas_kernels"):
        for path in sorted(p for p in tree.rglob("*") if p.suffix in (".py", ".cc", ".h")):
            digest.update(str(path.relative_to(tree.parent)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def enable_compilation_cache() -> None:
    """Turn on JAX's persistent compilation cache (compilation_cache_dir()/xla)
    so a second run skips XLA compilation, and drop the caches of all but the
    KEPT_FINGERPRINTS most recently used source fingerprints."""
    global _cache_enabled
    directory = compilation_cache_dir()
    if _cache_enabled or directory is None:
        return
    import jax

    (directory / "xla").mkdir(parents=True, exist_ok=True)
    os.utime(directory)  # most recently used
    _prune_fingerprints(directory.parent)
    jax.config.update("jax_compilation_cache_dir", str(directory / "xla"))
    # Cache even quick compilations: on a 2-core CPU most of ours take < 1 s each.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # XLA's autotuning results live outside the fingerprint (autotune_cache_dir).
    jax.config.update("jax_persistent_cache_enable_xla_caches", None)
    _cache_enabled = True


def _prune_fingerprints(root: Path) -> None:
    fingerprints = [p for p in root.iterdir() if p.is_dir() and len(p.name) == 16
                    and all(c in "0123456789abcdef" for c in p.name)]
    fingerprints.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    for stale in fingerprints[KEPT_FINGERPRINTS:]:
        shutil.rmtree(stale, ignore_errors=True)
