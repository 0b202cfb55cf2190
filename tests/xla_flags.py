"""The XLA flags the tests run under, and the environment of a test's child
process that needs several (virtual) CPU devices.

The suite compiles at LLVM's lowest optimization level
(--xla_backend_optimization_level=0). Most of a test's time on CPU is XLA
compiling tiny programs that then run for milliseconds, and a large part of
that is LLVM optimizing their machine code (the suite's work is a fifth less
at level 0; level 1 saves less, since compilation outweighs what its faster
code gains back). The level changes no program the tests check: the
optimized HLO (fusion, layouts, sharding, the collectives the parallel tests
count) is the product's; only how the fused loops become machine code differs.
One test runs real starts of the engine at the product's own level against
transformers (test_executable_cache.py, through product_level), and a run
that names a level in XLA_FLAGS keeps it:
XLA_FLAGS=--xla_backend_optimization_level=3 (XLA's default) bash scripts/test.sh tests the
product's level throughout."""

import os

LEVEL_FLAG = "--xla_backend_optimization_level"
SUITE_LEVEL = f"{LEVEL_FLAG}=0"
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def with_suite_level(flags: str) -> str:
    """XLA_FLAGS with the suite's optimization level, unless it names a level."""
    return flags if LEVEL_FLAG in flags else f"{flags} {SUITE_LEVEL}".strip()


def product_level(env: dict) -> dict:
    """`env` with XLA's default optimization level (the suite's flag removed)."""
    flags = [f for f in env.get("XLA_FLAGS", "").split() if f != SUITE_LEVEL]
    return {**env, "XLA_FLAGS": " ".join(flags)}


def cpu_devices_env(devices: int, **extra: str) -> dict:
    """The parent's environment (so the suite's flags and JAXINFER_WARMUP
    reach the child) on the CPU with `devices` host devices, no persistent
    compilation cache, and `extra` on top."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXINFER_DISABLE_COMPILATION_CACHE": "1", **extra}
    return {**env, "XLA_FLAGS": with_device_count(env.get("XLA_FLAGS", ""), devices)}


def with_device_count(flags: str, devices: int) -> str:
    """XLA_FLAGS giving the CPU `devices` host devices (any other count dropped)."""
    kept = [f for f in flags.split() if not f.startswith(DEVICE_COUNT_FLAG)]
    return " ".join([*kept, f"{DEVICE_COUNT_FLAG}={devices}"])
