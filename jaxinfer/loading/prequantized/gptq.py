"""GPTQ checkpoints (AutoGPTQ / GPTQModel, quant_method "gptq").

Per linear: `qweight` int32 [in / (32 / bits), out], the codes of
consecutive input rows packed low bits first; `qzeros` int32 [groups, out /
(32 / bits)], packed the same way along the output; `scales` float16
[groups, out]; `g_idx` int32 [in], each input row's group. w = (q - zero) *
scale. checkpoint_format "gptq" stores every zero minus one (AutoGPTQ's
historical offset), "gptq_v2" the zero itself.

desc_act (act-order, without static_groups): g_idx puts each group's rows
anywhere. The rows are then sorted by group once at load and the weight
kept as an InputOrdered (quant/input_order.py; act_order.py): the grouped
form over the permuted rows, whose activations are gathered by the same
order at every matmul. Every linear of a desc_act checkpoint is kept so
(the identity order where its groups happen to be consecutive), so that its
layers stack as one; a linear whose g_idx is in act order in a checkpoint
that does not say desc_act is kept so too."""

from __future__ import annotations

import numpy as np

from jaxinfer.errors import CheckpointError, UnsupportedModelError
from jaxinfer.loading.prequantized.act_order import group_order, is_trivial, order_label
from jaxinfer.loading.prequantized.packing import unpack_int32
from jaxinfer.loading.prequantized.stored_codes import grouped_codes
from jaxinfer.quant.input_order import InputOrdered
from jaxinfer.quant.tensor import QuantizedTensor

BITS = (4, 8)
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


class GptqFormat:
    name = "gptq"

    def __init__(self, config: dict, where: str):
        self.bits = int(config.get("bits", 4))
        self.group_size = int(config.get("group_size", 128))
        self.checkpoint_format = str(config.get("checkpoint_format") or "gptq").lower()
        if self.bits not in BITS:
            raise UnsupportedModelError(f"{where}: {self.bits}-bit GPTQ is not supported (supported: 4 and 8 bits)")
        if self.checkpoint_format not in CHECKPOINT_FORMATS or config.get("is_marlin_format"):
            shown = "marlin" if config.get("is_marlin_format") else self.checkpoint_format
            raise UnsupportedModelError(f"{where}: GPTQ checkpoint_format {shown!r} is not supported "
                                        f"(supported: {', '.join(CHECKPOINT_FORMATS)})")
        if config.get("dynamic"):
            raise UnsupportedModelError(f"{where}: GPTQ per-module `dynamic` overrides are not supported")
        # AutoGPTQ's static_groups fixes the groups before the act-order
        # permutation: its g_idx are consecutive again.
        self.act_order = bool(config.get("desc_act")) and not config.get("static_groups")
        self.where = where

    def is_quantized(self, prefix: str, names) -> bool:
        return f"{prefix}.qweight" in names

    def read(self, prefix: str, get, names) -> QuantizedTensor | InputOrdered:
        codes = unpack_int32(get(f"{prefix}.qweight"), self.bits, axis=0)
        in_features, out_features = codes.shape
        scales = np.asarray(get(f"{prefix}.scales"))
        zeros = unpack_int32(get(f"{prefix}.qzeros"), self.bits, axis=1)[:, :out_features].astype(np.int32)
        if self.checkpoint_format == "gptq":
            zeros = zeros + 1
        group_size = in_features if self.group_size == -1 else self.group_size
        if scales.shape[0] != in_features // group_size:
            raise CheckpointError(f"{prefix}: {scales.shape[0]} scale rows for {in_features} inputs "
                                  f"in groups of {group_size}")
        g_idx = np.asarray(get(f"{prefix}.g_idx")) if f"{prefix}.g_idx" in names else None
        if g_idx is None or (not self.act_order and is_trivial(g_idx, group_size)):
            return grouped_codes(codes, zeros, scales, self.bits, group_size, prefix)
        order = group_order(g_idx, in_features, group_size, f"{prefix}.g_idx")
        weight = grouped_codes(codes[order], zeros, scales, self.bits, group_size, prefix)
        return InputOrdered(weight, order, order_label(prefix, "g_idx", g_idx, get, names))
