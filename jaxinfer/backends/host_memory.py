"""Host memory settings of a CPU engine (the CPU backend's start_engine)."""

from __future__ import annotations

import os

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


def available_host_bytes() -> int:
    """Memory the host can still give this process without swapping: the
    kernel's MemAvailable (free memory plus the page cache it can drop), or
    the free pages where /proc/meminfo is not there."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
