"""InputOrdered: a quantized weight whose input rows are stored in another
order than the activations' features (a GPTQ desc_act / act-order
checkpoint, loading/prequantized/act_order.py), as a pytree that stacks,
scans, unstacks per layer and shards like any QuantizedTensor.

    weight    a QuantizedTensor [..., in, out] over the permuted rows:
              weight[..., j, :] is the checkpoint's row order[..., j]
    order     int32 [..., in], a permutation of range(in) per matrix
    order_of  static: a label naming whose order this is. Weights of one
              layer with the same label hold equal orders (a GPTQ
              checkpoint's q / k / v, and gate / up, see the same
              activations, so their groups follow one Hessian order),
              which lets the activations be gathered once for them all.

    x @ value == x[..., order] @ weight

where value is the matrix in the checkpoint's row order (`dequantized`).
models/llama.py (adapted_linears, through `input_groups`) gathers the
activations of every layer linear so and hands the plain weights on to the
backend's kernels; quant/linear.py's reference does the same for a weight
that reaches it directly (a quantized head)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.quant.layer_weights import LayerOf
from jaxinfer.quant.tensor import QuantizedTensor, dequantize


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class InputOrdered:
    weight: QuantizedTensor
    order: jax.Array
    order_of: str = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (dequantized) shape."""
        return self.weight.shape

    def with_weight(self, weight) -> InputOrdered:
        return dataclasses.replace(self, weight=weight)

    def dequantized(self, dtype=jnp.float32) -> jax.Array:
        """The logical [..., in, out] matrix with its rows in the checkpoint's
        (the activations') order."""
        inverse = jnp.argsort(self.order, axis=-1)
        return jnp.take_along_axis(dequantize(self.weight, dtype), inverse[..., None], axis=-2)


def logical_value(w, dtype=jnp.float32) -> jax.Array:
    """The logical [..., in, out] matrix of a QuantizedTensor or an InputOrdered
    (rows in the activations' order)."""
    return w.dequantized(dtype) if isinstance(w, InputOrdered) else dequantize(w, dtype)


def _split(w):
    """(the weight the backend multiplies, its order or None, its label) for a
    layer weight as run_layers hands it: a plain one, an InputOrdered, or one
    layer of a stacked InputOrdered (LayerOf: the CPU backend's in-place
    form, which stays LayerOf for its kernels)."""
    if isinstance(w, InputOrdered):
        return w.weight, w.order, w.order_of
    if isinstance(w, LayerOf) and isinstance(w.stacked, InputOrdered):
        return LayerOf(w.stacked.weight, w.index), w.stacked.order[w.index], w.stacked.order_of
    return w, None, None


def input_groups(x, ws: list) -> list[tuple]:
    """Weights on the same activations x [..., in] -> [(x', indices, weights)]:
    x' @ weights[k] is x @ ws[indices[k]]. The plain weights take x as it
    is; the ordered ones x gathered by their order, once for each label, so
    weights sharing an order still reach a kernel together."""
    groups: dict = {}
    for i, w in enumerate(ws):
        weight, order, label = _split(w)
        if label not in groups:
            groups[label] = (x if order is None else jnp.take(x, order, axis=-1), [], [])
        groups[label][1].append(i)
        groups[label][2].append(weight)
    return list(groups.values())
