"""What host 0's per-step word costs a lockstep step, on one machine.

`python -m jaxinfer.parallel.step_channel_bench [STEPS]` starts two processes
(jax.distributed on 127.0.0.1, one CPU device each, gloo) and times STEPS
iterations of a stand-in step (a tiny all-reduce over both processes'
devices, as a TP step's collectives join the hosts) alone, then preceded by
host 0's message through the key-value store (step_channel.py), empty and
with one request's worth of bytes, then through broadcast_one_to_all of a
fixed 4 KiB buffer. Prints one JSON line per variant from host 0.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import time

BUFFER = 4096


def _worker(steps: int) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxinfer.parallel.step_channel import StepReader, StepWriter, kv_client

    from jaxinfer.parallel.distributed import initialize

    initialize()  # from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID
    leader = jax.process_index() == 0
    mesh = Mesh(np.array(jax.devices()), ("x",))
    ones = jax.make_array_from_callback((len(jax.devices()),), NamedSharding(mesh, P("x")),
                                        lambda index: np.ones(1, np.float32))
    step = jax.jit(lambda x: jnp.sum(x), out_shardings=NamedSharding(mesh, P()))

    def collective():
        return float(step(ones))

    request = pickle.dumps([("add", "cmpl-1-0", list(range(512)), {"max_tokens": 256, "temperature": 0.7},
                             None, 0)])
    client = kv_client()
    writer, reader = StepWriter(client), StepReader(client)

    def kv(message):
        def run():
            if leader:
                writer.publish(message)
            else:
                assert reader.receive() == message
            collective()
            if leader:
                writer.stepped()
        return run

    def broadcast(message):
        buffer = np.zeros(BUFFER, np.uint8)
        if leader:
            buffer[:4] = np.frombuffer(np.uint32(len(message)).tobytes(), np.uint8)
            buffer[4:4 + len(message)] = np.frombuffer(message, np.uint8)

        def run():
            got = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
            size = int(got[:4].view(np.uint32)[0])
            assert got[4:4 + size].tobytes() == message
            collective()
        return run

    variants = {"step alone": collective, "kv empty": kv(b""), f"kv {len(request)} B": kv(request),
                "broadcast empty": broadcast(b""), f"broadcast {len(request)} B": broadcast(request)}
    for name, run in variants.items():
        for _ in range(20):  # warm: compilation, connections
            run()
        multihost_utils.sync_global_devices(name)
        start = time.perf_counter()
        for _ in range(steps):
            run()
        elapsed = time.perf_counter() - start
        if leader:
            print(json.dumps({"variant": name, "steps": steps, "us_per_step": round(elapsed / steps * 1e6, 1)}),
                  flush=True)


def main(steps: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for process_id in range(2):
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
               "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
               "JAX_PROCESS_ID": str(process_id)}
        procs.append(subprocess.Popen([sys.executable, "-m", __spec__.name, "--worker", str(steps)], env=env))
    for p in procs:
        p.wait(timeout=600)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(int(sys.argv[2]))
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000)
