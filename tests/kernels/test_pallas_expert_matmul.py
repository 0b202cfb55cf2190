"""The Pallas grouped expert matmul (pallas_kernels/expert_matmul.py) in
interpret mode on CPU, against float64 numpy and its jnp reference: rows
sorted by expert with runs of several lengths and unused experts, K and N
that end inside a tile, bfloat16 activations. The GPU backend's use of it
(cross-lowered for CUDA) is in tests/models/test_backends.py."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import expert_matmul as kernel


@pytest.mark.parametrize("runs,in_features,out_features", [([1, 0, 2, 1], 64, 64), ([3, 1, 0, 4], 72, 100),
                                                           ([0, 0, 1, 0], 200, 40), ([2, 2, 2, 2], 16, 130)])
def test_matches_float64(runs, in_features, out_features):
    rng = np.random.default_rng(sum(runs) + in_features)
    w = rng.standard_normal((len(runs), in_features, out_features)).astype(np.float32)
    ids = np.repeat(np.arange(len(runs)), runs).astype(np.int32)
    x = rng.standard_normal((len(ids), in_features)).astype(np.float32)
    y = np.asarray(kernel.expert_matmul(x, w, ids, block_k=32, block_n=32, interpret=True))
    expected = np.stack([x[r].astype(np.float64) @ w[e] for r, e in enumerate(ids)])
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    np.testing.assert_allclose(y, np.asarray(kernel.expert_matmul_reference(x, w, ids)), rtol=1e-5, atol=1e-5)


def test_bfloat16_rows_sum_in_float32():
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((3, 128, 64)), jnp.bfloat16)
    ids = np.array([0, 2, 2], np.int32)
    x = jnp.asarray(rng.standard_normal((3, 128)), jnp.bfloat16)
    y = kernel.expert_matmul(x, w, ids, interpret=True)
    assert y.dtype == jnp.bfloat16
    expected = np.stack([np.asarray(x[r], np.float64) @ np.asarray(w[e], np.float64) for r, e in enumerate(ids)])
    np.testing.assert_allclose(np.asarray(y, np.float32), expected, rtol=1e-2, atol=1e-2 * np.abs(expected).max())


def test_supports_decode_sizes_of_float_stacks():
    w = jnp.zeros((4, 8, 8), jnp.float32)
    assert kernel.supports(w, 1) and kernel.supports(w, kernel.MAX_ROWS)
    assert not kernel.supports(w, kernel.MAX_ROWS + 1) and not kernel.supports(w.astype(jnp.int8), 1)
