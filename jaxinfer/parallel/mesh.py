"""Device meshes for tensor and data parallelism.

Tensor parallelism (TP) runs one model over a mesh with a single axis,
"model", of tensor_parallel_size devices: the params and the KV pool are
sharded over it (sharding.py) and XLA's SPMD partitioner (GSPMD) inserts the
all-reduces. Data parallelism (DP) is data_parallel_size independent engine
replicas, each on its own TP mesh over a disjoint group of devices
(engine/data_parallel.py spreads requests over them): replica r gets devices [r * tp, (r + 1) * tp)
of jax.devices(). Replicas rather than a "data" mesh axis because each
replica keeps its own scheduler, block manager and paged pool, so they
never wait on each other's batch shapes or block tables, and one replica's
program is exactly the TP program (see README.md, "Multi-device").

Device order: jax.devices() lists devices by process, then by local id;
consecutive groups of tp devices stay inside one host when tp divides the
devices per host, so a replica's all-reduces ride the intra-host links
(NVLink) whenever it fits in one host.

Context parallelism (CP, context_parallel_size=C > 1) adds a second axis,
"context", in front: the mesh is (C, tp) devices, axes ("context", "model").
The params are split over "model" only (so they are replicated over
"context"), the KV pool's block axis is split over "context" (each device
owns a contiguous range of physical blocks, engine/block_ownership.py), and
attention runs as ring attention (models/ring_attention.py). With C == 1 the
mesh stays the plain ("model",) one, so a TP-only run is exactly as before.
"""

from __future__ import annotations

import numpy as np
from jax.sharding import Mesh

MODEL_AXIS = "model"
CONTEXT_AXIS = "context"


def tensor_parallel_size(mesh) -> int:
    """Devices the params are split over (the "model" axis); 1 without a mesh."""
    return 1 if mesh is None else mesh.shape[MODEL_AXIS]


def context_parallel_size(mesh) -> int:
    """Devices the sequence (the KV pool's blocks) is split over; 1 without a "context" axis."""
    return 1 if mesh is None or CONTEXT_AXIS not in mesh.axis_names else mesh.shape[CONTEXT_AXIS]


def check_parallel_sizes(tensor_parallel_size: int, data_parallel_size: int, num_devices: int,
                         context_parallel_size: int = 1) -> None:
    for name, value in (("tensor_parallel_size", tensor_parallel_size), ("data_parallel_size", data_parallel_size),
                        ("context_parallel_size", context_parallel_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if 16 % context_parallel_size:
        # Prompt steps split their token rows evenly over the context axis, and
        # the smallest token bucket is 16 rows (engine/compiled_programs.py).
        raise ValueError(f"context_parallel_size must divide 16 (1, 2, 4, 8 or 16), got {context_parallel_size}")
    needed = tensor_parallel_size * data_parallel_size * context_parallel_size
    if needed > num_devices:
        raise ValueError(
            f"context_parallel_size {context_parallel_size} x "
            f"tensor_parallel_size {tensor_parallel_size} x data_parallel_size {data_parallel_size} needs {needed} "
            f"devices, but JAX sees {num_devices} (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N "
            f"before JAX starts)"
        )


def replica_meshes(tensor_parallel_size: int = 1, data_parallel_size: int = 1, devices=None,
                   context_parallel_size: int = 1) -> list[Mesh]:
    """One ("model",) mesh of tensor_parallel_size devices per DP replica, over
    disjoint consecutive groups of `devices` (default jax.devices()); with
    context_parallel_size C > 1, a (C, tp) ("context", "model") mesh per
    replica, the tp devices of one context shard consecutive (TP's all-reduces
    are the chattier collectives, so they get the nearest devices)."""
    import jax

    devices = list(jax.devices() if devices is None else devices)
    check_parallel_sizes(tensor_parallel_size, data_parallel_size, len(devices), context_parallel_size)
    tp, cp = tensor_parallel_size, context_parallel_size
    size = tp * cp
    groups = [np.array(devices[r * size:(r + 1) * size]) for r in range(data_parallel_size)]
    if cp == 1:
        return [Mesh(group, (MODEL_AXIS,)) for group in groups]
    return [Mesh(group.reshape(cp, tp), (CONTEXT_AXIS, MODEL_AXIS)) for group in groups]
