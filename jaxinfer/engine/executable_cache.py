"""The engine's compiled programs, kept on disk under a key of what they were
compiled from, so that a warm start neither compiles nor traces them.

JAX's persistent cache (utils.enable_compilation_cache) skips only XLA's
compilation: its key is a hash of the lowered module, so every start still
traces and lowers each program first, ~1.8 s of the default model's ~3.4 s
warm start on the 2-core CPU (25 programs; BENCHMARKS.md, "Cold start").
Here the key is computed from the program's inputs alone: its name, the
shapes, dtypes and tree of its arguments, its static arguments (the model
config among them), the device, the CPU's flags and the environment that
steers lowering; the jaxinfer sources and JAX's version are in the directory
(utils.compilation_cache_dir). A hit is deserialized
(jax.experimental.serialize_executable) in ~20 ms.

Two rules keep a stored program runnable:
- Only executables XLA compiled in this process are stored. One that JAX read
  back from its own persistent cache serializes again without its machine
  code (XLA:CPU keeps none for it) and fails at run time ("Function ... not
  found"); JAX reports such a hit as an event on the compiling thread, but
  hands the same executable back from its in-memory cache, with no event,
  when an equal program is lowered and compiled again in the process (a
  second engine of the same model), so the ones it served are remembered.
- The native kernels (native/build.py, native_ffi_target) a program may call are found
  by name when it runs: an entry lists those registered when it was compiled,
  and loading registers them again (a miss where one cannot be built).

Single device only (the engine passes no cache on a mesh). Entries are never
evicted within a fingerprint's directory (utils keeps the last few
fingerprints); the default model's 25 programs take ~5 MB.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np
from jax.experimental import serialize_executable

from jaxinfer.native.build import cpu_flags, cxx_compiler, native_ffi_target, registered_ffi_targets
from jaxinfer.utils import compilation_cache_dir

log = logging.getLogger(__name__)

# Loading is mostly XLA's C++ (linking the machine code), which runs outside
# the GIL: two threads load the default model's programs in ~0.3 s against ~0.5 s.
LOAD_THREADS = 2

# Set on a thread while JAX serves its compilation from the persistent cache.
_persistent_cache_hit = threading.local()


def _on_event(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _persistent_cache_hit.value = True


# id -> runtime executable, of those JAX's persistent cache served in this
# process (held, so that no other object takes the id; JAX's in-memory cache
# holds them anyway).
_served_by_persistent_cache: dict[int, object] = {}
_served_lock = threading.Lock()


jax.monitoring.register_event_listener(_on_event)


# Native kernel sources are recorded relative to the package (a moved tree keeps its entries).
PACKAGE = Path(__file__).parent.parent


def argument_signature(args) -> tuple:
    """What a compiled program requires of `args` (arrays, their shapes, or
    host arrays): the tree, and each leaf's shape, dtype and placement. Keys
    entries here; CompiledPrograms.adopt compares it directly."""
    leaves, tree = jax.tree.flatten(args)
    return tree, [(np.shape(x), np.dtype(x.dtype), getattr(x, "sharding", None)) for x in leaves]


class ExecutableCache:
    def __init__(self, directory: Path):
        self.directory = Path(directory)
        # The one device the engine's single-device programs run on. A loaded
        # program is bound to it explicitly: deserialize_and_load's default is
        # every device of the platform, and on a host with several (8 GPUs, or
        # forced CPU devices) the program then expected one shard per device.
        self.device = device = jax.devices()[0]
        # What every key shares: the device, the CPU's flags and the
        # environment that steers lowering, the same for the whole process.
        self._environment = [
            device.platform, device.device_kind, cpu_flags(),
            *(f"{var}={os.environ.get(var, '')}" for var in ("XLA_FLAGS", "JAXINFER_CPU_KERNELS")),
            # JAX options that change what a trace lowers to.
            *(f"{name}={getattr(jax.config, name)}" for name in ("jax_enable_x64", "jax_default_matmul_precision")),
            # Without a compiler the kernels' jnp paths were compiled: a
            # compiler installed later must not find those.
            str(cxx_compiler()),
        ]

    @classmethod
    def default(cls, mesh=None) -> ExecutableCache | None:
        """The cache in this process's compilation cache directory for a runner
        on `mesh`; None where caching is off, and on a mesh (a program's
        shardings would have to be part of the key and restored on load;
        JAX's persistent cache serves mesh runners)."""
        directory = compilation_cache_dir()
        return None if directory is None or mesh is not None else cls(directory / "executables")

    def key(self, name: tuple, args: tuple, statics: dict) -> str:
        """The key of program `name` called with `args` (arrays or their
        shapes) and keyword `statics`."""
        parts = [repr(name), repr(argument_signature(args)), repr(sorted(statics.items())), *self._environment]
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]

    def load_all(self, keys: dict, threads: int = LOAD_THREADS) -> dict:
        """{program: executable} for each program of `keys` ({program: key})
        that is stored and loads (on `threads` threads); the others are left out."""
        with ThreadPoolExecutor(threads) as pool:
            loaded = dict(zip(keys, pool.map(self.load, keys.values())))
        return {program: executable for program, executable in loaded.items() if executable is not None}

    def has(self, key: str) -> bool:
        """Whether an entry is stored under `key` (it may still fail to load)."""
        return (self.directory / f"{key}.pkl").exists()

    def load(self, key: str):
        path = self.directory / f"{key}.pkl"
        try:
            with open(path, "rb") as file:
                payload, in_tree, out_tree, targets = pickle.load(file)
        except FileNotFoundError:
            return None
        except Exception as error:  # written by another version, or cut short
            log.warning("ignoring executable cache entry %s: %s", path, error)
            return None
        if not all(native_ffi_target(str(PACKAGE / source), symbol, target)
                   for target, (source, symbol) in targets.items()):
            return None
        try:
            return serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                             execution_devices=[self.device])
        except Exception as error:
            log.warning("could not load executable cache entry %s: %s", path, error)
            return None

    def compile(self, lowered, key: str, compiler_options: dict | None = None):
        """Compile `lowered` (with XLA `compiler_options`, which the key must
        cover) and store the executable under `key`, when XLA compiled it here."""
        _persistent_cache_hit.value = False
        executable = lowered.compile(compiler_options)
        runtime = executable.runtime_executable()
        with _served_lock:
            if _persistent_cache_hit.value:
                _served_by_persistent_cache[id(runtime)] = runtime
            served = _served_by_persistent_cache.get(id(runtime)) is runtime
        if served:
            log.info("not storing %s: JAX's persistent cache served it, and its copy cannot be serialized again", key)
            return executable
        try:
            payload, in_tree, out_tree = serialize_executable.serialize(executable)
        except Exception as error:  # e.g. a program that closes over constants
            log.warning("not storing %s in the executable cache: %s", key, error)
            return executable
        targets = {target: (str(Path(source).relative_to(PACKAGE)), symbol)
                   for target, (source, symbol) in registered_ffi_targets().items()}
        self.directory.mkdir(parents=True, exist_ok=True)
        # Written to a temporary name and renamed: a process loading at the
        # same time never reads half an entry.
        with tempfile.NamedTemporaryFile(dir=self.directory, delete=False) as file:
            pickle.dump((payload, in_tree, out_tree, targets), file)
        os.replace(file.name, self.directory / f"{key}.pkl")
        return executable
