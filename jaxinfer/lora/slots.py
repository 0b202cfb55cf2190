"""The adapters on the device: fixed-size stacked buffers with `max_loras`
slots, filled and evicted LRU, so loading an adapter never recompiles.

Per adapted weight (wq, wk, wv, wo, w_gate, w_up, w_down), two buffers that
ride in the params' `layers` dict, stacked over layers like every other
per-layer weight (the forward's lax.scan slices them per layer):

    layers/lora/<target> = (A [L, in, max_loras, max_lora_rank],
                            B [L, max_loras, max_lora_rank, out])

The slot number of a request is 0 for "no adapter" and 1..max_loras for
buffer index slot - 1: slot 0 is all zeros by construction (models/lora.py
gives its tokens a zero mask) instead of a stored slot of zeros that every
step would multiply through. Shapes depend only on (max_loras, max_lora_rank)
and the model, so adapters come and go by writing one slot's rows (a jitted
dynamic update with the slot index as an argument and the buffers donated,
compiled once at start-up). Every target gets buffers whatever an adapter
adapts: a target an adapter leaves alone is written as zeros.

Slots are pinned while any running sequence uses them; an unpinned slot keeps
its adapter until the least recently released one is needed for another
adapter. Host copies of every registered adapter stay, so reloading an
evicted adapter reads no file.

Tensor parallelism: A and B are split like the base weight they add to. For a
column-parallel weight (wq wk wv w_gate w_up, output split) B is split on
its output axis and A is replicated, so each device computes its own output
columns; for a row-parallel weight (wo w_down, input split) A is split on its
input axis and B replicated, so x A is a partial sum that GSPMD all-reduces
before B (r columns, not the output's width). K/V heads repeated over devices
(parallel/sharding.py's rule) repeat B's output columns the same way.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.lora.adapter import AdapterError, LoRAAdapter, load_adapter, target_shapes
from jaxinfer.lora.request import LoRARequest

KV_TARGETS = ("wk", "wv")


def _write(buffers, index, new):
    """Slot `index`'s rows of every buffer <- new (A [L, in, r], B [L, r, out] per target)."""
    return {key: (a.at[:, :, index].set(new[key][0].astype(a.dtype)),
                  b.at[:, index].set(new[key][1].astype(b.dtype))) for key, (a, b) in buffers.items()}


