"""The native CPU matmuls (native/matmul.cc, few rows of float
activations; native/q8_matmul.cc, activations quantized to int8 blocks)
against float64 numpy on weights dequantized independently here (own nibble
order, scale and offset expansion) and, for the second, activations rounded
to int8 blocks here, for int4 and int8 codes, grouped and per channel, with
and without offsets, and a layer index into stacked weights."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.backends import CpuBackend, cpu_weights
from jaxinfer.models.llama import forward
from jaxinfer.native import matmul as cpu_matmul
from jaxinfer.quant.layer_weights import LayerOf
from jaxinfer.quant.linear import linear
from jaxinfer.quant.tensor import QuantizedTensor, pack_int4
from tests.cpu_features import INT8_DOTS, VEC16, needs_vec16, needs_int8_dots

# The CPU backend's operations: what the model's layer loop calls on one device.
CPU = CpuBackend()


def test_kernels_build_here():
    # Not a skip: CI has g++, and without the kernels decode silently takes the
    # slow path. The int8-activation kernel is AVX512-VNNI or AVX2 code, and the exact
    # kernel stores tiles only where its tiled paths (vec16.h) read them.
    assert cpu_matmul.available() and cpu_matmul.q8_available() == INT8_DOTS
    w = QuantizedTensor(jnp.zeros((64, 64), jnp.int8), jnp.ones((1, 64)), None, "int8", 64)
    assert cpu_matmul.tileable(w) == VEC16


def assert_matches(actual, expected):
    """float32 results against a float64 reference: 1e-5 relative, and 1e-5 of
    the largest magnitude for results that cancel to near zero."""
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def random_stacked_weight(rng, scheme, layers, in_features, out_features, group_size, offsets):
    """(QuantizedTensor [layers, ...], its float64 value [layers, in, out]) from random codes."""
    groups = in_features // group_size
    scales = rng.random((layers, groups, out_features)).astype(np.float32) * 0.1
    shift = rng.standard_normal((layers, groups, out_features)).astype(np.float32) * 0.1 if offsets else None
    if scheme == "int4":
        codes = rng.integers(0, 16, (layers, in_features, out_features)).astype(np.uint8)
        data = pack_int4(jnp.asarray(codes))
    else:
        codes = rng.integers(-127, 128, (layers, in_features, out_features)).astype(np.int8)
        data = jnp.asarray(codes)
    value = codes.astype(np.float64) * np.repeat(scales, group_size, axis=1)
    if offsets:
        value += np.repeat(shift, group_size, axis=1)
    tensor = QuantizedTensor(data, jnp.asarray(scales), None if shift is None else jnp.asarray(shift), scheme,
                             group_size)
    return tensor, value


@pytest.mark.parametrize("scheme,group_size,offsets", [("int4", 32, True), ("int8", 32, False), ("int8", 16, True),
                                                       ("int8", 576, False), ("int4", 576, True)])
@pytest.mark.parametrize("rows,out_features", [(1, 1000), (2, 1000), (5, 1000), (8, 1000), (13, 1000), (9, 192),
                                                (23, 192), (40, 128)])
def test_matches_float64(scheme, group_size, offsets, rows, out_features):
    """Up to 8 rows: chunks of 256 columns (1000: several and a partial one).
    Past 8, tiles of 64 columns and 6 rows in equal tasks of at most 36 rows
    (23 rows: two tasks of 12 on two cores; 40: two of 20, a partial tile
    each), or, where the columns are no multiple of 64, blocks of 8 rows (13:
    a block of 8 and one of 5)."""
    rng = np.random.default_rng(rows + group_size)
    w, value = random_stacked_weight(rng, scheme, 3, 576, out_features, group_size, offsets)
    x = rng.standard_normal((rows, 576)).astype(np.float32)
    run = jax.jit(cpu_matmul.quantized_matmul)
    for layer in (0, 2):
        expected = x.astype(np.float64) @ value[layer]
        assert_matches(np.asarray(run(x, w, layer)), expected)


@needs_vec16
@pytest.mark.parametrize("scheme,group_size,offsets", [("int4", 32, True), ("int8", 32, False), ("int8", 16, True),
                                                       ("int4", 576, True)])
@pytest.mark.parametrize("rows,out_features", [(1, 512), (1, 192), (2, 384), (3, 192), (5, 192), (6, 128), (7, 128),
                                                (8, 512), (23, 192)])
def test_tiled_matches_float64(scheme, group_size, offsets, rows, out_features):
    """The layout of 64-column tiles (what the loader stores for the kernels):
    at up to 8 rows tasks of 256 columns at one row (512; 192 cannot: 64),
    128 at two (384), else 64 in row tiles of 5, 4 or 3 (6, 7 and 8 rows as
    two tiles); past 8 rows the register-tiled path."""
    rng = np.random.default_rng(rows + group_size + out_features)
    w, value = random_stacked_weight(rng, scheme, 3, 576, out_features, group_size, offsets)
    tiled = w.tiled(cpu_matmul.TILE)
    assert tiled.data.shape[-3:] == (out_features // 64, w.data.shape[-2], 64) and tiled.shape == w.shape
    x = rng.standard_normal((rows, 576)).astype(np.float32)
    run = jax.jit(cpu_matmul.quantized_matmul)
    for layer in (0, 2):
        assert_matches(np.asarray(run(x, tiled, layer)), x.astype(np.float64) @ value[layer])


@needs_vec16
def test_tiled_row_does_not_depend_on_the_rows_beside_it():
    """Every row count up to 8 (each its own tiling of rows and columns), and
    the register-tiled path's splits past it (13 and 32 rows: one task or
    two; 75: tasks of 19 or 25 rows, each ending on one row), give each row
    bit for bit its one-row result: what lets a verification of 1 + K rows
    score a sequence's tokens exactly as plain decoding, one at a time, does,
    and a batch of 32 decode each sequence as it would alone."""
    rng = np.random.default_rng(7)
    w, _ = random_stacked_weight(rng, "int4", 2, 576, 576, 32, True)
    tiled = w.tiled(cpu_matmul.TILE)
    x = rng.standard_normal((75, 576)).astype(np.float32)
    run = jax.jit(cpu_matmul.quantized_matmul)
    alone = np.stack([np.asarray(run(x[r:r + 1], tiled, 1))[0] for r in range(75)])
    for rows in [*range(2, 9), 13, 32, 75]:
        np.testing.assert_array_equal(np.asarray(run(x[:rows], tiled, 1)), alone[:rows])


@needs_vec16
@pytest.mark.parametrize("rows", [1, 3, 9, 23])
def test_several_weights_in_one_call(rows):
    """One call for a layer's q, k and v (576, 192 and 192 outputs: 9 and 3
    tiles, each tile's inputs in two parts on two cores) and a plain weight:
    each output against float64, and bit for bit the weight's own call."""
    rng = np.random.default_rng(rows)
    pairs = [random_stacked_weight(rng, "int4", 2, 576, out, 32, True) for out in (576, 192, 192, 128)]
    ws = [w.tiled(cpu_matmul.TILE) for w, _ in pairs[:3]] + [pairs[3][0]]
    x = rng.standard_normal((rows, 576)).astype(np.float32)
    together = jax.jit(cpu_matmul.quantized_matmuls)(x, ws, jnp.int32(1))
    alone = jax.jit(cpu_matmul.quantized_matmul)
    for y, w, (_, value) in zip(together, ws, pairs):
        assert_matches(np.asarray(y), x.astype(np.float64) @ value[1])
        np.testing.assert_array_equal(np.asarray(y), np.asarray(alone(x, w, jnp.int32(1))))


