"""Paged decode attention kernel (Pallas, interpret mode on CPU) against its jnp
reference and against a float64 numpy computation on dense per-sequence K/V.

Every pool slot the sequences do not own (null block, spare blocks, the tail of
each last block, the whole other layer) is poisoned with NaN (for int8 pools:
through a NaN scale), so reading a wrong block, slot or layer, or letting a
masked value reach a dot, shows up as NaN or as a mismatch.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.paged_decode_attention import (
    _MAX_SPLITS,
    _TARGET_PROGRAMS,
    decode_tiling,
    default_num_splits,
    merge_splits,
    paged_decode_attention,
    paged_decode_attention_reference,
)

NUM_LAYERS, LAYER = 2, 1


def build_case(rng, context_lens, *, num_queries, num_kv_heads, group, head_dim, block_size, kv_dtype, q_dtype):
    """A ragged batch on a NaN-poisoned pool; returns kernel inputs and dense float64 K/V per sequence."""
    context_lens = np.asarray(context_lens, np.int32)
    blocks_per_seq = -(-context_lens // block_size)
    max_blocks = int(blocks_per_seq.max()) + 1  # one always-padded column
    num_blocks = 1 + int(blocks_per_seq.sum()) + 2  # null block + owned + spare
    pool_shape = (NUM_LAYERS, num_blocks, block_size, num_kv_heads, head_dim)
    quantized = kv_dtype in ("int8", "fp8")

    if kv_dtype == "int8":
        # int8 cannot hold NaN: poison through the scales; the values are garbage anyway.
        k_pool = rng.integers(-127, 128, pool_shape).astype(np.int8)
        v_pool = rng.integers(-127, 128, pool_shape).astype(np.int8)
    else:
        k_pool = np.full(pool_shape, np.nan, np.float32)
        v_pool = np.full(pool_shape, np.nan, np.float32)
    k_scales = np.full(pool_shape[:-1], np.nan, np.float32)
    v_scales = np.full(pool_shape[:-1], np.nan, np.float32)

    free_blocks = list(rng.permutation(np.arange(1, num_blocks)))
    block_tables = np.zeros((len(context_lens), max_blocks), np.int32)
    dense_k, dense_v = [], []
    for s, context_len in enumerate(context_lens):
        token_shape = (context_len, num_kv_heads, head_dim)
        if kv_dtype == "int8":
            k_vals = rng.integers(-127, 128, token_shape).astype(np.int8)
            v_vals = rng.integers(-127, 128, token_shape).astype(np.int8)
            k_scale = rng.uniform(0.004, 0.02, token_shape[:-1]).astype(np.float32)
            v_scale = rng.uniform(0.004, 0.02, token_shape[:-1]).astype(np.float32)
        elif kv_dtype == "fp8":
            k_vals = (2 * rng.standard_normal(token_shape)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
            v_vals = (2 * rng.standard_normal(token_shape)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
            k_scale = rng.uniform(0.2, 1.0, token_shape[:-1]).astype(np.float32)
            v_scale = rng.uniform(0.2, 1.0, token_shape[:-1]).astype(np.float32)
        else:
            # Round through the pool dtype so the float64 truth sees what the pool holds.
            k_vals = rng.standard_normal(token_shape).astype(kv_dtype).astype(np.float32)
            v_vals = rng.standard_normal(token_shape).astype(kv_dtype).astype(np.float32)
            k_scale = v_scale = np.ones(token_shape[:-1], np.float32)
        for b in range(blocks_per_seq[s]):
            block = block_tables[s, b] = free_blocks.pop()
            first, n = b * block_size, min(block_size, context_len - b * block_size)
            k_pool[LAYER, block, :n] = k_vals[first : first + n]
            v_pool[LAYER, block, :n] = v_vals[first : first + n]
            k_scales[LAYER, block, :n] = k_scale[first : first + n]
            v_scales[LAYER, block, :n] = v_scale[first : first + n]
        dense_k.append(k_vals.astype(np.float64) * k_scale[..., None])
        dense_v.append(v_vals.astype(np.float64) * v_scale[..., None])

    pool_dtype = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}.get(kv_dtype, kv_dtype)
    num_heads = num_kv_heads * group
    q = rng.standard_normal((len(context_lens), num_queries, num_heads, head_dim)).astype(np.float32)
    inputs = dict(
        q=jnp.asarray(q, q_dtype),
        k_pool=jnp.asarray(k_pool, pool_dtype),
        v_pool=jnp.asarray(v_pool, pool_dtype),
        layer_index=jnp.int32(LAYER),
        block_tables=jnp.asarray(block_tables),
        context_lens=jnp.asarray(context_lens),
        k_scales=jnp.asarray(k_scales) if quantized else None,
        v_scales=jnp.asarray(v_scales) if quantized else None,
    )
    return inputs, dense_k, dense_v


def float64_attention(q, context_lens, dense_k, dense_v, group, sliding_window=None):
    """Independent truth: per sequence, query and head, softmax over the visible dense keys."""
    q = np.asarray(q.astype(jnp.float32), np.float64)
    num_seqs, num_queries, num_heads, head_dim = q.shape
    out = np.zeros(q.shape, np.float64)
    for s in range(num_seqs):
        for i in range(num_queries):
            pos = int(context_lens[s]) - num_queries + i
            first = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            if pos < 0:
                continue  # padding sequence
            for h in range(num_heads):
                k = dense_k[s][first : pos + 1, h // group]
                v = dense_v[s][first : pos + 1, h // group]
                scores = k @ q[s, i, h] / np.sqrt(head_dim)
                weights = np.exp(scores - scores.max())
                out[s, i, h] = weights / weights.sum() @ v
    return out


def tolerance(q_dtype):
    # bf16 queries mean bf16 dot operands (probabilities included): ~3 significant digits.
    return dict(atol=3e-2, rtol=3e-2) if q_dtype == jnp.bfloat16 else dict(atol=3e-5, rtol=1e-4)


def check_against_truth(out, expected, q_dtype):
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, expected, **tolerance(q_dtype))


# (head_dim, group, block_size, num_queries, kv_dtype, q_dtype, sliding_window, context_lens)
# context_lens are ragged within a call and include a padding sequence (0) in most.
CASES = [
    (64, 1, 8, 1, "float32", jnp.float32, None, [1, 37, 0, 9]),
    (128, 3, 16, 2, "bfloat16", jnp.bfloat16, None, [70, 2, 16, 0]),
    (64, 4, 32, 4, "int8", jnp.float32, None, [4, 100, 33, 0]),
    (128, 8, 8, 1, "fp8", jnp.float32, None, [1, 8, 41, 0]),
    (64, 4, 16, 2, "float32", jnp.float32, 13, [90, 5, 0, 17]),
    (64, 8, 8, 4, "fp8", jnp.bfloat16, 20, [60, 4, 0, 23]),
    (128, 1, 32, 4, "int8", jnp.bfloat16, 40, [130, 7, 0, 64]),
    (64, 3, 8, 2, "float32", jnp.float32, None, [2, 3, 55, 24]),
]


@pytest.mark.parametrize("case_index", range(len(CASES)))
def test_kernel_matches_reference_and_float64(case_index):
    head_dim, group, block_size, num_queries, kv_dtype, q_dtype, sliding_window, context_lens = CASES[case_index]
    rng = np.random.default_rng(case_index)
    num_kv_heads = 1 if group == 8 else 2
    inputs, dense_k, dense_v = build_case(
        rng,
        context_lens,
        num_queries=num_queries,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        kv_dtype=kv_dtype,
        q_dtype=q_dtype,
    )
    expected = float64_attention(inputs["q"], context_lens, dense_k, dense_v, group, sliding_window)

    # Several splits so that every case also exercises the split merge.
    out = paged_decode_attention(**inputs, sliding_window=sliding_window, num_splits=3, interpret=True)
    reference = paged_decode_attention_reference(**inputs, sliding_window=sliding_window)
    assert out.shape == inputs["q"].shape and out.dtype == q_dtype
    check_against_truth(out, expected, q_dtype)
    check_against_truth(reference, expected, q_dtype)
    padding = np.asarray(context_lens) == 0
    assert (np.asarray(out.astype(jnp.float32))[padding] == 0).all()


@pytest.mark.parametrize("seed", range(4))
def test_random_configurations(seed):
    """Randomly drawn shapes, dtypes, window and ragged context lengths (seeded)."""
    rng = np.random.default_rng(1000 + seed)
    head_dim = int(rng.choice([64, 128]))
    group = int(rng.choice([1, 3, 4, 8]))
    block_size = int(rng.choice([8, 16, 32]))
    num_queries = int(rng.choice([1, 2, 4]))
    kv_dtype = str(rng.choice(["float32", "bfloat16", "int8", "fp8"]))
    q_dtype = jnp.bfloat16 if kv_dtype == "bfloat16" else jnp.float32
    sliding_window = None if rng.random() < 0.5 else int(rng.integers(1, 3 * block_size))
    context_lens = rng.integers(num_queries, 5 * block_size + 1, 4)
    context_lens[rng.integers(4)] = 0  # one padding sequence
    inputs, dense_k, dense_v = build_case(
        rng,
        context_lens,
        num_queries=num_queries,
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        kv_dtype=kv_dtype,
        q_dtype=q_dtype,
    )
    expected = float64_attention(inputs["q"], context_lens, dense_k, dense_v, group, sliding_window)
    out = paged_decode_attention(**inputs, sliding_window=sliding_window, num_splits=1 + seed, interpret=True)
    check_against_truth(out, expected, q_dtype)
    check_against_truth(paged_decode_attention_reference(**inputs, sliding_window=sliding_window), expected, q_dtype)


def long_and_short_case(sliding_window):
    """One long sequence among short ones and a padding sequence, f32, GQA 4, block size 8."""
    context_lens = [300, 3, 0, 17, 9]
    rng = np.random.default_rng(100 + (sliding_window or 0))
    inputs, dense_k, dense_v = build_case(
        rng,
        context_lens,
        num_queries=2,
        num_kv_heads=2,
        group=4,
        head_dim=64,
        block_size=8,
        kv_dtype="float32",
        q_dtype=jnp.float32,
    )
    expected = float64_attention(inputs["q"], context_lens, dense_k, dense_v, 4, sliding_window)
    return inputs, expected, np.asarray(context_lens)


@pytest.mark.parametrize("sliding_window", [None, 45])
def test_split_count_does_not_change_the_result(sliding_window):
    inputs, expected, context_lens = long_and_short_case(sliding_window)
    num_seqs, num_kv_heads = inputs["q"].shape[0], inputs["k_pool"].shape[3]
    tilings = [dict(num_splits=1, blocks_per_tile=2), dict(num_splits=5, blocks_per_tile=2)]
    assert [decode_tiling(64, 8, num_seqs, num_kv_heads, **t)[1] for t in tilings] == [1, 5]

    single, split = (
        np.asarray(paged_decode_attention(**inputs, sliding_window=sliding_window, interpret=True, **t))
        for t in tilings
    )
    check_against_truth(single, expected, jnp.float32)
    check_against_truth(split, expected, jnp.float32)
    np.testing.assert_allclose(split, single, atol=2e-6, rtol=1e-5)
    # The padding sequence gives exact zeros, not NaN, with and without splits.
    assert (single[context_lens == 0] == 0).all() and (split[context_lens == 0] == 0).all()


def test_default_tuning_matches_float64():
    inputs, expected, _ = long_and_short_case(None)
    out = paged_decode_attention(**inputs, interpret=True)
    check_against_truth(out, expected, jnp.float32)


def new_kv_case(seed, context_lens, kv_dtype, q_dtype, num_queries=1, group=3, sliding_window=None):
    """A decode (Q = 1) or verify step whose own K/V (each sequence's last Q
    positions) are not in the pool yet: their slots hold NaN, and q carries
    them as heads H.. of one [S, Q, H + 2 KVH, D] array."""
    inputs, dense_k, dense_v = build_case(np.random.default_rng(seed), context_lens, num_queries=num_queries,
                                          num_kv_heads=2, group=group, head_dim=64, block_size=8, kv_dtype=kv_dtype,
                                          q_dtype=q_dtype)
    k_pool, v_pool = np.asarray(inputs["k_pool"]).copy(), np.asarray(inputs["v_pool"]).copy()
    tables = np.asarray(inputs["block_tables"])
    new_k = np.zeros((len(context_lens), num_queries, 2, 64), np.float32)
    new_v = np.zeros_like(new_k)
    slots = {}  # (sequence, row) -> (block, slot)
    for s, context_len in enumerate(context_lens):
        for j in range(num_queries if context_len else 0):
            position = context_len - num_queries + j
            block, slot = tables[s, position // 8], position % 8
            new_k[s, j], new_v[s, j] = dense_k[s][position], dense_v[s][position]
            k_pool[LAYER, block, slot] = v_pool[LAYER, block, slot] = np.nan
            slots[s, j] = (block, slot)
    q = jnp.concatenate([inputs["q"], jnp.asarray(new_k, q_dtype), jnp.asarray(new_v, q_dtype)], axis=2)
    expected = float64_attention(inputs["q"], context_lens, dense_k, dense_v, group, sliding_window)
    pools = {name: jnp.asarray(pool, inputs[name].dtype) for name, pool in (("k_pool", k_pool), ("v_pool", v_pool))}
    return {**inputs, "q": q, **pools}, expected, new_k, new_v, slots


@pytest.mark.parametrize("kv_dtype,q_dtype,num_splits,num_queries,sliding_window", [
    ("float32", jnp.float32, 1, 1, None), ("float32", jnp.float32, 3, 1, None), ("bfloat16", jnp.bfloat16, 4, 1, None),
    ("float32", jnp.float32, 3, 3, None), ("float32", jnp.float32, 2, 4, 6)])
def test_new_kv_written_into_the_pool_and_attended(kv_dtype, q_dtype, num_splits, num_queries, sliding_window):
    """new_kv: the kernel writes each live sequence's own K/V (its last Q
    positions: a decode step, or a verify step's rows) into their slots
    (exactly, nothing else in either pool changes: NaN poison included) and
    attends to them as if they had been there (float64 truth, causal and
    windowed among the new rows too); a context of Q keys sees only its own,
    a padding sequence writes nothing."""
    context_lens = [num_queries, 37, 0, 9, 16]
    inputs, expected, new_k, new_v, slots = new_kv_case(7, context_lens, kv_dtype, q_dtype, num_queries,
                                                        sliding_window=sliding_window)
    out, k_pool, v_pool = paged_decode_attention(**inputs, num_splits=num_splits, sliding_window=sliding_window,
                                                 new_kv=True, interpret=True)
    assert out.shape == (5, num_queries, 6, 64) and out.dtype == q_dtype
    check_against_truth(out, expected, q_dtype)
    assert (np.asarray(out.astype(jnp.float32))[2] == 0).all()
    # float32 views: numpy compares NaN positions only for its own float types.
    want_k, want_v = (np.array(inputs[pool].astype(jnp.float32)) for pool in ("k_pool", "v_pool"))
    for (s, j), (block, slot) in slots.items():
        want_k[LAYER, block, slot], want_v[LAYER, block, slot] = new_k[s, j], new_v[s, j]
    np.testing.assert_array_equal(np.asarray(k_pool.astype(jnp.float32)), want_k)
    np.testing.assert_array_equal(np.asarray(v_pool.astype(jnp.float32)), want_v)


def test_new_kv_lowers_to_triton_with_the_pools_in_place():
    """Cross-lowered for CUDA, the new_kv kernel is a Triton call whose pool
    outputs alias its pool inputs (written in place, never copied)."""
    inputs, *_ = new_kv_case(8, [40, 9, 0], "bfloat16", jnp.bfloat16, num_queries=2)
    for num_splits in (1, 2):
        lowered = jax.jit(lambda i: paged_decode_attention(**i, num_splits=num_splits, new_kv=True)).trace(
            inputs).lower(lowering_platforms=("cuda",))
        text = lowered.as_text()
        assert "triton" in text and "output_operand_aliases" in text


def test_decode_tiling_respects_triton_limits():
    for head_dim in (64, 128):
        for block_size in (8, 16, 32):
            blocks_per_tile, _ = decode_tiling(head_dim, block_size, 4, 8)
            tile_tokens = blocks_per_tile * block_size
            assert tile_tokens >= 16 and tile_tokens & (tile_tokens - 1) == 0
    with pytest.raises(ValueError):
        decode_tiling(64, 8, 4, 8, blocks_per_tile=1)  # 8-token tile: too small for a Triton dot
    with pytest.raises(ValueError):
        decode_tiling(64, 8, 4, 8, num_splits=0)


def test_split_count_fills_the_gpu_from_the_batch_shape():
    """The default split count comes from sequences x KV heads alone: a lone
    sequence spreads over many programs, a large batch is not split."""
    assert default_num_splits(1, 8) == 32
    assert default_num_splits(64, 8) == 1
    assert default_num_splits(1, 1) == _MAX_SPLITS
    for num_seqs in (1, 2, 3, 7, 16, 33, 64, 256):
        for num_kv_heads in (1, 2, 8):
            num_splits = default_num_splits(num_seqs, num_kv_heads)
            programs = num_seqs * num_kv_heads * num_splits
            assert num_splits >= 1 and num_splits & (num_splits - 1) == 0
            # Never more programs than the target unless the batch alone exceeds it,
            # and a doubling would overshoot it (or hit the cap).
            assert programs <= max(_TARGET_PROGRAMS, num_seqs * num_kv_heads)
            assert 2 * programs > _TARGET_PROGRAMS or num_splits == _MAX_SPLITS


def widened(inputs, max_blocks, rng):
    """The same batch with its block table widened (or cut) to max_blocks
    columns: the columns past each sequence's blocks point at random blocks,
    poisoned or owned by other sequences, which the kernel must never read into
    a live key."""
    table = np.asarray(inputs["block_tables"])
    num_blocks = inputs["k_pool"].shape[1]
    wide = rng.integers(0, num_blocks, (table.shape[0], max_blocks)).astype(np.int32)
    used = -(-np.asarray(inputs["context_lens"]) // inputs["k_pool"].shape[2])
    for s, n in enumerate(used):
        wide[s, :n] = table[s, :n]
    return {**inputs, "block_tables": jnp.asarray(wide)}


# The split counts default_num_splits can return.
CHOOSER_SPLITS = sorted({default_num_splits(n, 1) for n in range(1, 2 * _TARGET_PROGRAMS)})


def narrow_case(sliding_window):
    """Contexts that fit an 8-block table (block size 16), small head_dim, GQA 4."""
    context_lens = [128, 37, 0, 2]
    rng = np.random.default_rng(7)
    inputs, dense_k, dense_v = build_case(
        rng, context_lens, num_queries=2, num_kv_heads=2, group=4, head_dim=16, block_size=16,
        kv_dtype="float32", q_dtype=jnp.float32,
    )
    expected = float64_attention(inputs["q"], context_lens, dense_k, dense_v, 4, sliding_window)
    return inputs, expected


@pytest.mark.slow
@pytest.mark.parametrize("max_blocks", [8, 64, 1024])
def test_table_width_does_not_change_the_result(max_blocks):
    """Same contexts, tables of 8, 64 and 1024 columns, match float64 with
    16-token tiles (a 128-token context spans 8 tiles, so the larger split
    counts leave splits with no key): at every split count the chooser can
    pick on the widest table, at the extremes on the others."""
    assert CHOOSER_SPLITS == [1 << i for i in range(_MAX_SPLITS.bit_length())]
    inputs, expected = narrow_case(None)
    inputs = widened(inputs, max_blocks, np.random.default_rng(max_blocks))
    split_counts = CHOOSER_SPLITS if max_blocks == 1024 else [1, _MAX_SPLITS]
    for num_splits in split_counts:
        out = paged_decode_attention(**inputs, num_splits=num_splits, blocks_per_tile=1, interpret=True)
        check_against_truth(out, expected, jnp.float32)
    if max_blocks == 1024:
        check_against_truth(paged_decode_attention_reference(**inputs), expected, jnp.float32)
    # The default tiling, and a sliding window whose visible tiles are shared out.
    check_against_truth(paged_decode_attention(**inputs, interpret=True), expected, jnp.float32)
    windowed_inputs, windowed = narrow_case(45)
    windowed_inputs = widened(windowed_inputs, max_blocks, np.random.default_rng(max_blocks))
    out = paged_decode_attention(**windowed_inputs, sliding_window=45, num_splits=4, blocks_per_tile=1, interpret=True)
    check_against_truth(out, windowed, jnp.float32)


def pallas_calls(jaxpr):
    """Every pallas_call equation in a jaxpr, through nested jit bodies."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
            continue
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                yield from pallas_calls(inner)


