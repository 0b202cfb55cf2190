"""MixedStack: a layer weight whose layers are stored in different formats,
held as one stack per format.

A GGUF file mixes block types within one weight: llama.cpp's Q4_K_M stores
attn_v and ffn_down as Q6_K in some layers and Q4_K in the others, Q3_K_M
mixes Q5_K and Q4_K. One stacked array needs one format, and widening every
layer to the widest (int8 codes in groups of 16) read 1.25 bytes a weight
where the file holds 0.56 and 0.82 (BENCHMARKS.md, "K-quant files"). Here
each format keeps its own stack of the layers stored in it, at its own size,
and the layer loop picks the stack of the layer it is at:

    parts            tuple of stacked weights (KQuantTensor or QuantizedTensor [n_k, ...])
    part_of_layer    static: layer i is in parts[part_of_layer[i]] ...
    index_in_part    static: ... at index index_in_part[i]

A scan cannot slice it (its parts have different lengths), so every
backend's layer loop hands it to the body as LayerOf(stack, layer_index)
(quant/layer_weights.py), and `apply` (which LayerOf.apply calls) runs a
per-part computation under a lax.switch on the (traced) layer index: only
the branch of the layer's format runs, reading its stack in place. (A
kernel may instead take every part with the layer's index in its own and
read that one: the CPU K-quant kernel, native/kquant_matmul.py.)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MixedStack:
    parts: tuple
    part_of_layer: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    index_in_part: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def of(cls, per_layer: list, format_of, stack=None) -> MixedStack:
        """The layers' weights (one per layer) grouped by format_of(weight),
        each group stacked in layer order by stack(weights) (default:
        jnp.stack of each leaf)."""
        stack = stack or (lambda weights: jax.tree.map(lambda *leaves: jnp.stack(leaves), *weights))
        formats, part_of_layer, index_in_part = cls.grouping([format_of(w) for w in per_layer])
        parts = tuple(stack([w for w, part in zip(per_layer, part_of_layer) if part == i]) for i in range(len(formats)))
        return cls(parts, part_of_layer, index_in_part)

    @staticmethod
    def grouping(formats_of_layers: list) -> tuple[list, tuple[int, ...], tuple[int, ...]]:
        """(the distinct formats in the order of their first layers,
        part_of_layer, index_in_part) of layers in `formats_of_layers`: where
        each layer goes, for a loader that fills the parts in place."""
        formats = list(dict.fromkeys(formats_of_layers))
        part_of_layer = tuple(formats.index(f) for f in formats_of_layers)
        index_in_part = tuple(formats_of_layers[:i].count(f) for i, f in enumerate(formats_of_layers))
        return formats, part_of_layer, index_in_part

    @property
    def num_layers(self) -> int:
        return len(self.part_of_layer)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, *self.parts[0].shape[1:])

    @property
    def out_features(self) -> int:
        return self.parts[0].out_features

    def layer(self, i: int):
        """Layer i (a Python int) in its own format, without the layer axis."""
        return jax.tree.map(lambda a: a[self.index_in_part[i]], self.parts[self.part_of_layer[i]])

    def apply(self, layer_index, fn):
        """fn(part, index) for the part that holds layer `layer_index` (traced
        or not) and the layer's index in it; every branch must return the
        same shapes."""
        part = jnp.asarray(self.part_of_layer, jnp.int32)[layer_index]
        index = jnp.asarray(self.index_in_part, jnp.int32)[layer_index]
        branches = [lambda index, stacked=stacked: fn(stacked, index) for stacked in self.parts]
        return jax.lax.switch(part, branches, index)

    def replace_parts(self, fn) -> MixedStack:
        """The same stack with fn applied to each part (a layout step: tiling, marking)."""
        return dataclasses.replace(self, parts=tuple(fn(p) for p in self.parts))
