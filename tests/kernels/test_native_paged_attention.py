"""The native CPU paged attention kernel (native/paged_attention.cc)
against a float64 numpy computation on dense per-sequence K/V: decode (1 row
per sequence), verification (1 + K rows) and prompt (ragged rows per
sequence) layouts, GQA, sliding windows, every pool dtype, a layer index
into a multi-layer pool, and padding rows. Pool slots no sequence owns hold
NaN, so reading a wrong slot fails."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.models.kv_cache import as_fp8, quantize_kv
from jaxinfer.native import paged_attention as cpu_paged_attention
from tests.kernels.test_paged_attention_reference import make_case as paged_case
from tests.kernels.test_paged_attention_reference import numpy_attention as numpy_ragged_attention


def test_kernel_builds_here():
    # Not a skip: the suite runs where g++ is (CI installs nothing else), and
    # without the kernel every CPU decode step silently takes the slow path.
    assert cpu_paged_attention.available()


def make_case(rng, num_seqs, rows, block_size, num_kv_heads, group, head_dim, num_layers, layer):
    """test_paged_attention's random contexts and NaN-poisoned pool, with one
    sequence emptied into a padding row (its blocks poisoned too, its table
    the null block), the pool placed at `layer` of a NaN-filled
    [layers, blocks, block_size, KV, D] stack, and R query rows per sequence."""
    _, pool_k, pool_v, meta, dense_k, dense_v = paged_case(rng, num_seqs, block_size, num_kv_heads, group, head_dim,
                                                           max_ctx_blocks=6)
    tables, context_lens = meta.block_tables.copy(), meta.context_lens.copy()
    empty = rng.integers(num_seqs)
    pool_k[tables[empty]] = pool_v[tables[empty]] = np.nan
    tables[empty], context_lens[empty] = 0, 0
    k_pool, v_pool = (np.full((num_layers, *pool.shape), np.nan, np.float32) for pool in (pool_k, pool_v))
    k_pool[layer], v_pool[layer] = pool_k, pool_v
    q = rng.standard_normal((num_seqs, rows, num_kv_heads * group, head_dim)).astype(np.float32)
    return q, k_pool, v_pool, tables, context_lens, list(zip(dense_k, dense_v))


def numpy_attention(q, dense, context_lens, group, sliding_window=None):
    """float64: row r of sequence s sits at context_len - rows + r and sees
    keys at positions <= its own (within the window); no key -> zeros."""
    num_seqs, rows, num_heads, head_dim = q.shape
    out = np.zeros(q.shape, np.float64)
    for s in range(num_seqs):
        k, v = (x.astype(np.float64) for x in dense[s])
        for r in range(rows):
            pos = context_lens[s] - rows + r
            first = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            if pos < 0:
                continue
            for h in range(num_heads):
                scores = k[first:pos + 1, h // group] @ q[s, r, h].astype(np.float64) / np.sqrt(head_dim)
                weights = np.exp(scores - scores.max())
                out[s, r, h] = weights @ v[first:pos + 1, h // group] / weights.sum()
    return out


def run_kernel(q, k_pool, v_pool, tables, context_lens, layer, sliding_window=None, k_scales=None, v_scales=None):
    fn = jax.jit(lambda *a: cpu_paged_attention.paged_decode_attention(
        *a, k_scales=k_scales, v_scales=v_scales, sliding_window=sliding_window))
    return np.asarray(fn(jnp.asarray(q), k_pool, v_pool, jnp.int32(layer), jnp.asarray(tables),
                         jnp.asarray(context_lens)))


@pytest.mark.parametrize("rows,group,head_dim,sliding_window,num_seqs",
                         [(1, 3, 64, None, 5), (1, 1, 128, None, 13), (4, 4, 64, None, 3), (1, 3, 64, 20, 5),
                          (3, 2, 32, 7, 9), (2, 3, 64, None, 4), (3, 1, 128, 9, 6)])
def test_float32_pool_matches_float64(rows, group, head_dim, sliding_window, num_seqs):
    # 13 sequences with 2 KV heads: enough for the kernel's one-task-per-sequence split.
    # Head dims 64 and 128 take the register loops (vec16.h), on AVX-512 in runs of 4 and 2
    # query rows (rows x group = 3, 16, 6: a short last run of 3, none, 2; 1 and 3 at 128),
    # on AVX2 one row at a time; 32 takes the general loop.
    rng = np.random.default_rng(rows * 100 + head_dim + num_seqs)
    q, k_pool, v_pool, tables, context_lens, dense = make_case(rng, num_seqs, rows, 16, 2, group, head_dim,
                                                               num_layers=3, layer=1)
    out = run_kernel(q, jnp.asarray(k_pool), jnp.asarray(v_pool), tables, context_lens, 1, sliding_window)
    np.testing.assert_allclose(out, numpy_attention(q, dense, context_lens, group, sliding_window),
                               atol=2e-5, rtol=1e-5)


def test_sharp_scores_match_float64():
    """Queries 40x larger: scores minus their maximum reach below -100, where
    exp underflows to 0 (the kernel's vector exp clamps and scales by 2^n
    there), and every other range of its argument in between."""
    rng = np.random.default_rng(11)
    q, k_pool, v_pool, tables, context_lens, dense = make_case(rng, 6, 1, 16, 2, 3, 64, num_layers=2, layer=0)
    q *= 40
    out = run_kernel(q, jnp.asarray(k_pool), jnp.asarray(v_pool), tables, context_lens, 0)
    np.testing.assert_allclose(out, numpy_attention(q, dense, context_lens, 3), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8", "fp8"])
def test_low_precision_pools_read_back_as_stored(kv_dtype):
    """The reference gets the values the pool holds (rounded or quantized and
    dequantized with their per-token scales), so only the kernel's own
    reading and arithmetic are under test."""
    rng = np.random.default_rng(7)
    q, k_pool, v_pool, tables, context_lens, dense = make_case(rng, 6, 2, 16, 3, 3, 64, num_layers=2, layer=0)
    k_pool, v_pool = np.nan_to_num(k_pool), np.nan_to_num(v_pool)
    if kv_dtype == "bfloat16":
        k_stored, v_stored = jnp.asarray(k_pool, jnp.bfloat16), jnp.asarray(v_pool, jnp.bfloat16)
        scales = {}
        k_read, v_read = np.asarray(k_stored, np.float32), np.asarray(v_stored, np.float32)
    else:
        storage = jnp.int8 if kv_dtype == "int8" else jnp.uint8  # fp8 as its bits, as the CPU pool holds it
        (k_stored, k_scale), (v_stored, v_scale) = quantize_kv(k_pool, storage), quantize_kv(v_pool, storage)
        scales = {"k_scales": k_scale, "v_scales": v_scale}
        k_read = np.asarray(as_fp8(k_stored).astype(np.float32)) * np.asarray(k_scale)[..., None]
        v_read = np.asarray(as_fp8(v_stored).astype(np.float32)) * np.asarray(v_scale)[..., None]
    # The dense reference from the stored values, block by block.
    stored = []
    for s, (k, _) in enumerate(dense):
        positions = np.arange(len(k))
        rows_of = tables[s, positions // 16], positions % 16
        stored.append((k_read[0][rows_of], v_read[0][rows_of]))
    out = run_kernel(q, k_stored, v_stored, tables, context_lens, 0, **scales)
    np.testing.assert_allclose(out, numpy_attention(q, stored, context_lens, 3), atol=2e-5, rtol=1e-5)


def scattered_pools(rng, context_lens, num_kv_heads, head_dim, block_size=16, num_layers=1, layer=0, spare_blocks=0):
    """NaN-filled K and V pools [layers, blocks, block_size, KV, D] (null block
    0 and `spare_blocks` unused ones included) holding each sequence's random
    K/V at `layer` in blocks scattered over the pool; -> (k_pool, v_pool,
    block tables, each sequence's dense (K, V))."""
    blocks = [-(-c // block_size) for c in context_lens]
    num_blocks = 1 + sum(blocks) + spare_blocks
    pools = [np.full((num_layers, num_blocks, block_size, num_kv_heads, head_dim), np.nan, np.float32)
             for _ in range(2)]
    free = list(rng.permutation(np.arange(1, num_blocks)))
    tables = np.zeros((len(context_lens), max(blocks) + 1), np.int32)
    dense = []
    for s, context in enumerate(context_lens):
        kv = [rng.standard_normal((context, num_kv_heads, head_dim)).astype(np.float32) for _ in range(2)]
        for b in range(blocks[s]):
            tables[s, b] = free.pop()
            n = min(block_size, context - b * block_size)
            for pool, x in zip(pools, kv):
                pool[layer, tables[s, b], :n] = x[b * block_size:][:n]
        dense.append(tuple(kv))
    return *pools, tables, dense


def long_case(rng, context_lens, rows, num_kv_heads=2, group=3, head_dim=64):
    """make_case's shapes for contexts of many blocks: a one-layer pool
    (scattered_pools) and R query rows per sequence."""
    k_pool, v_pool, tables, dense = scattered_pools(rng, context_lens, num_kv_heads, head_dim)
    q = rng.standard_normal((len(context_lens), rows, num_kv_heads * group, head_dim)).astype(np.float32)
    return q, k_pool, v_pool, tables, np.array(context_lens, np.int32), dense


@pytest.mark.parametrize("rows,sliding_window", [(1, None), (3, None), (1, 300)])
def test_long_context_at_few_sequences_matches_float64(rows, sliding_window):
    """Decode and verification at two sequences of 715 and 300 tokens: too
    few runs of rows for the cores, so each sequence's keys are cut into
    chunks of 16 blocks computed by tasks of their own and merged (a window
    of 300 hides whole chunks)."""
    rng = np.random.default_rng(rows + (sliding_window or 0))
    q, k_pool, v_pool, tables, context_lens, dense = long_case(rng, [715, 300], rows)
    out = run_kernel(q, jnp.asarray(k_pool), jnp.asarray(v_pool), tables, context_lens, 0, sliding_window)
    np.testing.assert_allclose(out, numpy_attention(q, dense, context_lens, 3, sliding_window), atol=2e-5, rtol=1e-5)


def test_a_rows_output_does_not_depend_on_its_batch():
    """The same decode row, bit for bit, whether its sequence is the only one
    (its 40 blocks shared out over tasks chunk by chunk, then by KV head) or
    one of 16 (a task each): the exact default promises that another batch
    never changes a greedy decode."""
    rng = np.random.default_rng(5)
    q, k_pool, v_pool, tables, context_lens, _ = long_case(rng, [640 - s for s in range(16)], 1)
    k_pool, v_pool = jnp.asarray(k_pool), jnp.asarray(v_pool)
    batch = run_kernel(q, k_pool, v_pool, tables, context_lens, 0)
    for s in (0, 7):
        alone = run_kernel(q[s:s + 1], k_pool, v_pool, tables[s:s + 1], context_lens[s:s + 1], 0)
        np.testing.assert_array_equal(alone[0], batch[s])


PROMPT_STEP = [(70, 70), (1, 1), (90, 33), (0, 0), (45, 1), (17, 17)]


@pytest.mark.parametrize("head_dim,sliding_window,contexts_and_rows", [
    (64, None, PROMPT_STEP), (32, None, PROMPT_STEP), (64, 24, PROMPT_STEP), (64, None, [(6000, 40), (3, 1)])])
def test_prompt_rows_match_float64(head_dim, sliding_window, contexts_and_rows):
    """A flattened step as the engine builds it: a whole prompt of 70 rows (three
    runs of the kernel's 32 positions), a chunk of 33 at the end of a longer
    context, decode rows, a sequence with no rows (padding), then padding rows.
    Head dim 64 takes the register loops, 32 the general one. A chunk of 40
    rows over 6,000 keys is cut into runs of 29 and 11 (the scores buffer's
    bound, kScoreFloats)."""
    rng = np.random.default_rng(head_dim + (sliding_window or 0) + len(contexts_and_rows))
    num_kv_heads, group, layer = 2, 3, 1
    k_pool, v_pool, tables, dense = scattered_pools(rng, [c for c, _ in contexts_and_rows], num_kv_heads, head_dim,
                                                    num_layers=2, layer=layer, spare_blocks=2)
    dense_k, dense_v = [k for k, _ in dense], [v for _, v in dense]
    token_seq, positions = [], []
    for s, (context, rows) in enumerate(contexts_and_rows):
        token_seq += [s] * rows
        positions += range(context - rows, context)
    num_padding = 3
    q = rng.standard_normal((len(token_seq) + num_padding, num_kv_heads * group, head_dim)).astype(np.float32)
    query_start = np.concatenate([[0], np.cumsum([r for _, r in contexts_and_rows])]).astype(np.int32)
    context_lens = np.array([c for c, _ in contexts_and_rows], np.int32)
    fn = jax.jit(lambda *a: cpu_paged_attention.paged_attention(*a, sliding_window=sliding_window))
    out = np.asarray(fn(jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), jnp.int32(layer),
                        jnp.asarray(tables), jnp.asarray(context_lens), jnp.asarray(query_start)))
    rows = types.SimpleNamespace(token_seq=token_seq, positions=positions)
    expected = numpy_ragged_attention(q[:len(token_seq)], rows, dense_k, dense_v, group, sliding_window)
    np.testing.assert_allclose(out[:len(token_seq)], expected, atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(out[len(token_seq):], 0.0)


def test_engine_decode_step_calls_the_kernel():
    """The CPU backend's decode attention compiles to the kernel's custom
    call, not the jnp tile loop (whose results the engine tests compare with
    HF transformers through this same path)."""
    from jaxinfer.backends import CpuBackend
    from jaxinfer.models.paged_attention import PagedAttentionMetadata

    rng = np.random.default_rng(0)
    q, k_pool, v_pool, tables, context_lens, _ = make_case(rng, 4, 1, 16, 2, 2, 32, num_layers=1, layer=0)
    meta = PagedAttentionMetadata(slot_mapping=jnp.zeros(4, jnp.int32), positions=jnp.asarray(context_lens - 1),
                                  token_seq=jnp.arange(4, dtype=jnp.int32), block_tables=jnp.asarray(tables),
                                  context_lens=jnp.asarray(context_lens),
                                  query_start=jnp.arange(5, dtype=jnp.int32))
    attend = CpuBackend().paged_attention(meta, None, True, None)
    new_kv = jnp.zeros((1, 4, 2, 32), jnp.float32)
    hlo = jax.jit(attend).lower(jnp.asarray(q[:, 0])[None], new_kv, new_kv,
                                (jnp.nan_to_num(k_pool), jnp.nan_to_num(v_pool)), jnp.int32(0)).as_text()
    assert cpu_paged_attention.TARGET_NAME in hlo