class LoRASlots:
    """max_loras device slots over any number of registered (host) adapters.

    config: the config the model runs with (its buffers' shapes);
    checkpoint_config: the checkpoint's (what an adapter's shapes are checked
    against; they differ only in KV heads repeated for tensor parallelism)."""

    def __init__(self, config: ModelConfig, checkpoint_config: ModelConfig, max_loras: int, max_lora_rank: int,
                 dtype, mesh=None):
        if not isinstance(max_loras, int) or max_loras < 1:
            raise ValueError(f"max_loras must be an int >= 1, got {max_loras!r}")
        if not isinstance(max_lora_rank, int) or max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be an int >= 1, got {max_lora_rank!r}")
        self.config = config
        self.checkpoint_config = checkpoint_config
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.mesh = mesh
        self.adapters: dict[int, LoRAAdapter] = {}  # host copies, by lora_int_id
        self._slot_of: dict[int, int] = {}  # resident lora_int_id -> slot
        self._id_in_slot: list[int | None] = [None] * (max_loras + 1)
        self._pins = [0] * (max_loras + 1)
        self._never_used = list(range(1, max_loras + 1))
        self._unpinned: OrderedDict[int, None] = OrderedDict()  # resident, unused: least recently released first
        self.num_loads = 0
        self.load_time = 0.0  # seconds writing slots

        L, S, r = config.num_layers, max_loras, max_lora_rank
        shapes = target_shapes(config)
        shardings = self._shardings() if mesh is not None else None
        self.buffers = {}
        for key, (fan_in, fan_out) in shapes.items():
            a = jnp.zeros((L, fan_in, S, r), dtype)
            b = jnp.zeros((L, S, r, fan_out), dtype)
            if shardings is not None:
                a, b = jax.device_put(a, shardings[key][0]), jax.device_put(b, shardings[key][1])
            self.buffers[key] = (a, b)
        self._write = jax.jit(_write, donate_argnums=0, out_shardings=shardings)
        self._zeros = {key: (np.zeros((L, i, r), np.float32), np.zeros((L, r, o), np.float32))
                       for key, (i, o) in shapes.items()}
        # Compile the slot write now (slot 1 stays zeros), not when the first adapter arrives.
        self._write_slot(1, self._zeros)

    def _shardings(self):
        from jax.sharding import NamedSharding, PartitionSpec as P

        from jaxinfer.parallel.mesh import MODEL_AXIS
        from jaxinfer.parallel.sharding import COLUMN_PARALLEL

        out_split = (P(), P(None, None, None, MODEL_AXIS))
        in_split = (P(None, MODEL_AXIS, None, None), P())
        return {key: tuple(NamedSharding(self.mesh, s) for s in (out_split if key in COLUMN_PARALLEL else in_split))
                for key in target_shapes(self.config)}

    # -- host copies -----------------------------------------------------------
    def register(self, request: LoRARequest) -> LoRAAdapter:
        """The host copy of a request's adapter, read and checked on first
        sight; raises AdapterError (a RequestError) if it cannot be served."""
        if not isinstance(request, LoRARequest):
            raise AdapterError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        known = self.adapters.get(request.lora_int_id)
        if known is not None:
            if (known.name, known.path) != (request.lora_name, str(request.lora_path)):
                raise AdapterError(f"lora_int_id {request.lora_int_id} is already adapter {known.name!r} "
                                   f"({known.path}); give {request.lora_name!r} another id")
            return known
        adapter = load_adapter(request.lora_name, request.lora_int_id, request.lora_path, self.checkpoint_config,
                               self.max_lora_rank)
        self.adapters[request.lora_int_id] = adapter
        return adapter

    # -- device slots ----------------------------------------------------------
    def acquire(self, lora_int_id: int) -> int | None:
        """Pin the adapter's slot, loading it into a free or the least
        recently released slot if it is not resident; None when every slot
        is pinned by other adapters (the request waits)."""
        slot = self._slot_of.get(lora_int_id)
        if slot is None:
            if self._never_used:
                slot = self._never_used.pop(0)
            elif self._unpinned:
                slot, _ = self._unpinned.popitem(last=False)
                del self._slot_of[self._id_in_slot[slot]]
            else:
                return None
            self._load(slot, self.adapters[lora_int_id])
            self._slot_of[lora_int_id] = slot
            self._id_in_slot[slot] = lora_int_id
        self._unpinned.pop(slot, None)
        self._pins[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        self._pins[slot] -= 1
        if self._pins[slot] == 0:
            self._unpinned[slot] = None

    def resident(self) -> dict[int, int]:
        """lora_int_id -> slot of the adapters on the device now."""
        return dict(self._slot_of)

    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        start = time.perf_counter()
        new = dict(self._zeros)
        new.update(adapter.weights)
        if self.config.num_kv_heads != self.checkpoint_config.num_kv_heads:
            from jaxinfer.parallel.sharding import expand_kv_heads

            heads = self.checkpoint_config.num_kv_heads
            repeat = self.config.num_kv_heads // heads
            for key in KV_TARGETS:
                a, b = new[key]
                new[key] = (a, expand_kv_heads(b, heads, repeat))
        self._write_slot(slot, new)
        self.num_loads += 1
        self.load_time += time.perf_counter() - start

    def _write_slot(self, slot: int, new: dict) -> None:
        if self.mesh is not None:
            from jaxinfer.parallel.placement import replicate

            new = replicate(new, self.mesh)
        self.buffers = self._write(self.buffers, np.int32(slot - 1), new)
        jax.block_until_ready(self.buffers)


__all__ = ["AdapterError", "LoRASlots"]
