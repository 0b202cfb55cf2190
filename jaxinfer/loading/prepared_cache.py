"""A GGUF load's params as the backend arranged them, kept on disk, so that
the next load of the same file with the same options maps them back
instead of converting the blocks again (and the mapped weights stay
page-cache pages, not the process's own memory: BENCHMARKS.md, "GGUF
start-up").

Key: everything the arranged params depend on: the file (resolved path,
size, mtime_ns, ctime_ns, inode, a hash of its first and last MiB), the
quantization, dtype and backend (its repr: class and fields), the platform
and the CPU's flags, the compiler and JAXINFER_CPU_KERNELS (which native
kernels exist decides which weights are tiled and how), the jaxinfer
version and FORMAT_VERSION. The directory is per source fingerprint as
well (utils.compilation_cache_dir): an edited tree starts afresh.

Where: <compilation_cache_dir()>/prepared, beside the executable cache, and
off where that is off (JAXINFER_DISABLE_COMPILATION_CACHE). Entries are
written to a temporary name and renamed (a reader never sees half an
entry), and the least recently used are deleted once the directory holds
more than JAXINFER_PREPARED_CACHE_BYTES (default MAX_BYTES; 0 turns the
cache off, the other caches staying on).

An entry is one file:

    MAGIC, header length (u64), crc32 of the header (u32), padding to 32 bytes
    header   pickle of {key, data_bytes, structure, leaves}: the params tree with
             each array replaced by _Leaf(i), and each leaf's (offset from
             the data start, dtype name, shape)
    data     from the first ALIGN boundary after the header, each leaf's
             bytes at an ALIGN boundary

Reading maps the file once (copy-on-write) and hands each leaf's view to
jax.device_put, which on CPU adopts an aligned host buffer without copying:
the weights stay page-cache pages, read when a step first touches them.
An entry that does not read back whole (damaged, cut short, another key or
format) is ignored and rebuilt. The data bytes themselves carry no checksum
(crc32 of them would add ~0.15 s per 200 MB to every load); entries are
only ever replaced whole, by rename.

Only single-device loads on CPU take it (load() asks `for_gguf_load`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import pickle
import struct
import tempfile
import threading
import time
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.native.build import cpu_flags, cxx_compiler
from jaxinfer.utils import compilation_cache_dir, source_fingerprint

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MAGIC = b"jaxinfer-params\n"
PREAMBLE = 32  # MAGIC, header length, header crc32, padding
ALIGN = 4096   # every leaf starts on a page: an aligned buffer is what device_put adopts without a copy
MAX_BYTES = 16 * 2**30  # two 8B Q4_K_M files' params (4.5 GB each), or one 13B's
SAMPLE_BYTES = 2**20  # of the file's start and end, hashed into the key
STALE_TEMPORARY_SECONDS = 3600  # a temporary file this old was left by a process that died writing it


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """Where an array stood in the params tree (the header's structure)."""
    index: int


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jaxinfer")
    except PackageNotFoundError:  # a plain checkout on the path: the source fingerprint stands for it
        return "unknown"


def file_identity(path: Path) -> list[str]:
    """What identifies the file's content without reading all of it: its
    resolved path, size, times and inode, and a hash of its first and last
    SAMPLE_BYTES (a rewrite that restored the times still changes ctime)."""
    path = path.resolve()
    with open(path, "rb") as file:
        stat = os.fstat(file.fileno())
        digest = hashlib.sha256(file.read(SAMPLE_BYTES))
        file.seek(max(stat.st_size - SAMPLE_BYTES, 0))
        digest.update(file.read(SAMPLE_BYTES))
    return [str(path), str(stat.st_size), str(stat.st_mtime_ns), str(stat.st_ctime_ns), str(stat.st_ino),
            digest.hexdigest()]


class PreparedParamsCache:
    def __init__(self, directory: Path, max_bytes: int | None = None):
        self.directory = Path(directory)
        if max_bytes is None:
            max_bytes = int(os.environ.get("JAXINFER_PREPARED_CACHE_BYTES", MAX_BYTES))
        self.max_bytes = max_bytes

    @classmethod
    def default(cls) -> PreparedParamsCache | None:
        """The cache in this process's compilation cache directory; None where caching is off."""
        directory = compilation_cache_dir()
        return None if directory is None else cls(directory / "prepared")

    @classmethod
    def for_gguf_load(cls, source, mesh, quantization, dtype, backend) -> PreparedLoad | None:
        """The entry of a load of the GGUF file `source` reads, or None where
        this load does not take the cache: not a GGUF, on a mesh, not on CPU,
        caching off, or the file unreadable."""
        from jaxinfer.loading.gguf import GGUFTensors

        if not isinstance(source, GGUFTensors) or mesh is not None or jax.default_backend() != "cpu":
            return None
        cache = cls.default()
        if cache is None or cache.max_bytes <= 0:
            return None
        try:
            return PreparedLoad(cache, Path(source.description), (quantization, dtype, backend))
        except OSError as error:
            log.warning("not caching the prepared params of %s: %s", source.description, error)
            return None

    def key(self, path: Path, quantization, dtype, backend) -> str:
        device = jax.devices()[0]
        parts = [f"format {FORMAT_VERSION}", _version(), source_fingerprint(), *file_identity(path),
                 repr(quantization), np.dtype(dtype).name, repr(backend),
                 device.platform, device.device_kind, cpu_flags(), str(cxx_compiler()),
                 f"JAXINFER_CPU_KERNELS={os.environ.get('JAXINFER_CPU_KERNELS', '')}",
                 f"jax_enable_x64={jax.config.jax_enable_x64}"]
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.params"

    # -- reading -------------------------------------------------------------------
    def read(self, key: str):
        """The params stored under `key` on the default device, or None (not
        stored, or an entry that does not read back whole: logged, ignored)."""
        path = self.path(key)
        try:
            file = open(path, "rb")
        except FileNotFoundError:
            return None
        try:
            with file:
                params = self._read(file, key)
        except Exception as error:  # damaged, cut short, or written by another format
            log.warning("ignoring prepared params cache entry %s: %s", path, error)
            return None
        try:
            os.utime(path)  # most recently used, for eviction
        except OSError:
            pass
        log.info("prepared params read from %s", path)
        return params

    @staticmethod
    def _read(file, key: str):
        preamble = file.read(PREAMBLE)
        if len(preamble) != PREAMBLE or preamble[:len(MAGIC)] != MAGIC:
            raise ValueError("not a prepared params file")
        length, crc = struct.unpack_from("<QI", preamble, len(MAGIC))
        header_bytes = file.read(length)
        if len(header_bytes) != length or zlib.crc32(header_bytes) != crc:
            raise ValueError("header damaged")
        header = pickle.loads(header_bytes)
        size = os.fstat(file.fileno()).st_size
        start = _align(PREAMBLE + length)
        if header["key"] != key or start + header["data_bytes"] != size:
            raise ValueError(f"entry of key {header['key']} and {start + header['data_bytes']} bytes, "
                             f"expected {key} and {size}")
        # Mapped from the open file, so an entry renamed over or evicted
        # meanwhile is still this one. Copy-on-write: nothing reaches the file.
        mapped = np.memmap(file, np.uint8, mode="c")
        leaves = []
        for offset, dtype_name, shape in header["leaves"]:
            dtype = np.dtype(jnp.dtype(dtype_name))
            count = int(np.prod(shape, dtype=np.int64))
            view = mapped[start + offset:start + offset + count * dtype.itemsize].view(dtype).reshape(shape)
            leaves.append(jax.device_put(view))
        return jax.tree.map(lambda leaf: leaves[leaf.index], header["structure"])

    # -- writing -------------------------------------------------------------------
    def write(self, key: str, params) -> None:
        """Store `params` (arrays and the quantized forms' pytrees) under `key`;
        a params tree this cannot hold faithfully (weakly typed or non-array
        leaves), or one past max_bytes, is not stored."""
        leaves, treedef = jax.tree.flatten(params)
        if not all(isinstance(leaf, (jax.Array, np.ndarray)) and not getattr(leaf, "weak_type", False)
                   for leaf in leaves):
            log.info("not caching prepared params: a leaf is not a plain array")
            return
        entries, offset = [], 0
        for leaf in leaves:
            entries.append((offset, np.dtype(leaf.dtype).name, tuple(leaf.shape)))
            offset = _align(offset + leaf.size * leaf.dtype.itemsize)
        structure = jax.tree.unflatten(treedef, [_Leaf(i) for i in range(len(leaves))])
        header_bytes = pickle.dumps({"key": key, "data_bytes": offset, "structure": structure, "leaves": entries},
                                    protocol=pickle.HIGHEST_PROTOCOL)
        start = _align(PREAMBLE + len(header_bytes))
        size = start + offset
        if size > self.max_bytes:
            log.info("not caching prepared params of %d bytes (the cap is %d)", size, self.max_bytes)
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._evict(keep_free=size)
            with tempfile.NamedTemporaryFile(dir=self.directory, prefix=".tmp-", delete=False) as file:
                try:
                    file.write(MAGIC + struct.pack("<QI4x", len(header_bytes), zlib.crc32(header_bytes)))
                    file.write(header_bytes)
                    for leaf, (leaf_offset, _, _) in zip(leaves, entries):
                        file.seek(start + leaf_offset)
                        # One leaf at a time: np.asarray of a CPU array is a view, not a copy.
                        file.write(np.ascontiguousarray(np.asarray(leaf)).reshape(-1).view(np.uint8))
                    file.truncate(size)
                except BaseException:
                    file.close()
                    os.unlink(file.name)
                    raise
            os.replace(file.name, self.path(key))
        except OSError as error:  # a full disk, a read-only cache directory
            log.warning("could not store prepared params in %s: %s", self.directory, error)

    def _evict(self, keep_free: int) -> None:
        """Delete the least recently used entries until `keep_free` more bytes
        fit under max_bytes, and temporary files that dying writers left."""
        entries = []
        for path in self.directory.iterdir():
            try:
                stat = path.stat()
            except OSError:  # deleted meanwhile by another process
                continue
            if path.name.startswith(".tmp-"):
                if time.time() - stat.st_mtime > STALE_TEMPORARY_SECONDS:
                    path.unlink(missing_ok=True)
            elif path.suffix == ".params":
                entries.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total + keep_free <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size


# key -> the thread writing that entry in this process (PreparedLoad.write_behind).
_writers: dict[str, threading.Thread] = {}
_writers_lock = threading.Lock()


def finish_writes() -> None:
    """Wait for every entry this process is writing (write_behind)."""
    with _writers_lock:
        writers = list(_writers.values())
    for writer in writers:
        writer.join()


class PreparedLoad:
    """One load's entry: `read` before converting, `write` (or
    `write_behind`) after (stored only if the file is still the one the key
    was taken of)."""

    def __init__(self, cache: PreparedParamsCache, path: Path, options: tuple):
        self.cache, self.path, self.options = cache, path, options
        self.key = cache.key(path, *options)

    def read(self):
        with _writers_lock:
            writer = _writers.get(self.key)
        if writer is not None:  # this process is writing it: read it whole
            writer.join()
        return self.cache.read(self.key)

    def write_behind(self, params) -> None:
        """`write` on a thread, so that the load returns while the entry is
        written (hundreds of MB, most of a cold load's second once the
        conversion is native). Not a daemon: the process waits for it at exit
        rather than leave the next start nothing to read; a later `read` of
        the same entry in this process waits for it too."""
        def write():
            try:
                self.write(params)
            finally:
                with _writers_lock:
                    if _writers.get(self.key) is thread:
                        del _writers[self.key]

        thread = threading.Thread(target=write, name="write-prepared-params")
        with _writers_lock:
            _writers[self.key] = thread
        thread.start()

    def write(self, params) -> None:
        try:
            unchanged = self.cache.key(self.path, *self.options) == self.key
        except OSError:
            unchanged = False
        if not unchanged:
            log.warning("not caching the prepared params of %s: the file changed while it loaded", self.path)
            return
        self.cache.write(self.key, params)
