"""x @ K-quant weights (quant/kquant.py: Q2_K .. Q6_K as the file stores them)
on CPU: kquant_matmul.cc, float32 activations, the weight's exact values,
any number of rows; built with the machine's compiler on first use
(native/build.py). The int8-activation path for the same weights ("gguf-a8")
is q8_matmul.cc's second handler (q8_kquant_matmuls).

Why native code: the XLA path (quant/linear.py) dequantizes the weight into a
float32 copy on every call; the kernels read the codes and two-level scales
once, in place, from the stacked weights of every layer plus a layer index
(quant/layer_weights.py, LayerOf), and expand them in registers.

The supports* functions say what a kernel can take; which one multiplies a
weight at how many rows is the CPU backend's choice (backends/cpu_weights.py).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.native.build import cpu_runs_vec16, native_ffi_target, native_library, registered_library
from jaxinfer.quant.kquant import SUPER_BLOCK, KQuantTensor
from jaxinfer.quant.mixed_stack import MixedStack

SOURCE = Path(__file__).with_suffix(".cc")
TARGET_NAME = "jaxinfer_kquant_matmul"
Q8_SOURCE = Path(__file__).with_name("q8_matmul.cc")
Q8_TARGET_NAME = "jaxinfer_q8_kquant_matmuls"
KINDS = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")  # kquant_matmul.cc's Kind
TILE = 64  # columns per tile: the kernels read tiled weights only


def available() -> bool:
    """Whether the exact kernel's handler is built and registered (built on
    first call, where cpu_runs_vec16). Each kind's kernels are a library of
    their own, loaded by load_kinds."""
    return cpu_runs_vec16() and native_ffi_target(str(SOURCE), "JaxinferKQuantMatmuls", TARGET_NAME)


_kind_locks = {kind: threading.Lock() for kind in KINDS}


def load_kinds(kinds) -> bool:
    """Build (or load, once cached) the exact kernels of each kind in `kinds`
    (KINDS' names) and hand them to the registered handler; False where one
    cannot be built. A kind is kquant_matmul.cc built with
    JAXINFER_KQUANT_KIND: all five kinds in one library took 25 s to compile
    with AVX-512, where a Q4_K_M file needs two (Q4_K 6.8 s, Q6_K 5.7 s, each
    on a thread of its own). Threads may load different kinds at once."""
    return cpu_runs_vec16() and all(_load_kind(kind) for kind in kinds) and available()


def _load_kind(kind: str) -> bool:
    with _kind_locks[kind]:
        return _loaded_kind(kind)


@functools.cache
def _loaded_kind(kind: str) -> bool:
    index = KINDS.index(kind)
    library = native_library(str(SOURCE), (f"JAXINFER_KQUANT_KIND={index}",))
    if library is None or not available():
        return False
    handler = registered_library(TARGET_NAME)
    library.JaxinferKQuantPlanner.restype = ctypes.c_void_p
    handler.JaxinferKQuantSetPlanner.argtypes = [ctypes.c_int64, ctypes.c_void_p]
    handler.JaxinferKQuantSetPlanner(index, library.JaxinferKQuantPlanner())
    return True


def kinds_of(ws) -> set[str]:
    """The kinds of ws' stacks (every part of a MixedStack)."""
    return {p.kind for w in ws for p in (w.parts if isinstance(w, MixedStack) else [w])}


def q8_available() -> bool:
    """Whether the int8-activation kernel is built and registered (AVX512-VNNI, or AVX2 with FMA and F16C)."""
    return native_ffi_target(str(Q8_SOURCE), "JaxinferQ8KQuantMatmuls", Q8_TARGET_NAME)


def tileable(w: KQuantTensor) -> bool:
    """Whether w should be stored in tiles of TILE columns: the kernels read no other layout."""
    return cpu_runs_vec16() and not w.tile and w.out_features % TILE == 0 and w.in_features % 256 == 0


def supports(w: KQuantTensor | MixedStack) -> bool:
    """Whether the exact kernel takes w: tiled, at most one leading layer
    axis; a MixedStack whose parts it all takes (it reads the part that
    holds the layer)."""
    if isinstance(w, MixedStack):
        return all(isinstance(p, KQuantTensor) and p.codes.ndim == 4 and supports(p) for p in w.parts)
    return w.tile == TILE and w.codes.ndim in (3, 4)


def supports_q8(w: KQuantTensor | MixedStack) -> bool:
    """Whether the int8-activation kernel takes w: as supports(), with an
    activation block of one super-block (every part's, for a MixedStack)."""
    if isinstance(w, MixedStack):
        return all(isinstance(p, KQuantTensor) and p.codes.ndim == 4 and supports_q8(p) for p in w.parts)
    return w.activation_block == SUPER_BLOCK and supports(w)


def _arrays(w: KQuantTensor) -> list:
    """w's six arrays with a leading layer axis (a free reshape), [1] placeholders where absent."""
    def stacked(a, dtype):
        if a is None:
            return jnp.zeros((1,), dtype)
        return a[None] if a.ndim == 3 else a
    return [stacked(w.codes, jnp.uint8), stacked(w.high, jnp.uint8), stacked(w.sub_scales, jnp.uint8),
            stacked(w.sub_mins, jnp.uint8), stacked(w.d, jnp.float16), stacked(w.dmin, jnp.float16)]


def kquant_matmuls(x, ws: list[KQuantTensor | MixedStack], layer_index=0) -> list[jax.Array]:
    """[x [rows, in] @ layer `layer_index` of w -> float32 [rows, out] for w in
    ws] in one kernel call (the cores share out every weight's tasks). A
    MixedStack passes every part, each with the layer's index in it or -1,
    and the kernel reads the one that holds the layer: no switch around the
    call, and the call can take the layer's other weights too."""
    if not load_kinds(kinds_of(ws)):
        raise RuntimeError("the CPU K-quant matmul kernel is not available here (see the warning above)")
    return _call(TARGET_NAME, x, ws, layer_index)


def q8_kquant_matmuls(x, ws: list[KQuantTensor | MixedStack], layer_index=0) -> list[jax.Array]:
    """[int8_blocks(x, 256) [rows, in] @ layer `layer_index` of w for w in ws]
    in one call, as kquant_matmuls (the kernel rounds x to int8 itself)."""
    if not q8_available():
        raise RuntimeError("the CPU int8-activation K-quant kernel is not available here (see the warning above)")
    return _call(Q8_TARGET_NAME, x, ws, layer_index)


def _call(target: str, x, ws: list, layer_index) -> list[jax.Array]:
    """Both kernels' call: x, each stack's layer index (-1 in a MixedStack's
    parts that do not hold it), each stack's six arrays, their kinds, and
    each weight's number of stacks (kquant_layer.h, ForEachWeight)."""
    layer_index = jnp.asarray(layer_index, jnp.int32)
    stacks, layers = [], []
    for w in ws:
        if isinstance(w, MixedStack):
            part = jnp.asarray(w.part_of_layer, jnp.int32)[layer_index]
            index = jnp.asarray(w.index_in_part, jnp.int32)[layer_index]
            stacks += w.parts
            layers += [jnp.where(part == k, index, -1) for k in range(len(w.parts))]
        else:
            stacks.append(w)
            layers.append(layer_index)
    call = jax.ffi.ffi_call(target, [jax.ShapeDtypeStruct((x.shape[0], w.out_features), jnp.float32) for w in ws])
    return list(call(x.astype(jnp.float32), jnp.stack(layers), *[a for w in stacks for a in _arrays(w)],
                     kinds=np.array([KINDS.index(w.kind) for w in stacks], np.int64),
                     stacks=np.array([len(w.parts) if isinstance(w, MixedStack) else 1 for w in ws], np.int64)))


def kquant_matmul(x, w: KQuantTensor, layer_index=0) -> jax.Array:
    return kquant_matmuls(x, [w], layer_index)[0]


def q8_kquant_matmul(x, w: KQuantTensor, layer_index=0) -> jax.Array:
    """int8_blocks(x, w.activation_block) [rows, in] @ layer `layer_index` of w -> float32 [rows, out]."""
    return q8_kquant_matmuls(x, [w], layer_index)[0]
