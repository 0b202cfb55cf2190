"""KV-cache quantization (kv_cache_dtype "int8" / "fp8"): the quantize-on-write
round trip against the quantizers' error bounds, paged attention over a
quantized cache (the jnp reference and the Pallas kernels in interpret mode, decode and mixed steps)
against float64 numpy, and the engine with a quantized cache on the default
model.

Every pool slot the step does not own (null block, spare blocks, the tail of
each last block, the other layer) is poisoned: NaN values and NaN scales (int8
cannot hold NaN, so there the scales carry it), so reading a wrong block, slot
or layer, or a wrong slot's scale, shows up as NaN.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxinfer.backends import CpuBackend, GpuBackend, XlaBackend, choose_backend
from jaxinfer.config import ModelConfig
from jaxinfer.models.kv_cache import allocate_kv_cache, as_fp8, kv_block_bytes, kv_storage_dtype, quantize_kv
from jaxinfer.models.paged_attention import (
    PagedAttentionMetadata,
    paged_attention_reference,
    write_kv,
)

NUM_LAYERS, LAYER = 2, 1
BLOCK_SIZE, NUM_KV_HEADS, GROUP, HEAD_DIM = 8, 2, 2, 32
# Context lengths per sequence, and this step's new tokens per sequence.
CONTEXT_LENS = np.array([13, 30, 5], np.int32)
STEPS = {"decode": np.array([1, 1, 1]), "mixed": np.array([4, 1, 5])}


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(architecture="llama", vocab_size=32, hidden_size=NUM_KV_HEADS * GROUP * HEAD_DIM,
                  intermediate_size=64, num_layers=NUM_LAYERS, num_heads=NUM_KV_HEADS * GROUP,
                  num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM)
    return ModelConfig(**{**fields, **overrides})


E4M3_NAN_BITS = 0x7F  # S.1111.111: the NaN of float8_e4m3fn (it has no inf)


def poisoned_cache(num_blocks: int, kv_cache_dtype: str, rng):
    """An allocated cache whose every slot is poisoned (see the module docstring)."""
    cache = allocate_kv_cache(tiny_config(), num_blocks, BLOCK_SIZE, jnp.float32, kv_cache_dtype,
                              fp8_dtype=choose_backend().kv_fp8_dtype)
    poisoned = []
    for array in cache:
        if array.dtype == jnp.int8:
            poisoned.append(jnp.asarray(rng.integers(-127, 128, array.shape), jnp.int8))
        elif array.dtype == jnp.uint8:  # fp8 bits (CPU)
            poisoned.append(jnp.full(array.shape, E4M3_NAN_BITS, jnp.uint8))
        else:
            poisoned.append(jnp.full(array.shape, jnp.nan, array.dtype))
    return tuple(poisoned)


def pool_values(pool) -> np.ndarray:
    """A pool (or part of one) as float64 numpy, reading uint8 as e4m3fn bits."""
    pool = np.asarray(pool)
    if pool.dtype == np.uint8:
        pool = pool.view(ml_dtypes.float8_e4m3fn)
    return pool.astype(np.float64)


# -- quantize-on-write --------------------------------------------------------


def read_slots(cache, slots):
    """float64 numpy (values [T, KV, D], scales [T, KV] or None) at flat slots of LAYER."""
    block, offset = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    values = [pool_values(pool[LAYER, block, offset]) for pool in cache[:2]]
    scales = [np.asarray(s[LAYER, block, offset], np.float64) for s in cache[2:]] or [None, None]
    return values, scales


def test_nan_poison_is_nan():
    assert np.isnan(np.uint8(E4M3_NAN_BITS).view(ml_dtypes.float8_e4m3fn).astype(np.float32))


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_write_kv_round_trip_error_bound(kv_cache_dtype):
    rng = np.random.default_rng(0)
    num_tokens = 40
    # Rows over nine orders of magnitude (the scale is per token and head), and an all-zero row.
    magnitude = 10.0 ** rng.uniform(-4, 5, (num_tokens, NUM_KV_HEADS, 1))
    k = (rng.standard_normal((num_tokens, NUM_KV_HEADS, HEAD_DIM)) * magnitude).astype(np.float32)
    v = (rng.standard_normal((num_tokens, NUM_KV_HEADS, HEAD_DIM)) * magnitude[::-1]).astype(np.float32)
    k[3, 1] = 0.0
    num_blocks = 12
    slots = rng.permutation(np.arange(BLOCK_SIZE, num_blocks * BLOCK_SIZE))[:num_tokens].astype(np.int32)
    fp8_dtype = choose_backend().kv_fp8_dtype  # as the engine allocates it here
    cache = allocate_kv_cache(tiny_config(), num_blocks, BLOCK_SIZE, jnp.float32, kv_cache_dtype, fp8_dtype=fp8_dtype)
    cache = jax.jit(write_kv)(cache, LAYER, k, v, slots)

    # fp8 is held as its bit patterns in uint8 on CPU (backends/cpu.py, kv_fp8_dtype).
    storage = {"int8": jnp.int8, "fp8": fp8_dtype}
    assert [a.dtype for a in cache] == [storage[kv_cache_dtype]] * 2 + [jnp.float32] * 2
    (k_q, v_q), (k_scale, v_scale) = read_slots(cache, slots)
    limit = {"int8": 127.0, "fp8": 448.0}[kv_cache_dtype]
    for x, q, scale in ((k, k_q, k_scale), (v, v_q, v_scale)):
        x = x.astype(np.float64)
        absmax = np.abs(x).max(-1)
        np.testing.assert_allclose(scale, np.where(absmax > 0, absmax / limit, 1.0), rtol=1e-6)
        # The absmax element lands on the top code, so the whole range is used.
        np.testing.assert_array_equal(np.abs(q).max(-1), np.where(absmax > 0, limit, 0.0))
        error = np.abs(q * scale[..., None] - x)
        if kv_cache_dtype == "int8":
            # Rounding to the nearest integer step; 1e-5 covers float32 division.
            bound = scale[..., None] * (0.5 + 1e-5)
        else:
            # e4m3 keeps 3 mantissa bits: half a step is 2^-4 of the value for
            # normals, and 2^-10 (half the subnormal step 2^-9) below 2^-6.
            bound = np.maximum(2.0**-4 * np.abs(x), 2.0**-10 * scale[..., None]) * (1 + 1e-5)
        assert (error <= bound).all(), float((error / bound).max())
    assert k_scale[3, 1] == 1.0 and (k_q[3, 1] == 0).all()
    # Nothing but the written slots changed: the rest of the pool is still zero.
    written = np.zeros((NUM_LAYERS, num_blocks * BLOCK_SIZE), bool)
    written[LAYER, slots] = True
    for array in cache:
        flat = pool_values(array).reshape(NUM_LAYERS, num_blocks * BLOCK_SIZE, -1)
        assert (flat[~written] == 0).all()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
def test_one_token_write_is_the_scatter(kv_cache_dtype):
    """A one-token step's write (a dynamic-update-slice) leaves every pool
    (values and scales) as the same token written with a second, null-block
    token beside it (the scatter): its slot changed, nothing else."""
    config = tiny_config()
    rng = np.random.default_rng(7)
    cache = allocate_kv_cache(config, 6, BLOCK_SIZE, jnp.float32, kv_cache_dtype)
    cache = tuple(jnp.asarray(rng.standard_normal(p.shape), jnp.float32).astype(p.dtype) for p in cache)
    k, v = (jnp.asarray(rng.standard_normal((2, NUM_KV_HEADS, HEAD_DIM)), jnp.float32) for _ in range(2))
    slot = 3 * BLOCK_SIZE + 5
    one = jax.jit(write_kv)(cache, LAYER, k[:1], v[:1], jnp.array([slot], jnp.int32))
    # The second row writes into slot 0 (the null block), which the comparison leaves out.
    two = jax.jit(write_kv)(cache, LAYER, k, v, jnp.array([slot, 0], jnp.int32))
    for after_one, after_two, before in zip(one, two, cache):
        after_one, after_two, before = (np.asarray(a).view(np.uint8) for a in (after_one, after_two, before))
        np.testing.assert_array_equal(after_one[:, 1:], after_two[:, 1:])
        np.testing.assert_array_equal(after_one[:, 0], before[:, 0])
        assert (after_one[LAYER, 3, 5] != before[LAYER, 3, 5]).any()


def test_fp8_bits_and_fp8_pools_hold_the_same_codes():
    """The uint8 (CPU) and float8_e4m3fn (GPU) forms of an fp8 pool are the same bytes."""
    assert kv_storage_dtype(jnp.float32, "fp8", GpuBackend.kv_fp8_dtype) == jnp.float8_e4m3fn
    assert kv_storage_dtype(jnp.float32, "fp8", CpuBackend.kv_fp8_dtype) == jnp.uint8
    x = jnp.asarray(np.random.default_rng(1).standard_normal((7, NUM_KV_HEADS, HEAD_DIM)), jnp.float32)
    as_bits, bit_scales = quantize_kv(x, jnp.uint8)
    as_float8, float8_scales = quantize_kv(x, jnp.float8_e4m3fn)
    assert as_float8.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(as_bits), np.asarray(as_float8).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(bit_scales), np.asarray(float8_scales))
    assert as_fp8(as_bits).dtype == jnp.float8_e4m3fn


def test_auto_cache_is_the_model_dtype_pair():
    cache = allocate_kv_cache(tiny_config(), 5, BLOCK_SIZE, jnp.bfloat16)
    assert len(cache) == 2 and all(a.dtype == jnp.bfloat16 for a in cache)
    assert cache[0].shape == (NUM_LAYERS, 5, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        allocate_kv_cache(tiny_config(), 5, BLOCK_SIZE, jnp.float32, "int4")


def test_kv_block_bytes_counts_values_and_scales():
    c = tiny_config()
    values = 2 * NUM_LAYERS * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM  # K and V elements per block
    scales = 2 * NUM_LAYERS * BLOCK_SIZE * NUM_KV_HEADS
    assert kv_block_bytes(c, BLOCK_SIZE, jnp.float32) == 4 * values
    assert kv_block_bytes(c, BLOCK_SIZE, jnp.bfloat16, "auto") == 2 * values
    assert kv_block_bytes(c, BLOCK_SIZE, jnp.float32, "int8") == values + 4 * scales
    assert kv_block_bytes(c, BLOCK_SIZE, jnp.bfloat16, "fp8") == values + 4 * scales
    # The allocated arrays take exactly that.
    for kv_cache_dtype in ("auto", "int8", "fp8"):
        cache = allocate_kv_cache(c, 3, BLOCK_SIZE, jnp.float32, kv_cache_dtype)
        assert sum(a.nbytes for a in cache) == 3 * kv_block_bytes(c, BLOCK_SIZE, jnp.float32, kv_cache_dtype)


# -- attention over a quantized cache -------------------------------------------


def attention_case(step: str, rng):
    """Random K/V for every context token, the step's metadata, and scattered block tables."""
    chunk_lens = STEPS[step]
    blocks_per_seq = -(-CONTEXT_LENS // BLOCK_SIZE)
    num_blocks = 1 + int(blocks_per_seq.sum()) + 2  # null block + owned + spare
    free = list(rng.permutation(np.arange(1, num_blocks)))
    tables = np.zeros((len(CONTEXT_LENS), int(blocks_per_seq.max()) + 1), np.int32)
    for s, n in enumerate(blocks_per_seq):
        tables[s, :n] = [free.pop() for _ in range(n)]
    dense_k = [rng.standard_normal((n, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32) for n in CONTEXT_LENS]
    dense_v = [rng.standard_normal((n, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32) for n in CONTEXT_LENS]
    seq_pos = lambda s, p: tables[s, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE  # noqa: E731
    cached = [(s, p) for s in range(len(CONTEXT_LENS)) for p in range(CONTEXT_LENS[s] - chunk_lens[s])]
    new = [(s, p) for s in range(len(CONTEXT_LENS)) for p in range(CONTEXT_LENS[s] - chunk_lens[s], CONTEXT_LENS[s])]

    def gather(tokens):
        slots = np.array([seq_pos(s, p) for s, p in tokens], np.int32)
        k = np.stack([dense_k[s][p] for s, p in tokens])
        v = np.stack([dense_v[s][p] for s, p in tokens])
        return slots, k, v

    meta = PagedAttentionMetadata(
        slot_mapping=gather(new)[0],
        positions=np.array([p for _, p in new], np.int32),
        token_seq=np.array([s for s, _ in new], np.int32),
        block_tables=tables,
        context_lens=CONTEXT_LENS,
        query_start=np.concatenate([[0], np.cumsum(chunk_lens)]).astype(np.int32),
    )
    q = rng.standard_normal((len(new), NUM_KV_HEADS * GROUP, HEAD_DIM)).astype(np.float32)
    return q, meta, num_blocks, gather(cached), gather(new)[1:], dense_k, dense_v


def float64_attention(q, meta, dense_k, dense_v):
    """out [T, H, D] and, per (token, head), the visible keys and values, in float64."""
    out = np.zeros(q.shape, np.float64)
    for t, (s, pos) in enumerate(zip(meta.token_seq, meta.positions)):
        k = dense_k[s][: pos + 1].astype(np.float64)
        v = dense_v[s][: pos + 1].astype(np.float64)
        for h in range(q.shape[1]):
            scores = k[:, h // GROUP] @ q[t, h].astype(np.float64) / np.sqrt(HEAD_DIM)
            p = np.exp(scores - scores.max())
            out[t, h] = (p / p.sum()) @ v[:, h // GROUP]
    return out


def element_error_bound(x, kv_cache_dtype):
    """Worst-case |dequantized - x| per element, from the quantizer's definition alone."""
    absmax = np.abs(x).max(-1, keepdims=True).astype(np.float64)
    if kv_cache_dtype == "int8":
        return np.broadcast_to(absmax / 127 * (0.5 + 1e-5), x.shape)
    return np.maximum(2.0**-4 * np.abs(x), 2.0**-10 * absmax / 448) * (1 + 1e-5)


def quantized_attention_bound(q, meta, dense_k, dense_v, kv_cache_dtype):
    """Worst-case |out(quantized cache) - out(float cache)| per output element.

    With |dk| <= ek and |dv| <= ev per element, each score q.k / sqrt(D) moves
    by at most delta_j = sum_d |q_d| ek_jd / sqrt(D); with delta = max_j delta_j
    every softmax weight changes by a factor in [e^-2delta, e^2delta], so
    ||p' - p||_1 <= e^(2 delta) - 1. Then
      |sum p'v' - sum p v| <= max_j ev_j + ||p' - p||_1 * (max_j v_j - min_j v_j) / 2
    (the weights' change sums to zero, so v may be centred on its mid-range).
    """
    bound = np.zeros(q.shape, np.float64)
    for t, (s, pos) in enumerate(zip(meta.token_seq, meta.positions)):
        k, v = dense_k[s][: pos + 1], dense_v[s][: pos + 1].astype(np.float64)
        ek, ev = element_error_bound(k, kv_cache_dtype), element_error_bound(v, kv_cache_dtype)
        for h in range(q.shape[1]):
            kv = h // GROUP
            delta = (ek[:, kv] @ np.abs(q[t, h].astype(np.float64))).max() / np.sqrt(HEAD_DIM)
            spread = (v[:, kv].max(0) - v[:, kv].min(0)) / 2
            bound[t, h] = ev[:, kv].max(0) + np.expm1(2 * delta) * spread
    return bound


@functools.lru_cache(maxsize=None)  # the float-cache run is shared by the int8 and fp8 cases
def run_step(backend, step, kv_cache_dtype, seed):
    """Write the cached tokens, then run one attention step (which writes the new
    tokens itself) over the poisoned cache; the same seed gives the same K/V/q
    whatever the cache dtype."""
    case = attention_case(step, np.random.default_rng(seed))
    q, meta, num_blocks, (slots, k_cached, v_cached), (k_new, v_new), dense_k, dense_v = case
    cache = poisoned_cache(num_blocks, kv_cache_dtype, np.random.default_rng(seed + 100))
    cache = jax.jit(write_kv)(cache, LAYER, k_cached, v_cached, slots)
    # "gpu": the GPU backend's Pallas attention, whose decode kernel writes a float pool itself.
    chosen = GpuBackend().with_attention("pallas") if backend == "gpu" else XlaBackend().with_attention(backend)
    attend = chosen.paged_attention(meta, None, step == "decode", None)
    out, cache = jax.jit(attend)(q[None], k_new[None], v_new[None], cache, jnp.int32(LAYER))
    return np.asarray(out[0], np.float64), cache, q, meta, dense_k, dense_v


@pytest.mark.parametrize("backend", ["reference", "pallas", "gpu"])
@pytest.mark.parametrize("step", ["decode", "mixed"])
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_attention_over_quantized_cache(kv_cache_dtype, step, backend):
    seed = list(STEPS).index(step)
    out, cache, q, meta, dense_k, dense_v = run_step(backend, step, kv_cache_dtype, seed)
    assert np.isfinite(out).all()

    # 1. Exactly the attention of what the cache holds: float64 over the
    # dequantized values read back from the pool (values * their scales).
    held_k, held_v = [], []
    for s, n in enumerate(CONTEXT_LENS):
        pos = np.arange(n)
        (k_q, v_q), (k_scale, v_scale) = read_slots(cache, meta.block_tables[s, pos // BLOCK_SIZE] * BLOCK_SIZE
                                                    + pos % BLOCK_SIZE)
        held_k.append(k_q * k_scale[..., None])
        held_v.append(v_q * v_scale[..., None])
    np.testing.assert_allclose(out, float64_attention(q, meta, held_k, held_v), atol=5e-5, rtol=1e-4)
    if kv_cache_dtype == "fp8" and backend == "reference":
        # The GPU form of the pool (float8_e4m3fn rather than uint8 bits) reads the same.
        gpu_pools = [as_fp8(pool) for pool in cache[:2]]
        # As the engine calls it: the step's own rows' K/V (what the pool now holds) handed in.
        new_k, new_v = (np.stack([held[s][p] for s, p in zip(meta.token_seq, meta.positions)]).astype(np.float32)
                        for held in (held_k, held_v))
        reads = [paged_attention_reference(q, *pools, meta, layer_index=LAYER, k_scales=cache[2], v_scales=cache[3],
                                           new_k=new_k, new_v=new_v) for pools in (gpu_pools, cache[:2])]
        np.testing.assert_array_equal(*reads)

    # 2. Within the worst-case bound of the same step over a float cache (see
    # quantized_attention_bound; 5e-5 is the float32 computation's own error).
    float_out = run_step(backend, step, "auto", seed)[0]
    np.testing.assert_allclose(float_out, float64_attention(q, meta, dense_k, dense_v), atol=5e-5, rtol=1e-4)
    bound = quantized_attention_bound(q, meta, dense_k, dense_v, kv_cache_dtype)
    error = np.abs(out - float_out)
    print(f"{kv_cache_dtype} {step} {backend}: max |error| {error.max():.2e}, max bound {bound.max():.2e}, "
          f"max error / bound {(error / bound).max():.3f}")
    assert (error <= bound + 5e-5).all(), float((error - bound).max())
    # And it is a quantized cache: not the float answer to float32 accuracy.
    assert error.max() > 1e-3


# -- the engine on the default model ------------------------------------------------

# Long contexts and 8 sequences ask for more than the CPU's 512 MiB KV budget with
# any cache dtype, so every engine below sizes its pool by that same budget;
# few token buckets keep warm-up short.
ENGINE_OPTIONS = dict(max_model_len=8192, max_num_seqs=8, max_num_batched_tokens=32)
PROMPT = "Q: What is 2 + 2?\nA:"
# Greedy tokens are compared only while the float run's top-1 token leads the
# runner-up by at least this many nats (see test_quantized_cache_engine).
CONFIDENT_MARGIN = 1.0
MIN_CONFIDENT_TOKENS = 8


def test_unknown_kv_cache_dtype_is_rejected():
    from jaxinfer.engine.config import EngineConfig

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="float8", **ENGINE_OPTIONS)


def test_quantized_cache_holds_more_blocks_in_the_same_budget(default_llm):
    from jaxinfer.engine.config import EngineConfig, choose_num_blocks, kv_block_bytes

    model = default_llm.model
    blocks = {}
    for kv_cache_dtype in ("auto", "int8", "fp8"):
        config = EngineConfig(kv_cache_dtype=kv_cache_dtype, **ENGINE_OPTIONS).for_backend(model.backend)
        per_block = kv_block_bytes(model, config.block_size, kv_cache_dtype)
        blocks[kv_cache_dtype] = choose_num_blocks(model, config)
        assert blocks[kv_cache_dtype] == model.backend.host_kv_cache_bytes // per_block + 1
    c = model.config
    # float32 model: 4 bytes per element against 1 byte plus a 4-byte scale per head_dim elements.
    ratio = (4 * c.head_dim) / (c.head_dim + 4)
    assert blocks["int8"] == blocks["fp8"]
    assert blocks["int8"] / blocks["auto"] == pytest.approx(ratio, rel=2e-3)


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_cache_engine(default_llm, kv_cache_dtype):
    """A quantized-cache engine generates the float engine's greedy tokens for as
    long as the float run is confident.

    Robustness: a greedy token can only change where the quantized cache moves
    the top-1 / top-2 logprob gap by the whole gap. Each token is compared only
    while the float gap is >= 1 nat (MIN_CONFIDENT_TOKENS of them on this prompt,
    which the test checks first), and the test also bounds how far the chosen
    tokens' logprobs move: 0.25 nat for int8, 0.5 for fp8 (measured 0.08-0.12
    and 0.18-0.2), so a flip would need the runner-up alone to move by > 0.5 nat.
    """
    from jaxinfer import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    assert default_llm.engine.config.kv_cache_dtype == "auto"
    reference = default_llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    quantized_llm = LLM(progress=False, kv_cache_dtype=kv_cache_dtype, **ENGINE_OPTIONS)
    quantized = quantized_llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]

    storage = quantized_llm.engine.runner.kv_cache
    assert len(storage) == 4 and storage[0].dtype.itemsize == 1
    stats, float_stats = quantized_llm.stats(), default_llm.stats()
    assert stats.keys() == float_stats.keys()
    # Same 512 MiB budget on both sides (checked in the test above), about 3.8x the blocks.
    assert stats["kv_blocks_total"] > 3 * float_stats["kv_blocks_total"]

    assert len(quantized.token_ids) == params.max_tokens and quantized.text
    margins = [np.subtract(*sorted((lp.logprob for lp in step.values()), reverse=True)[:2])
               for step in reference.logprobs]
    confident = next((i for i, m in enumerate(margins) if m < CONFIDENT_MARGIN), len(margins))
    assert confident >= MIN_CONFIDENT_TOKENS, f"prompt no longer gives a confident prefix: margins {margins}"
    assert quantized.token_ids[:confident] == reference.token_ids[:confident]
    moved = [abs(q[t].logprob - r[t].logprob)
             for q, r, t in zip(quantized.logprobs, reference.logprobs, reference.token_ids[:confident])]
    assert max(moved) <= {"int8": 0.25, "fp8": 0.5}[kv_cache_dtype]
    print(f"{kv_cache_dtype}: {confident} confident tokens, max logprob shift {max(moved):.3f}, "
          f"blocks {stats['kv_blocks_total']} vs {float_stats['kv_blocks_total']}")
