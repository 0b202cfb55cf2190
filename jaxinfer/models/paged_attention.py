"""Attention over the paged KV cache: its metadata, the write of a step's
new K/V into the pool, and the plain-jnp references every kernel is tested
against. Which implementation a step runs (this reference, the Pallas
kernels, the CPU's native kernel) is the backend's choice
(jaxinfer/backends/attention.py).

The engine flattens a step's tokens from many sequences into one row
(prefill chunks and decode tokens together). Its cache is one pool of blocks
per layer, (k_pool, v_pool) each [layers, num_blocks, block_size, KV, D], plus
(k_scales, v_scales) [layers, num_blocks, block_size, KV] for int8 / fp8 caches
(see models/kv_cache.py); a sequence's tokens live in the blocks its block
table lists, token i at block table[i // block_size], slot i % block_size.
Block 0 is the null block that padding points at.

Per-token metadata (PagedAttentionMetadata):
    slot_mapping [T]   flat pool slot (block * block_size + offset) each new token's K/V goes to
    positions    [T]   position of each token in its sequence
    token_seq    [T]   which batch sequence each token belongs to
    block_tables [S, max_blocks]  (padded with the null block)
    context_lens [S]   tokens in each sequence's cache after this step
    query_start  [S+1] sequence s's new tokens are rows query_start[s]:query_start[s+1]
                       (a sequence's tokens are contiguous; padding rows come last)

A token attends to its sequence's cached positions <= its own, which makes a
prefill chunk causal with the mask aligned bottom-right (query i of a chunk
of q_len sits at position context_len - q_len + i) and lets decode tokens and
chunks share one call. Keys are visited a tile of blocks at a time with an
online softmax, so memory stays O(T * tile) rather than O(T * context), and
the loop stops at the longest context in the batch.

A verification step (speculative decoding) has another layout: exactly
R = 1 + K rows per sequence (its last token and its drafts).
`multi_query_attention_reference` serves it (the backends' "reference"),
which gathers each tile once per sequence rather than once per row; both
references share the tile gather (`gather_tile`) and the online softmax.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.models.attention import AttentionFn
from jaxinfer.models.kv_cache import as_fp8, is_quantized, quantize_kv


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedAttentionMetadata:
    slot_mapping: jax.Array
    positions: jax.Array
    token_seq: jax.Array
    block_tables: jax.Array
    context_lens: jax.Array
    query_start: jax.Array


# The references compute in float32 and their dots say so: on a GPU, JAX's
# default runs a float32 dot as TF32 (10-bit mantissas).
FLOAT32 = jax.lax.Precision.HIGHEST

# The step's new rows attend to each other as one [T, T] product (masked to
# their own sequence), which grows with the square of the flattened step: up to
# this many rows it is cheaper than gathering a tile per row (a 512-token
# prefill's [512, 512] scores are ~9 MB a layer); past it, every key comes from
# the pool as before.
MAX_DENSE_NEW_TOKENS = 1024


def paged_attention_reference(q, k_pool, v_pool, meta: PagedAttentionMetadata, sliding_window=None, tile_blocks=8,
                              layer_index=None, k_scales=None, v_scales=None, new_k=None, new_v=None):
    """q [T, H, D]; k_pool, v_pool [num_blocks, block_size, KV, D] -> [T, H, D].

    With `layer_index`, the pools are the whole cache [layers, num_blocks, ...]
    and tiles are gathered straight from it: slicing out the layer first
    would copy the layer's entire pool every step. int8 / fp8 pools (fp8 as
    uint8 bits on CPU, see models/kv_cache.py) come with their per-token
    scales [(layers,) num_blocks, block_size, KV]; each gathered tile is
    dequantized, so only a tile is ever held in float32.
    Tokens whose sequence has context_len 0 (padding) get zeros.

    new_k, new_v [T, KV, D]: the step's own K/V as the pool holds them
    (stored_kv), given when they are already in the pool. For steps of up to
    MAX_DENSE_NEW_TOKENS rows, keys at or after a sequence's first new
    position then come from them, all T x T at once (masked to the same
    sequence and causally), and tiles are gathered only for the keys cached
    before the step: a fresh prompt gathers nothing, where gathering a tile
    per query token cost a 512-token prefill O(tokens x context) copies.
    """
    quantized = k_scales is not None
    if quantized != (v_scales is not None):
        raise ValueError("give both k_scales and v_scales or neither")
    if layer_index is None:
        k_pool, v_pool, layer_index = k_pool[None], v_pool[None], 0
        if quantized:
            k_scales, v_scales = jnp.asarray(k_scales)[None], jnp.asarray(v_scales)[None]
    q, k_pool, v_pool = jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool)
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_pool.shape[2], k_pool.shape[3]
    group = num_heads // num_kv_heads
    q = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32) * head_dim**-0.5
    # Pad the tables to whole tiles with the null block (masked by position anyway).
    max_blocks = meta.block_tables.shape[1]
    padded_blocks = -(-max_blocks // tile_blocks) * tile_blocks
    tables = jnp.pad(meta.block_tables, ((0, 0), (0, padded_blocks - max_blocks)))[meta.token_seq]  # [T, blocks]
    tile_tokens = tile_blocks * block_size
    positions = meta.positions
    valid_query = meta.context_lens[meta.token_seq] > 0
    stats_shape = (num_tokens, num_kv_heads, group)
    if new_k is None or num_tokens > MAX_DENSE_NEW_TOKENS:
        cached_end = positions + 1  # every key, the token's own included, comes from the pool
        init = None
    else:
        # Sequence s's new rows are query_start[s]:query_start[s + 1], at positions
        # context_len - q_len onwards; rows past query_start[-1] are padding.
        q_lens = meta.query_start[1:] - meta.query_start[:-1]
        cached_end = (meta.context_lens - q_lens)[meta.token_seq]
        real_key = jnp.arange(num_tokens) < meta.query_start[-1]
        mask = ((meta.token_seq[:, None] == meta.token_seq[None, :]) & real_key[None, :]
                & (positions[None, :] <= positions[:, None]) & valid_query[:, None])
        if sliding_window is not None:
            mask &= positions[:, None] - positions[None, :] < sliding_window
        scores = jnp.einsum("tkgd,skd->tkgs", q, new_k.astype(jnp.float32), precision=FLOAT32)
        scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
        empty = (jnp.full(stats_shape, -jnp.inf, jnp.float32), jnp.zeros(stats_shape, jnp.float32),
                 jnp.zeros((*stats_shape, head_dim), jnp.float32))
        init = online_softmax_update(*empty, scores, lambda probs: jnp.einsum("tkgs,skd->tkgd", probs,
                                                                               new_v.astype(jnp.float32),
                                                                               precision=FLOAT32))
    cached_end = jnp.where(valid_query, cached_end, 0)
    num_tiles = (jnp.max(cached_end) + tile_tokens - 1) // tile_tokens

    def visit_tile(tile, carry):
        running_max, denom, acc = carry
        blocks = jax.lax.dynamic_slice_in_dim(tables, tile * tile_blocks, tile_blocks, axis=1)  # [T, tb]
        k, v = gather_tile(k_pool, v_pool, k_scales, v_scales, layer_index, blocks)
        key_pos = tile * tile_tokens + jnp.arange(tile_tokens)
        mask = key_pos[None, :] < cached_end[:, None]
        if sliding_window is not None:
            mask &= positions[:, None] - key_pos[None, :] < sliding_window
        scores = jnp.einsum("tkgd,tskd->tkgs", q, k, precision=FLOAT32)
        scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
        # Slots past a context (tail of its last block, null block) may hold
        # anything, NaN included (in the values or the scales), and 0 * NaN is
        # NaN: zero them out of V after dequantizing.
        v = jnp.where(mask[:, :, None, None], v, 0)
        return online_softmax_update(running_max, denom, acc, scores,
                                     lambda probs: jnp.einsum("tkgs,tskd->tkgd", probs, v, precision=FLOAT32))

    out = _online_softmax(visit_tile, num_tiles, stats_shape, head_dim, init)
    return out.reshape(num_tokens, num_heads, head_dim)


def multi_query_attention_reference(q, k_pool, v_pool, layer_index, block_tables, context_lens, *, k_scales=None,
                                    v_scales=None, sliding_window=None, tile_blocks: int = 8):
    """q [S, R, H, D]: R query rows per sequence, row i at position
    context_len - R + i; pools [layers, blocks, block_size, KV, D] -> [S, R, H, D] (float32).

    The layout of a verification step (the last token and K drafts per
    sequence). paged_attention_reference serves it too, but gathers the
    context once per row; here each tile is gathered once per sequence and
    all its rows attend to it. context_len 0 (padding) gives zeros.
    """
    q, k_pool, v_pool = jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool)
    if k_scales is not None:
        k_scales, v_scales = jnp.asarray(k_scales), jnp.asarray(v_scales)
    num_seqs, rows, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_pool.shape[2], k_pool.shape[3]
    group = num_heads // num_kv_heads
    q = q.reshape(num_seqs, rows, num_kv_heads, group, head_dim).astype(jnp.float32) * head_dim**-0.5
    max_blocks = block_tables.shape[1]
    padded_blocks = -(-max_blocks // tile_blocks) * tile_blocks
    tables = jnp.pad(block_tables, ((0, 0), (0, padded_blocks - max_blocks)))  # null block: masked anyway
    tile_tokens = tile_blocks * block_size
    num_tiles = (jnp.max(context_lens) + tile_tokens - 1) // tile_tokens
    query_pos = context_lens[:, None] - rows + jnp.arange(rows)[None, :]  # [S, R]

    def visit_tile(tile, carry):
        running_max, denom, acc = carry
        blocks = jax.lax.dynamic_slice_in_dim(tables, tile * tile_blocks, tile_blocks, axis=1)  # [S, tb]
        k, v = gather_tile(k_pool, v_pool, k_scales, v_scales, layer_index, blocks)
        key_pos = tile * tile_tokens + jnp.arange(tile_tokens)
        in_context = key_pos[None, :] < context_lens[:, None]  # [S, T]
        mask = (key_pos[None, None, :] <= query_pos[:, :, None]) & in_context[:, None, :]  # [S, R, T]
        if sliding_window is not None:
            mask &= query_pos[:, :, None] - key_pos[None, None, :] < sliding_window
        # As above: slots past a context may hold NaN, and 0 * NaN would leak into the sum.
        v = jnp.where(in_context[:, :, None, None], v, 0.0)
        scores = jnp.einsum("srkgd,stkd->srkgt", q, k, precision=FLOAT32)
        scores = jnp.where(mask[:, :, None, None, :], scores, -jnp.inf)
        return online_softmax_update(running_max, denom, acc, scores,
                                     lambda probs: jnp.einsum("srkgt,stkd->srkgd", probs, v, precision=FLOAT32))

    out = _online_softmax(visit_tile, num_tiles, (num_seqs, rows, num_kv_heads, group), head_dim)
    return out.reshape(num_seqs, rows, num_heads, head_dim)


def gather_tile(k_pool, v_pool, k_scales, v_scales, layer_index, blocks):
    """K and V of the blocks `blocks` [N, tile_blocks] of one layer as float32
    [N, tile_blocks * block_size, KV, D], dequantized with their per-token
    scales for an int8 / fp8 pool (fp8 stored as uint8 bits on CPU is viewed
    as fp8 first, models/kv_cache.py). Only a tile is ever held in float32."""
    num_kv_heads, head_dim = k_pool.shape[3:]
    shape = (blocks.shape[0], -1, num_kv_heads, head_dim)

    def read(pool, scales):
        return _as_float32(pool[layer_index, blocks], None if scales is None else scales[layer_index, blocks])

    return read(k_pool, k_scales).reshape(shape), read(v_pool, v_scales).reshape(shape)


def _as_float32(values, scales):
    """Stored K or V [..., D] as float32: fp8 bits viewed as fp8, times the
    per-token scales [...] of a quantized pool. The one rule for reading the
    pool back, shared by gather_tile and stored_kv."""
    x = as_fp8(values).astype(jnp.float32)
    return x if scales is None else x * scales[..., None]


def _online_softmax(visit_tile, num_tiles, stats_shape, head_dim, init=None):
    """Run visit_tile over num_tiles tiles from `init` (default: empty
    statistics) and normalize; rows that saw no key (padding) give zeros."""
    if init is None:
        init = (
            jnp.full(stats_shape, -jnp.inf, jnp.float32),
            jnp.zeros(stats_shape, jnp.float32),
            jnp.zeros((*stats_shape, head_dim), jnp.float32),
        )
    _, denom, acc = jax.lax.fori_loop(0, num_tiles, visit_tile, init)
    return jnp.where(denom[..., None] > 0, acc / jnp.where(denom > 0, denom, 1.0)[..., None], 0.0)


def online_softmax_update(running_max, denom, acc, scores, weighted_values):
    """One tile of online softmax: fold masked `scores` (-inf where hidden;
    keys on the last axis) into the running max, denominator and accumulator;
    weighted_values(probs) is probs times the tile's values. Rows with nothing
    visible yet keep max -inf and are shifted by 0, avoiding inf - inf."""
    new_max = jnp.maximum(running_max, scores.max(-1))
    safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
    probs = jnp.exp(scores - safe_max[..., None])
    correction = jnp.exp(jnp.where(jnp.isfinite(running_max), running_max - safe_max, -jnp.inf))
    denom = denom * correction + probs.sum(-1)
    acc = acc * correction[..., None] + weighted_values(probs)
    return new_max, denom, acc


def write_kv(kv_cache, layer_index, k, v, slot_mapping):
    """Scatter the new tokens' K/V [T, KV, D] into their slots of one layer,
    in place on the donated cache (pools [layers, blocks, block_size, KV, D]).
    An int8 / fp8 cache gets the quantized values and their per-token scales."""
    k_pool, v_pool = kv_cache[:2]
    block_size = k_pool.shape[2]
    block, offset = slot_mapping // block_size, slot_mapping % block_size

    def write(pool, values):
        """pool[layer_index, block[t], offset[t]] = values[t] for each new token t."""
        if slot_mapping.shape[0] == 1:
            # One token (a batch-1 decode step): XLA makes a one-index scatter
            # a dynamic-update-slice guarded by a bounds check (read the old
            # row, select, write: three kernels a pool on a GPU). The slot is
            # in bounds (padding writes into the null block): write it directly.
            start = (layer_index, block[0], offset[0]) + (0,) * (pool.ndim - 3)
            return jax.lax.dynamic_update_slice(pool, values.astype(pool.dtype)[None, None], start)
        return pool.at[layer_index, block, offset].set(values.astype(pool.dtype))

    if not is_quantized(kv_cache):
        return write(k_pool, k), write(v_pool, v)
    k_scales, v_scales = kv_cache[2:]
    k_q, k_scale = quantize_kv(k, k_pool.dtype)
    v_q, v_scale = quantize_kv(v, v_pool.dtype)
    return write(k_pool, k_q), write(v_pool, v_q), write(k_scales, k_scale), write(v_scales, v_scale)


def stored_kv(x, storage_dtype, quantized: bool):
    """New K or V [T, KV, D] as float32 with exactly the value the pool now
    holds for it (as gather_tile would read it back): rounded to the pool's
    dtype, or quantized with its per-token scale and dequantized."""
    if not quantized:
        return _as_float32(x.astype(storage_dtype), None)
    return _as_float32(*quantize_kv(x, storage_dtype))


def write_new_kv(kv_cache, layer_index, k, v, meta: PagedAttentionMetadata):
    """Write the step's new K/V [1, T, KV, D] first (in place, donated), then
    hand the layer's attention (k_pool, v_pool, k_scales, v_scales); scales
    are None for a float pool."""
    kv_cache = write_kv(kv_cache, layer_index, k[0], v[0], meta.slot_mapping)
    scales = kv_cache[2:] if is_quantized(kv_cache) else (None, None)
    return kv_cache, (*kv_cache[:2], *scales)
