"""Matmuls by grouped int8 / int4 weights on CPU as native XLA FFI kernels,
built with the machine's C++ compiler on first use (native/build.py,
native_library):

  matmul.cc         float32 activations, any number of rows: the weight's
                    exact value; one call may take several weights of one
                    layer (a layer's q, k and v: quantized_matmuls); and a
                    MoE's experts, each row by its own expert
                    (quantized_expert_matmuls)
  q8_matmul.cc      activations quantized to int8 blocks on the fly (weights
                    with activation_block, quant/tensor.py), any number of
                    rows: int8 dots (AVX512-VNNI, or AVX2 with FMA and F16C;
                    without them the build fails and quant/linear.py
                    multiplies the same numbers in XLA)

Why native code: XLA does not fuse a convert into a dot, so the XLA path
(quant/linear.py) writes a float32 copy of each weight on every call, which
at a few rows (decode at small batches, speculative verification) is most of the
step, and past that a float32 dot is compute-bound. The kernels read the
codes once, in place, from the stacked weights of every layer plus a layer
index (quant/layer_weights.py, LayerOf): a per-layer slice handed to a
custom call would be copied by XLA first.

The supports* functions say what a kernel can take (scheme, dtype, layout,
tiles); which kernel multiplies which weight at how many rows is the CPU
backend's choice (backends/cpu_weights.py).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.quant.tensor import QuantizedTensor
from jaxinfer.native.build import cpu_runs_vec16, native_ffi_target

SOURCE = Path(__file__).with_suffix(".cc")
TARGET_NAME = "jaxinfer_quantized_matmul"
EXPERT_TARGET_NAME = "jaxinfer_quantized_expert_matmul"
Q8_SOURCE = Path(__file__).with_name("q8_matmul.cc")
Q8_TARGET_NAME = "jaxinfer_q8_matmul"
Q8_COLUMNS = 64  # the int8-activation kernel's output columns per tile
# Columns per tile of a tiled weight (quant/tensor.py), the width the exact
# kernel's register paths take (tileable(): AVX-512, or AVX2 with FMA and
# F16C, vec16.h). The int8-activation kernel reads the plain layout: tiles
# made it slower (BENCHMARKS.md, "Tiled weights").
TILE = 64


def available() -> bool:
    """Whether the kernel is built and registered with XLA (built on first call)."""
    return native_ffi_target(str(SOURCE), "JaxinferQuantizedMatmuls", TARGET_NAME)


def experts_available() -> bool:
    """Whether the experts' entry of the same library is registered (built on first call)."""
    return available() and native_ffi_target(str(SOURCE), "JaxinferQuantizedExpertMatmuls", EXPERT_TARGET_NAME)


def supports(w: QuantizedTensor) -> bool:
    """Whether the exact kernel takes w (one matrix [in, out] or a stack of
    layers, plain or in tiles of TILE where cpu_runs_vec16)."""
    return (w.scheme in ("int8", "int4") and w.scales.dtype == jnp.float32 and _layout_ok(w)
            and (not w.tile or cpu_runs_vec16()) and (w.scheme == "int8" or w.group_size % 2 == 0))


def share_attributes(ws: list[QuantizedTensor]) -> bool:
    """Whether one call of the exact kernel takes all of ws (quantized_matmuls,
    quantized_expert_matmuls): one group size, and offsets on all or none
    (the call's attributes)."""
    return len({w.group_size for w in ws}) == 1 and len({w.offsets is None for w in ws}) == 1


def q8_available() -> bool:
    """Whether the int8-activation kernel is built and registered (built on first call)."""
    return native_ffi_target(str(Q8_SOURCE), "JaxinferQ8Matmul", Q8_TARGET_NAME)


def supports_q8(w: QuantizedTensor) -> bool:
    """Whether the int8-activation kernel takes w, a weight with
    activation_block set (one matrix or a stack of layers, plain layout)."""
    return (w.scheme in ("int8", "int4") and w.activation_block in (16, 32) and w.group_size % w.activation_block == 0
            and w.out_features % Q8_COLUMNS == 0 and w.data.ndim in (2, 3) and not w.tile
            and w.scales.dtype in (jnp.float32, jnp.float16))


def tileable(w: QuantizedTensor) -> bool:
    """Whether w (stacked layer weights, or one matrix) can be stored in tiles
    of TILE columns for the exact kernel: one it takes, plain, whose columns
    fill whole tiles, on a CPU the tiled paths are built for (cpu_runs_vec16)."""
    return cpu_runs_vec16() and not w.tile and w.out_features % TILE == 0 and supports(w)


def tileable_experts(w: QuantizedTensor) -> bool:
    """tileable() for a MoE's stack of experts [layers, experts, in, out]."""
    return (cpu_runs_vec16() and not w.tile and w.data.ndim == 4 and w.out_features % TILE == 0
            and supports_experts([w]))


