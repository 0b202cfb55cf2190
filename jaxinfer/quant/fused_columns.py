"""Weights that share an input stored as one: a layer's q|k|v and gate|up
concatenated along out (the GPU backend's layout, backends/gpu.py), so one
GEMM reads each weight once instead of three or two GEMMs, or a copy XLA's
dot merger would make every step. The model still names each weight: the
backend's layer loop hands it a FusedPart per name, and its `linears` runs a
whole group in one call.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxinfer.quant.tensor import QuantizedTensor


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FusedColumns:
    """One layer's weights `names` ([in, size] each) concatenated along out:
    an array or a QuantizedTensor [in, sum(sizes)], whose groups run along
    `in`, so its columns are each weight's own codes and scales. Stored in
    the layers dict under fused_key(names)."""
    weight: jax.Array | QuantizedTensor
    names: tuple[str, ...] = dataclasses.field(metadata=dict(static=True))
    sizes: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    def parts(self) -> dict:
        """Each weight under its own name, as the model's layer dict holds it."""
        return {name: FusedPart(self, index) for index, name in enumerate(self.names)}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FusedPart:
    """Weight `index` of a FusedColumns: what run_layers hands the model
    under that weight's name. GpuBackend.linears multiplies a whole group in
    one call; a part multiplied alone is sliced out of it."""
    fused: FusedColumns
    index: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.fused.weight.shape[:-1], self.fused.sizes[self.index])

    def weight(self):
        """This weight's columns alone (a copy)."""
        start = sum(self.fused.sizes[:self.index])
        stop = start + self.fused.sizes[self.index]
        w = self.fused.weight
        if isinstance(w, QuantizedTensor):
            return dataclasses.replace(w, data=w.data[..., start:stop], scales=w.scales[..., start:stop],
                                       offsets=None if w.offsets is None else w.offsets[..., start:stop])
        return w[..., start:stop]


def fused_key(names) -> str:
    """The layers dict's key of the FusedColumns of `names`."""
    return "+".join(names)
