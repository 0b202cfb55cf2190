"""Multi-host start-up: jax.distributed.initialize from flags or environment.

The choice: every host runs the whole engine in lockstep (JAX's
multi-controller model), not a scheduler on host 0 feeding workers. Each
process is given the same prompts and options, runs the same deterministic
scheduler, block manager and runner, and so calls the same compiled
programs with the same host inputs in the same order; the params and the
KV pool are global arrays sharded over every host's devices, and the
sampled tokens come back replicated, so every host sees every output.
Offline, nothing extra crosses hosts beyond XLA's own collectives (`jaxinfer
serve` adds host 0's word on each step's adds and aborts, step_channel.py,
and heartbeats, peer_watch.py, since only host 0 takes requests). A host-0
scheduler would instead have to broadcast each step's batch (another
collective per step) and keep the workers' programs in sync by hand.

What lockstep requires, and how it fails:
  * identical inputs and options on every host; anything that makes the
    scheduler diverge (a different prompt, an option, a request added on one
    host only) makes the hosts issue different programs, and the collectives
    of the mismatched programs hang or fail; there is no detection beyond
    XLA's collective timeouts.
  * no host-local randomness in scheduling: unseeded sampled requests draw
    their seeds from an engine RNG seeded once from host 0
    (engine_seed), so sampling agrees across hosts.
  * one host dying (or being slower than the coordinator's heartbeat
    timeout) stops the whole job: the others block in a collective until
    jax.distributed's timeout kills them; restart every process.
  * data_parallel_size must be 1 across hosts: a replica whose devices all
    sit on one host could only be driven by that host, and the others could
    not see its outputs. Run one jaxinfer per host (each with its own
    data-parallel replicas) for that.
"""

from __future__ import annotations

import os

ENV = {
    "coordinator_address": "JAX_COORDINATOR_ADDRESS",
    "num_processes": "JAX_NUM_PROCESSES",
    "process_id": "JAX_PROCESS_ID",
}


def distributed_args(coordinator_address=None, num_processes=None, process_id=None, environ=None) -> dict | None:
    """The jax.distributed.initialize arguments from flags, falling back to the
    environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID);
    None when neither names a coordinator (a single-host run)."""
    environ = os.environ if environ is None else environ
    given = {"coordinator_address": coordinator_address, "num_processes": num_processes, "process_id": process_id}
    values = {k: v if v is not None else environ.get(ENV[k]) for k, v in given.items()}
    if values["coordinator_address"] is None:
        extra = [k for k in ("num_processes", "process_id") if values[k] is not None]
        if extra:
            raise ValueError(f"{', '.join(extra)} given without a coordinator address "
                             f"(--coordinator-address or {ENV['coordinator_address']})")
        return None
    for key in ("num_processes", "process_id"):
        if values[key] is None:
            raise ValueError(f"a multi-host run needs {key} (--{key.replace('_', '-')} or {ENV[key]})")
        try:
            values[key] = int(values[key])
        except ValueError:
            raise ValueError(f"{key} must be an integer, got {values[key]!r}") from None
    if values["num_processes"] < 1 or not 0 <= values["process_id"] < values["num_processes"]:
        raise ValueError(f"process_id must lie in [0, num_processes): got {values['process_id']} of "
                         f"{values['num_processes']}")
    return values


def initialize(coordinator_address=None, num_processes=None, process_id=None) -> bool:
    """Call jax.distributed.initialize when a coordinator is named (flags or
    environment); must run before anything else touches JAX's devices.
    Returns whether it did."""
    args = distributed_args(coordinator_address, num_processes, process_id)
    if args is None:
        return False
    import jax

    jax.distributed.initialize(**args)
    return True


def check_data_parallel_hosts(data_parallel_size: int) -> None:
    import jax

    if data_parallel_size > 1 and jax.process_count() > 1:
        raise ValueError("data_parallel_size > 1 is not supported across hosts (see jaxinfer/parallel/"
                         "distributed.py); run one jaxinfer per host, or use tensor parallelism across hosts")


def engine_seed() -> int | None:
    """Seed for the engine's RNG of unseeded requests: None (fresh entropy) on
    one host; host 0's draw, broadcast to all, in a multi-host run."""
    import jax

    if jax.process_count() == 1:
        return None
    import numpy as np
    from jax.experimental import multihost_utils

    seed = np.random.default_rng().integers(2**31, dtype=np.int64)
    return int(multihost_utils.broadcast_one_to_all(seed))
