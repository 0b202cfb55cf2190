"""Putting host tensors and per-layer weights straight into their shards.

`put` hands each addressable device only its slice of a host array (with a
memory-mapped safetensors source, only that slice is ever read), through
jax.make_array_from_callback, which is also what multi-host runs need: each
process supplies the slices of its own devices. `stack` joins per-layer
sharded arrays into the stacked [layers, ...] parameter with one jitted
concatenation whose output sharding equals its inputs' on the other axes, so
every device stacks its own slices and nothing moves between devices.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxinfer.parallel.mesh import tensor_parallel_size



def put(array: np.ndarray, sharding, dtype=None) -> jax.Array:
    """A host array (numpy, memmap or a view of one) -> a global array with
    `sharding`; each device's slice is cut, cast and copied on its own."""
    dtype = np.dtype(dtype or array.dtype)
    return jax.make_array_from_callback(
        tuple(array.shape), sharding, lambda index: np.ascontiguousarray(array[index], dtype=dtype)
    )


def put_tree(tree, shardings):
    """`put` for every numpy leaf of a pytree (e.g. a QuantizedTensor with numpy parts)."""
    return jax.tree_util.tree_map(put, tree, shardings)


@functools.lru_cache(maxsize=None)
def _stacker(out_sharding_tree):
    return jax.jit(lambda *xs: jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), *xs),
                   out_shardings=out_sharding_tree.value)


class Hashable:
    """A pytree of shardings as an lru_cache key (its leaves and structure hash)."""

    def __init__(self, value):
        self.value = value
        self._key = tuple(jax.tree_util.tree_leaves(value)), jax.tree_util.tree_structure(value)

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return self._key == other._key


def stack(per_layer: list, stacked_shardings):
    """Per-layer (sharded) arrays or QuantizedTensors -> one stacked along a new
    leading layer axis, placed with `stacked_shardings` (same tree)."""
    return _stacker(Hashable(stacked_shardings))(*per_layer)


def drop_layer_axis(sharding: NamedSharding) -> NamedSharding:
    """The sharding of one layer's slice of a stacked parameter."""
    return NamedSharding(sharding.mesh, P(*tuple(sharding.spec)[1:]))


def layer_shardings(stacked_shardings):
    return jax.tree_util.tree_map(drop_layer_axis, stacked_shardings)


def shard_params(params: dict, mesh) -> dict:
    """Device params -> their declared shardings on `mesh` (parallel/sharding.py),
    device to device; a no-op for leaves already placed so."""
    from jaxinfer.parallel.sharding import named, param_specs

    return jax.device_put(params, named(param_specs(params, tensor_parallel_size(mesh)), mesh))


def expand_kv_params(params: dict, num_kv_heads: int, mesh) -> dict:
    """Repeat the KV heads of wk / wv / bk / bv on the device (the KV-head rule),
    straight into their declared shardings: each device computes only its
    own heads, from a replicated copy of the (small) unexpanded weight."""
    from jaxinfer.parallel.sharding import expand_kv_weight, kv_head_replication, named, param_specs

    r = kv_head_replication(num_kv_heads, tensor_parallel_size(mesh))
    if r == 1:
        return params
    layers = dict(params["layers"])
    for key in ("wk", "wv", "bk", "bv"):
        if key in layers:
            fn = functools.partial(expand_kv_weight, num_kv_heads=num_kv_heads, replication=r)
            shape = jax.eval_shape(fn, layers[key])
            out = named(param_specs({"layers": {key: shape}}, tensor_parallel_size(mesh)), mesh)["layers"][key]
            layers[key] = jax.jit(fn, out_shardings=out)(layers[key])
    return {**params, "layers": layers}


def replicate(tree, mesh):
    """Host inputs (numpy leaves, the same on every process) -> replicated global arrays on `mesh`.
    One process: one device_put of the whole tree. Several (multi-host lockstep):
    each process fills its own devices from its own copy."""
    sharding = NamedSharding(mesh, P())
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)
    return jax.tree_util.tree_map(lambda x: put(np.asarray(x), sharding), tree)
