"""Platforms as backends: everything platform-specific, chosen once at load.

    xla.py        XlaBackend: the interface, and the plain XLA reference (any platform)
    cpu.py        CpuBackend: the native C++ kernels (jaxinfer/native/), scan over stacked weights
    gpu.py        GpuBackend: the Pallas kernels (pallas_kernels/), unrolled over per-layer weights
    attention.py  the attention implementations they choose from (reference, Pallas), behind one helper
    host_memory.py  a CPU engine's host memory settings

`choose_backend` picks one from the platform the model runs on; load()
stores it on the Model, and the engine's programs take it as a static
argument with the `attention` option applied (with_attention).
"""

from __future__ import annotations

import jax

from jaxinfer.backends.cpu import CpuBackend
from jaxinfer.backends.gpu import GpuBackend
from jaxinfer.backends.xla import XlaBackend

__all__ = ["CpuBackend", "GpuBackend", "XlaBackend", "backend_class", "choose_backend"]


def backend_class(platform: str | None = None) -> type[XlaBackend]:
    """The backend of `platform` (default: JAX's default backend)."""
    platform = platform or jax.default_backend()
    return {"cpu": CpuBackend, "gpu": GpuBackend}.get(platform, XlaBackend)


def choose_backend(mesh=None, allow_tf32: bool = False) -> XlaBackend:
    """The backend of a model on `mesh` (None: the default device): the
    platform's, with its default attention. allow_tf32: the opt-in to TF32
    dots for a float32 model off CPU (see with_dtype, which load() applies
    once the dtype is known)."""
    platform = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
    cls = backend_class(platform)
    # GSPMD cannot split a custom call: the backends' own kernels run on one device only.
    one_device_only = {CpuBackend: "native", GpuBackend: "residual_in_norm"}.get(cls)
    fields = {one_device_only: mesh is None} if one_device_only else {}
    return cls(allow_tf32=allow_tf32, **fields)
