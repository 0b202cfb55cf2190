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
"""

from __future__ import annotations

import numpy as np
from jax.sharding import Mesh

MODEL_AXIS = "model"


def check_parallel_sizes(tensor_parallel_size: int, data_parallel_size: int, num_devices: int) -> None:
    for name, value in (("tensor_parallel_size", tensor_parallel_size), ("data_parallel_size", data_parallel_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    needed = tensor_parallel_size * data_parallel_size
    if needed > num_devices:
        raise ValueError(
            f"tensor_parallel_size {tensor_parallel_size} x data_parallel_size {data_parallel_size} needs {needed} "
            f"devices, but JAX sees {num_devices} (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N "
            f"before JAX starts)"
        )


def replica_meshes(tensor_parallel_size: int = 1, data_parallel_size: int = 1, devices=None) -> list[Mesh]:
    """One ("model",) mesh of tensor_parallel_size devices per DP replica, over
    disjoint consecutive groups of `devices` (default jax.devices())."""
    import jax

    devices = list(jax.devices() if devices is None else devices)
    check_parallel_sizes(tensor_parallel_size, data_parallel_size, len(devices))
    tp = tensor_parallel_size
    return [Mesh(np.array(devices[r * tp:(r + 1) * tp]), (MODEL_AXIS,)) for r in range(data_parallel_size)]
