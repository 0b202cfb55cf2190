"""Ring attention over a paged KV pool split across devices (context parallelism).

Ring attention (Liu, Zaharia, Abbeel, 2023) splits the sequence over the
devices of a ring; K/V blocks travel around it while every device runs
blockwise attention with an online softmax. Here the engine's layout shapes
it: a step is a flattened row of T tokens from many sequences, and the KV
pool [layers, blocks, block_size, KV, D] has its block axis split over the
mesh's "context" axis, C devices, device c owning the physical blocks
[c * B, (c + 1) * B) (engine/block_ownership.py). Everything below runs under
shard_map over ("context", "model"): each device sees its own blocks of the
pool and, with tensor parallelism beside it, its own heads.

Prompt steps ("mixed" layout, T a multiple of C): the token rows, and so the
whole residual stream, are split over "context" in C contiguous chunks of
T / C rows; device c holds chunk c's queries and new K/V. Two rings:

  1. New K/V ring. C rounds; in round s device c holds the new K/V of chunk
     j = (c - s) mod C: it writes the rows whose slots it owns into its pool
     (every chunk visits every device once, so every new row reaches its
     owner with no extra collective), folds chunk j into its queries' online
     softmax (same sequence, causal), and passes the chunk on with one
     ppermute, issued before the fold so the transfer can overlap it.
     Chunks after the device's own (j > c) lie entirely in the future of its
     queries, because a sequence's rows are contiguous and in position
     order: their fold is skipped (lax.cond).
  2. Cached-prefix ring. Keys computed in earlier steps (a previous chunk of
     a long prompt, a prefix-cache hit) stay where they are, in their
     owners' pools; instead, the queries travel (C - 1 ppermutes, each
     issued before the fold it overlaps), every device folds each chunk's
     queries into a partial softmax over the blocks it owns and sends the
     partial, [T / C, H, D + 2] floats, straight to the chunk's device
     (C - 1 more ppermutes, each overlapping the next fold; only the last
     is exposed), where the C partials are merged by log-sum-exp.

Decode steps ("decode" layout, one token per sequence): the rows are few,
so the residual stream is replicated over "context". Each device writes the
new K/V it owns, attends every query to its own blocks only, and the
per-device partials (running max, denominator, accumulator) are merged by
log-sum-exp after one all_gather of those statistics, [C, T, H, D + 2]
floats: no device ever reads another device's K/V.

Load balancing: in the classic single-sequence ring, contiguous chunks
leave device c with c + 1 causal blocks, and a zig-zag order evens that out.
Here a step mixes many ragged sequences whose causal triangles do not align
with the chunks, and only round 1's T / C x T / C blocks are causal; the
cached prefix (round 2) is spread evenly by allocation (each new block goes
to the device with the most room). So chunks stay contiguous, which keeps a
chunk's rows a plain slice of the step; see BENCHMARKS.md.

Float pools only (an int8 / fp8 pool is refused at start-up, engine/config.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxinfer.models.attention import AttentionFn
from jaxinfer.models.paged_attention import PagedAttentionMetadata, gather_tile, online_softmax_update
from jaxinfer.parallel.mesh import CONTEXT_AXIS, MODEL_AXIS, context_parallel_size


def ring_cache_attention(meta: PagedAttentionMetadata, sliding_window=None, decode: bool = False, mesh=None,
                         tile_blocks: int = 8) -> AttentionFn:
    """The model-facing attention of a step on a ("context", "model") mesh
    (the contract of backends/attention.py's over_paged_pool attention; float pool)."""
    num_devices = context_parallel_size(mesh)
    rows = P(None, MODEL_AXIS, None) if decode else P(CONTEXT_AXIS, MODEL_AXIS, None)
    pool = P(None, CONTEXT_AXIS, None, MODEL_AXIS, None)
    local = _decode_local if decode else _prefill_local
    local = functools.partial(local, sliding_window=sliding_window, num_devices=num_devices,
                              tile_blocks=tile_blocks)

    def attend(q, k, v, kv_cache, layer_index):
        if len(kv_cache) != 2:
            raise ValueError("context parallelism needs a float KV cache (kv_cache_dtype='auto')")
        # check_vma off: the fori_loop carries mix device-varying and replicated values.
        out, k_pool, v_pool = jax.shard_map(
            local, mesh=mesh, in_specs=(rows, rows, rows, pool, pool, P(), P()), out_specs=(rows, pool, pool),
            check_vma=False,
        )(q[0], k[0], v[0], *kv_cache, layer_index, meta)
        return out[None].astype(q.dtype), (k_pool, v_pool)

    return attend


# -- per device ------------------------------------------------------------------------------


def _decode_local(q, k, v, k_pool, v_pool, layer_index, meta, *, sliding_window, num_devices, tile_blocks):
    """q [T, H, D] (all rows), k, v [T, KV, D]; this device's pools -> (out [T, H, D], pools)."""
    first, per_device = _my_blocks(k_pool)
    k_pool, v_pool = _write_owned(k_pool, v_pool, layer_index, k, v, meta.slot_mapping, first, per_device)
    num_kv_heads = k_pool.shape[3]
    qs = _scaled(q, num_kv_heads)
    owned = _owned_blocks(meta.block_tables, first, per_device, tile_blocks)
    valid = meta.context_lens[meta.token_seq] > 0
    key_end = jnp.where(valid, meta.positions + 1, 0)  # the token's own K/V is in the pool already
    stats = _fold_pool(_empty(qs), qs, k_pool, v_pool, layer_index, owned, meta.token_seq, key_end, meta.positions,
                       sliding_window, tile_blocks)
    # The one collective: every device's (acc, max, denom), merged by log-sum-exp.
    gathered = jax.lax.all_gather(_pack_stats(stats), CONTEXT_AXIS)  # [C, T, KV, G, D + 2]
    head_dim = q.shape[-1]
    merged = _merge_all(gathered[..., -2], gathered[..., -1], gathered[..., :head_dim])
    return _normalize(merged).reshape(q.shape), k_pool, v_pool


def _prefill_local(q, k, v, k_pool, v_pool, layer_index, meta, *, sliding_window, num_devices, tile_blocks):
    """q [T / C, H, D], k, v [T / C, KV, D]: this device's chunk of the step's rows."""
    c = jax.lax.axis_index(CONTEXT_AXIS)
    chunk = q.shape[0]
    first, per_device = _my_blocks(k_pool)
    num_kv_heads, head_dim = k_pool.shape[3:]
    qs = _scaled(q, num_kv_heads)

    def rows_of(x, j):
        return jax.lax.dynamic_slice_in_dim(x, j * chunk, chunk)

    valid = meta.context_lens[meta.token_seq] > 0
    perm = [(i, (i + 1) % num_devices) for i in range(num_devices)]

    # Round 1: the step's new K/V travel; each device folds them into its own queries.
    my_seq, my_pos, my_valid = rows_of(meta.token_seq, c), rows_of(meta.positions, c), rows_of(valid, c)
    num_real = meta.query_start[-1]
    stats = _empty(qs)
    kv = jnp.concatenate([k, v], axis=-1)  # one ppermute per round carries both
    for step in range(num_devices):
        j = (c - step) % num_devices
        if step < num_devices - 1:
            kv_next = jax.lax.ppermute(kv, CONTEXT_AXIS, perm)  # in flight while this round computes
        k_j, v_j = kv[..., :head_dim], kv[..., head_dim:]
        k_pool, v_pool = _write_owned(k_pool, v_pool, layer_index, k_j, v_j, rows_of(meta.slot_mapping, j), first,
                                      per_device)
        # The values the pool now holds (rounded to its dtype), as a single device reads them back.
        k_j, v_j = k_j.astype(k_pool.dtype).astype(jnp.float32), v_j.astype(v_pool.dtype).astype(jnp.float32)

        def fold_new(stats, k_j=k_j, v_j=v_j, j=j):
            key_seq, key_pos = rows_of(meta.token_seq, j), rows_of(meta.positions, j)
            real_key = j * chunk + jnp.arange(chunk) < num_real
            mask = ((my_seq[:, None] == key_seq[None, :]) & real_key[None, :]
                    & (key_pos[None, :] <= my_pos[:, None]) & my_valid[:, None])
            if sliding_window is not None:
                mask &= my_pos[:, None] - key_pos[None, :] < sliding_window
            scores = jnp.einsum("tkgd,skd->tkgs", qs, k_j)
            scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
            return online_softmax_update(*stats, scores, lambda probs: jnp.einsum("tkgs,skd->tkgd", probs, v_j))

        # A later chunk is entirely in the future of this device's rows: skip it.
        stats = jax.lax.cond(j <= c, fold_new, lambda stats: stats, stats)
        if step < num_devices - 1:
            kv = kv_next

    # Round 2: keys cached before this step stay in their owners' pools; the
    # queries travel instead. Each device folds every chunk's queries into a
    # partial softmax over the blocks it owns (its own chunk's starting from
    # round 1's statistics). Nothing waits on a fold but the last partial:
    # the next chunk's queries are sent before the fold (they do not depend on
    # it), in the model's dtype (scaled to float32 on arrival, as the
    # single-device path does), and each finished partial is sent straight to
    # its chunk's device (a ppermute by `step` places), so it travels while
    # the next fold runs. Passing the statistics around with the queries would
    # put every one of the C transfers behind a fold.
    q_lens = meta.query_start[1:] - meta.query_start[:-1]
    cached_end = jnp.where(valid, (meta.context_lens - q_lens)[meta.token_seq], 0)
    owned = _owned_blocks(meta.block_tables, first, per_device, tile_blocks)
    q_j, received = q, []
    for step in range(num_devices):
        j = (c - step) % num_devices
        if step < num_devices - 1:
            q_next = jax.lax.ppermute(q_j, CONTEXT_AXIS, perm)
        start = stats if step == 0 else _empty(qs)  # step 0 is this device's own chunk (j == c)
        partial = _fold_pool(start, _scaled(q_j, num_kv_heads), k_pool, v_pool, layer_index, owned,
                             rows_of(meta.token_seq, j), rows_of(cached_end, j), rows_of(meta.positions, j),
                             sliding_window, tile_blocks)
        home = [(i, (i - step) % num_devices) for i in range(num_devices)]  # chunk j's device is c - step
        received.append(_pack_stats(partial) if step == 0 else
                        jax.lax.ppermute(_pack_stats(partial), CONTEXT_AXIS, home))
        if step < num_devices - 1:
            q_j = q_next
    # received[s]: the partial of this device's chunk over device c + s's blocks.
    received = jnp.stack(received)  # [C, T / C, KV, G, D + 2]
    merged = _merge_all(received[..., -2], received[..., -1], received[..., :head_dim])
    return _normalize(merged).reshape(q.shape), k_pool, v_pool


# -- pieces ----------------------------------------------------------------------------------


def _my_blocks(k_pool):
    """(first physical block id, blocks) of this device's share of the pool."""
    per_device = k_pool.shape[1]
    return jax.lax.axis_index(CONTEXT_AXIS) * per_device, per_device


def _write_owned(k_pool, v_pool, layer_index, k, v, slot_mapping, first, per_device):
    """Write the rows whose slot lies in this device's blocks; the others are
    dropped here (their owner writes them)."""
    block_size = k_pool.shape[2]
    local = slot_mapping // block_size - first
    local = jnp.where((local >= 0) & (local < per_device), local, per_device)  # out of bounds: dropped
    offset = slot_mapping % block_size
    k_pool = k_pool.at[layer_index, local, offset].set(k.astype(k_pool.dtype), mode="drop")
    v_pool = v_pool.at[layer_index, local, offset].set(v.astype(v_pool.dtype), mode="drop")
    return k_pool, v_pool


def _owned_blocks(block_tables, first, per_device, tile_blocks):
    """This device's blocks of each sequence, in table (= position) order:
    (local ids [S, N], logical block indices [S, N], count [S]), N padded to
    whole tiles. Block 0 (padding of the tables, the null block) is never owned."""
    owned = (block_tables >= first) & (block_tables < first + per_device) & (block_tables != 0)
    order = jnp.argsort(jnp.logical_not(owned), axis=1, stable=True)  # owned first, order kept
    local = jnp.take_along_axis(block_tables, order, axis=1) - first
    count = owned.sum(axis=1)
    width = block_tables.shape[1]
    padded = -(-width // tile_blocks) * tile_blocks
    local = jnp.where(jnp.arange(width)[None, :] < count[:, None], local, 0)
    pad = ((0, 0), (0, padded - width))
    return jnp.pad(local, pad), jnp.pad(order, pad), count


def _fold_pool(stats, q, k_pool, v_pool, layer_index, owned, row_seq, key_end, positions, sliding_window,
               tile_blocks):
    """Fold into row r's statistics the keys at positions < key_end[r] of its
    sequence that lie in this device's blocks (a tile of blocks at a time)."""
    local, logical, count = owned
    block_size = k_pool.shape[2]
    local, logical, count = local[row_seq], logical[row_seq], count[row_seq]  # [R, N], [R, N], [R]
    num_rows = q.shape[0]
    # Owned blocks are in position order, so the ones starting before key_end are a prefix.
    listed = jnp.arange(local.shape[1])[None, :] < count[:, None]
    needed = jnp.sum(listed & (logical * block_size < key_end[:, None]), axis=1)
    num_tiles = (jnp.max(needed) + tile_blocks - 1) // tile_blocks
    tile_tokens = tile_blocks * block_size

    def visit_tile(tile, stats):
        blocks = jax.lax.dynamic_slice_in_dim(local, tile * tile_blocks, tile_blocks, axis=1)  # [R, tb]
        logi = jax.lax.dynamic_slice_in_dim(logical, tile * tile_blocks, tile_blocks, axis=1)
        in_list = tile * tile_blocks + jnp.arange(tile_blocks)[None, :] < needed[:, None]
        k, v = gather_tile(k_pool, v_pool, None, None, layer_index, blocks)  # [R, tile_tokens, KV, D]
        key_pos = (logi[:, :, None] * block_size + jnp.arange(block_size)).reshape(num_rows, tile_tokens)
        mask = jnp.repeat(in_list, block_size, axis=1) & (key_pos < key_end[:, None])
        if sliding_window is not None:
            mask &= positions[:, None] - key_pos < sliding_window
        scores = jnp.einsum("rkgd,rskd->rkgs", q, k)
        scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
        # Slots past a context may hold anything (NaN included); 0 * NaN is NaN.
        v = jnp.where(mask[:, :, None, None], v, 0.0)
        return online_softmax_update(*stats, scores, lambda probs: jnp.einsum("rkgs,rskd->rkgd", probs, v))

    return jax.lax.fori_loop(0, num_tiles, visit_tile, stats)


def _scaled(q, num_kv_heads):
    """[R, H, D] -> float32 [R, KV, G, D], times 1 / sqrt(D)."""
    rows, heads, head_dim = q.shape
    return q.reshape(rows, num_kv_heads, heads // num_kv_heads, head_dim).astype(jnp.float32) * head_dim**-0.5


def _empty(qs):
    shape = qs.shape[:-1]
    return (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32), jnp.zeros(qs.shape, jnp.float32))


def _pack_stats(stats):
    """(max, denom, acc) -> one array [..., D + 2], so a collective moves them together."""
    running_max, denom, acc = stats
    return jnp.concatenate([acc, running_max[..., None], denom[..., None]], axis=-1)


def _merge_all(running_max, denom, acc):
    """Log-sum-exp merge of partial statistics stacked on axis 0."""
    total_max = running_max.max(axis=0)
    safe = jnp.where(jnp.isfinite(total_max), total_max, 0.0)
    weight = jnp.exp(jnp.where(jnp.isfinite(running_max), running_max - safe, -jnp.inf))
    return total_max, (denom * weight).sum(axis=0), (acc * weight[..., None]).sum(axis=0)


def _normalize(stats):
    _, denom, acc = stats
    return jnp.where(denom[..., None] > 0, acc / jnp.where(denom > 0, denom, 1.0)[..., None], 0.0)
