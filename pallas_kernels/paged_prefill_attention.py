"""Blockwise (flash) prefill attention of ragged query chunks over the paged KV
cache, as a Pallas kernel for the Triton GPU lowering, beside its plain-jnp
reference.

Layout (the engine's, fixed):
  q             [T, H, D]        flattened query rows; sequence s owns rows
                                 query_start[s] : query_start[s + 1]. Rows at or
                                 past query_start[S] (and before query_start[0])
                                 are padding and come out as zeros.
  query_start   [S + 1] int32    nondecreasing; q_len 0 means no rows.
  context_lens  [S] int32        cached tokens including this chunk; query i of a
                                 chunk of q_len sits at position
                                 context_len - q_len + i (causal mask aligned
                                 bottom-right). A whole prompt, a later chunk of
                                 a chunked prefill, a prefix-cache hit
                                 (context > q_len) and a decode token (q_len 1)
                                 all mix freely in one call.
  k_pool/v_pool [L, N, B, KVH, D] one pool for all layers, read in place at
                                 layer_index; block 0 is the null block.
  k/v_scales    [L, N, B, KVH]   float32 per-token scales for int8 / fp8 pools,
                                 applied inside the kernel.
  block_tables  [S, max_blocks]  position p of sequence s lives in block
                                 block_tables[s, p // B], slot p % B.

GQA mapping: one program owns one KV head and block_q *query rows*, where a row
is a (token, q head) pair of that KV head's group: row r is token r // group of
the tile and head kv_head * group + r % group. So a tile holds
block_q // group tokens, all of one sequence. Why pack the group rather than
run one q head per program:
  * K/V tiles are read once per group instead of once per q head (a group-fold
    cut in the dominant memory traffic for long cached contexts);
  * a decode token (q_len 1) or a short chunk still fills `group` rows of the
    dot instead of 1 row of a mostly-empty block_q tile;
  * the tokens of a tile stay contiguous, so the causal skip (below) is as
    fine-grained as with per-head programs of block_q // group tokens.
Rows past (block_q // group) * group are dummies (masked), so a group of 3 with
block_q 64 wastes 1 row of 64, not the quarter that padding the group to 4 would.

Ragged batches on a fixed grid: grid = (num_tiles, KVH) with the static
num_tiles = cdiv(T, tokens_per_tile) + min(S, T), an upper bound on
sum_s cdiv(q_len_s, tokens_per_tile). The tile list (sequence, first row,
token count, first position) is computed in jnp from query_start outside the
kernel; tiles never cross sequences and unused tiles have 0 tokens and do
nothing. Each tile stores only its own rows (masked store); rows nobody owns
(padding) are zeroed by a where() after the call.
The grid and the output follow the step's query rows and sequences only; the
block table is read in place, never padded, and its width (max_model_len)
sizes nothing but itself, while the keys walked follow each tile's context.

Algorithm per program: load the q tile once, then an online softmax (exp2,
float32 statistics) over KV tiles of block_kv tokens. The loop range is
dynamic: it stops at the tile containing the last query's position (tiles
entirely above the causal diagonal are never visited) and, with a sliding
window, starts at the tile containing the first query's earliest visible key.
Every key's block id is read from the block-table ref for its own position, so
a KV tile may span several blocks (block_kv a multiple of block_size) or part
of one (a divisor); any power of two >= 16 works with any block_size. K/V rows
are gathered straight from the full pool at [layer, block_id, slot, kv_head, :]
with all-array indices, so no layer slice is materialized and no loaded value is
reshaped inside the kernel.

Quantized K/V: the tile is cast to the compute dtype (exact for int8 and fp8
into bf16/f32) and the per-token scale is applied to score columns (K) and to
the probabilities before the PV dot (V), which equals dequantizing first.

NaN safety: slots past a context, the null block and other layers may hold
NaN. K/V/scale loads are masked by "key position < end of this tile's keys".
Dead V rows are zeroed with a where() after the cast to the compute dtype (not
other=, which would put an fp8 constant in the Triton IR), so no NaN meets a
zero probability; dead K rows only reach their own score columns, which the
where() that forces invisible scores to -inf discards. The running max is
replaced by 0 while still -inf, and rows that saw no key divide by 1, not 0.

Float32 inputs use IEEE dots (precision HIGHEST); the Triton default would be
TF32, which is far less accurate than the float32 reference.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._common import MIN_DOT_DIM, check_kv_pool, defaults_for, is_power_of_two, next_power_of_two

# Per head_dim: (block_q rows, block_kv tokens, num_warps, num_stages).
# 64 query rows keep short chunks and decode tokens from wasting most of a tile
# while still amortizing each K/V tile over 64 rows; the float32 accumulator
# [block_q, D] plus the q tile fit 4 warps' registers up to D = 128, and D = 256
# halves both tiles for the same reason. A GPU session should tune these.
_DEFAULTS_BY_HEAD_DIM = {
    64: (64, 64, 4, 2),
    128: (64, 64, 4, 2),
    256: (32, 32, 4, 2),
}
_LOG2_E = math.log2(math.e)


def _num_q_tiles(num_rows: int, num_seqs: int, tokens_per_tile: int) -> int:
    # Each sequence with q_len > 0 wastes at most one partial tile, and at most
    # min(S, T) sequences have rows.
    return pl.cdiv(num_rows, tokens_per_tile) + min(num_seqs, num_rows)


def _build_q_tiles(query_start, context_lens, tokens_per_tile: int, num_tiles: int):
    """Tile list for the fixed grid, in jnp: for each tile its sequence, first
    q row, number of tokens (0 for unused tiles) and the position of its first
    token. Tiles of a sequence are consecutive and never cross sequences."""
    query_start = query_start.astype(jnp.int32)
    num_seqs = context_lens.shape[0]
    q_lens = jnp.maximum(query_start[1:] - query_start[:-1], 0)
    tiles_per_seq = (q_lens + tokens_per_tile - 1) // tokens_per_tile
    tile_end = jnp.cumsum(tiles_per_seq)
    tile_ids = jnp.arange(num_tiles, dtype=jnp.int32)
    # First sequence whose tiles end after this tile id (skips q_len 0 sequences).
    tile_seq = jnp.searchsorted(tile_end, tile_ids, side="right").astype(jnp.int32)
    used = tile_seq < num_seqs
    tile_seq = jnp.minimum(tile_seq, num_seqs - 1)
    tile_in_seq = tile_ids - (tile_end - tiles_per_seq)[tile_seq]
    first_offset = tile_in_seq * tokens_per_tile
    tile_first_row = query_start[tile_seq] + first_offset
    tile_num_tokens = jnp.where(used, jnp.clip(q_lens[tile_seq] - first_offset, 0, tokens_per_tile), 0)
    tile_first_pos = context_lens.astype(jnp.int32)[tile_seq] - q_lens[tile_seq] + first_offset
    tile_first_row = jnp.where(used, tile_first_row, 0)
    tile_first_pos = jnp.where(used, tile_first_pos, 0)
    return tile_seq, tile_first_row, tile_num_tokens.astype(jnp.int32), tile_first_pos


def _prefill_kernel(
    tile_seq_ref,  # [num_tiles] int32
    tile_first_row_ref,  # [num_tiles] int32
    tile_num_tokens_ref,  # [num_tiles] int32
    tile_first_pos_ref,  # [num_tiles] int32
    layer_index_ref,  # [1] int32
    block_tables_ref,  # [S, max_blocks] int32
    q_ref,  # [T, H, D]
    k_pool_ref,  # [L, N, B, KVH, D] whole pool
    v_pool_ref,  # [L, N, B, KVH, D] whole pool
    k_scales_ref,  # [L, N, B, KVH] or None
    v_scales_ref,  # [L, N, B, KVH] or None
    out_ref,  # [T, H, D]
    *,
    group: int,
    block_q: int,
    block_kv: int,
    block_size: int,
    sliding_window: int | None,
    compute_dtype,
    precision,
):
    tile, kv_head = pl.program_id(0), pl.program_id(1)
    num_rows_total, _, head_dim = q_ref.shape
    max_blocks = block_tables_ref.shape[1]
    scale_log2 = head_dim**-0.5 * _LOG2_E

    seq = tile_seq_ref[tile]
    first_row = tile_first_row_ref[tile]
    num_tokens = tile_num_tokens_ref[tile]
    first_pos = tile_first_pos_ref[tile]
    layer = layer_index_ref[0]

    # Row r of the tile: token r // group, q head kv_head * group + r % group.
    row = jnp.arange(block_q, dtype=jnp.int32)
    row_token = lax.div(row, group)
    row_head = kv_head * group + lax.rem(row, group)
    # Not clamped: every (token, head) pair of the tile stays distinct, so the
    # masked store never has a dead lane aliasing a live row (interpret mode
    # writes dead lanes back with their old value, and a duplicate index would
    # race with the live write); past-the-end lanes are dropped or masked.
    row_index = first_row + row_token
    # The bound on T only matters for a malformed query_start[S] > T: never write past q.
    row_live = (row_token < num_tokens) & (row_index < num_rows_total)
    row_pos = first_pos + row_token

    q_shape = (block_q, head_dim)
    features = jnp.broadcast_to(jnp.arange(head_dim, dtype=jnp.int32)[None, :], q_shape)
    q_rows = jnp.broadcast_to(row_index[:, None], q_shape)
    q_heads = jnp.broadcast_to(row_head[:, None], q_shape)
    q_live = jnp.broadcast_to(row_live[:, None], q_shape)
    # All-array indices: the gather form both the Triton lowering and interpret
    # mode accept (interpret mode rejects gathers mixed with slices).
    q = plt.load(q_ref.at[q_rows, q_heads, features], mask=q_live, other=0).astype(compute_dtype)

    # Keys this tile can see: [kv_begin, kv_end). kv_end is one past the last
    # query's position, so it never exceeds the context length.
    kv_end = jnp.maximum(first_pos + num_tokens, 0)
    if sliding_window is None:
        kv_begin = jnp.int32(0)
    else:
        kv_begin = jnp.clip(first_pos - sliding_window + 1, 0, kv_end)
    first_kv_tile = lax.div(kv_begin, block_kv)
    end_kv_tile = lax.div(kv_end + block_kv - 1, block_kv)

    key_in_tile = jnp.arange(block_kv, dtype=jnp.int32)
    kv_shape = (block_kv, head_dim)
    kv_features = jnp.broadcast_to(jnp.arange(head_dim, dtype=jnp.int32)[None, :], kv_shape)

    def kv_step(kv_tile, carry):
        acc, row_max, row_sum = carry
        key_pos = kv_tile * block_kv + key_in_tile
        key_live = key_pos < kv_end
        table_index = jnp.minimum(lax.div(key_pos, block_size), max_blocks - 1)
        block_ids = plt.load(block_tables_ref.at[seq, table_index], mask=key_live, other=0)
        slots = lax.rem(key_pos, block_size)

        kv_blocks = jnp.broadcast_to(block_ids[:, None], kv_shape)
        kv_slots = jnp.broadcast_to(slots[:, None], kv_shape)
        kv_live = jnp.broadcast_to(key_live[:, None], kv_shape)
        # No other= for K/V: an fp8 `other` needs an fp8 constant, which the Triton
        # path handles poorly. Dead K rows may hold anything, but a K row only
        # reaches its own score column, which the causal where() below discards.
        k = plt.load(k_pool_ref.at[layer, kv_blocks, kv_slots, kv_head, kv_features], mask=kv_live)
        k = k.astype(compute_dtype)
        scores = lax.dot_general(
            q,
            k,
            (((1,), (1,)), ((), ())),
            precision=precision,
            preferred_element_type=jnp.float32,
        )
        if k_scales_ref is not None:
            # A per-token K scale is constant along the contraction: it scales score columns.
            k_scale = plt.load(k_scales_ref.at[layer, block_ids, slots, kv_head], mask=key_live, other=0.0)
            scores = scores * k_scale[None, :]
        scores = scores * scale_log2

        # key_pos <= row_pos < kv_end for live rows, so this also hides dead keys.
        visible = key_pos[None, :] <= row_pos[:, None]
        if sliding_window is not None:
            visible = visible & (row_pos[:, None] - key_pos[None, :] < sliding_window)
        scores = jnp.where(visible, scores, -jnp.inf)

        new_max = jnp.maximum(row_max, scores.max(axis=1))
        # While a row has seen no visible key its max is -inf; shift by 0 instead.
        shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)
        rescale = jnp.exp2(row_max - shift)
        probs = jnp.exp2(scores - shift[:, None])
        row_sum = row_sum * rescale + probs.sum(axis=1)

        v = plt.load(v_pool_ref.at[layer, kv_blocks, kv_slots, kv_head, kv_features], mask=kv_live)
        # Dead V rows meet probability 0, and 0 * NaN = NaN: zero them.
        v = jnp.where(kv_live, v.astype(compute_dtype), 0)
        if v_scales_ref is not None:
            # A per-token V scale runs along the contraction: fold it into the probabilities.
            v_scale = plt.load(v_scales_ref.at[layer, block_ids, slots, kv_head], mask=key_live, other=0.0)
            probs = probs * v_scale[None, :]
        acc = acc * rescale[:, None] + lax.dot_general(
            probs.astype(compute_dtype),
            v,
            (((1,), (0,)), ((), ())),
            precision=precision,
            preferred_element_type=jnp.float32,
        )
        return acc, new_max, row_sum

    acc = jnp.zeros(q_shape, jnp.float32)
    row_max = jnp.full((block_q,), -jnp.inf, jnp.float32)
    row_sum = jnp.zeros((block_q,), jnp.float32)
    acc, row_max, row_sum = lax.fori_loop(first_kv_tile, end_kv_tile, kv_step, (acc, row_max, row_sum))

    out = acc / jnp.where(row_sum > 0.0, row_sum, 1.0)[:, None]
    plt.store(out_ref.at[q_rows, q_heads, features], out.astype(out_ref.dtype), mask=q_live)


@functools.partial(
    jax.jit,
    static_argnames=("sliding_window", "block_q", "block_kv", "num_warps", "num_stages", "interpret"),
)
def paged_prefill_attention(
    q,
    k_pool,
    v_pool,
    layer_index,
    block_tables,
    context_lens,
    query_start,
    *,
    k_scales=None,
    v_scales=None,
    sliding_window: int | None = None,
    block_q: int | None = None,
    block_kv: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
):
    """Causal attention of ragged query chunks over the paged cache -> [T, H, D].

    Tuning (all static; None takes the per-head_dim default):
      block_q: query rows per program, a power of two >= max(16, group); a row is
        a (token, q head) pair, so a tile holds block_q // group tokens.
      block_kv: keys per online-softmax step, a power of two >= 16; independent
        of block_size (a tile may span several blocks or part of one).
      num_warps, num_stages: Triton compiler parameters.
    """
    num_rows, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = k_pool.shape
    num_seqs, max_blocks = block_tables.shape
    quantized = check_kv_pool(num_heads, head_dim, k_pool, v_pool, k_scales, v_scales)
    if context_lens.shape != (num_seqs,) or query_start.shape != (num_seqs + 1,):
        raise ValueError(
            f"context_lens {context_lens.shape} / query_start {query_start.shape} do not match {num_seqs} sequences"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")

    group = num_heads // num_kv_heads
    default_block_q, default_block_kv, default_warps, default_stages = defaults_for(_DEFAULTS_BY_HEAD_DIM, head_dim)
    min_block_q = max(MIN_DOT_DIM, next_power_of_two(group))
    if block_q is None:
        # Small batches (a few decode tokens) get small tiles.
        block_q = max(min_block_q, min(default_block_q, next_power_of_two(max(1, num_rows) * group)))
    if not is_power_of_two(block_q) or block_q < min_block_q:
        raise ValueError(f"block_q={block_q} must be a power of two >= {min_block_q} (16 and the GQA group {group})")
    if block_kv is None:
        # No point in key tiles wider than the longest possible context.
        block_kv = max(MIN_DOT_DIM, min(default_block_kv, next_power_of_two(max_blocks * block_size)))
    if not is_power_of_two(block_kv) or block_kv < MIN_DOT_DIM:
        raise ValueError(f"block_kv={block_kv} must be a power of two >= {MIN_DOT_DIM}")
    num_warps = default_warps if num_warps is None else num_warps
    num_stages = default_stages if num_stages is None else num_stages

    if num_rows == 0 or num_seqs == 0:
        return jnp.zeros_like(q)

    tokens_per_tile = block_q // group
    num_tiles = _num_q_tiles(num_rows, num_seqs, tokens_per_tile)
    query_start = query_start.astype(jnp.int32)
    tiles = _build_q_tiles(query_start, context_lens, tokens_per_tile, num_tiles)
    layer_index = jnp.asarray(layer_index, jnp.int32).reshape(1)

    if quantized:
        compute_dtype = q.dtype
    else:
        compute_dtype = jnp.promote_types(q.dtype, k_pool.dtype)
    precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None

    kernel = functools.partial(
        _prefill_kernel,
        group=group,
        block_q=block_q,
        block_kv=block_kv,
        block_size=block_size,
        sliding_window=sliding_window,
        compute_dtype=compute_dtype,
        precision=precision,
    )
    whole = pl.BlockSpec()  # no block_shape: the kernel sees the whole array
    scale_spec = whole if quantized else None
    out = pl.pallas_call(
        kernel,
        grid=(num_tiles, num_kv_heads),
        in_specs=[whole] * 9 + [scale_spec, scale_spec],
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"paged_prefill_attention_bq{block_q}_bkv{block_kv}",
    )(*tiles, layer_index, block_tables.astype(jnp.int32), q, k_pool, v_pool, k_scales, v_scales)

    # Rows no tile owns were never written (the buffer starts uninitialized).
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    owned = (rows >= query_start[0]) & (rows < query_start[num_seqs])
    return jnp.where(owned[:, None, None], out, jnp.zeros((), q.dtype))


@functools.partial(jax.jit, static_argnames=("sliding_window",))
def paged_prefill_attention_reference(
    q,
    k_pool,
    v_pool,
    layer_index,
    block_tables,
    context_lens,
    query_start,
    *,
    k_scales=None,
    v_scales=None,
    sliding_window: int | None = None,
):
    """Plain jnp, token by token: find each row's sequence and position, gather
    that sequence's whole cache, dequantize, masked float32 softmax. Memory is
    O(T * max_blocks * block_size * KVH * D): meant for tests and modest
    benchmark shapes, not for serving."""
    num_rows, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_pool.shape[2], k_pool.shape[3]
    num_seqs, max_blocks = block_tables.shape
    group = num_heads // num_kv_heads
    max_tokens = max_blocks * block_size

    rows = jnp.arange(num_rows, dtype=jnp.int32)
    # Row r belongs to the first sequence whose rows end after r.
    seq = jnp.minimum(jnp.searchsorted(query_start[1:], rows, side="right"), num_seqs - 1)
    owned = (rows >= query_start[0]) & (rows < query_start[num_seqs])
    q_len = query_start[seq + 1] - query_start[seq]
    context_len = context_lens[seq]
    query_pos = context_len - q_len + (rows - query_start[seq])

    # [T, max_blocks, B, KVH, D] -> [T, max_tokens, KVH, D], straight from the full pool.
    table = block_tables[seq]
    k = k_pool[layer_index, table].reshape(num_rows, max_tokens, num_kv_heads, head_dim).astype(jnp.float32)
    v = v_pool[layer_index, table].reshape(num_rows, max_tokens, num_kv_heads, head_dim).astype(jnp.float32)
    if k_scales is not None:
        k = k * k_scales[layer_index, table].reshape(num_rows, max_tokens, num_kv_heads, 1)
        v = v * v_scales[layer_index, table].reshape(num_rows, max_tokens, num_kv_heads, 1)

    key_pos = jnp.arange(max_tokens, dtype=jnp.int32)
    visible = owned[:, None] & (key_pos[None, :] <= query_pos[:, None]) & (key_pos[None, :] < context_len[:, None])
    if sliding_window is not None:
        visible &= query_pos[:, None] - key_pos[None, :] < sliding_window
    # Invisible slots may hold NaN; zero them so a 0 weight cannot meet a NaN.
    k = jnp.where(visible[:, :, None, None], k, 0.0)
    v = jnp.where(visible[:, :, None, None], v, 0.0)

    grouped_q = q.astype(jnp.float32).reshape(num_rows, num_kv_heads, group, head_dim)
    scores = jnp.einsum("thgd,tnhd->thgn", grouped_q, k, precision=lax.Precision.HIGHEST) * head_dim**-0.5
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    row_max = jnp.where(row_max == -jnp.inf, 0.0, row_max)
    probs = jnp.exp(scores - row_max)
    row_sum = probs.sum(axis=-1, keepdims=True)
    probs = probs / jnp.where(row_sum > 0.0, row_sum, 1.0)
    out = jnp.einsum("thgn,tnhd->thgd", probs, v, precision=lax.Precision.HIGHEST)
    return out.reshape(num_rows, num_heads, head_dim).astype(q.dtype)