def decode_call_shape(num_seqs, num_kv_heads, group, head_dim, block_size, max_blocks, dtype=jnp.bfloat16):
    """(grid, output bytes) of the decode kernel's pallas_call for these shapes,
    read from the traced program (abstract inputs: nothing is allocated)."""
    pool = jax.ShapeDtypeStruct((2, 64, block_size, num_kv_heads, head_dim), dtype)
    args = (
        jax.ShapeDtypeStruct((num_seqs, 1, num_kv_heads * group, head_dim), dtype),
        pool,
        pool,
        jax.ShapeDtypeStruct((), jnp.int32),
        jax.ShapeDtypeStruct((num_seqs, max_blocks), jnp.int32),
        jax.ShapeDtypeStruct((num_seqs,), jnp.int32),
    )
    jaxpr = jax.make_jaxpr(lambda *a: paged_decode_attention(*a, interpret=True))(*args)
    # The attention kernel; with several splits a merge kernel follows it (test_merge_kernel_matches_float64).
    call = next(pallas_calls(jaxpr.jaxpr))
    out_bytes = sum(v.aval.size * v.aval.dtype.itemsize for v in call.outvars)
    return tuple(call.params["grid_mapping"].grid), out_bytes


def test_grid_and_output_bytes_do_not_grow_with_the_table():
    """The kernel's grid and the bytes its programs write, for a table sized
    for 128 tokens up to one sized for 131,072, stay those of the batch's shape."""
    for num_seqs in (1, 4, 64):
        shapes = {decode_call_shape(num_seqs, 8, 4, 128, 16, max_blocks) for max_blocks in (8, 64, 1024, 8192)}
        assert len(shapes) == 1, shapes
        ((grid, out_bytes),) = shapes
        num_splits = default_num_splits(num_seqs, 8)
        assert grid == (num_seqs, 8, num_splits)
        # The 4 query rows of each KV head are written where they live: the
        # padding rows of the program's 16-row dots are not written at all.
        if num_splits == 1:
            # One split writes the final output in q's dtype (bf16), no log-sum-exp.
            assert out_bytes == num_seqs * 8 * 4 * 128 * 2
        else:
            assert out_bytes == num_seqs * 8 * num_splits * 4 * (128 + 1) * 4
    # Batch 1 with 8 KV heads: 32 splits and 0.5 MiB of partials, at any max_model_len.
    assert decode_call_shape(1, 8, 4, 128, 16, 8192) == ((1, 8, 32), 8 * 32 * 4 * 129 * 4)


