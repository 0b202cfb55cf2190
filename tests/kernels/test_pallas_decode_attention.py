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
    decode_tiling,
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

    # Small splits so that every case also exercises the split merge.
    out = paged_decode_attention(**inputs, sliding_window=sliding_window, blocks_per_split=4, interpret=True)
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
    out = paged_decode_attention(**inputs, sliding_window=sliding_window, blocks_per_split=2, interpret=True)
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
    max_blocks = inputs["block_tables"].shape[1]
    tilings = [dict(num_splits=1, blocks_per_tile=2), dict(num_splits=5, blocks_per_tile=2)]
    assert [decode_tiling(64, 8, max_blocks, **t)[2] for t in tilings] == [1, 5]

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


def test_decode_tiling_respects_triton_limits():
    for head_dim in (64, 128):
        for block_size in (8, 16, 32):
            for max_blocks in (1, 3, 17, 256):
                blocks_per_tile, blocks_per_split, num_splits = decode_tiling(head_dim, block_size, max_blocks)
                tile_tokens = blocks_per_tile * block_size
                assert tile_tokens >= 16 and tile_tokens & (tile_tokens - 1) == 0
                assert blocks_per_split % blocks_per_tile == 0
                assert (num_splits - 1) * blocks_per_split < max_blocks <= num_splits * blocks_per_split
    # A long context spreads over several splits by default.
    assert decode_tiling(128, 16, 2048)[2] > 1
    with pytest.raises(ValueError):
        decode_tiling(64, 8, 16, blocks_per_tile=1)  # 8-token tile: too small for a Triton dot


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

    def attention(inputs):
        return paged_decode_attention(**inputs, sliding_window=9, blocks_per_split=2)

    lowered = jax.jit(attention).trace(inputs).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()