def _layout_ok(w: QuantizedTensor) -> bool:
    """One weight [in, out] or a stack of layers, plain or in tiles of TILE."""
    return w.data.ndim - (1 if w.tile else 0) in (2, 3) and w.tile in (0, TILE)


def quantized_matmul(x, w: QuantizedTensor, layer_index=0) -> jax.Array:
    """x [rows, in] @ layer `layer_index` of w -> float32 [rows, out]; w is
    [in, out] or stacked [layers, in, out] (read in place either way)."""
    return quantized_matmuls(x, [w], layer_index)[0]


def quantized_matmuls(x, ws: list[QuantizedTensor], layer_index=0) -> list[jax.Array]:
    """[quantized_matmul(x, w, layer_index) for w in ws] in one kernel call
    (the same numbers): the cores share out every weight's tasks at once.
    The weights must share a group size and have offsets all or none
    (share_attributes)."""
    if not available():
        raise RuntimeError("the CPU quantized matmul kernel is not available here (see the warning above)")
    if not share_attributes(ws):
        raise ValueError("quantized_matmuls: the weights must share a group size and all or none have offsets")
    buffers = []
    for w in ws:
        data, scales, offsets = _stacked(w)
        buffers += [data, scales, jnp.zeros((1,), jnp.float32) if offsets is None else offsets]
    call = jax.ffi.ffi_call(TARGET_NAME, [jax.ShapeDtypeStruct((x.shape[0], w.out_features), jnp.float32) for w in ws])
    return list(call(x.astype(jnp.float32), jnp.asarray(layer_index, jnp.int32), *buffers,
                     group_size=np.int64(ws[0].group_size), has_offsets=ws[0].offsets is not None))


def supports_experts(ws: list[QuantizedTensor]) -> bool:
    """Whether quantized_expert_matmuls takes these stacks of experts
    [layers, experts, in, out] in one call (any number of rows; a weight
    with an activation block multiplies activations its caller rounded
    first)."""
    return all(w.scheme in ("int8", "int4") and w.scales.dtype == jnp.float32
               and w.data.ndim - (1 if w.tile else 0) == 4 and w.tile in (0, TILE)
               and (not w.tile or cpu_runs_vec16()) and (w.scheme == "int8" or w.group_size % 2 == 0)
               for w in ws) and share_attributes(ws)


def quantized_expert_matmuls(x, ws: list[QuantizedTensor], layer_index, expert_ids) -> list[jax.Array]:
    """Rows x [rows, in] sorted by expert (expert_ids int32 [rows],
    non-decreasing) -> for each stack w of ws [layers, experts, in, out],
    float32 [rows, out] with row r = x[r] @ w[layer_index, expert_ids[r]]:
    only the selected experts' codes are read, each once for all its rows."""
    if not experts_available():
        raise RuntimeError("the CPU quantized matmul kernel is not available here (see the warning above)")
    num_experts = ws[0].data.shape[1]
    buffers = []
    for w in ws:  # [layers, experts, ...] as one stack of matrices: a free reshape
        flat = lambda a: None if a is None else a.reshape(-1, *a.shape[2:])  # noqa: E731
        buffers += [flat(w.data), flat(w.scales),
                    jnp.zeros((1,), jnp.float32) if w.offsets is None else flat(w.offsets)]
    matrix = jnp.asarray(layer_index, jnp.int32) * num_experts + expert_ids.astype(jnp.int32)
    call = jax.ffi.ffi_call(EXPERT_TARGET_NAME,
                            [jax.ShapeDtypeStruct((x.shape[0], w.out_features), jnp.float32) for w in ws])
    return list(call(x.astype(jnp.float32), matrix, *buffers, group_size=np.int64(ws[0].group_size),
                     has_offsets=ws[0].offsets is not None))


def q8_matmul(x, w: QuantizedTensor, layer_index=0) -> jax.Array:
    """int8_blocks(x, w.activation_block) [rows, in] @ layer `layer_index` of w
    -> float32 [rows, out], as quantized_matmul."""
    if not q8_available():
        raise RuntimeError("the CPU int8-activation matmul kernel is not available here (see the warning above)")
    data, scales, offsets = _stacked(w)
    call = jax.ffi.ffi_call(Q8_TARGET_NAME, jax.ShapeDtypeStruct((x.shape[0], w.out_features), jnp.float32))
    return call(x.astype(jnp.float32), data, scales, jnp.zeros((1,), scales.dtype) if offsets is None else offsets,
                jnp.asarray(layer_index, jnp.int32), group_size=np.int64(w.group_size),
                has_offsets=offsets is not None, block=np.int64(w.activation_block))


def _stacked(w: QuantizedTensor):
    """w's (data, scales, offsets) with a leading layer axis (a leading axis of
    1 is a free reshape, not a copy)."""
    data, scales, offsets = w.data, w.scales, w.offsets
    if data.ndim == (3 if w.tile else 2):
        data, scales = data[None], scales[None]
        offsets = None if offsets is None else offsets[None]
    return data, scales, offsets

