"""A mixture of experts' matmul by float32 experts on CPU as a native XLA
FFI kernel (expert_matmul.cc), built with the machine's C++ compiler on
first use (native/build.py).

Why native code: XLA's grouped matmul on CPU (jax.lax.ragged_dot) is a
product of every row with every expert under a mask, so a token would pay
for all the experts instead of its active ones; the kernel reads only the
selected experts, each once for all the rows that chose it. Quantized
experts go to matmul.cc's entry for them (native/matmul.py,
quantized_expert_matmuls).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from jaxinfer.native.build import native_ffi_target

SOURCE = Path(__file__).with_suffix(".cc")
TARGET_NAME = "jaxinfer_expert_matmul"


def available() -> bool:
    """Whether the kernel is built and registered with XLA (built on first call)."""
    return native_ffi_target(str(SOURCE), "JaxinferExpertMatmuls", TARGET_NAME)


def supports(ws) -> bool:
    """Whether the kernel takes these stacks of experts [layers, experts, in, out]: float32 ones."""
    return all(isinstance(w, jax.Array) and w.dtype == jnp.float32 and w.ndim == 4 for w in ws)


def expert_matmuls(x, ws, layer_index, expert_ids) -> list[jax.Array]:
    """Rows x [rows, in] sorted by expert (expert_ids int32 [rows],
    non-decreasing) -> for each float32 stack w of ws [layers, experts, in,
    out], float32 [rows, out] with row r = x[r] @ w[layer_index, expert_ids[r]]."""
    if not available():
        raise RuntimeError("the CPU expert matmul kernel is not available here (see the warning above)")
    num_experts = ws[0].shape[1]
    matrix = jnp.asarray(layer_index, jnp.int32) * num_experts + expert_ids.astype(jnp.int32)
    call = jax.ffi.ffi_call(TARGET_NAME, [jax.ShapeDtypeStruct((x.shape[0], w.shape[-1]), jnp.float32) for w in ws])
    return list(call(x.astype(jnp.float32), matrix, *(w.reshape(-1, *w.shape[2:]) for w in ws)))
