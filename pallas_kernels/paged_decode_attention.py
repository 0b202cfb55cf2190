"""Paged decode attention as a Pallas kernel for the Triton GPU lowering, beside
its plain-jnp reference.

Layout (the engine's, fixed):
  q             [S, Q, H, D]    Q query tokens per sequence; query i sits at
                                position context_len - Q + i (Q = 1 for plain
                                decode, a few for speculative verification).
  k_pool/v_pool [L, N, B, KVH, D]  one pool for all layers; block 0 is the null
                                block that padding points at.
  k/v_scales    [L, N, B, KVH]  float32 per-token scales for int8 / fp8 pools.
  block_tables  [S, max_blocks] token p of sequence s lives in block
                                block_tables[s, p // B], slot p % B.
  context_lens  [S]             tokens in the cache including this step's;
                                0 marks a padding sequence (output zeros).

Algorithm:
  * GQA by gathering rows in place: one program owns one KV head of one
    sequence and all Q * group query rows that read it (row r = query
    r // group, head kv_head * group + r % group), which it loads straight
    out of q [S, Q, H, D] with per-row indices, the rows past Q * group
    masked to zeros up to a power of two >= 16 so that both dots are legal
    under Triton. Its output rows are stored the same way, straight into
    [S, Q, H, D] (or the split partials [S, splits, Q, H, D]): no copy packs
    q into a padded per-KV-head layout before the kernel or unpacks the
    output after it. K/V are read once per KV head, not per head.
  * Split-k: grid (S, KVH, num_splits) with a small static num_splits chosen
    from the step's shape (S x KVH), never from the block table's width:
    enough programs in all (about 256, a few per SM) to fill a GPU, so a lone
    sequence with 8 KV heads gets 32 splits and 32 or more sequences get one
    (no merge). Sizing splits by the table instead (a fixed number of tokens
    each) would make a 131k max_model_len cost 256 splits per KV head, each writing
    and the merge reading a partial block, whatever the contexts. Each
    split takes a dynamic, contiguous share of its own sequence's visible tiles,
    ceil(visible tiles / num_splits), computed in the kernel from context_len
    (and the sliding window). So the programs, the partial outputs and the
    merge are sized by the batch, and the keys walked by its contexts: a
    table sized for max_model_len costs nothing but its own bytes, and needs no
    padding (block-table reads past its last column are clamped; the keys they
    would serve lie past the context and are masked). Splits left without a
    tile (context shorter than num_splits tiles) run zero iterations,
    report lse = -inf and write no partial output.
  * Inside a split, an online softmax walks tiles of blocks_per_tile blocks.
    The tile's per-token block ids are assembled from scalar block-table reads,
    and K/V rows are gathered straight out of the full pool at
    [layer, block_id, slot, kv_head, :], so no layer slice is ever
    materialized and no reshape happens in the kernel. The loop's trip count is
    dynamic, so it never visits a tile past the context or before the window.
  * With several splits each writes its normalized partial output and its
    log-sum-exp, merged by a second small kernel (merge_splits: a log-sum-exp
    merge over the splits axis, an lse of -inf weighing 0) into [S, Q, H, D]
    in q's dtype. With one split the kernel writes the final output in q's
    dtype and there is no merge.
  * new_kv (a decode or verify step, float pool): q arrives as one
    [S, Q, H + 2 KVH, D] array holding each row's own K and V heads after its
    queries. Every split's tile loop leaves the last Q positions out (their
    keys are not in the pool yet); the split walking a sequence's last tile
    owns them: it attends to the new keys and values from registers as the
    pool stores them (causally: row i sees new keys 0..i) and stores them
    into the pool, which comes back as the kernel's outputs aliased to its
    inputs (in place). No other program reads those slots in the step, so
    the stores need no ordering. On a GPU this removes the two scatter
    kernels a layer and lets XLA produce q, k and v in one fusion.

NaN safety: cache slots past a context (and the null block, other layers) may
hold anything, NaN included. K/V/scale loads are masked with other=0 for dead
tokens so nothing NaN reaches a dot, scores of invisible keys are forced to
-inf with where(), and the running max is replaced by 0 while it is still -inf
so exp() never sees -inf - -inf.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._common import MIN_DOT_DIM, check_kv_pool, defaults_for, is_power_of_two, next_power_of_two

# Per head_dim: (tokens per tile, num_warps, num_stages). Tiles shrink as
# head_dim grows to keep the [tile, head_dim] K and V tiles (plus the packed
# query rows) in registers.
_DEFAULTS_BY_HEAD_DIM = {
    64: (128, 4, 2),
    128: (64, 4, 2),
    256: (32, 8, 2),
}
# Programs (sequence x KV head x split) a step aims at: a few per SM of an H100
# (132 SMs), so one sequence still fills the GPU while a batch of 32 sequences
# with 8 KV heads already does without splitting.
_TARGET_PROGRAMS = 256
# Beyond this the merge (num_splits partial blocks per row) outweighs what
# another split adds, even for one sequence with one KV head (a head shard).
_MAX_SPLITS = 64
# The Triton lowering runs float32 dots as TF32 unless told otherwise; HIGHEST
# makes them IEEE float32 (bf16 operands are unaffected).
_DOT_PRECISION = lax.Precision.HIGHEST


def _previous_power_of_two(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def default_num_splits(num_seqs: int, num_kv_heads: int) -> int:
    """Splits per (sequence, KV head): the power of two that brings the grid
    nearest _TARGET_PROGRAMS from below, at least 1 and at most _MAX_SPLITS."""
    return min(_MAX_SPLITS, _previous_power_of_two(_TARGET_PROGRAMS // max(1, num_seqs * num_kv_heads)))


def decode_tiling(
    head_dim: int,
    block_size: int,
    num_seqs: int,
    num_kv_heads: int,
    *,
    blocks_per_tile: int | None = None,
    num_splits: int | None = None,
) -> tuple[int, int]:
    """The static (blocks_per_tile, num_splits) the kernel uses; the grid is
    (num_seqs, num_kv_heads, num_splits). Neither depends on the block table's
    width: a split's share of the keys is dynamic (see the module docstring).

    A requested tile must be a power of two of at least 16 tokens (Triton's
    smallest dot); a requested num_splits >= 1 is used as given.
    """
    default_tile_tokens, _, _ = defaults_for(_DEFAULTS_BY_HEAD_DIM, head_dim)
    min_blocks_per_tile = max(1, MIN_DOT_DIM // block_size)
    if blocks_per_tile is None:
        blocks_per_tile = max(1, default_tile_tokens // block_size, min_blocks_per_tile)
    if not is_power_of_two(blocks_per_tile) or blocks_per_tile < min_blocks_per_tile:
        raise ValueError(
            f"blocks_per_tile={blocks_per_tile} must be a power of two with "
            f"blocks_per_tile * block_size >= {MIN_DOT_DIM}"
        )
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    return blocks_per_tile, num_splits


def _decode_kernel(
    layer_index_ref,  # [1] int32
    context_lens_ref,  # [S] int32
    block_tables_ref,  # [S, max_blocks] int32
    q_ref,  # [S, Q, H, D] every query (this program gathers its KV head's rows); with new_kv [S, 1, H + 2 KVH, D]
    k_pool_ref,  # [L, N, B, KVH, D] whole pool
    v_pool_ref,  # [L, N, B, KVH, D] whole pool
    k_scales_ref,  # [L, N, B, KVH] or None
    v_scales_ref,  # [L, N, B, KVH] or None
    out_ref,  # [S, splits, Q, H, D] normalized partial outputs (float32), or [S, Q, H, D] final (q's dtype)
    lse_ref,  # [S, splits, Q, H] float32, log-sum-exp of each split (-inf: no keys); None with one split
    k_out_ref,  # with new_kv: the K pool, aliased to k_pool_ref (the new key written into it); else None
    v_out_ref,  # with new_kv: the V pool, aliased to v_pool_ref; else None
    *,
    num_heads: int,
    num_queries: int,
    group: int,
    num_rows: int,
    block_size: int,
    blocks_per_tile: int,
    num_splits: int,
    sliding_window: int | None,
    compute_dtype,
):
    seq, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    head_dim = q_ref.shape[-1]
    new_kv = k_out_ref is not None
    max_blocks = block_tables_ref.shape[1]
    tile_tokens = blocks_per_tile * block_size
    sm_scale = head_dim**-0.5

    layer = layer_index_ref[0]
    context_len = context_lens_ref[seq]
    # Earliest key any query of this sequence can see.
    if sliding_window is None:
        first_visible = jnp.int32(0)
    else:
        first_visible = jnp.maximum(context_len - num_queries - sliding_window + 1, 0)

    # This split's share of the tiles that hold visible keys: the sequence's
    # own context decides the work, the table's width does not.
    first_seq_tile = lax.div(first_visible, tile_tokens)
    end_seq_tile = lax.div(context_len + tile_tokens - 1, tile_tokens)
    seq_tiles = jnp.maximum(end_seq_tile - first_seq_tile, 0)
    tiles_per_split = lax.div(seq_tiles + num_splits - 1, num_splits)
    first_tile = first_seq_tile + split * tiles_per_split
    num_tiles = jnp.clip(end_seq_tile - first_tile, 0, tiles_per_split)

    row_pos = context_len - num_queries + jnp.arange(num_rows, dtype=jnp.int32) // group
    token_in_tile = jnp.arange(tile_tokens, dtype=jnp.int32)
    block_in_tile = token_in_tile // block_size
    slots = token_in_tile % block_size
    feature_index = jnp.broadcast_to(jnp.arange(head_dim, dtype=jnp.int32)[None, :], (tile_tokens, head_dim))

    # This KV head's query rows, gathered in place: row r is query r // group,
    # head kv_head * group + r % group. The rows past Q * group (query index
    # past Q) are masked: loaded as zeros, never stored. Their indices are
    # left out of bounds rather than clamped: a clamped row would alias a
    # live one, and interpret mode's masked store (a scatter of the old value
    # where the mask is off) could then write that row back over it.
    row = jnp.arange(num_rows, dtype=jnp.int32)
    row_live = row < num_queries * group
    row_query = row // group
    row_head = kv_head * group + row % group
    rows_shape = (num_rows, head_dim)
    row_queries = jnp.broadcast_to(row_query[:, None], rows_shape)
    row_heads = jnp.broadcast_to(row_head[:, None], rows_shape)
    row_features = jnp.broadcast_to(jnp.arange(head_dim, dtype=jnp.int32)[None, :], rows_shape)
    live_rows = jnp.broadcast_to(row_live[:, None], rows_shape)
    q = plt.load(q_ref.at[seq, row_queries, row_heads, row_features], mask=live_rows,
                 other=jnp.zeros((), q_ref.dtype))
    # A zero of the pool's own dtype: the lowering cannot cast an int 0 to fp8.
    pool_zero = jnp.zeros((), k_pool_ref.dtype)

    def tile_step(i, carry):
        acc, row_max, row_sum = carry
        tile_first_block = (first_tile + i) * blocks_per_tile
        key_pos = tile_first_block * block_size + token_in_tile
        # Per-token block ids from scalar block-table reads (no in-kernel reshape).
        # The last tile may reach past the table; those keys lie past the context
        # (masked below), so a clamped read serves them instead of a padded table.
        block_ids = jnp.zeros((tile_tokens,), jnp.int32)
        for b in range(blocks_per_tile):
            block_id = block_tables_ref[seq, jnp.minimum(tile_first_block + b, max_blocks - 1)]
            block_ids = jnp.where(block_in_tile == b, block_id, block_ids)
        # With new_kv the step's own keys (its last Q positions) are not in
        # the pool yet: they come from registers after the loop.
        key_live = (key_pos >= first_visible) & (key_pos < context_len - (num_queries if new_kv else 0))

        # Every pool index as a [tile, head_dim] array: a pure gather, which both the
        # Triton lowering and interpret mode accept (interpret mode rejects gathers
        # mixed with slices).
        tile_shape = (tile_tokens, head_dim)
        row_blocks = jnp.broadcast_to(block_ids[:, None], tile_shape)
        row_slots = jnp.broadcast_to(slots[:, None], tile_shape)
        live_rows = jnp.broadcast_to(key_live[:, None], tile_shape)
        k = plt.load(
            k_pool_ref.at[layer, row_blocks, row_slots, kv_head, feature_index], mask=live_rows, other=pool_zero
        )
        scores = lax.dot_general(
            q,
            k.astype(compute_dtype),
            (((1,), (1,)), ((), ())),
            precision=_DOT_PRECISION,
            preferred_element_type=jnp.float32,
        )
        scores = scores * sm_scale
        if k_scales_ref is not None:
            # A per-token scale is constant along the contraction, so it scales score columns.
            k_scale = plt.load(
                k_scales_ref.at[layer, block_ids, slots, kv_head], mask=key_live, other=0.0
            )
            scores = scores * k_scale[None, :]

        visible = key_live[None, :] & (key_pos[None, :] <= row_pos[:, None])
        if sliding_window is not None:
            visible = visible & (row_pos[:, None] - key_pos[None, :] < sliding_window)
        scores = jnp.where(visible, scores, -jnp.inf)

        new_max = jnp.maximum(row_max, scores.max(axis=1))
        # While a row has seen no key its max is -inf; shift by 0 instead.
        shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)
        rescale = jnp.exp(row_max - shift)
        probs = jnp.exp(scores - shift[:, None])
        row_sum = row_sum * rescale + probs.sum(axis=1)

        v = plt.load(
            v_pool_ref.at[layer, row_blocks, row_slots, kv_head, feature_index], mask=live_rows, other=pool_zero
        )
        if v_scales_ref is not None:
            # A per-token V scale runs along the contraction: fold it into the probabilities.
            v_scale = plt.load(
                v_scales_ref.at[layer, block_ids, slots, kv_head], mask=key_live, other=0.0
            )
            probs = probs * v_scale[None, :]
        acc = acc * rescale[:, None] + lax.dot_general(
            probs.astype(compute_dtype),
            v.astype(compute_dtype),
            (((1,), (0,)), ((), ())),
            precision=_DOT_PRECISION,
            preferred_element_type=jnp.float32,
        )
        return acc, new_max, row_sum

    acc = jnp.zeros((num_rows, head_dim), jnp.float32)
    row_max = jnp.full((num_rows,), -jnp.inf, jnp.float32)
    row_sum = jnp.zeros((num_rows,), jnp.float32)
    acc, row_max, row_sum = lax.fori_loop(0, num_tiles, tile_step, (acc, row_max, row_sum))
    if new_kv:
        acc, row_max, row_sum = _attend_new_keys(
            (acc, row_max, row_sum), q, row_query, row_live, seq, kv_head, layer, context_len, block_tables_ref, q_ref,
            k_out_ref, v_out_ref, num_heads=num_heads, num_queries=num_queries, block_size=block_size,
            sm_scale=sm_scale, sliding_window=sliding_window,
            # The split walking the last visible tile owns the new keys (exactly one split of a live sequence).
            owner=(num_tiles > 0) & (first_tile + num_tiles == end_seq_tile))

    has_keys = row_sum > 0.0
    out = (acc / jnp.where(has_keys, row_sum, 1.0)[:, None]).astype(out_ref.dtype)
    # Each live row back where its query and head live; the padding rows nowhere.
    if lse_ref is None:
        plt.store(out_ref.at[seq, row_queries, row_heads, row_features], out, mask=live_rows)
    else:
        # A row that saw no key in this split (a split past a short context, a padding sequence) writes no
        # partial output: its lse of -inf tells the merge not to read it.
        plt.store(out_ref.at[seq, split, row_queries, row_heads, row_features], out,
                  mask=live_rows & has_keys[:, None])
        lse = jnp.where(has_keys, row_max + jnp.log(jnp.where(has_keys, row_sum, 1.0)), -jnp.inf)
        plt.store(lse_ref.at[seq, split, row_query, row_head], lse, mask=row_live)


def _attend_new_keys(carry, q, row_query, row_live, seq, kv_head, layer, context_len, block_tables_ref, qkv_ref,
                     k_out_ref, v_out_ref, *, num_heads: int, num_queries: int, block_size: int, sm_scale: float,
                     sliding_window: int | None, owner):
    """The online softmax's last steps, over the step's own keys and values
    (positions context_len - Q .. context_len - 1, row j of qkv at heads
    num_heads + kv_head and num_heads + KVH + kv_head) as the pool stores
    them, and their writes into the pool, both by the owning program only.
    No other program reads those slots in this step (its tiles stop before
    them; a sequence's blocks past its computed tokens are its own), so the
    writes need no ordering against any read. A verify row padding a
    sequence with fewer drafts writes its K/V where the scatter would have
    put them into the null block: into a slot past the sequence's tokens
    (rewritten before any query reads it) or the null block itself."""
    acc, row_max, row_sum = carry
    num_kv_heads = k_out_ref.shape[3]
    features = jnp.arange(q.shape[-1], dtype=jnp.int32)
    live = jnp.broadcast_to(owner, features.shape)
    zero = jnp.zeros((), qkv_ref.dtype)
    for j in range(num_queries):
        k = plt.load(qkv_ref.at[seq, j, num_heads + kv_head, features], mask=live, other=zero).astype(k_out_ref.dtype)
        v = plt.load(qkv_ref.at[seq, j, num_heads + num_kv_heads + kv_head, features], mask=live,
                     other=zero).astype(v_out_ref.dtype)
        position = jnp.maximum(context_len - num_queries + j, 0)
        block = block_tables_ref[seq, lax.div(position, block_size)]
        slot = lax.rem(position, block_size)
        plt.store(k_out_ref.at[layer, block, slot, kv_head, features], k, mask=live)
        plt.store(v_out_ref.at[layer, block, slot, kv_head, features], v, mask=live)

        # One key: its score per row is an elementwise product summed (a dot needs 16 columns).
        k, v = k.astype(q.dtype).astype(jnp.float32), v.astype(q.dtype).astype(jnp.float32)
        score = jnp.sum(q.astype(jnp.float32) * k[None, :], axis=1) * sm_scale
        # Query row r (position context_len - Q + row_query[r]) sees key j at or before it.
        visible = owner & row_live & (row_query >= j)
        if sliding_window is not None:
            visible = visible & (row_query - j < sliding_window)
        score = jnp.where(visible, score, -jnp.inf)
        new_max = jnp.maximum(row_max, score)
        shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)
        rescale = jnp.exp(row_max - shift)
        prob = jnp.exp(score - shift)
        acc, row_max, row_sum = acc * rescale[:, None] + prob[:, None] * v[None, :], new_max, row_sum * rescale + prob
    return acc, row_max, row_sum


def _bind_outputs(kernel, num_inputs: int, has_lse: bool):
    """The kernel called with its output refs in their places: the log-sum-exp
    None with one split (no merge), the pools None without new_kv."""

    def bound(*refs):
        inputs, outputs = refs[:num_inputs], list(refs[num_inputs:])
        out = outputs.pop(0)
        lse = outputs.pop(0) if has_lse else None
        pools = outputs or [None, None]
        kernel(*inputs, out, lse, *pools)

    return bound


def _merge_kernel(out_ref, lse_ref, merged_ref, *, num_splits: int, num_heads: int):
    """The merge of one (sequence, query, head)'s splits, written in the
    output's dtype. In one kernel because XLA runs the same merge in jnp as
    four (a max, two sums of different shapes, the division and cast): on a
    GPU each is a launch per layer. The splits are padded to a power of two
    in registers; the padding's indices are masked, never read, as are
    the splits that saw no key (lse -inf: they wrote no output)."""
    seq, row = pl.program_id(0), pl.program_id(1)
    query, head = row // num_heads, row % num_heads
    head_dim = out_ref.shape[-1]
    split = jnp.arange(next_power_of_two(num_splits), dtype=jnp.int32)
    live = split < num_splits
    lse = plt.load(lse_ref.at[seq, split, query, head], mask=live, other=-jnp.inf)
    max_lse = jnp.max(lse)
    weights = jnp.exp(lse - jnp.where(max_lse == -jnp.inf, 0.0, max_lse))
    total = jnp.sum(weights)
    shape = (split.shape[0], head_dim)
    features = jnp.arange(head_dim, dtype=jnp.int32)
    parts = plt.load(
        out_ref.at[seq, jnp.broadcast_to(split[:, None], shape), query, head, jnp.broadcast_to(features[None], shape)],
        mask=jnp.broadcast_to((live & (lse > -jnp.inf))[:, None], shape), other=0.0,
    )
    merged = jnp.sum(parts * weights[:, None], axis=0) / jnp.where(total > 0.0, total, 1.0)
    plt.store(merged_ref.at[seq, query, head, features], merged.astype(merged_ref.dtype))


def merge_splits(partial_out, partial_lse, dtype, interpret: bool = False):
    """The log-sum-exp merge over axis 1 (splits) of the partial outputs
    [S, splits, Q, H, D] by their log-sum-exps [S, splits, Q, H] -> [S, Q,
    H, D] in `dtype`. Splits and rows with no keys (lse = -inf) weigh 0,
    their outputs not read (the kernel leaves them unwritten), and an
    all-empty row gives 0, never NaN."""
    num_seqs, num_splits, num_queries, num_heads, head_dim = partial_out.shape
    whole = pl.BlockSpec()
    return pl.pallas_call(
        functools.partial(_merge_kernel, num_splits=num_splits, num_heads=num_heads),
        grid=(num_seqs, num_queries * num_heads),
        in_specs=[whole, whole],
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((num_seqs, num_queries, num_heads, head_dim), dtype),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name=f"paged_decode_attention_merge_splits{num_splits}",
    )(partial_out, partial_lse)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sliding_window",
        "blocks_per_tile",
        "num_splits",
        "num_warps",
        "num_stages",
        "new_kv",
        "interpret",
    ),
)
def paged_decode_attention(
    q,
    k_pool,
    v_pool,
    layer_index,
    block_tables,
    context_lens,
    *,
    k_scales=None,
    v_scales=None,
    sliding_window: int | None = None,
    blocks_per_tile: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    new_kv: bool = False,
    interpret: bool = False,
):
    """Attention of Q new tokens per sequence over a paged KV cache -> [S, Q, H, D].

    new_kv: q is [S, Q, H + 2 KVH, D], each query row followed by the step's
      own K and V heads of its position (not yet in the pool): the kernel
      writes them into the pool (float pools, donated: the pool buffers are
      updated in place) and attends to them from registers -> (out
      [S, Q, H, D], k_pool, v_pool). One array in, so that XLA produces q, k
      and v in one fusion and no scatter kernel writes the pool.

    Tuning (all static, defaults from a per-head_dim table):
      blocks_per_tile: blocks per online-softmax step; a power of two with
        blocks_per_tile * block_size >= 16.
      num_splits: programs per (sequence, KV head), each walking a dynamic
        share of its sequence's visible tiles; by default from the batch's
        shape (default_num_splits), never from the table's width.
      num_warps, num_stages: Triton compiler parameters.
    """
    num_seqs, num_queries, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = k_pool.shape
    if new_kv:
        num_heads -= 2 * num_kv_heads
        if k_scales is not None:
            raise ValueError("new_kv takes a float pool (an int8 / fp8 pool's scales are computed outside)")
    quantized = check_kv_pool(num_heads, head_dim, k_pool, v_pool, k_scales, v_scales)
    if not is_power_of_two(block_size):
        raise ValueError(f"block_size {block_size} must be a power of two")

    group = num_heads // num_kv_heads
    blocks_per_tile, num_splits = decode_tiling(
        head_dim, block_size, num_seqs, num_kv_heads, blocks_per_tile=blocks_per_tile, num_splits=num_splits
    )
    _, default_warps, default_stages = defaults_for(_DEFAULTS_BY_HEAD_DIM, head_dim)
    num_warps = default_warps if num_warps is None else num_warps
    num_stages = default_stages if num_stages is None else num_stages

    block_tables = block_tables.astype(jnp.int32)
    context_lens = context_lens.astype(jnp.int32)
    layer_index = jnp.asarray(layer_index, jnp.int32).reshape(1)

    # The rows of one KV head a program multiplies, padded (in registers) to a power of two.
    padded_rows = max(MIN_DOT_DIM, next_power_of_two(num_queries * group))

    # Dots run in q's dtype (int8 / fp8 K/V convert to it exactly); accumulation is float32.
    compute_dtype = q.dtype
    kernel = functools.partial(
        _decode_kernel,
        num_heads=num_heads,
        num_queries=num_queries,
        group=group,
        num_rows=padded_rows,
        block_size=block_size,
        blocks_per_tile=blocks_per_tile,
        num_splits=num_splits,
        sliding_window=sliding_window,
        compute_dtype=compute_dtype,
    )
    # No block_shape: the kernel sees the whole array. q and the outputs too:
    # each program gathers and stores its own rows of them (see the module docstring).
    whole = pl.BlockSpec()
    scale_spec = whole if quantized else None
    if num_splits == 1:
        # One split sees every key: its normalized output is final, in q's dtype.
        out_specs = [whole]
        out_shape = [jax.ShapeDtypeStruct((num_seqs, num_queries, num_heads, head_dim), q.dtype)]
    else:
        out_specs = [whole, whole]
        out_shape = [
            jax.ShapeDtypeStruct((num_seqs, num_splits, num_queries, num_heads, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((num_seqs, num_splits, num_queries, num_heads), jnp.float32),
        ]
    aliases = {}
    if new_kv:  # the pools (inputs 4 and 5: no scales) come back as the last outputs, written in place
        aliases = {4: len(out_shape), 5: len(out_shape) + 1}
        out_specs = [*out_specs, whole, whole]
        out_shape = [*out_shape, jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype),
                     jax.ShapeDtypeStruct(v_pool.shape, v_pool.dtype)]
    outputs = pl.pallas_call(
        _bind_outputs(kernel, num_inputs=8, has_lse=num_splits > 1),
        grid=(num_seqs, num_kv_heads, num_splits),
        in_specs=[
            whole,  # layer_index
            whole,  # context_lens
            whole,  # block_tables
            whole,  # q
            whole,  # k_pool
            whole,  # v_pool
            scale_spec,  # k_scales
            scale_spec,  # v_scales
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"paged_decode_attention_bpt{blocks_per_tile}_splits{num_splits}{'_new_kv' if new_kv else ''}",
    )(layer_index, context_lens, block_tables, q, k_pool, v_pool, k_scales, v_scales)

    out = outputs[0] if num_splits == 1 else merge_splits(*outputs[:2], q.dtype, interpret)
    return (out, *outputs[-2:]) if new_kv else out


@functools.partial(jax.jit, static_argnames=("sliding_window",))
def paged_decode_attention_reference(
    q,
    k_pool,
    v_pool,
    layer_index,
    block_tables,
    context_lens,
    *,
    k_scales=None,
    v_scales=None,
    sliding_window: int | None = None,
):
    """Plain jnp: gather each sequence's blocks, dequantize, masked float32 softmax."""
    num_seqs, num_queries, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_pool.shape[2], k_pool.shape[3]
    group = num_heads // num_kv_heads
    max_tokens = block_tables.shape[1] * block_size

    # [S, max_blocks, B, KVH, D] -> [S, T, KVH, D]; one gather, no layer copy.
    k = k_pool[layer_index, block_tables].reshape(num_seqs, max_tokens, num_kv_heads, head_dim)
    v = v_pool[layer_index, block_tables].reshape(num_seqs, max_tokens, num_kv_heads, head_dim)
    k, v = k.astype(jnp.float32), v.astype(jnp.float32)
    if k_scales is not None:
        k = k * k_scales[layer_index, block_tables].reshape(num_seqs, max_tokens, num_kv_heads, 1)
        v = v * v_scales[layer_index, block_tables].reshape(num_seqs, max_tokens, num_kv_heads, 1)
    key_pos = jnp.arange(max_tokens)
    # Slots past the context may hold NaN; zero them so 0-weight * NaN cannot leak.
    in_context = (key_pos[None, :] < context_lens[:, None])[:, :, None, None]
    k = jnp.where(in_context, k, 0.0)
    v = jnp.where(in_context, v, 0.0)

    query_pos = context_lens[:, None] - num_queries + jnp.arange(num_queries)[None, :]  # [S, Q]
    visible = key_pos[None, None, :] <= query_pos[:, :, None]  # [S, Q, T]
    visible &= key_pos[None, None, :] < context_lens[:, None, None]
    if sliding_window is not None:
        visible &= query_pos[:, :, None] - key_pos[None, None, :] < sliding_window

    grouped_q = q.astype(jnp.float32).reshape(num_seqs, num_queries, num_kv_heads, group, head_dim)
    scores = jnp.einsum("sqhgd,sthd->sqhgt", grouped_q, k, precision=lax.Precision.HIGHEST)
    scores = scores * (head_dim**-0.5)
    scores = jnp.where(visible[:, :, None, None, :], scores, -jnp.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    row_max = jnp.where(row_max == -jnp.inf, 0.0, row_max)
    probs = jnp.exp(scores - row_max)
    row_sum = probs.sum(axis=-1, keepdims=True)
    probs = probs / jnp.where(row_sum > 0.0, row_sum, 1.0)
    out = jnp.einsum("sqhgt,sthd->sqhgd", probs, v, precision=lax.Precision.HIGHEST)
    return out.reshape(num_seqs, num_queries, num_heads, head_dim).astype(q.dtype)


__all__ = ["decode_tiling", "default_num_splits", "paged_decode_attention", "paged_decode_attention_reference"]
