"""A MoE checkpoint's expert tensors under one name per layer and weight.

loading/params.py reads each layer's experts as one stacked tensor in HF
orientation, [experts, out, in], under

    model.layers.{i}.mlp.experts.{gate,up,down}_proj.weight
    model.layers.{i}.mlp.gate.weight                          the router [experts, hidden]

Checkpoints store them in three ways, which `ExpertTensors` (a TensorSource
over a safetensors checkpoint) presents as those names:

  per expert (the Hub's checkpoints, and what transformers' save_pretrained
  writes)           mlp.experts.{e}.{gate,up,down}_proj.weight [out, in]
  Mixtral's names   block_sparse_moe.gate.weight, block_sparse_moe.experts.{e}.{w1,w3,w2}.weight
                    (w1 the gate, w3 the up, w2 the down projection)
  fused 3-D (transformers >= 5 in memory, and checkpoints saved from its state dict)
                    mlp.experts.gate_up_proj [experts, 2 * ffn, hidden] (the gate's rows, then the up's),
                    mlp.experts.down_proj [experts, hidden, ffn]

A GGUF file stores them stacked already (ffn_{gate,up,down}_exps), and
loading/gguf.py names them so itself. Stacking per-expert tensors copies one
layer's weight into host memory at a time (np.stack of memory-mapped views).

Over a quantized HF checkpoint (loading/prequantized/, which names each
quantized expert's `.weight` as a float checkpoint would), `get_stored`
gives a layer's experts in their stored form: one QuantizedTensor [experts,
in, out] stacking each expert's codes, scales and offsets as read (never
widened to float), the stacked form the engine's own int8 / int4 / fp8
experts take (quant/params.py). The experts of one weight must share one
form (scheme, group size, zero points or none); an expert stored float
beside quantized ones, or two forms, is refused (CheckpointError). So are
experts whose input rows are stored in act-order groups (GPTQ desc_act,
quant/input_order.py: UnsupportedModelError): the expert matmuls multiply
every row in the activations' own order.
"""

from __future__ import annotations

import re

import numpy as np

