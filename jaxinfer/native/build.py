"""Building, caching and registering the native CPU kernels of this folder.

Each kernel is a C++ XLA FFI handler (a .cc file here, all sharing
parallel.h), compiled with the machine's own compiler on first use
(-march=native: built on, and cached for, the machine that runs it), loaded
with ctypes and registered with XLA's CPU platform under a target name.
Its Python wrapper (matmul.py, paged_attention.py) asks `native_ffi_target`
whether it is available; where it is not (no compiler, a failed build,
JAXINFER_CPU_KERNELS=0) the CPU backend runs the plain jnp path instead.
"""

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

# -march=native: a native library is built on, and cached for, the machine that runs it.
NATIVE_CXXFLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd")
# The headers every kernel may include, as "jaxinfer/native/<name>" (part of each build's cache key).
NATIVE_HEADERS = tuple(Path(__file__).with_name(name) for name in ("parallel.h", "kquant_layer.h", "vec16.h"))


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


def cpu_runs_vec16() -> bool:
    """Whether this CPU has the instructions the kernel paths written on
    vec16.h need (kquant_matmul.cc, matmul.cc's tiled paths, which the
    Python side chooses by it; paged_attention.cc's vector paths, which the
    build alone chooses): AVX-512, or AVX2 with FMA and F16C."""
    return cpu_has("avx512f") or all(cpu_has(flag) for flag in ("avx2", "fma", "f16c"))


@functools.cache
def cxx_compiler() -> str | None:
    """The C++ compiler native kernels are built with ($CXX, else g++ or c++ on
    the PATH), or None."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def native_library(source: str, defines: tuple[str, ...] = ()):
    """A C++ XLA FFI kernel (`source`, a .cc file of this folder) built with
    the machine's compiler and loaded (ctypes.CDLL); `defines` ("NAME=VALUE")
    select a part of a source built apart (kquant_matmul.py's kinds). Built
    once per source, defines, compiler, CPU and JAX version, cached under ~/.cache/jaxinfer/kernels
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
        flags = (*NATIVE_CXXFLAGS, *(f"-D{define}" for define in defines))
        key = hashlib.sha256("\0".join([*texts, " ".join(flags), version, cpu_flags(),
                                        jax.ffi.include_dir(), jax.__version__]).encode()).hexdigest()[:16]
        cache = Path(os.environ.get("JAXINFER_KERNEL_CACHE_DIR") or Path.home() / ".cache" / "jaxinfer" / "kernels")
        path = cache / f"{name}-{key}.so"
        if not path.exists():
            cache.mkdir(parents=True, exist_ok=True)
            # Compile to a temporary name and rename: processes building at
            # once never load a half-written library.
            with tempfile.TemporaryDirectory(dir=cache) as tmp:
                out = Path(tmp) / path.name
                includes = [f"-I{jax.ffi.include_dir()}", f"-I{Path(__file__).parents[2]}"]
                subprocess.run([compiler, *flags, *includes, source, "-o", str(out)],
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
# target name -> the loaded library (ctypes.CDLL) its handler came from.
_libraries: dict[str, object] = {}
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
    _libraries[target_name] = library
    return True


def registered_library(target_name: str):
    """The loaded library (ctypes.CDLL) of a registered target's handler, for
    a kernel that hands it code built apart (kquant_matmul.py's kinds)."""
    return _libraries[target_name]


def registered_ffi_targets() -> dict[str, tuple[str, str]]:
    """{target name: (source, symbol)} of the native handlers registered so far."""
    return dict(_registered)
