"""The RMSNorm kernel (Pallas, interpret mode on CPU), alone and after adding a
projection's partial sums to the stream, against HF
Llama's RMSNorm in float64 numpy: statistics in float32 precision or better,
the normalized row rounded to x's dtype before the weight."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.rms_norm import add_rms_norm, rms_norm

EPS = 1e-5


def hf_rms_norm(x: np.ndarray, weight: np.ndarray, dtype) -> np.ndarray:
    """HF's LlamaRMSNorm in float64: variance of the float32 row, the normed
    row cast to x's dtype, then times the weight, rounded to the result's dtype."""
    x64 = x.astype(np.float64)
    normed = (x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + EPS)).astype(dtype)
    return (weight.astype(np.float64) * normed.astype(np.float64)).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 4096), (1, 576), (3, 96)])
def test_matches_hf_and_the_model(dtype, shape):
    """Rows of a power-of-two width and of others (the padded columns are
    masked: not read, not written), one row (what the GPU backend sends it)
    and several, float32 and bfloat16."""
    rng = np.random.default_rng(shape[-1])
    x = (rng.standard_normal(shape) * 3).astype(dtype)
    weight = (1 + 0.1 * rng.standard_normal(shape[-1])).astype(dtype)
    out = rms_norm(jnp.asarray(x), jnp.asarray(weight), EPS, interpret=True)
    assert out.dtype == jnp.dtype(dtype) and out.shape == shape
    expected = hf_rms_norm(x, weight, dtype).astype(np.float64)
    # float32: a few ulps of float32 rounding; bfloat16: one bfloat16 ulp where float32 rounding sits at a tie.
    tolerance = 1e-6 if dtype == np.float32 else 2**-7
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("shape,splits", [((2, 1, 4096), 8), ((3, 96), 1), ((4, 576), 4)])
def test_add_then_norm_matches_hf(dtype, shape, splits):
    """x plus a projection given as float32 partial sums (what a split-K
    GEMM writes), then the norm: the new stream is x + (sum of the parts,
    rounded to x's dtype) as the model adds it, the norm HF's of that."""
    rng = np.random.default_rng(splits)
    x = (rng.standard_normal(shape) * 3).astype(dtype)
    parts = rng.standard_normal((splits, *shape)).astype(np.float32)
    weight = (1 + 0.1 * rng.standard_normal(shape[-1])).astype(dtype)
    total, normed = add_rms_norm(jnp.asarray(x), jnp.asarray(parts), jnp.asarray(weight), EPS, interpret=True)
    assert total.dtype == normed.dtype == jnp.dtype(dtype) and total.shape == normed.shape == shape
    expected = (x.astype(np.float64) + parts.astype(np.float64).sum(0).astype(dtype)).astype(dtype)
    tolerance = 1e-6 if dtype == np.float32 else 2**-7
    np.testing.assert_allclose(np.asarray(total, np.float64), expected.astype(np.float64), rtol=tolerance,
                               atol=tolerance)
    # The norm of the stream the kernel wrote. bfloat16: over 8k values some normed value sits at a
    # rounding tie, where float32 statistics round it one ulp off float64's, two after the weight's rounding.
    tolerance = 1e-6 if dtype == np.float32 else 2**-6
    np.testing.assert_allclose(np.asarray(normed, np.float64),
                               hf_rms_norm(np.asarray(total), weight, dtype).astype(np.float64),
                               rtol=tolerance, atol=tolerance)


def test_add_then_norm_refuses_parts_of_another_shape():
    x = jnp.ones((2, 64), jnp.float32)
    with pytest.raises(ValueError, match="parts"):
        add_rms_norm(x, jnp.ones((2, 3, 64), jnp.float32), jnp.ones(64), EPS, interpret=True)
