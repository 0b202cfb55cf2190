"""Small helpers shared across the package."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger(__name__)


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


# Blocks up to this size stay in the process's heap once freed (mallopt below).
KEPT_ALLOCATION_BYTES = 1 << 30


def keep_freed_host_memory() -> bool:
    """Ask glibc to serve allocations of up to KEPT_ALLOCATION_BYTES from its
    heap and keep what is freed there, instead of a fresh mmap per block over
    32 MB that is unmapped again on free. XLA:CPU allocates every call's
    temporaries with malloc, so a program whose temporaries pass 32 MB (the
    sampler over a 49,152 vocabulary from 48 rows, a large prompt step) paid
    a page fault for every 4 KB page it touched, on every call: the sampler
    at 64 rows took 6.4 ms instead of 1.9 (BENCHMARKS.md). The process then
    holds its high-water mark of host memory, as tcmalloc or jemalloc would.
    False where this is not glibc, or the user set glibc's malloc options
    (GLIBC_TUNABLES, MALLOC_*_ env), which are left alone."""
    if "malloc" in os.environ.get("GLIBC_TUNABLES", "") or any(k.startswith("MALLOC_") for k in os.environ):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl has another mallopt)
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    return bool(libc.mallopt(m_mmap_threshold, KEPT_ALLOCATION_BYTES)
                and libc.mallopt(m_trim_threshold, 2 * KEPT_ALLOCATION_BYTES))


_cache_enabled = False
# Source fingerprints whose caches are kept under the cache root (the most
# recently used; a development tree makes a new one at every edit).
KEPT_FINGERPRINTS = 4


def compilation_cache_dir() -> Path | None:
    """Where this process's compiled programs are cached, or None where that
    is off (JAXINFER_DISABLE_COMPILATION_CACHE, set by the test suite): a
    directory per source fingerprint under JAXINFER_CACHE_DIR (default
    ~/.cache/jaxinfer/xla). JAX's persistent cache (<dir>/xla) and the
    engine's executable cache (engine/executable_cache.py, <dir>/executables)
    both live there, so a new jaxinfer version or an edited tree starts both
    afresh together: the executable cache stores only programs XLA compiled
    in the process (see there), so JAX's cache must not already hold them."""
    if os.environ.get("JAXINFER_DISABLE_COMPILATION_CACHE"):
        return None
    root = Path(os.environ.get("JAXINFER_CACHE_DIR") or Path.home() / ".cache" / "jaxinfer" / "xla")
    return root / source_fingerprint()


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
    _cache_enabled = True


def _prune_fingerprints(root: Path) -> None:
    fingerprints = [p for p in root.iterdir() if p.is_dir() and len(p.name) == 16
                    and all(c in "0123456789abcdef" for c in p.name)]
    fingerprints.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    for stale in fingerprints[KEPT_FINGERPRINTS:]:
        shutil.rmtree(stale, ignore_errors=True)


# -march=native: a native library is built on, and cached for, the machine that runs it.
NATIVE_CXXFLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd")
# The headers every kernel may include, as "jaxinfer/<name>" (part of each build's cache key).
NATIVE_HEADERS = (Path(__file__).with_name("cpu_parallel.h"),)


@functools.cache
def cpu_flags() -> str:
    """The CPU's feature flags: part of the key of a native library and of a
    stored executable, since both are compiled for them (a cache directory
    may outlive the machine)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


@functools.cache
def cpu_has(flag: str) -> bool:
    """Whether this CPU reports `flag` (e.g. "avx512f") in /proc/cpuinfo:
    the native kernels are compiled for the machine (-march=native), and
    some of their paths, and so where they pay, depend on it."""
    return flag in cpu_flags().split()


@functools.cache
def cxx_compiler() -> str | None:
    """The C++ compiler native kernels are built with ($CXX, else g++ or c++ on
    the PATH), or None."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def native_library(source: str):
    """A C++ XLA FFI kernel (`source`, a .cc file in the package) built with
    the machine's compiler and loaded (ctypes.CDLL). Built once per source,
    compiler, CPU and JAX version, cached under ~/.cache/jaxinfer/kernels
    (or JAXINFER_KERNEL_CACHE_DIR). None, with a warning, where that cannot be
    done (JAXINFER_CPU_KERNELS=0, no compiler, a failed build): callers then
    run their jnp path."""
    import ctypes

    import jax

    if os.environ.get("JAXINFER_CPU_KERNELS", "1") == "0":
        return None
    compiler = cxx_compiler()
    name = Path(source).stem
    if compiler is None:
        logger.warning("no C++ compiler found: %s runs in jnp (slower); install g++", name)
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
        texts = [Path(source).read_text(), *(header.read_text() for header in NATIVE_HEADERS)]
        key = hashlib.sha256("\0".join([*texts, " ".join(NATIVE_CXXFLAGS), version, cpu_flags(),
                                        jax.ffi.include_dir(), jax.__version__]).encode()).hexdigest()[:16]
        cache = Path(os.environ.get("JAXINFER_KERNEL_CACHE_DIR") or Path.home() / ".cache" / "jaxinfer" / "kernels")
        path = cache / f"{name}-{key}.so"
        if not path.exists():
            cache.mkdir(parents=True, exist_ok=True)
            # Compile to a temporary name and rename: processes building at
            # once never load a half-written library.
            with tempfile.TemporaryDirectory(dir=cache) as tmp:
                out = Path(tmp) / path.name
                includes = [f"-I{jax.ffi.include_dir()}", f"-I{Path(__file__).parent.parent}"]
                subprocess.run([compiler, *NATIVE_CXXFLAGS, *includes, source, "-o", str(out)],
                               capture_output=True, text=True, check=True)
                os.replace(out, path)
        return ctypes.cdll.LoadLibrary(str(path))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or str(error)
        logger.warning("could not build %s; it runs in jnp (slower):\n%s", name, detail[-2000:])
        return None


_registration_locks: dict[str, threading.Lock] = {}
# target name -> (source, symbol) of every handler registered in this process.
_registered: dict[str, tuple[str, str]] = {}
_registration_locks_lock = threading.Lock()


def native_ffi_target(source: str, symbol: str, target_name: str) -> bool:
    """Build and load `source` (native_library) and register its handler
    `symbol` with XLA's CPU platform as `target_name`, once per process;
    False where it cannot be built. Thread-safe: LLM() starts the builds on
    threads while a trace may already ask (a second caller waits for the
    first, builds of different sources run side by side)."""
    with _registration_locks_lock:
        lock = _registration_locks.setdefault(target_name, threading.Lock())
    with lock:
        return _register(source, symbol, target_name)


@functools.cache
def _register(source: str, symbol: str, target_name: str) -> bool:
    import jax

    library = native_library(source)
    if library is None:
        return False
    jax.ffi.register_ffi_target(target_name, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    _registered[target_name] = (source, symbol)
    return True


def registered_ffi_targets() -> dict[str, tuple[str, str]]:
    """{target name: (source, symbol)} of the native handlers registered so far."""
    return dict(_registered)