from jaxinfer.errors import CheckpointError, UnsupportedModelError
from jaxinfer.quant.input_order import InputOrdered
from jaxinfer.quant.tensor import QuantizedTensor

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_MIXTRAL_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def stacked_name(layer: int, projection: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{projection}.weight"


class ExpertTensors:
    """TensorSource over `source` (with HF names) adding the stacked expert
    names above for every layer of a model with `num_experts` experts."""

    def __init__(self, source, num_experts: int):
        self._source = source
        self._num_experts = num_experts
        self.description = source.description
        names = set(source.names())
        self._virtual: dict[str, tuple] = {}  # stacked name -> how to read it
        layers = {int(m.group(1)) for n in names if (m := re.match(r"^model\.layers\.(\d+)\.", n))}
        for i in sorted(layers):
            prefix = f"model.layers.{i}."
            for projection in PROJECTIONS:
                per_expert = [f"{prefix}mlp.experts.{e}.{projection}.weight" for e in range(num_experts)]
                mixtral = [f"{prefix}block_sparse_moe.experts.{e}.{_MIXTRAL_NAMES[projection]}.weight"
                           for e in range(num_experts)]
                if all(n in names for n in per_expert):
                    self._virtual[stacked_name(i, projection)] = ("stack", per_expert)
                elif all(n in names for n in mixtral):
                    self._virtual[stacked_name(i, projection)] = ("stack", mixtral)
                elif projection != "down_proj" and f"{prefix}mlp.experts.gate_up_proj" in names:
                    half = 0 if projection == "gate_proj" else 1
                    self._virtual[stacked_name(i, projection)] = ("half", f"{prefix}mlp.experts.gate_up_proj", half)
                elif projection == "down_proj" and f"{prefix}mlp.experts.down_proj" in names:
                    self._virtual[stacked_name(i, projection)] = ("fused", f"{prefix}mlp.experts.down_proj")
            if f"{prefix}mlp.gate.weight" not in names and f"{prefix}block_sparse_moe.gate.weight" in names:
                self._virtual[f"{prefix}mlp.gate.weight"] = ("fused", f"{prefix}block_sparse_moe.gate.weight")
        self._names = names | set(self._virtual)
        if hasattr(source, "get_stored"):  # a quantized checkpoint: its experts in their stored form too
            self.get_stored = self._get_stored

    def names(self):
        return self._names

    def get(self, name: str) -> np.ndarray:
        how = self._virtual.get(name)
        if how is None:
            return self._source.get(name)
        if how[0] == "stack":
            return np.stack([self._source.get(n) for n in how[1]])
        fused = self._source.get(how[1])
        if how[0] == "half":  # [experts, 2 * ffn, hidden]: the gate's rows, then the up's
            ffn = fused.shape[1] // 2
            return fused[:, how[2] * ffn:(how[2] + 1) * ffn]
        return fused

    def _get_stored(self, name: str) -> QuantizedTensor | None:
        """A linear weight [in, out] (a layer's experts: [experts, in, out]) in
        its stored form, or None where it is stored float."""
        how = self._virtual.get(name)
        if how is None:
            return self._source.get_stored(name)
        if how[0] != "stack":  # fused 3-D experts: no quantized format stores them so; read as float
            return None
        return stack_experts([self._source.get_stored(n) for n in how[1]], how[1], self.description)

    def __getattr__(self, attribute):  # stored_dtype and the like: the underlying checkpoint's
        return getattr(self._source, attribute)


def stack_experts(per_expert: list, names: list[str], description: str) -> QuantizedTensor | None:
    """Per-expert QuantizedTensors [in, out] (numpy leaves; None where stored
    float) -> one [experts, in, out], or None where every expert is float."""
    if all(q is None for q in per_expert):
        return None
    per_expert = [_in_input_order(q, n, description) for q, n in zip(per_expert, names)]
    stored_float = [n for n, q in zip(names, per_expert) if q is None]
    if stored_float:
        raise CheckpointError(f"{description}: {stored_float[0]} is stored float beside quantized experts of the "
                              f"same weight ({len(stored_float)} of {len(names)} float); the experts of one weight "
                              "must be stored in one form")
    forms = {}
    for n, q in zip(names, per_expert):
        forms.setdefault((q.scheme, q.group_size, q.offsets is None, q.activation_block, q.tile, q.shape), n)
    if len(forms) > 1:
        shown = "; ".join(f"{n}: {scheme}, groups of {group}, {'no zero points' if plain else 'zero points'}, "
                          f"shape {shape}" for (scheme, group, plain, _, _, shape), n in list(forms.items())[:2])
        raise CheckpointError(f"{description}: the experts of one weight are stored in different forms ({shown}); "
                              "they must share one to be stacked")
    first = per_expert[0]
    return QuantizedTensor(np.stack([np.asarray(q.data) for q in per_expert]),
                           np.stack([np.asarray(q.scales) for q in per_expert]),
                           None if first.offsets is None else np.stack([np.asarray(q.offsets) for q in per_expert]),
                           first.scheme, first.group_size)


def _in_input_order(q, name: str, description: str) -> QuantizedTensor | None:
    """An expert's stored weight with its rows in the activations' order: an
    InputOrdered whose order is the identity (a desc_act checkpoint keeps
    every linear so) is its plain weight; a real reordering is refused."""
    if not isinstance(q, InputOrdered):
        return q
    order = np.asarray(q.order)
    if not np.array_equal(order, np.arange(order.shape[-1])):
        raise UnsupportedModelError(f"{description}: {name} stores its input rows in act-order groups (desc_act); "
                                    "act-order experts are not supported yet (the expert matmuls take every row in "
                                    "the activations' order)")
    return q.weight
