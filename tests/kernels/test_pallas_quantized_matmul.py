"""Quantized matmul kernel (Pallas, interpret mode on CPU) against its jnp
reference and against a float64 numpy computation that unpacks and
dequantizes the weight independently (its own nibble order, scale and offset
expansion).

Most weights are built straight from random codes rather than by a quantizer,
so that every int8 value, all 16 int4 codes and e4m3 values up to the format's
maximum occur; two cases go through jaxinfer.quant.schemes.quantize to check
the kernel on what the quantizer produces.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxinfer.quant.schemes import quantize
from jaxinfer.quant.tensor import QuantizedTensor
from pallas_kernels import quantized_matmul as kernel
from pallas_kernels.quantized_matmul import MAX_ROWS, matmul_tiling


# The kernel takes plain arrays; the tests build QuantizedTensors (the layout
# jaxinfer stores) and unpack them here.
def quantized_matmul(x, w: QuantizedTensor, **kwargs):
    return kernel.quantized_matmul(x, w.data, w.scales, w.offsets, scheme=w.scheme, group_size=w.group_size, **kwargs)


def quantized_matmul_reference(x, w: QuantizedTensor):
    return kernel.quantized_matmul_reference(x, w.data, w.scales, w.offsets, scheme=w.scheme, group_size=w.group_size)


def supports(w: QuantizedTensor, num_rows: int) -> bool:
    return kernel.supports(w.data, w.scheme, w.group_size, num_rows)


def random_weight(rng, scheme, in_features, out_features, group_size=None, num_layers=None):
    """A QuantizedTensor of random codes, scales (and int4 offsets); group_size None = per channel."""
    group_size = group_size or in_features
    lead = () if num_layers is None else (num_layers,)
    groups = in_features // group_size
    scales = rng.uniform(0.005, 0.05, (*lead, groups, out_features)).astype(np.float32)
    offsets = None
    if scheme == "int8":
        data = rng.integers(-127, 128, (*lead, in_features, out_features)).astype(np.int8)
        data[..., 0, 0], data[..., 1, 0] = -127, 127
    elif scheme == "int4":
        codes = rng.integers(0, 16, (*lead, in_features, out_features)).astype(np.uint8)
        assert len(np.unique(codes)) == 16
        data = codes[..., 0::2, :] | (codes[..., 1::2, :] << 4)
        offsets = rng.uniform(-0.5, 0.1, (*lead, groups, out_features)).astype(np.float32)
    else:
        values = 3 * rng.standard_normal((*lead, in_features, out_features))
        values[..., 0, :2] = [448.0, -448.0]
        data = values.astype(ml_dtypes.float8_e4m3fn)
    return QuantizedTensor(
        jnp.asarray(data), jnp.asarray(scales), None if offsets is None else jnp.asarray(offsets), scheme, group_size
    )


def dequantize_float64(w: QuantizedTensor) -> np.ndarray:
    """Independent of quant/tensor.py: logical [in, out] float64."""
    data = np.asarray(w.data)
    if w.scheme == "int4":
        q = np.empty((data.shape[0] * 2, data.shape[1]), np.float64)
        q[0::2] = data & 0x0F
        q[1::2] = data >> 4
    else:
        q = data.astype(np.float64)
    value = q * np.repeat(np.asarray(w.scales, np.float64), w.group_size, axis=0)
    if w.offsets is not None:
        value += np.repeat(np.asarray(w.offsets, np.float64), w.group_size, axis=0)
    return value


def random_x(rng, num_rows, in_features, dtype):
    return jnp.asarray(rng.standard_normal((num_rows, in_features)), dtype)


def assert_matches(out, x, w, w_float64=None):
    """out vs the jnp reference and vs float64 numpy, to the output dtype's precision."""
    assert out.dtype == x.dtype and out.shape == (x.shape[0], w.out_features)
    out = np.asarray(out.astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(out))
    truth = np.asarray(x.astype(jnp.float32), np.float64) @ (dequantize_float64(w) if w_float64 is None else w_float64)
    reference = np.asarray(quantized_matmul_reference(x, w).astype(jnp.float32), np.float64)
    # bf16 output: a couple of ulps (2**-8 relative) of the largest value; float32: accumulation-order noise.
    tolerance = (2e-2 if x.dtype == jnp.bfloat16 else 2e-5) * np.abs(truth).max()
    np.testing.assert_allclose(out, truth, rtol=0, atol=tolerance)
    np.testing.assert_allclose(out, reference, rtol=0, atol=tolerance)


