"""The two forms in which a layer weight can reach the layer loop besides a
stacked array [layers, ...]: which one a model runs with is its backend's
choice (jaxinfer/backends/).

  LayerOf   one layer of a stacked weight, left unsliced: the CPU backend's
            scan hands its native kernels the whole stack plus the (traced)
            layer index, because XLA would copy a slice handed to a custom
            call first. Every other path takes `layer()`, the slice a scan
            over the stacked weight would have given.
  PerLayer  one array (or QuantizedTensor) per layer, the GPU backend's
            storage: its unrolled loop then hands each GEMM a whole array in
            place, where a scan over a stack made XLA copy every layer's
            slice before the GEMM (BENCHMARKS.md, "GPU").
"""

from __future__ import annotations

import dataclasses

import jax

from jaxinfer.quant.kquant import KQuantTensor
from jaxinfer.quant.mixed_stack import MixedStack
from jaxinfer.quant.tensor import QuantizedTensor


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerOf:
    """Layer `index` (traced) of a stacked QuantizedTensor or KQuantTensor
    [layers, ...], of a float stack (a MoE's experts, which a native kernel
    reads in place), or of a MixedStack (quant/mixed_stack.py: `apply`
    takes the place of `layer()`, since its layers differ in form), or of
    an InputOrdered (quant/input_order.py, which unwraps it for the model)."""
    stacked: QuantizedTensor | KQuantTensor | MixedStack | jax.Array
    index: jax.Array

    @property
    def shape(self) -> tuple:
        """One layer's (logical) shape."""
        return self.stacked.shape[1:]

    def apply(self, fn):
        """fn(stack, index) on the stack that holds this layer and the layer's
        index in it: the stack itself, or a MixedStack's part of the layer's
        format, under a switch on the index (MixedStack.apply). Every
        computation on a layer that may be a MixedStack's goes through here."""
        if isinstance(self.stacked, MixedStack):
            return self.stacked.apply(self.index, fn)
        return fn(self.stacked, self.index)

    def layer(self):
        if isinstance(self.stacked, MixedStack):
            raise TypeError("a MixedStack's layer has no one form under a traced index: use apply")
        layer = jax.tree.map(lambda a: a[self.index], self.stacked)
        return layer.untiled() if isinstance(layer, (QuantizedTensor, KQuantTensor)) else layer


@jax.tree_util.register_pytree_node_class
class PerLayer:
    """A weight of every layer as separate arrays (or QuantizedTensors):
    `per_layer[i]` is layer i's, of the stacked weight's shape without the
    layer axis."""

    def __init__(self, layers):
        self.layers = tuple(layers)

    def __getitem__(self, index: int):
        return self.layers[index]

    def __len__(self) -> int:
        return len(self.layers)

    def tree_flatten(self):
        return self.layers, None

    @classmethod
    def tree_unflatten(cls, _, layers):
        return cls(layers)

    @classmethod
    def unstack(cls, stacked) -> PerLayer:
        """A stacked array, QuantizedTensor or KQuantTensor [layers, ...], or a
        MixedStack, as one per layer (each in its own format)."""
        if isinstance(stacked, MixedStack):
            return cls(stacked.layer(i) for i in range(stacked.num_layers))
        num_layers = jax.tree.leaves(stacked)[0].shape[0]
        return cls(jax.tree.map(lambda a: a[i], stacked) for i in range(num_layers))

    def stacked(self):
        """The stacked [layers, ...] form again."""
        import jax.numpy as jnp

        return jax.tree.map(lambda *leaves: jnp.stack(leaves), *self.layers)
