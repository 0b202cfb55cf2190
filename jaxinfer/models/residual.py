"""The residual stream with a projection's output not yet added to it.

A decode step's wo and w_down GEMMs have a few rows, so XLA splits their
inner dimension (split-K) and reduces the float32 partial sums in the kernel
that consumes them: the residual add, a kernel of its own between the GEMM
and the next RMSNorm. A backend that can do better (backends/gpu.py) hands
the model a projection as those partial sums (backend.linear_parts) and
adds them in the norm's own kernel (backend.add_rms_norm); between the two
the stream is a Residual. Every other backend adds at once and never makes
one.
"""

from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Residual:
    """stream [..., hidden] plus parts.sum(0), parts float32 [k, ..., hidden],
    rounded to the stream's dtype before the add (as `x + x @ w` rounds)."""
    stream: jax.Array
    parts: jax.Array

    def settled(self) -> jax.Array:
        return self.stream + self.parts.sum(0).astype(self.stream.dtype)


def settled(x) -> jax.Array:
    """The residual stream x as one array: a Residual's parts added."""
    return x.settled() if isinstance(x, Residual) else x
