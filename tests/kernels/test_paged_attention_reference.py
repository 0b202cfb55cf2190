"""Plain-jnp paged attention (the engine's "xla" backend) against a float64
numpy computation on dense per-sequence K/V, with unused pool blocks poisoned
with NaN so that reading a wrong block fails the test."""

import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.models import paged_attention
from jaxinfer.models.llama import forward
from jaxinfer.backends import GpuBackend, XlaBackend
from jaxinfer.models.paged_attention import (
    PagedAttentionMetadata,
    multi_query_attention_reference,
    paged_attention_reference,
)


def make_case(rng, num_seqs, block_size, num_kv_heads, group, head_dim, max_ctx_blocks):
    """Random ragged batch: per sequence a context length and a query chunk at its end."""
    num_heads = num_kv_heads * group
    context_lens = rng.integers(1, max_ctx_blocks * block_size + 1, num_seqs)
    chunk_lens = np.minimum(context_lens, rng.integers(1, 20, num_seqs))
    blocks_per_seq = -(-context_lens // block_size)
    num_blocks = 1 + int(blocks_per_seq.sum()) + 3  # null block + used + spare
    k_pool = np.full((num_blocks, block_size, num_kv_heads, head_dim), np.nan, np.float32)
    v_pool = np.full_like(k_pool, np.nan)
    free = list(rng.permutation(np.arange(1, num_blocks)))
    max_blocks = int(blocks_per_seq.max()) + 1
    tables = np.zeros((num_seqs, max_blocks), np.int32)
    dense_k, dense_v, tokens = [], [], []
    for s in range(num_seqs):
        k = rng.standard_normal((context_lens[s], num_kv_heads, head_dim)).astype(np.float32)
        v = rng.standard_normal((context_lens[s], num_kv_heads, head_dim)).astype(np.float32)
        for b in range(blocks_per_seq[s]):
            tables[s, b] = free.pop()
            n = min(block_size, context_lens[s] - b * block_size)
            k_pool[tables[s, b], :n] = k[b * block_size : b * block_size + n]
            v_pool[tables[s, b], :n] = v[b * block_size : b * block_size + n]
        dense_k.append(k)
        dense_v.append(v)
        for i in range(chunk_lens[s]):
            tokens.append((s, context_lens[s] - chunk_lens[s] + i))
    q = rng.standard_normal((len(tokens), num_heads, head_dim)).astype(np.float32)
    token_seq = np.array([s for s, _ in tokens], np.int32)
    positions = np.array([p for _, p in tokens], np.int32)
    meta = PagedAttentionMetadata(
        slot_mapping=np.zeros(len(tokens), np.int32),  # unused by the reference
        positions=positions,
        token_seq=token_seq,
        block_tables=tables,
        context_lens=context_lens.astype(np.int32),
        query_start=np.concatenate([[0], np.cumsum(chunk_lens)]).astype(np.int32),
    )
    return q, k_pool, v_pool, meta, dense_k, dense_v


def numpy_attention(q, meta, dense_k, dense_v, group, sliding_window=None):
    out = np.zeros(q.shape, np.float64)
    for t, (s, pos) in enumerate(zip(meta.token_seq, meta.positions)):
        first = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
        k = dense_k[s][first : pos + 1].astype(np.float64)
        v = dense_v[s][first : pos + 1].astype(np.float64)
        for h in range(q.shape[1]):
            scores = k[:, h // group] @ q[t, h].astype(np.float64) / np.sqrt(q.shape[2])
            p = np.exp(scores - scores.max())
            out[t, h] = (p / p.sum()) @ v[:, h // group]
    return out


@pytest.mark.parametrize("seed", range(6))
def test_paged_attention_matches_float64(seed):
    rng = np.random.default_rng(seed)
    block_size = [4, 8, 16][seed % 3]
    group = [1, 3, 4][seed % 3]
    head_dim = [16, 64][seed % 2]
    sliding_window = 7 if seed == 5 else None
    q, k_pool, v_pool, meta, dense_k, dense_v = make_case(rng, 5, block_size, 2, group, head_dim, 5)
    tile_blocks = [1, 2, 8][seed % 3]
    expected = numpy_attention(q, meta, dense_k, dense_v, group, sliding_window)
    out = paged_attention_reference(q, k_pool, v_pool, meta, sliding_window, tile_blocks=tile_blocks)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, rtol=1e-4)
    # The engine's form: the step's own rows' K/V handed in, tiles only for the keys cached before them.
    new_k, new_v = (np.stack([d[s][p] for s, p in zip(meta.token_seq, meta.positions)]) for d in (dense_k, dense_v))
    for dense_limit in (paged_attention.MAX_DENSE_NEW_TOKENS, 4):  # 4: a step too big for the T x T form
        with mock.patch.object(paged_attention, "MAX_DENSE_NEW_TOKENS", dense_limit):
            out = paged_attention_reference(q, k_pool, v_pool, meta, sliding_window, tile_blocks=tile_blocks,
                                            new_k=new_k, new_v=new_v)
        assert np.isfinite(np.asarray(out)).all()
        np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, rtol=1e-4)


def test_padding_tokens_give_zeros_without_nan():
    rng = np.random.default_rng(9)
    q, k_pool, v_pool, meta, _, _ = make_case(rng, 3, 8, 2, 2, 16, 3)
    # Append a padding sequence (context 0, null-block table) and a padding token.
    meta = PagedAttentionMetadata(
        slot_mapping=np.append(meta.slot_mapping, 0),
        positions=np.append(meta.positions, 0),
        token_seq=np.append(meta.token_seq, 3).astype(np.int32),
        block_tables=np.vstack([meta.block_tables, np.zeros_like(meta.block_tables[:1])]),
        context_lens=np.append(meta.context_lens, 0).astype(np.int32),
        query_start=np.append(meta.query_start, meta.query_start[-1]).astype(np.int32),
    )
    k_pool[0] = v_pool[0] = 0.0  # the null block holds whatever padding wrote; never NaN-producing
    q = np.vstack([q, rng.standard_normal((1,) + q.shape[1:]).astype(np.float32)])
    out = np.asarray(paged_attention_reference(q, k_pool, v_pool, meta))
    assert np.isfinite(out).all() and (out[-1] == 0).all()
    new_kv = rng.standard_normal((2, len(q), *k_pool.shape[2:])).astype(np.float32)  # padding row's K/V: anything
    with_new = np.asarray(paged_attention_reference(q, k_pool, v_pool, meta, new_k=new_kv[0], new_v=new_kv[1]))
    assert np.isfinite(with_new).all() and (with_new[-1] == 0).all()


@pytest.mark.parametrize("backend", ["native", "reference", "pallas"])
def test_chunked_prefill_through_paged_cache_equals_full_forward(tmp_path, backend):
    """Two sequences fed through the paged cache in ragged chunks (both in the
    same calls, with scattered block tables, one pure-decode call among them)
    give the logits of a cache-free full-sequence forward at every position,
    with each attention implementation."""
    import jaxinfer
    from tests.tiny_models import make_hf_model, save_hf_model

    model = jaxinfer.load(str(save_hf_model(make_hf_model("qwen3", seed=2), tmp_path)), progress=False)
    c, block_size = model.config, 4
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, c.vocab_size, n).tolist() for n in (23, 12)]
    tables = np.array([[5, 2, 9, 1, 7, 11], [3, 10, 6, 0, 0, 0]], np.int32)
    pool_shape = (c.num_layers, 12, block_size, c.num_kv_heads, c.head_dim)
    cache = (jnp.full(pool_shape, jnp.nan), jnp.full(pool_shape, jnp.nan))

    @functools.partial(jax.jit, static_argnames="decode")
    def step(params, tokens, meta, cache, decode):
        ops = model.backend.with_attention(backend)
        attention = ops.paged_attention(meta, None, decode, None)
        hidden, cache = forward(params, c, tokens[None], meta.positions[None], attention, cache, backend=ops)
        return ops.logits(params, hidden[0]), cache

    computed, got = [0, 0], [[], []]
    for chunk, decode in (([7, 9], False), ([1, 1], True), ([10, 1], False), ([5, 1], False)):
        tokens, positions, token_seq, slots = [], [], [], []
        for s, n in enumerate(chunk):
            for pos in range(computed[s], computed[s] + n):
                tokens.append(seqs[s][pos])
                positions.append(pos)
                token_seq.append(s)
                slots.append(tables[s, pos // block_size] * block_size + pos % block_size)
            computed[s] += n
        meta = PagedAttentionMetadata(
            np.array(slots, np.int32), np.array(positions, np.int32), np.array(token_seq, np.int32),
            tables, np.array(computed, np.int32), np.concatenate([[0], np.cumsum(chunk)]).astype(np.int32),
        )
        logits, cache = step(model.params, np.array(tokens, np.int32), meta, cache, decode)
        for i, s in enumerate(token_seq):
            got[s].append(np.asarray(logits[i]))
    for s in range(2):
        expected = model.logits(seqs[s])
        np.testing.assert_allclose(np.stack(got[s]), expected, atol=1e-4 * np.abs(expected).max())


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_verification_attention_equals_paged_attention(sliding_window):
    """The per-sequence multi-query attention of verification steps against
    the general per-token paged attention, on the same flattened layout:
    3 sequences (one padding) of R = 3 rows, float, int8 and fp8 pools."""
    from jaxinfer.models.kv_cache import quantize_kv

    rng = np.random.default_rng(3)
    layers, blocks, bs, kvh, heads, dim, rows = 2, 12, 4, 2, 4, 8, 3
    k_pool = rng.standard_normal((layers, blocks, bs, kvh, dim)).astype(np.float32)
    v_pool = rng.standard_normal((layers, blocks, bs, kvh, dim)).astype(np.float32)
    tables = np.array([[3, 5, 7, 0], [2, 9, 0, 0], [0, 0, 0, 0]], np.int32)
    context_lens = np.array([14, 6, 0], np.int32)
    positions = np.concatenate([c - rows + np.arange(rows) if c else np.zeros(rows, int) for c in context_lens])
    q = rng.standard_normal((3 * rows, heads, dim)).astype(np.float32)
    meta = PagedAttentionMetadata(np.zeros(3 * rows, np.int32), positions.astype(np.int32),
                                  np.repeat(np.arange(3, dtype=np.int32), rows), tables, context_lens,
                                  np.array([0, rows, 2 * rows, 2 * rows], np.int32))
    cases = [((k_pool, v_pool), (None, None))]
    for storage in (jnp.int8, jnp.uint8):  # uint8: fp8 e4m3 bits, as a CPU fp8 pool holds them
        k_q, k_s = quantize_kv(jnp.asarray(k_pool), storage)
        v_q, v_s = quantize_kv(jnp.asarray(v_pool), storage)
        cases.append(((k_q, v_q), (k_s, v_s)))
    for pools, scales in cases:
        expected = paged_attention_reference(q, *pools, meta, sliding_window, layer_index=1, k_scales=scales[0],
                                             v_scales=scales[1])
        actual = multi_query_attention_reference(q.reshape(3, rows, heads, dim), *pools, 1, tables, context_lens,
                                                 k_scales=scales[0], v_scales=scales[1],
                                                 sliding_window=sliding_window, tile_blocks=2)
        np.testing.assert_allclose(np.asarray(actual).reshape(3 * rows, heads, dim)[: 2 * rows],
                                   np.asarray(expected)[: 2 * rows], rtol=1e-5, atol=1e-5)
        assert not np.asarray(actual)[2].any()  # padding sequence: zeros


def test_verification_attention_backends_agree():
    """The model-facing function: K/V written to their slots, then the Pallas
    multi-query decode kernel (interpret mode) agrees with the jnp path; so
    does the GPU backend's, its kernel writing the K/V itself."""

    rng = np.random.default_rng(4)
    layers, blocks, bs, kvh, heads, dim, rows = 2, 12, 4, 2, 4, 32, 3
    cache = tuple(jnp.asarray(rng.standard_normal((layers, blocks, bs, kvh, dim)), jnp.float32) for _ in range(2))
    tables = np.array([[3, 5, 7, 0], [2, 9, 0, 0]], np.int32)
    context_lens = np.array([14, 6], np.int32)
    positions = np.concatenate([c - rows + np.arange(rows) for c in context_lens]).astype(np.int32)
    seq = np.repeat(np.arange(2, dtype=np.int32), rows)
    slots = (tables[seq, positions // bs] * bs + positions % bs).astype(np.int32)
    meta = PagedAttentionMetadata(slots, positions, seq, tables, context_lens, np.array([0, 3, 6], np.int32))
    q = jnp.asarray(rng.standard_normal((1, 2 * rows, heads, dim)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 2 * rows, kvh, dim)), jnp.float32)
    outputs = {}
    # "gpu": the GPU backend's verify attention, whose kernel writes the rows' K/V into the pool itself.
    for backend in ("reference", "pallas", "gpu"):
        chosen = GpuBackend().with_attention("pallas") if backend == "gpu" else XlaBackend().with_attention(backend)
        attend = chosen.verification_attention(meta, rows, None, None)
        out, new_cache = attend(q, k, 0.5 * k, cache, 1)
        outputs[backend] = np.asarray(out)
        for pool, written in zip(new_cache, (k, 0.5 * k)):
            np.testing.assert_array_equal(np.asarray(pool)[1, tables[seq, positions // bs], positions % bs],
                                          np.asarray(written)[0])
    np.testing.assert_allclose(outputs["pallas"], outputs["reference"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outputs["gpu"], outputs["reference"], rtol=1e-5, atol=1e-5)