@pytest.mark.parametrize("num_splits", [2, 3, 32])
def test_merge_kernel_matches_float64(num_splits):
    """The splits' merge kernel against the log-sum-exp merge in float64:
    splits with no keys (lse -inf) weigh nothing and their outputs, which
    the decode kernel leaves unwritten (NaN here), are not read; a row whose
    splits all had none gives 0 (not NaN), a split count that is not a power
    of two reads no padding, and the result comes out in the dtype asked for."""
    rng = np.random.default_rng(num_splits)
    shape = (3, num_splits, 2, 4)  # sequences, splits, queries, heads
    out = rng.standard_normal((*shape, 16)).astype(np.float32)
    lse = (rng.standard_normal(shape) * 20).astype(np.float32)  # spread wide: exp() needs the max shift
    lse[rng.random(shape) < 0.3] = -np.inf
    lse[0, :, 1, 2] = -np.inf  # a row with no keys anywhere
    row_max = lse.astype(np.float64).max(1, keepdims=True)
    weights = np.exp(lse - np.where(np.isfinite(row_max), row_max, 0.0))  # exp(-inf) = 0
    total = weights.sum(1)
    expected = (out * weights[..., None]).sum(1) / np.where(total > 0, total, 1)[..., None]
    out[np.isneginf(lse)] = np.nan
    for dtype, tolerance in ((jnp.float32, 1e-6), (jnp.bfloat16, 8e-3)):
        merged = merge_splits(jnp.asarray(out), jnp.asarray(lse), dtype, interpret=True)
        assert merged.dtype == dtype and merged.shape == (3, 2, 4, 16)
        np.testing.assert_allclose(np.asarray(merged.astype(jnp.float32)), expected, rtol=tolerance, atol=tolerance)
    assert not np.asarray(merged[0, 1, 2]).any()


@pytest.mark.parametrize("q_dtype,kv_dtype", [("float32", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", "int8"),
                                              ("bfloat16", "fp8")])
def test_lowers_to_triton_for_cuda(q_dtype, kv_dtype):
    """Cross-lowering for CUDA on this CPU host runs the real Pallas Triton
    lowering rules on the kernel (primitives, casts, index forms) up to the
    Triton IR, which interpret mode never exercises; only PTX compilation is
    left to a GPU."""
    inputs, _, _ = build_case(
        np.random.default_rng(4), [40, 9, 0], num_queries=2, num_kv_heads=2, group=3, head_dim=64, block_size=16,
        kv_dtype=kv_dtype, q_dtype=q_dtype,
    )

    # One split (final output, no log-sum-exp) and several (partials to merge).
    for num_splits in (1, 2):

        def attention(inputs):
            return paged_decode_attention(**inputs, sliding_window=9, num_splits=num_splits)

        lowered = jax.jit(attention).trace(inputs).lower(lowering_platforms=("cuda",))
        assert "triton" in lowered.as_text()