def test_linears_share_one_call_where_the_kernel_takes_them_all():
    """The CPU backend's linears makes one kernel call for weights of one group size and
    offsets alike, and one per weight otherwise, with the same values."""
    rng = np.random.default_rng(3)
    a, a_value = random_stacked_weight(rng, "int4", 2, 64, 128, 32, True)
    b, b_value = random_stacked_weight(rng, "int4", 2, 64, 64, 32, True)
    c, c_value = random_stacked_weight(rng, "int8", 2, 64, 64, 16, False)
    x = jnp.asarray(rng.standard_normal((2, 64)), jnp.float32)
    for ws, values, calls in (([a, b], [a_value, b_value], 1), ([a, c], [a_value, c_value], 2)):
        fn = jax.jit(lambda x, ws, i: CPU.linears(x, [LayerOf(w, i) for w in ws]))
        assert fn.lower(x, ws, jnp.int32(1)).as_text().count(f"custom_call @{cpu_matmul.TARGET_NAME}(") == calls
        for y, value in zip(fn(x, ws, jnp.int32(1)), values):
            assert_matches(np.asarray(y), np.asarray(x, np.float64) @ value[1])


def test_tiled_layout_round_trips_and_reaches_xla_untiled():
    """untiled() restores the stored arrays exactly; past max_exact_rows() the CPU backend
    hands the XLA path the untiled layer, with the same values."""
    rng = np.random.default_rng(4)
    w, value = random_stacked_weight(rng, "int4", 2, 64, 192, 32, True)
    tiled = w.tiled(cpu_matmul.TILE)
    for a, b in zip(jax.tree.leaves(tiled.untiled()), jax.tree.leaves(w)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    x = jnp.asarray(rng.standard_normal((cpu_weights.max_exact_rows() + 1, 64)), jnp.float32)
    fn = jax.jit(lambda x, w, i: CPU.linear(x, LayerOf(w, i)))
    assert cpu_matmul.TARGET_NAME not in fn.lower(x, tiled, jnp.int32(1)).as_text()
    assert_matches(np.asarray(fn(x, tiled, jnp.int32(1))), np.asarray(x, np.float64) @ value[1])


def int8_blocks_float64(x, block):
    """x [rows, in] float32 -> float64: each block of `block` inputs rounded to
    int8 with scale absmax / 127 (1 for an all-zero block), half to even,
    and scaled back."""
    blocks = x.reshape(x.shape[0], -1, block)
    scale = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    scale = np.where(scale > 0, scale, np.float32(1))
    codes = np.clip(np.round(blocks / scale), -127, 127)
    return (codes.astype(np.float64) * scale).reshape(x.shape)


@needs_int8_dots
@pytest.mark.parametrize("scheme,group_size,offsets", [("int4", 32, True), ("int8", 32, False), ("int8", 16, True),
                                                       ("int4", 64, True), ("int8", 576, False)])
@pytest.mark.parametrize("rows", [1, 2, 7, 64])
def test_q8_matches_float64(scheme, group_size, offsets, rows):
    rng = np.random.default_rng(rows + group_size)
    # 320 columns: five 64-column tiles.
    w, value = random_stacked_weight(rng, scheme, 3, 576, 320, group_size, offsets)
    block = min(32, group_size)
    w = dataclasses.replace(w, activation_block=block)
    x = rng.standard_normal((rows, 576)).astype(np.float32)
    x[0, 32:64] = 0.0  # an all-zero block
    run = jax.jit(cpu_matmul.q8_matmul)
    for layer in (0, 2):
        expected = int8_blocks_float64(x, block) @ value[layer]
        assert_matches(np.asarray(run(x, w, layer)), expected)


@needs_int8_dots
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_q8_exact_at_the_largest_products(scheme):
    """Codes at their largest magnitude (int8 127 and -128 for alternate pairs
    of inputs, int4 15) against activations that round to +127 / -127 with
    the codes' signs, so every product adds the same way: AVX2's dots add
    pairs of products in int16, where 2 * 128 * 127 = 32,512 just fits (int8
    weights go in as |w| times the activations with w's signs; as w + 128, a
    pair of 127s would be 2 * 255 * 127), at one row and at three."""
    inputs = np.arange(64)[:, None]
    codes = np.where(inputs // 2 % 2 == 0, 127, -128) if scheme == "int8" else np.full((64, 1), 15)
    codes = np.broadcast_to(codes, (64, 128))
    data = jnp.asarray(codes, jnp.int8) if scheme == "int8" else pack_int4(jnp.asarray(codes, jnp.uint8))
    scales = np.full((2, 128), 0.01, np.float32)
    w = QuantizedTensor(data[None], jnp.asarray(scales)[None], None, scheme, 32, activation_block=32)
    value = codes * np.repeat(scales, 32, axis=0).astype(np.float64)
    for rows in (1, 3):
        x = np.broadcast_to(np.sign(codes[:, 0]).astype(np.float32), (rows, 64)).copy()
        assert_matches(np.asarray(jax.jit(cpu_matmul.q8_matmul)(x, w, 0)), int8_blocks_float64(x, 32) @ value)


@needs_int8_dots
@pytest.mark.parametrize("scheme,in_features", [("int8", 576), ("int4", 32)])
@pytest.mark.parametrize("rows", [1, 3, 8, 9])
def test_q8_wide_weight(scheme, in_features, rows):
    """Weights of 4,096+ columns (a page per byte row, like the head) take
    the kernel's other split at up to 8 rows: input-block ranges summed at
    the end, times column parts (65 tiles: uneven parts; 32 inputs: one
    block, fewer than the ranges)."""
    rng = np.random.default_rng(rows)
    w, value = random_stacked_weight(rng, scheme, 2, in_features, 4160, 32, scheme == "int4")
    w = dataclasses.replace(w, activation_block=32)
    x = rng.standard_normal((rows, in_features)).astype(np.float32)
    expected = int8_blocks_float64(x, 32) @ value[1]
    assert_matches(np.asarray(jax.jit(cpu_matmul.q8_matmul)(x, w, 1)), expected)


@needs_int8_dots
@pytest.mark.parametrize("rows", [1, 20])
def test_q8_float16_scales(rows):
    """Scales and offsets stored as float16 (what with_int8_activations keeps
    for a GGUF's own d and m) multiply as their exact float32 values."""
    rng = np.random.default_rng(5)
    w, _ = random_stacked_weight(rng, "int4", 2, 576, 4160, 32, True)
    half = dataclasses.replace(w, scales=w.scales.astype(jnp.float16), offsets=w.offsets.astype(jnp.float16),
                               activation_block=32)
    codes = np.asarray(jnp.concatenate([half.data & 0x0F, half.data >> 4], axis=1))  # even rows, then odd rows
    value = np.empty((2, 576, 4160))
    value[:, 0::2], value[:, 1::2] = codes[:, :288], codes[:, 288:]
    value = value * np.repeat(np.asarray(half.scales, np.float64), 32, axis=1) + np.repeat(
        np.asarray(half.offsets, np.float64), 32, axis=1)
    x = rng.standard_normal((rows, 576)).astype(np.float32)
    expected = int8_blocks_float64(x, 32) @ value[0]
    assert_matches(np.asarray(jax.jit(cpu_matmul.q8_matmul)(x, half, 0)), expected)


@needs_int8_dots
def test_linear_with_int8_activations_same_on_every_path():
    """A weight with activation_block: the CPU backend's linear on LayerOf runs the q8 kernel
    at any row count; on the plain layer (the XLA path, or a mesh) it
    multiplies int8_blocks(x) in float. Both give the float64 product of the
    rounded activations."""
    rng = np.random.default_rng(1)
    w, value = random_stacked_weight(rng, "int4", 2, 64, 128, 32, True)
    w = dataclasses.replace(w, activation_block=32)
    for rows in (3, 40):
        x = rng.standard_normal((rows, 64)).astype(np.float32)
        expected = int8_blocks_float64(x, 32) @ value[1]
        native = jax.jit(lambda x, w, i: CPU.linear(x, LayerOf(w, i)))
        assert cpu_matmul.Q8_TARGET_NAME in native.lower(x, w, jnp.int32(1)).as_text()
        plain = jax.jit(lambda x, w: linear(x, LayerOf(w, jnp.int32(1)).layer()))
        for fn, args in ((native, (x, w, jnp.int32(1))), (plain, (x, w))):
            assert_matches(np.asarray(fn(*args)), expected)


def test_linear_hands_layer_of_to_the_kernel_and_the_rest_to_xla():
    """The CPU backend's linear on LayerOf runs the kernel up to max_exact_rows() rows (512 with
    AVX-512, 256 with AVX2) and the XLA path (on the sliced layer) past that: the same
    values either way."""
    rng = np.random.default_rng(0)
    w, value = random_stacked_weight(rng, "int4", 2, 64, 128, 32, True)
    max_rows = cpu_weights.max_exact_rows()
    for rows in (3, max_rows, max_rows + 1):
        x = jnp.asarray(rng.standard_normal((rows, 64)), jnp.float32)
        fn = jax.jit(lambda x, w, i: CPU.linear(x, LayerOf(w, i)))
        hlo = fn.lower(x, w, jnp.int32(1)).as_text()
        assert (cpu_matmul.TARGET_NAME in hlo) == (rows <= max_rows)
        assert_matches(np.asarray(fn(x, w, jnp.int32(1))), np.asarray(x, np.float64) @ value[1])


def test_model_forward_uses_the_kernel_only_when_allowed(tiny_llama_quantized):
    """A decode-sized forward of a quantized model on the CPU backend reads its
    stacked layers through the kernel; with native=False (a mesh) it never
    does, and both give the same logits."""
    params, config = tiny_llama_quantized
    tokens = jnp.asarray([[5, 9]], jnp.int32)
    positions = jnp.asarray([[0, 1]], jnp.int32)

    def run(native):
        from jaxinfer.models.attention import full_sequence_attention

        fn = jax.jit(lambda p, t: forward(p, config, t, positions, full_sequence_attention(positions),
                                          backend=CpuBackend(native=native))[0])
        return fn.lower(params, tokens).as_text(), np.asarray(fn(params, tokens))

    (native_hlo, native_out), (xla_hlo, xla_out) = run(True), run(False)
    assert cpu_matmul.TARGET_NAME in native_hlo and cpu_matmul.TARGET_NAME not in xla_hlo
    np.testing.assert_allclose(native_out, xla_out, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_llama_quantized():
    from jaxinfer.config import ModelConfig
    from jaxinfer.models.llama import param_shapes
    from jaxinfer.quant.params import quantize_params

    config = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda shape: jnp.asarray(rng.standard_normal(shape) * 0.1, jnp.float32),
                          param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))
    return quantize_params(params, "int4", include_head=True), config