# (scheme, group_size, num_rows, in_features, out_features, x dtype, tuning overrides)
CASES = [
    # per channel, K and N multiples of the tiles, decode row counts
    ("int8", None, 1, 256, 128, jnp.bfloat16, {}),
    ("fp8", None, 1, 256, 128, jnp.bfloat16, {}),
    # ragged K and N (per channel), several K tiles, a split whose last part is short
    ("int8", None, 5, 300, 70, jnp.float32, dict(block_k=64, split_k=2)),
    ("fp8", None, 9, 160, 48, jnp.float32, dict(block_k=32)),
    ("int4", None, 2, 200, 50, jnp.float32, dict(block_k=64)),
    # grouped: GGUF-sized groups of 32 and the usual 128, several groups per tile row of programs
    ("int8", 32, 16, 256, 80, jnp.bfloat16, {}),
    ("int8", 128, 3, 512, 64, jnp.float32, dict(split_k=2)),
    ("int4", 32, 7, 256, 64, jnp.bfloat16, {}),
    ("int4", 128, 1, 512, 96, jnp.float32, dict(split_k=2, block_n=64)),
    # more rows than one M tile
    ("int4", 64, 40, 256, 128, jnp.bfloat16, dict(block_m=32)),
    ("int8", None, MAX_ROWS + 22, 128, 64, jnp.bfloat16, {}),
]


@pytest.mark.parametrize("scheme,group_size,num_rows,in_features,out_features,dtype,tuning", CASES)
def test_matches_reference_and_float64(scheme, group_size, num_rows, in_features, out_features, dtype, tuning):
    rng = np.random.default_rng(in_features * 1000 + out_features + num_rows)
    w = random_weight(rng, scheme, in_features, out_features, group_size)
    x = random_x(rng, num_rows, in_features, dtype)
    assert_matches(quantized_matmul(x, w, interpret=True, **tuning), x, w)


@pytest.mark.parametrize("scheme,group_size", [("int8", None), ("int4", 128)])
def test_quantizer_output(scheme, group_size):
    """What schemes.quantize produces (the model's real weights), checked against
    the float64 dequantization of those same codes and, loosely, the float weight."""
    rng = np.random.default_rng(7)
    w_float = rng.standard_normal((256, 96)).astype(np.float32) * 0.05
    w = quantize(jnp.asarray(w_float), scheme, group_size)
    x = random_x(rng, 4, 256, jnp.bfloat16)
    out = quantized_matmul(x, w, interpret=True)
    assert_matches(out, x, w)
    # Against the float weight only quantization error remains: RTN on Gaussian
    # weights gives about 1% (int8) and 10% (int4, 16 levels) relative RMS error.
    exact = np.asarray(x.astype(jnp.float32), np.float64) @ w_float
    relative_rms = np.sqrt(np.mean((np.asarray(out, np.float64) - exact) ** 2) / np.mean(exact**2))
    assert relative_rms < {"int8": 0.03, "int4": 0.2}[scheme], relative_rms


def test_stacked_weight_reads_only_its_layer():
    """A [layers, in, out] stack with a traced layer_index: the other layers'
    scales and offsets are NaN, so reading any of them poisons the result."""
    rng = np.random.default_rng(11)
    stack = random_weight(rng, "int4", 128, 64, group_size=32, num_layers=3)
    layer = 1
    poison = np.full(stack.scales.shape, np.nan, np.float32)
    poison[layer] = np.asarray(stack.scales[layer])
    poison_offsets = np.full(stack.offsets.shape, np.nan, np.float32)
    poison_offsets[layer] = np.asarray(stack.offsets[layer])
    stack = QuantizedTensor(stack.data, jnp.asarray(poison), jnp.asarray(poison_offsets), "int4", 32)
    one_layer = QuantizedTensor(stack.data[layer], stack.scales[layer], stack.offsets[layer], "int4", 32)
    x = random_x(rng, 2, 128, jnp.float32)
    out = jax.jit(lambda x, w, i: quantized_matmul(x, w, layer_index=i, interpret=True))(x, stack, jnp.int32(layer))
    assert_matches(out, x, one_layer)


def test_leading_axes_and_zero_rows():
    rng = np.random.default_rng(5)
    w = random_weight(rng, "int8", 64, 32)
    x = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.float32)
    out = quantized_matmul(x, w, interpret=True)
    assert out.shape == (2, 3, 32)
    assert_matches(out.reshape(6, 32), x.reshape(6, 64), w)
    assert quantized_matmul(jnp.zeros((0, 64), jnp.float32), w, interpret=True).shape == (0, 32)


