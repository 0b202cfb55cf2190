"""Pallas paged prefill attention (interpret mode) against its plain-jnp
reference and an independent float64 numpy computation on dense per-sequence
K/V.

Every pool slot the batch does not own (unused blocks, the null block, the
tails of last blocks, the other layers) is poisoned with NaN (for int8 pools,
which have no NaN, the scales are poisoned), so a read of the wrong block, slot
or layer turns the output NaN and fails the test."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_prefill_attention import (
    _build_q_tiles,
    _num_q_tiles,
    paged_prefill_attention,
    paged_prefill_attention_reference,
)
from tests.kernels.test_pallas_decode_attention import pallas_calls

NUM_LAYERS = 3
LAYER_INDEX = 1  # poisoned layers on both sides


def make_batch(rng, chunks, *, block_size, num_kv_heads, group, head_dim, q_dtype, kv_kind, pad_rows):
    """chunks: [(context_len, q_len)] per sequence. kv_kind: float32 | bfloat16 | int8 | fp8."""
    num_heads = num_kv_heads * group
    num_seqs = len(chunks)
    blocks_needed = [-(-ctx // block_size) for ctx, _ in chunks]
    num_blocks = 1 + sum(blocks_needed) + 3  # null block + owned + spare (poisoned)
    max_blocks = max(blocks_needed) + 1
    pool_shape = (NUM_LAYERS, num_blocks, block_size, num_kv_heads, head_dim)

    quantized = kv_kind in ("int8", "fp8")
    k_pool = np.full(pool_shape, np.nan, np.float32)
    v_pool = np.full(pool_shape, np.nan, np.float32)
    k_scales = np.full(pool_shape[:-1], np.nan, np.float32) if quantized else None
    v_scales = np.full(pool_shape[:-1], np.nan, np.float32) if quantized else None

    def random_values(ctx):
        if kv_kind == "int8":
            return rng.integers(-127, 128, (ctx, num_kv_heads, head_dim)).astype(np.float32)
        values = rng.standard_normal((ctx, num_kv_heads, head_dim)).astype(np.float32)
        storage = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}[kv_kind]
        # Round through the storage dtype so the dense copy holds exactly what the pool holds.
        return np.asarray(jnp.asarray(values).astype(storage).astype(jnp.float32))

    free = list(rng.permutation(np.arange(1, num_blocks)))
    block_tables = np.zeros((num_seqs, max_blocks), np.int32)
    dense_k, dense_v = [], []
    for s, (ctx, _) in enumerate(chunks):
        k, v = random_values(ctx), random_values(ctx)
        k_scale = rng.uniform(0.005, 0.03, (ctx, num_kv_heads)).astype(np.float32)
        v_scale = rng.uniform(0.005, 0.03, (ctx, num_kv_heads)).astype(np.float32)
        for b in range(blocks_needed[s]):
            block = block_tables[s, b] = free.pop()
            lo, hi = b * block_size, min(ctx, (b + 1) * block_size)
            k_pool[LAYER_INDEX, block, : hi - lo] = k[lo:hi]
            v_pool[LAYER_INDEX, block, : hi - lo] = v[lo:hi]
            if quantized:
                k_scales[LAYER_INDEX, block, : hi - lo] = k_scale[lo:hi]
                v_scales[LAYER_INDEX, block, : hi - lo] = v_scale[lo:hi]
        if quantized:
            k, v = k * k_scale[..., None], v * v_scale[..., None]
        dense_k.append(k.astype(np.float64))
        dense_v.append(v.astype(np.float64))

    if kv_kind == "int8":
        # int8 has no NaN: poison unowned slots with a large value (their scales are NaN).
        k_pool = np.nan_to_num(k_pool, nan=127.0)
        v_pool = np.nan_to_num(v_pool, nan=-127.0)
    pool_dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[
        kv_kind
    ]

    q_lens = [q_len for _, q_len in chunks]
    query_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_rows = int(query_start[-1]) + pad_rows
    q = rng.standard_normal((num_rows, num_heads, head_dim)).astype(np.float32)
    q[query_start[-1] :] = np.nan  # padding rows must never be read into a live row
    q = jnp.asarray(q).astype(q_dtype)

    args = (
        q,
        jnp.asarray(k_pool).astype(pool_dtype),
        jnp.asarray(v_pool).astype(pool_dtype),
        jnp.int32(LAYER_INDEX),
        jnp.asarray(block_tables),
        jnp.asarray([ctx for ctx, _ in chunks], jnp.int32),
        jnp.asarray(query_start),
    )
    scales = {}
    if quantized:
        scales = {"k_scales": jnp.asarray(k_scales), "v_scales": jnp.asarray(v_scales)}
    return args, scales, dense_k, dense_v


def numpy_attention(q, chunks, query_start, dense_k, dense_v, group, sliding_window):
    """Float64, one query row and head at a time; untouched rows stay 0."""
    q = np.asarray(jnp.asarray(q).astype(jnp.float32)).astype(np.float64)
    out = np.zeros(q.shape, np.float64)
    for s, (ctx, q_len) in enumerate(chunks):
        for i in range(q_len):
            pos = ctx - q_len + i
            first = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            k = dense_k[s][first : pos + 1]
            v = dense_v[s][first : pos + 1]
            row = query_start[s] + i
            for h in range(q.shape[1]):
                scores = k[:, h // group] @ q[row, h] / np.sqrt(q.shape[2])
                p = np.exp(scores - scores.max())
                out[row, h] = (p / p.sum()) @ v[:, h // group]
    return out


def mixed_chunks(rng, max_chunk, max_context, extra):
    """Always a whole prompt, a prefix hit / later chunk (context > chunk), a
    decode token, a q_len-0 sequence and a padding sequence, plus `extra` random
    chunks; shuffled so the kinds interleave."""
    prompt = int(rng.integers(1, max_chunk + 1))
    later = int(rng.integers(1, max_chunk + 1))
    chunks = [
        (prompt, prompt),
        (later + int(rng.integers(1, max_context - later + 1)), later),
        (int(rng.integers(1, max_context + 1)), 1),
        (int(rng.integers(1, max_context + 1)), 0),
        (0, 0),
    ]
    for _ in range(extra):
        q_len = int(rng.integers(1, max_chunk + 1))
        chunks.append((q_len + int(rng.integers(0, max_context - q_len + 1)), q_len))
    return [chunks[i] for i in rng.permutation(len(chunks))]


# (seed, head_dim, num_kv_heads, group, block_size, q dtype, kv kind, sliding window, block_q, block_kv)
# block_q is in query rows (block_q // group tokens per tile): 16 with group 3 is 5 tokens,
# 32 with group 3 is 10, 64 with group 3 is 21, none of which divides the chunk lengths.
CASES = [
    (0, 64, 2, 3, 16, "float32", "float32", None, 16, 32),  # block_kv = 2 blocks
    (1, 128, 1, 4, 8, "float32", "float32", None, None, 16),  # default block_q
    (2, 64, 2, 8, 32, "float32", "float32", 13, 32, 16),  # block_kv = half a block, window
    (3, 64, 2, 1, 8, "float32", "int8", None, 16, 16),
    (4, 128, 1, 3, 16, "float32", "fp8", 20, 32, 32),
    (5, 128, 1, 1, 32, "float32", "float32", 5, 64, 64),  # window far smaller than a tile
    (6, 64, 1, 3, 16, "bfloat16", "bfloat16", None, 64, 32),
]


def run_case(seed, head_dim, num_kv_heads, group, block_size, q_dtype, kv_kind, sliding_window, block_q, block_kv):
    rng = np.random.default_rng(seed)
    chunks = mixed_chunks(rng, max_chunk=64, max_context=100, extra=2)
    if seed == 0:
        chunks.append((64, 64))  # the longest chunk, whole prompt
    args, scales, dense_k, dense_v = make_batch(
        rng,
        chunks,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        q_dtype=q_dtype,
        kv_kind=kv_kind,
        pad_rows=3,
    )
    out = paged_prefill_attention(
        *args, **scales, sliding_window=sliding_window, block_q=block_q, block_kv=block_kv, interpret=True
    )
    reference = paged_prefill_attention_reference(*args, **scales, sliding_window=sliding_window)
    query_start = np.asarray(args[6])
    expected = numpy_attention(args[0], chunks, query_start, dense_k, dense_v, group, sliding_window)
    return chunks, query_start, np.asarray(out.astype(jnp.float32)), np.asarray(reference.astype(jnp.float32)), expected


@pytest.mark.parametrize("case", CASES, ids=[f"seed{c[0]}-d{c[1]}-g{c[3]}-{c[6]}" for c in CASES])
def test_matches_float64_and_reference(case):
    chunks, query_start, out, reference, expected = run_case(*case)
    tolerance = {"atol": 2e-2, "rtol": 2e-2} if case[5] == "bfloat16" else {"atol": 5e-5, "rtol": 1e-4}
    assert out.shape == expected.shape
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, expected, **tolerance)
    np.testing.assert_allclose(reference, expected, **tolerance)
    np.testing.assert_allclose(out, reference, **tolerance)
    # Padding rows past query_start[S] are exactly zero, live rows are not.
    assert (out[query_start[-1] :] == 0).all()
    assert np.abs(out[: query_start[-1]]).max(axis=(1, 2)).min() > 0
    assert [q_len for _, q_len in chunks].count(0) >= 2  # a q_len-0 sequence and a padding sequence


def test_decode_only_batch_and_single_long_chunk():
    """Edge shapes: only decode tokens (one q row per sequence, small default
    tiles), then a single chunk whose sequence spans many KV tiles."""
    for chunks, kwargs in [
        ([(1, 1), (17, 1), (33, 1), (8, 1)], {}),
        ([(90, 40)], {"block_q": 16, "block_kv": 16}),
    ]:
        rng = np.random.default_rng(len(chunks))
        args, _, dense_k, dense_v = make_batch(
            rng,
            chunks,
            block_size=8,
            num_kv_heads=2,
            group=4,
            head_dim=64,
            q_dtype="float32",
            kv_kind="float32",
            pad_rows=0,
        )
        out = np.asarray(paged_prefill_attention(*args, **kwargs, interpret=True))
        expected = numpy_attention(args[0], chunks, np.asarray(args[6]), dense_k, dense_v, 4, None)
        np.testing.assert_allclose(out, expected, atol=5e-5, rtol=1e-4)


def test_tile_list_covers_every_live_row_once():
    """The static-length tile list: tiles never cross sequences, cover each
    live row exactly once, give each row its position, and fit the grid."""
    rng = np.random.default_rng(7)
    num_seqs, max_q_len, max_pad = 6, 30, 4
    build = jax.jit(_build_q_tiles, static_argnums=(2, 3))
    for trial in range(24):
        q_lens = rng.integers(0, max_q_len, num_seqs)
        q_lens[rng.integers(0, num_seqs)] = 0
        contexts = q_lens + rng.integers(0, 50, num_seqs)
        query_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        num_rows = int(query_start[-1]) + int(rng.integers(0, max_pad + 1))
        tokens_per_tile = [1, 3, 5, 16][trial % 4]
        # The grid size for the largest possible T, so shapes (and compilations) repeat.
        num_tiles = _num_q_tiles(num_seqs * max_q_len + max_pad, num_seqs, tokens_per_tile)
        tiles = build(jnp.asarray(query_start), jnp.asarray(contexts, jnp.int32), tokens_per_tile, num_tiles)
        tile_seq, first_row, num_tokens, first_pos = (np.asarray(t) for t in tiles)
        # The bound the kernel uses for this T must hold too.
        assert np.count_nonzero(num_tokens) <= _num_q_tiles(max(num_rows, 1), num_seqs, tokens_per_tile)
        covered = np.zeros(num_rows + 1, np.int32)
        for t in np.flatnonzero(num_tokens):
            s = tile_seq[t]
            assert num_tokens[t] <= tokens_per_tile
            assert query_start[s] <= first_row[t] and first_row[t] + num_tokens[t] <= query_start[s + 1]
            assert first_pos[t] == contexts[s] - q_lens[s] + first_row[t] - query_start[s]
            covered[first_row[t] : first_row[t] + num_tokens[t]] += 1
        np.testing.assert_array_equal(covered[: query_start[-1]], 1)
        assert not covered[query_start[-1] :].any()


def test_rejects_illegal_tiles():
    rng = np.random.default_rng(0)
    args, _, _, _ = make_batch(
        rng, [(5, 5)], block_size=8, num_kv_heads=1, group=4, head_dim=64, q_dtype="float32", kv_kind="float32",
        pad_rows=0,
    )
    for bad in [{"block_q": 24}, {"block_q": 8}, {"block_kv": 8}, {"block_kv": 48}]:
        with pytest.raises(ValueError):
            paged_prefill_attention(*args, **bad, interpret=True)
    with pytest.raises(ValueError):
        paged_prefill_attention(*args[:4], args[4], args[5], args[6][:-1], interpret=True)
    int8_pool = args[1].astype(jnp.int8)
    with pytest.raises(ValueError):  # quantized pool without scales
        paged_prefill_attention(args[0], int8_pool, int8_pool, *args[3:], interpret=True)


def test_metadata_values_are_traced_not_baked_in():
    """Same shapes, new context lengths through the same jitted call: the result follows the values."""
    rng = np.random.default_rng(11)
    chunks = [(20, 5), (9, 9)]
    args, _, dense_k, dense_v = make_batch(
        rng, chunks, block_size=8, num_kv_heads=1, group=1, head_dim=64, q_dtype="float32", kv_kind="float32",
        pad_rows=2,
    )
    first = paged_prefill_attention(*args, block_q=16, block_kv=16, interpret=True)
    # Same shapes, the first sequence one token shorter: its chunk now ends a position earlier.
    new_contexts = jnp.asarray([19, 9], jnp.int32)
    second = paged_prefill_attention(*args[:5], new_contexts, args[6], block_q=16, block_kv=16, interpret=True)
    new_chunks = [(19, 5), (9, 9)]
    expected = numpy_attention(args[0], new_chunks, np.asarray(args[6]), [dense_k[0][:19], dense_k[1]],
                               [dense_v[0][:19], dense_v[1]], 1, None)
    np.testing.assert_allclose(np.asarray(second), expected, atol=5e-5, rtol=1e-4)
    assert not np.allclose(np.asarray(first)[:5], np.asarray(second)[:5])


def with_table_width(args, max_blocks, block_size, rng):
    """args with the block table widened to max_blocks columns; the columns past
    each sequence's blocks point at random (poisoned or foreign) blocks."""
    table = np.asarray(args[4])
    num_blocks = args[1].shape[1]
    wide = rng.integers(0, num_blocks, (table.shape[0], max_blocks)).astype(np.int32)
    for s, context_len in enumerate(np.asarray(args[5])):
        used = -(-int(context_len) // block_size)
        wide[s, :used] = table[s, :used]
    return (*args[:4], jnp.asarray(wide), *args[5:])


WIDTH_CHUNKS = [(128, 30), (20, 1), (0, 0), (60, 60), (90, 0)]  # all fit 8 blocks of 16


def test_table_width_does_not_change_the_result_or_the_grid():
    """Same chunks and contexts with tables of 8, 64 and 1024 columns: the same
    float64-checked output, and the same kernel grid and output bytes (read from
    the traced program): nothing about the call follows the table's width."""
    rng = np.random.default_rng(21)
    args, _, dense_k, dense_v = make_batch(
        rng, WIDTH_CHUNKS, block_size=16, num_kv_heads=2, group=4, head_dim=16, q_dtype="float32",
        kv_kind="float32", pad_rows=2,
    )
    expected = numpy_attention(args[0], WIDTH_CHUNKS, np.asarray(args[6]), dense_k, dense_v, 4, None)
    def attention(*args):
        return paged_prefill_attention(*args, block_q=16, block_kv=16, interpret=True)

    calls = set()
    for max_blocks in (8, 64, 1024):
        wide_args = with_table_width(args, max_blocks, 16, np.random.default_rng(max_blocks))
        np.testing.assert_allclose(np.asarray(attention(*wide_args)), expected, atol=5e-5, rtol=1e-4)
        jaxpr = jax.make_jaxpr(attention)(*wide_args)
        (call,) = pallas_calls(jaxpr.jaxpr)
        out_bytes = sum(v.aval.size * v.aval.dtype.itemsize for v in call.outvars)
        calls.add((tuple(call.params["grid_mapping"].grid), out_bytes))
    # One program per (query tile, KV head); the output is q itself.
    assert calls == {((_num_q_tiles(args[0].shape[0], len(WIDTH_CHUNKS), 16 // 4), 2), args[0].size * 4)}


@pytest.mark.parametrize("q_dtype,kv_kind", [("float32", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", "int8"),
                                             ("bfloat16", "fp8")])
def test_lowers_to_triton_for_cuda(q_dtype, kv_kind):
    """Cross-lowering for CUDA on this CPU host runs the real Pallas Triton
    lowering rules (every primitive, dtype cast and index form of the kernel)
    up to the Triton IR; only PTX compilation is left to a GPU."""
    rng = np.random.default_rng(3)
    args, scales, _, _ = make_batch(
        rng, [(40, 23), (9, 1), (5, 0)], block_size=16, num_kv_heads=2, group=3, head_dim=64, q_dtype=q_dtype,
        kv_kind=kv_kind, pad_rows=2,
    )

    def attention(*args, **scales):
        return paged_prefill_attention(*args, **scales, sliding_window=9, block_q=32, block_kv=16)

    lowered = jax.jit(attention).trace(*args, **scales).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()
