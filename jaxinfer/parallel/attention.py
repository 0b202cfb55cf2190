"""Attention kernels under tensor parallelism: run per shard with shard_map.

A Pallas kernel is an opaque custom call to XLA's SPMD partitioner, which
would gather its sharded operands onto every device (the whole KV pool!)
and run it replicated. shard_map instead hands each device its own query
heads [.., H / N, D] and its own KV heads of the pool
[layers, blocks, block_size, KV / N, D] (plus their scales), and the
kernel runs unchanged on them: a device's query heads read exactly its KV
heads, because heads are split in contiguous groups and the KV-head rule
(sharding.py) makes KV / N >= 1 with the GQA grouping preserved. No
communication happens inside attention; the row-parallel wo that follows
does the one all-reduce. The block tables, context lengths and other
metadata are replicated. The "xla" backend needs none of this: it is plain
jnp, which GSPMD partitions over the same head axis by itself.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from jaxinfer.parallel.mesh import MODEL_AXIS


def shard_heads(kernel, mesh):
    """kernel(q, k_pool, v_pool, k_scales, v_scales, layer_index, meta) -> out shaped like q,
    with q [..., H, D] (heads second to last) and k_scales / v_scales None for a float pool
    -> the same function running `kernel` on each device's heads."""
    if mesh is None:
        return kernel

    def run(q, k_pool, v_pool, k_scales, v_scales, layer_index, meta):
        heads = P(*([None] * (q.ndim - 2)), MODEL_AXIS, None)
        pool, scales = P(None, None, None, MODEL_AXIS, None), P(None, None, None, MODEL_AXIS)
        quantized = k_scales is not None

        def local(q, k_pool, v_pool, layer_index, meta, *scale_arrays):
            ks, vs = scale_arrays if quantized else (None, None)
            return kernel(q, k_pool, v_pool, ks, vs, layer_index, meta)

        in_specs = (heads, pool, pool, P(), P()) + ((scales, scales) if quantized else ())
        args = (q, k_pool, v_pool, layer_index, meta) + ((k_scales, v_scales) if quantized else ())
        # check_vma off: pallas_call does not declare how its outputs vary over the mesh.
        return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=heads, check_vma=False)(*args)

    return run
