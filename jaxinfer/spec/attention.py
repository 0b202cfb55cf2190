"""Attention of a verification step: R = 1 + K query rows per sequence (the
last token and the drafts), row i at position context_len - R + i, over the
paged KV cache.

The general paged attention (models/paged_attention.py) serves this layout
too, but its plain-jnp backend gathers the cache per query token, so R rows
of one sequence gather the same context R times; here the "xla" backend
gathers each sequence's context once per tile and attends all its rows to
it (measured on the 2-core CPU: see BENCHMARKS.md). The Pallas backends run
the decode kernel, which takes a few query tokens per sequence in exactly
this layout (pallas_kernels/paged_decode_attention.py).

Row positions are implied by context_len, as in the decode kernel, so a
sequence with fewer drafts than K pads its rows at the end (their K/V go to
the null block, their outputs are ignored) and counts them in context_len;
a real row never sees them (they come after it). The new K/V are written
into the donated pool first, as in the general path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.models.attention import AttentionFn
from jaxinfer.models.kv_cache import is_quantized
from jaxinfer.models.paged_attention import PagedAttentionMetadata, online_softmax_update, write_kv
from jaxinfer.parallel.attention import shard_heads


def multi_query_attention_reference(q, k_pool, v_pool, layer_index, block_tables, context_lens, *, k_scales=None,
                                    v_scales=None, sliding_window=None, tile_blocks: int = 8):
    """q [S, R, H, D]; pools [layers, blocks, block_size, KVH, D] -> [S, R, H, D] (float32).

    Tiles of tile_blocks blocks are gathered per sequence and visited with an
    online softmax, up to the longest context. context_len 0 (padding) gives zeros.
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
        shape = (num_seqs, tile_tokens, num_kv_heads, head_dim)
        k = k_pool[layer_index, blocks].reshape(shape).astype(jnp.float32)
        v = v_pool[layer_index, blocks].reshape(shape).astype(jnp.float32)
        if k_scales is not None:
            k = k * k_scales[layer_index, blocks].reshape(*shape[:3], 1)
            v = v * v_scales[layer_index, blocks].reshape(*shape[:3], 1)
        key_pos = tile * tile_tokens + jnp.arange(tile_tokens)
        in_context = key_pos[None, :] < context_lens[:, None]  # [S, T]
        mask = (key_pos[None, None, :] <= query_pos[:, :, None]) & in_context[:, None, :]  # [S, R, T]
        if sliding_window is not None:
            mask &= query_pos[:, :, None] - key_pos[None, None, :] < sliding_window
        # Slots past a context may hold anything; 0 * NaN would leak into the sum.
        v = jnp.where(in_context[:, :, None, None], v, 0.0)
        scores = jnp.einsum("srkgd,stkd->srkgt", q, k)
        scores = jnp.where(mask[:, :, None, None, :], scores, -jnp.inf)
        return online_softmax_update(running_max, denom, acc, scores,
                                     lambda probs: jnp.einsum("srkgt,stkd->srkgd", probs, v))

    stats_shape = (num_seqs, rows, num_kv_heads, group)
    init = (
        jnp.full(stats_shape, -jnp.inf, jnp.float32),
        jnp.zeros(stats_shape, jnp.float32),
        jnp.zeros((*stats_shape, head_dim), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(0, num_tiles, visit_tile, init)
    out = jnp.where(denom[..., None] > 0, acc / jnp.where(denom > 0, denom, 1.0)[..., None], 0.0)
    return out.reshape(num_seqs, rows, num_heads, head_dim)


def verification_attention(meta: PagedAttentionMetadata, rows: int, sliding_window=None,
                           backend: str = "xla", mesh=None) -> AttentionFn:
    """The model-facing attention of a verification step (batch dim 1, the
    S * rows tokens flattened sequence-major). mesh: as in
    models/paged_attention.py (the Pallas kernel then runs per shard)."""

    def kernel(q, k_pool, v_pool, k_scales, v_scales, layer_index, meta):
        from pallas_kernels.paged_decode_attention import paged_decode_attention

        return paged_decode_attention(q, k_pool, v_pool, layer_index, meta.block_tables, meta.context_lens,
                                      k_scales=k_scales, v_scales=v_scales, sliding_window=sliding_window,
                                      interpret=backend == "pallas_interpret")

    def attend(q, k, v, kv_cache, layer_index):
        kv_cache = write_kv(kv_cache, layer_index, k[0], v[0], meta.slot_mapping)
        k_pool, v_pool = kv_cache[:2]
        k_scales, v_scales = kv_cache[2:] if is_quantized(kv_cache) else (None, None)
        num_tokens, num_heads, head_dim = q.shape[1:]
        per_seq = q[0].reshape(num_tokens // rows, rows, num_heads, head_dim)
        if backend == "xla":
            out = multi_query_attention_reference(per_seq, k_pool, v_pool, layer_index, meta.block_tables,
                                                  meta.context_lens, k_scales=k_scales, v_scales=v_scales,
                                                  sliding_window=sliding_window)
        else:
            out = shard_heads(kernel, mesh)(per_seq, k_pool, v_pool, k_scales, v_scales, layer_index, meta)
        return out.reshape(1, num_tokens, num_heads, head_dim).astype(q.dtype), kv_cache

    return attend
