"""The attention implementations the backends choose from, behind one helper.

A step's attention over the paged pool (models/attention.py's interface) is
always the same three moves: write the step's new K/V into the donated pool,
hand the query rows and the layer's pools to an implementation, shape the
result back. `over_paged_pool` does the first and last once; an
implementation is only `kernel(q, k, v, pools, layer_index) -> out`, with

    q      [T, H, D] (a flattened step: decode rows and prompt chunks), or
           [S, R, H, D] for a step of exactly R rows per sequence
           (speculative verification; `rows`=R)
    k, v   the step's new K/V [T, KV, D] (already in the pool)
    pools  (k_pool, v_pool, k_scales, v_scales), scales None for a float pool

A Pallas decode or verify step on one device skips the first move for a
float pool: `pallas_decode_over_pool` hands q, k and v to the decode kernel
as one array, which writes k and v into the pool itself (two kernels a layer
fewer on a GPU: the scatters, and q's own fusion, see paged_decode_attention.py).

The implementations (named by the `attention` option, resolved once by the
backend's with_attention, backends/xla.py):

    "reference"  the plain-jnp tiled references of models/paged_attention.py
    "pallas"     pallas_kernels/ (the GPU backend's default; in interpret
                 mode off a GPU, for tests)
    "native"     the CPU backend's C++ kernel (backends/cpu.py)
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxinfer.models.attention import AttentionFn
from jaxinfer.models.kv_cache import as_fp8, is_quantized
from jaxinfer.models.paged_attention import (PagedAttentionMetadata, multi_query_attention_reference,
                                             paged_attention_reference, stored_kv, write_new_kv)
from jaxinfer.parallel.attention import shard_heads

# Accepted for one release: the names of the old attention_backend option.
# "xla" meant the platform's own non-Pallas attention (the native kernel on
# CPU, the reference elsewhere): backends resolve it themselves.
ATTENTION_ALIASES = {"jnp": "reference", "pallas_interpret": "pallas"}
ATTENTION_NAMES = ("reference", "native", "pallas")


def check_attention_name(name: str | None) -> str | None:
    """The option as given, if it is a known name or alias (None: the backend's default)."""
    if name is not None and name not in (*ATTENTION_NAMES, *ATTENTION_ALIASES, "xla"):
        raise ValueError(f"attention must be one of {ATTENTION_NAMES} (older names {('xla', *ATTENTION_ALIASES)} "
                         f"are accepted too), got {name!r}")
    return name


def over_paged_pool(meta: PagedAttentionMetadata, kernel, rows: int | None = None) -> AttentionFn:
    """The model-facing attention (batch dim 1, tokens flattened) running
    `kernel` on the pool after the step's K/V are written into it, in
    place. rows: None for a flattened step, R for R rows per sequence."""

    def attend(q, k, v, kv_cache, layer_index):
        kv_cache, pools = write_new_kv(kv_cache, layer_index, k, v, meta)
        num_tokens, num_heads, head_dim = q.shape[1:]
        query = q[0] if rows is None else q[0].reshape(num_tokens // rows, rows, num_heads, head_dim)
        out = kernel(query, k[0], v[0], pools, layer_index)
        return out.reshape(1, num_tokens, num_heads, head_dim).astype(q.dtype), kv_cache

    return attend


def pallas_decode_over_pool(meta: PagedAttentionMetadata, sliding_window, interpret: bool,
                            rows: int | None = None, split_seqs: int | None = None) -> AttentionFn:
    """A decode step's attention (one new token per sequence; rows=R: a
    verify step's R per sequence), on one device, by the Pallas decode
    kernel writing the step's K/V into a float pool itself; an int8 / fp8
    pool (its scales computed in XLA) as over_paged_pool. split_seqs: the
    sequences the kernel's splits are sized for (default_num_splits; None:
    the step's)."""
    from pallas_kernels.paged_decode_attention import default_num_splits, paged_decode_attention

    written_first = over_paged_pool(meta, pallas_kernel(meta, sliding_window, rows is None, rows, interpret, None),
                                    rows)

    def attend(q, k, v, kv_cache, layer_index):
        if is_quantized(kv_cache):
            return written_first(q, k, v, kv_cache, layer_index)
        k_pool, v_pool = kv_cache
        num_tokens, num_heads, head_dim = q.shape[1:]
        per_seq = rows or 1
        # [1, T, H + 2 KV, D] -> [S, R, ...]: each row's q heads, then its k's, then its v's.
        qkv = jnp.concatenate([q, k.astype(q.dtype), v.astype(q.dtype)], axis=2)
        qkv = qkv.reshape(num_tokens // per_seq, per_seq, -1, head_dim)
        splits = None if split_seqs is None else default_num_splits(split_seqs, k_pool.shape[3])
        out, k_pool, v_pool = paged_decode_attention(qkv, k_pool, v_pool, layer_index, meta.block_tables,
                                                     meta.context_lens, sliding_window=sliding_window, new_kv=True,
                                                     num_splits=splits, interpret=interpret)
        return out.reshape(1, num_tokens, num_heads, head_dim).astype(q.dtype), (k_pool, v_pool)

    return attend


def reference_kernel(meta: PagedAttentionMetadata, sliding_window, rows: int | None = None):
    """The plain-jnp references: paged_attention_reference for a flattened
    step (the step's own K/V taken as stored, not gathered back), the
    multi-query reference for R rows per sequence. GSPMD partitions them
    over a tensor-parallel mesh by itself."""

    def kernel(q, k, v, pools, layer_index):
        k_pool, v_pool, k_scales, v_scales = pools
        if rows is not None:
            return multi_query_attention_reference(q, k_pool, v_pool, layer_index, meta.block_tables,
                                                   meta.context_lens, k_scales=k_scales, v_scales=v_scales,
                                                   sliding_window=sliding_window)
        return paged_attention_reference(q, k_pool, v_pool, meta, sliding_window, layer_index=layer_index,
                                         k_scales=k_scales, v_scales=v_scales,
                                         new_k=stored_kv(k, k_pool.dtype, k_scales is not None),
                                         new_v=stored_kv(v, v_pool.dtype, v_scales is not None))

    return kernel


def pallas_kernel(meta: PagedAttentionMetadata, sliding_window, decode: bool, rows: int | None, interpret: bool,
                  mesh):
    """The Pallas kernels: the split-k decode kernel for a pure decode step
    (`decode`: one row per sequence) and for R rows per sequence, the ragged
    prefill kernel for other steps. On a tensor-parallel mesh they run per
    shard of heads (parallel/attention.py)."""
    # Imported here so that a backend never choosing Pallas never imports it.
    from pallas_kernels.paged_decode_attention import paged_decode_attention
    from pallas_kernels.paged_prefill_attention import paged_prefill_attention

    def per_shard(q, k_pool, v_pool, k_scales, v_scales, layer_index, meta):
        # A CPU fp8 pool is uint8 bits (models/kv_cache.py): viewing it as fp8
        # copies it, which only interpret mode (tests) ever does.
        k_pool, v_pool = as_fp8(k_pool), as_fp8(v_pool)
        if rows is not None or decode:
            per_seq = q if rows is not None else q[:, None]
            out = paged_decode_attention(per_seq, k_pool, v_pool, layer_index, meta.block_tables, meta.context_lens,
                                         k_scales=k_scales, v_scales=v_scales, sliding_window=sliding_window,
                                         interpret=interpret)
            return out if rows is not None else out[:, 0]
        return paged_prefill_attention(q, k_pool, v_pool, layer_index, meta.block_tables, meta.context_lens,
                                       meta.query_start, k_scales=k_scales, v_scales=v_scales,
                                       sliding_window=sliding_window, interpret=interpret)

    sharded = shard_heads(per_shard, mesh)
    return lambda q, k, v, pools, layer_index: sharded(q, *pools, layer_index, meta)
