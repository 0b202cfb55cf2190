"""The native CPU expert matmuls of a MoE (native/expert_matmul.cc for
float32 experts, native/matmul.cc's expert entry for int8 / int4 codes,
plain and in tiles): each row by its own expert of a stack [layers,
experts, in, out], against float64 numpy on weights dequantized
independently (tests/kernels/test_native_matmul.py's random_stacked_weight); runs of
1 to 13 rows per expert (every tile shape of both kernels), columns that
end inside a tile, a row's result independent of the rows beside it, and
the backend's reference (jax.lax.ragged_dot) agreeing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.backends import CpuBackend, XlaBackend
from jaxinfer.native import expert_matmul
from jaxinfer.native import matmul as cpu_matmul
from jaxinfer.quant.layer_weights import LayerOf
from tests.cpu_features import needs_vec16
from tests.kernels.test_native_matmul import assert_matches, random_stacked_weight

LAYERS, EXPERTS = 2, 5


def test_kernels_build_here():
    assert expert_matmul.available() and cpu_matmul.experts_available()


def routed_rows(rng, runs: list[int], in_features: int):
    """Rows sorted by expert: runs[e] rows for expert e (0 rows: unused)."""
    expert_ids = np.repeat(np.arange(len(runs)), runs).astype(np.int32)
    return rng.standard_normal((len(expert_ids), in_features)).astype(np.float32), expert_ids


def expected(x, value, layer, expert_ids):
    return np.stack([x[r].astype(np.float64) @ value[layer, e] for r, e in enumerate(expert_ids)])


RUNS = [[1, 0, 2, 3, 13], [4, 5, 6, 7, 8], [0, 0, 1, 0, 0], [9, 1, 0, 2, 1]]


@pytest.mark.parametrize("runs", RUNS)
@pytest.mark.parametrize("out_features", [300, 128, 64, 40])
def test_float_experts_match_float64(runs, out_features):
    rng = np.random.default_rng(sum(runs) + out_features)
    in_features = 72
    w = rng.standard_normal((LAYERS, EXPERTS, in_features, out_features)).astype(np.float32)
    x, expert_ids = routed_rows(rng, runs, in_features)
    ys = jax.jit(expert_matmul.expert_matmuls)(x, [jnp.asarray(w), jnp.asarray(2 * w)], jnp.int32(1),
                                               jnp.asarray(expert_ids))
    assert_matches(np.asarray(ys[0]), expected(x, w.astype(np.float64), 1, expert_ids))
    assert_matches(np.asarray(ys[1]), expected(x, 2 * w.astype(np.float64), 1, expert_ids))


def stacked_experts(rng, scheme, in_features, out_features, group_size, offsets, tiled):
    tensor, value = random_stacked_weight(rng, scheme, LAYERS * EXPERTS, in_features, out_features, group_size,
                                          offsets)
    tensor = jax.tree.map(lambda a: a.reshape(LAYERS, EXPERTS, *a.shape[1:]), tensor)
    value = value.reshape(LAYERS, EXPERTS, in_features, out_features)
    return (tensor.tiled(cpu_matmul.TILE) if tiled else tensor), value


@pytest.mark.parametrize("scheme,group_size,offsets,tiled", [
    pytest.param("int4", 32, True, True, marks=needs_vec16), pytest.param("int8", 32, False, True, marks=needs_vec16),
    ("int8", 16, True, False), ("int4", 64, True, False), pytest.param("int8", 64, False, True, marks=needs_vec16)])
@pytest.mark.parametrize("runs", RUNS)
def test_quantized_experts_match_float64(scheme, group_size, offsets, tiled, runs):
    rng = np.random.default_rng(sum(runs) + group_size)
    tensor, value = stacked_experts(rng, scheme, 128, 192, group_size, offsets, tiled)
    assert cpu_matmul.supports_experts([tensor])
    x, expert_ids = routed_rows(rng, runs, 128)
    (y,) = jax.jit(cpu_matmul.quantized_expert_matmuls)(x, [tensor], jnp.int32(1), jnp.asarray(expert_ids))
    assert_matches(np.asarray(y), expected(x, value, 1, expert_ids))


@pytest.mark.parametrize("scheme", ["float32", pytest.param("int4", marks=needs_vec16)])
def test_a_row_does_not_depend_on_the_rows_beside_it(scheme):
    """A token's experts give it the same bits alone as among 1..24 other
    rows of the same expert (every path of both kernels): a sequence's
    tokens never depend on which neighbours chose its experts."""
    rng = np.random.default_rng(3)
    if scheme == "float32":
        w = jnp.asarray(rng.standard_normal((LAYERS, EXPERTS, 96, 320)).astype(np.float32))
    else:
        w, _ = stacked_experts(rng, "int4", 96, 320, 32, True, True)
    backend = CpuBackend()
    call = jax.jit(lambda x, ids: backend.expert_linears(x, [LayerOf(w, jnp.int32(0))], ids)[0])
    x = rng.standard_normal((25, 96)).astype(np.float32)
    alone = np.stack([np.asarray(call(x[r:r + 1], jnp.full((1,), 3, jnp.int32)))[0] for r in range(25)])
    for rows in (2, 3, 7, 8, 9, 16, 25):
        together = np.asarray(call(x[:rows], jnp.full((rows,), 3, jnp.int32)))
        np.testing.assert_array_equal(together, alone[:rows])


@pytest.mark.parametrize("scheme", ["float32", pytest.param("int8", marks=needs_vec16)])
def test_backend_takes_the_kernels_and_agrees_with_the_reference(scheme):
    """The CPU backend's expert_linears on a stack in place (LayerOf) runs the
    kernel (its custom call in the program) and gives the XLA reference's
    ragged_dot values."""
    rng = np.random.default_rng(4)
    if scheme == "float32":
        w = jnp.asarray(rng.standard_normal((LAYERS, EXPERTS, 64, 128)).astype(np.float32))
        target = expert_matmul.TARGET_NAME
    else:
        w, _ = stacked_experts(rng, "int8", 64, 128, 32, False, True)
        target = cpu_matmul.EXPERT_TARGET_NAME
    x, expert_ids = routed_rows(rng, [3, 0, 1, 4, 2], 64)

    def native(x, ids):
        return CpuBackend().expert_linears(x, [LayerOf(w, jnp.int32(1))], ids)[0]

    assert target in jax.jit(native).lower(x, expert_ids).as_text()
    reference = XlaBackend().expert_linears(jnp.asarray(x), [LayerOf(w, jnp.int32(1)).layer()],
                                            jnp.asarray(expert_ids))[0]
    np.testing.assert_allclose(np.asarray(jax.jit(native)(x, expert_ids)), np.asarray(reference), rtol=1e-5,
                               atol=1e-5)