def test_supports():
    rng = np.random.default_rng(0)
    assert supports(random_weight(rng, "int8", 64, 32), 1)
    assert supports(random_weight(rng, "int8", 64, 32, group_size=16), MAX_ROWS)
    assert supports(random_weight(rng, "int4", 256, 32, group_size=32), 16)
    assert supports(random_weight(rng, "int4", 200, 32), 1)  # per channel, ragged K
    assert supports(random_weight(rng, "fp8", 64, 32), 1)  # CPU: no compute-capability limit
    assert not supports(random_weight(rng, "int8", 64, 32), MAX_ROWS + 1)
    assert not supports(random_weight(rng, "int8", 64, 32), 0)
    assert not supports(random_weight(rng, "int8", 64, 32, group_size=8), 1)  # a tile would cross groups
    assert not supports(random_weight(rng, "int4", 64, 32, group_size=16), 1)  # 8 packed rows < 16
    assert not supports(random_weight(rng, "int8", 64, 32, num_layers=2), 1)  # a stack needs layer_index
    assert not kernel.supports(jnp.zeros((64, 32), jnp.int8), "int3", 64, 1)  # no such scheme
    with pytest.raises(ValueError, match="group_size 16 must be a multiple of 32"):
        quantized_matmul(jnp.zeros((1, 64)), random_weight(rng, "int4", 64, 32, group_size=16), interpret=True)
    with pytest.raises(ValueError, match="x has 63 features"):
        quantized_matmul(jnp.zeros((1, 63)), random_weight(rng, "int8", 64, 32), interpret=True)


def test_tiling():
    """Defaults for the Llama-3-8B decode shapes are legal and spread the work;
    requested values are checked."""
    for scheme, group in (("int8", 4096), ("int4", 128), ("int8", 32), ("fp8", 4096)):
        for in_features, out_features in ((4096, 4096), (4096, 14336), (14336, 4096), (4096, 1024)):
            g = in_features if group == 4096 else group
            t = matmul_tiling(scheme, g, in_features, out_features, 1)
            assert t.block_m == 16 and t.block_k <= g and (g == in_features or g % t.block_k == 0)
            k_tiles = -(-in_features // t.block_k)
            assert -(-k_tiles // t.split_k) * (t.split_k - 1) < k_tiles  # no split left empty
            programs = -(-out_features // t.block_n) * t.split_k
            assert programs >= 128, (scheme, in_features, out_features, t)
    assert matmul_tiling("int4", 128, 4096, 4096, 1).block_k == 128
    assert matmul_tiling("int8", 32, 4096, 4096, 1).block_k == 32
    assert matmul_tiling("int8", 4096, 4096, 14336, 1).split_k == 1  # 448 column tiles are enough
    assert matmul_tiling("int8", 4096, 4096, 1024, 1).split_k > 1
    assert matmul_tiling("int8", 256, 256, 128, 1, split_k=64).split_k == 2  # as many splits as tiles
    with pytest.raises(ValueError, match="block_k=16 must be a power of two >= 32"):
        matmul_tiling("int4", 128, 256, 64, 1, block_k=16)
    with pytest.raises(ValueError, match="block_k=64 must divide group_size 32"):
        matmul_tiling("int8", 32, 256, 64, 1, block_k=64)
    with pytest.raises(ValueError, match="block_n=48 must be a power of two"):
        matmul_tiling("int8", 256, 256, 64, 1, block_n=48)


LOWERING_CASES = [
    ("int8", None, 1, 4096, 1024, jnp.bfloat16, {}),  # split-k partials
    ("int8", 32, 16, 512, 96, jnp.bfloat16, {}),  # ragged N
    ("int4", 128, 1, 4096, 4096, jnp.bfloat16, {}),
    ("int4", None, 3, 200, 64, jnp.float32, {}),  # ragged K, per-channel offsets
    ("fp8", None, 1, 1024, 512, jnp.bfloat16, {}),
    ("fp8", None, 40, 256, 128, jnp.float32, {}),
]


@pytest.mark.parametrize("scheme,group_size,num_rows,in_features,out_features,dtype,tuning", LOWERING_CASES)
def test_lowers_to_triton_for_cuda(scheme, group_size, num_rows, in_features, out_features, dtype, tuning):
    """Cross-lowering for CUDA on this CPU host runs the real Pallas Triton
    lowering rules (every primitive, cast and index form of the kernel) up to
    the Triton IR; only PTX compilation is left to a GPU."""
    rng = np.random.default_rng(1)
    w = random_weight(rng, scheme, in_features, out_features, group_size)
    x = random_x(rng, num_rows, in_features, dtype)
    lowered = jax.jit(lambda x, w: quantized_matmul(x, w, **tuning)).trace(x, w).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()


def test_stacked_lowers_to_triton_for_cuda():
    rng = np.random.default_rng(2)
    stack = random_weight(rng, "int8", 256, 128, group_size=32, num_layers=4)
    x = random_x(rng, 1, 256, jnp.bfloat16)
    lowered = jax.jit(lambda x, w, i: quantized_matmul(x, w, layer_index=i)).trace(x, stack, jnp.int32(2)).lower(
        lowering_platforms=("cuda",)
    )
    assert "triton" in lowered.as_text()
