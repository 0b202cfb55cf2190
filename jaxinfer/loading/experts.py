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
"""

from __future__ import annotations

import re

import numpy as np

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

    def __getattr__(self, attribute):  # stored_dtype and the like: the underlying checkpoint's
        return getattr(self._source, attribute)
