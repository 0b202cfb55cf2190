"""Attention behind one interface, so the paged cache and Pallas kernels can
replace the implementation without touching the model code.

The model calls `attention(q, k, v, kv_cache, layer_index) -> (out, kv_cache)`
once per layer, where q is [B, T, num_heads, head_dim], k/v are the new
tokens' [B, T, num_kv_heads, head_dim], `kv_cache` is whatever the
implementation keeps for all layers (None for a cache-free full-sequence
forward) and `layer_index` is a traced int32 scalar.
Everything else an implementation needs (positions, lengths, block tables) is
bound when it is constructed, outside the layer scan.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, Any, jax.Array], tuple[jax.Array, Any]]


def attention_reference(q, k, v, q_positions, k_positions, k_valid=None, sliding_window=None):
    """Plain-jnp scaled dot-product attention with GQA and a position-based mask.

    q: [B, T, H, D]; k, v: [B, S, KV, D]; q_positions [B, T]; k_positions [B, S];
    k_valid [B, S] marks real keys. A query attends to keys at positions <= its
    own (and within `sliding_window` of it). Scores and softmax in float32.
    """
    batch, q_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    # Group query heads by the KV head they share instead of repeating K/V.
    q = q.reshape(batch, q_len, num_kv_heads, num_heads // num_kv_heads, head_dim)
    # float32 inputs are multiplied in float32 (on a GPU, JAX's default is TF32).
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32, precision=precision)
    scores = scores * (head_dim**-0.5)
    mask = k_positions[:, None, :] <= q_positions[:, :, None]  # [B, T, S]
    if sliding_window is not None:
        mask &= q_positions[:, :, None] - k_positions[:, None, :] < sliding_window
    if k_valid is not None:
        mask &= k_valid[:, None, :]
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    # A fully masked row (a padding query) would give NaN; give it zeros.
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(mask.any(-1)[:, None, None, :, None], probs, 0.0)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32,
                     precision=precision)
    return out.reshape(batch, q_len, num_heads, head_dim).astype(q.dtype)


def full_sequence_attention(positions, sliding_window=None) -> AttentionFn:
    """Causal self-attention over the tokens of the call itself (no cache)."""

    def attend(q, k, v, kv_cache, layer_index):
        return attention_reference(q, k, v, positions, positions, sliding_window=sliding_window), kv_cache

    return attend
