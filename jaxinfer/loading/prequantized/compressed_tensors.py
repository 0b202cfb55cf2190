"""compressed-tensors checkpoints (llm-compressor, quant_method
"compressed-tensors").

`config_groups` give each targeted layer's scheme: weights (num_bits, type
int / float, symmetric, strategy tensor / channel / group / block), and
input_activations; `ignore` lists the layers kept float; `format` how the
weights are stored:

  pack-quantized   `weight_packed` int32 [out, in * bits / 32], signed
                   codes + 2**(bits - 1) packed low bits first along the
                   input; asymmetric zero points `weight_zero_point` packed
                   the same way along the output
  int-quantized,   `weight` int8 [out, in] signed codes (naive: also for
  naive-quantized  fewer bits); `weight_zero_point` int8 where asymmetric
  float-quantized  `weight` float8_e4m3fn [out, in]

w = (q - zero_point) * weight_scale, scales [1] (tensor), [out, 1]
(channel), [out, in / group_size] (group) or per block. Groups in act
order (actorder "group": `weight_g_idx` int32 [in], each input's group)
are sorted into consecutive rows once at load, the weight kept as an
InputOrdered (act_order.py, quant/input_order.py). Kept as: 4-bit
codes the int4 form, 8-bit ones int8 (w8a8 where the activations are
quantized to int8 per token on the fly, symmetric: quant/linear.py's
scheme), fp8 the fp8 form (activations left float)."""

from __future__ import annotations

import logging
import re

import numpy as np

from jaxinfer.errors import CheckpointError, UnsupportedModelError
from jaxinfer.loading.prequantized.act_order import group_order, order_label
from jaxinfer.loading.prequantized.fp8_weights import block_fp8, channel_fp8, grouped_fp8
from jaxinfer.loading.prequantized.packing import unpack_int32
from jaxinfer.loading.prequantized.stored_codes import grouped_codes
from jaxinfer.quant.input_order import InputOrdered
from jaxinfer.quant.tensor import QuantizedTensor

log = logging.getLogger(__name__)

FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized", "dense")
STRATEGIES = ("tensor", "channel", "group", "block")


def _matches(target: str, module: str) -> bool:
    """A compressed-tensors target or ignore entry: "re:<regex>", a class name
    (every layer we read is a Linear), or a module name."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == "Linear" or module == target or module.endswith("." + target)


class CompressedTensorsFormat:
    name = "compressed-tensors"

    def __init__(self, config: dict, where: str):
        self.where = where
        if config.get("sparsity_config"):
            raise UnsupportedModelError(f"{where}: compressed-tensors sparsity ({config['sparsity_config'].get('format')}) "
                                        "is not supported")
        if config.get("transform_config"):
            raise UnsupportedModelError(f"{where}: compressed-tensors transforms are not supported")
        status = config.get("quantization_status", "compressed")
        if status not in ("compressed", "frozen"):
            raise UnsupportedModelError(f"{where}: compressed-tensors quantization_status {status!r} is not supported")
        self.format = config.get("format", "dense")
        self.ignore = tuple(config.get("ignore") or ())
        self.groups = []
        for group_name, group in (config.get("config_groups") or {}).items():
            fmt = group.get("format") or self.format
            weights = group.get("weights")
            if fmt not in FORMATS:
                raise UnsupportedModelError(f"{where}: compressed-tensors format {fmt!r} is not supported "
                                            f"(supported: {', '.join(FORMATS)})")
            if weights is not None:
                self._check(group_name, fmt, weights, group.get("input_activations"), group.get("output_activations"))
            self.groups.append((tuple(group.get("targets") or ()), fmt, weights, group.get("input_activations")))

    def _check(self, group_name, fmt, weights, inputs, outputs):
        where = f"{self.where}: compressed-tensors group {group_name}"
        kind, bits = weights.get("type", "int"), int(weights.get("num_bits", 8))
        strategy = weights.get("strategy", "tensor")
        if strategy not in STRATEGIES or (strategy == "block" and kind != "float"):
            raise UnsupportedModelError(f"{where}: weight strategy {strategy!r} is not supported for {kind} weights")
        if kind == "int" and bits not in (4, 8):
            raise UnsupportedModelError(f"{where}: {bits}-bit int weights are not supported (supported: 4, 8)")
        if kind == "float" and bits != 8:
            raise UnsupportedModelError(f"{where}: {bits}-bit float weights are not supported (supported: fp8)")
        if kind not in ("int", "float"):
            raise UnsupportedModelError(f"{where}: weight type {kind!r} is not supported")
        if weights.get("dynamic"):
            raise UnsupportedModelError(f"{where}: dynamically quantized weights are not supported")
        if outputs:
            raise UnsupportedModelError(f"{where}: output activation quantization is not supported")
        if inputs and kind == "int" and not self._int8_per_token(weights, inputs):
            raise UnsupportedModelError(
                f"{where}: int weights with input activations {inputs.get('type')}{inputs.get('num_bits')} "
                f"{inputs.get('strategy')} (dynamic {inputs.get('dynamic')}, symmetric {inputs.get('symmetric')}) are "
                "not supported (supported: none, or dynamic symmetric int8 per token with 8-bit symmetric per-channel "
                "weights: w8a8)")
        if inputs and kind == "float":
            log.warning("%s: fp8 activation quantization is not applied; activations stay float", where)

    @staticmethod
    def _int8_per_token(weights, inputs) -> bool:
        return (int(weights.get("num_bits", 8)) == 8 and weights.get("strategy") == "channel"
                and weights.get("symmetric", True) and inputs.get("type", "int") == "int"
                and int(inputs.get("num_bits", 8)) == 8 and inputs.get("dynamic") is True
                and inputs.get("symmetric", True) and inputs.get("strategy") == "token")

    def _scheme(self, prefix: str):
        if any(_matches(target, prefix) for target in self.ignore):
            return None
        for targets, fmt, weights, inputs in self.groups:
            if weights is not None and fmt != "dense" and any(_matches(t, prefix) for t in targets):
                return fmt, weights, inputs
        return None

    def is_quantized(self, prefix: str, names) -> bool:
        return self._scheme(prefix) is not None and (f"{prefix}.weight_scale" in names)

    def read(self, prefix: str, get, names) -> QuantizedTensor | InputOrdered:
        fmt, weights, inputs = self._scheme(prefix)
        kind, bits = weights.get("type", "int"), int(weights.get("num_bits", 8))
        strategy, symmetric = weights.get("strategy", "tensor"), weights.get("symmetric", True)
        scales = np.asarray(get(f"{prefix}.weight_scale"), np.float32)
        g_idx = np.asarray(get(f"{prefix}.weight_g_idx")) if f"{prefix}.weight_g_idx" in names else None
        if kind == "float":
            if g_idx is not None:
                raise UnsupportedModelError(f"{self.where}: {prefix}: act-order groups (weight_g_idx) of fp8 "
                                            "weights are not supported")
            weight = get(f"{prefix}.weight")
            if strategy == "block":
                return block_fp8(weight, scales, tuple(weights["block_structure"]), prefix)
            if strategy == "group":
                return grouped_fp8(weight, scales, int(weights["group_size"]), prefix)
            return channel_fp8(weight, scales, prefix)
        if fmt == "pack-quantized":
            shape = tuple(int(n) for n in np.asarray(get(f"{prefix}.weight_shape")))
            codes = unpack_int32(get(f"{prefix}.weight_packed"), bits, axis=1)[:, :shape[1]]  # [out, in] unsigned
        else:
            codes = (np.asarray(get(f"{prefix}.weight")).astype(np.int16) + (1 << (bits - 1))).astype(np.uint8)
        out_features, in_features = codes.shape
        group_size = int(weights["group_size"]) if strategy == "group" else in_features
        groups = in_features // group_size
        order = None if g_idx is None else group_order(g_idx, in_features, group_size, f"{prefix}.weight_g_idx")
        if order is not None:
            codes = codes[:, order]
        scales = np.broadcast_to(scales.reshape(scales.shape[0], -1) if scales.size > 1 else scales.reshape(1, 1),
                                 (out_features, groups))
        zeros = np.zeros((out_features, groups), np.int32)
        if not symmetric:
            stored = get(f"{prefix}.weight_zero_point")
            if fmt == "pack-quantized":
                stored = unpack_int32(stored, bits, axis=0)[:out_features].astype(np.int32) - (1 << (bits - 1))
            zeros = np.broadcast_to(np.asarray(stored, np.int32).reshape(-1, groups) if np.size(stored) > 1
                                    else np.asarray(stored, np.int32).reshape(1, 1), (out_features, groups))
        if scales.shape != (out_features, groups):
            raise CheckpointError(f"{prefix}: weight_scale {scales.shape} does not fit {strategy} groups of "
                                  f"a {codes.shape} weight")
        unsigned_zeros = zeros + (1 << (bits - 1))
        if bits == 8 and symmetric:  # int8 codes as they are, no offsets: the int8 / w8a8 forms
            data = np.ascontiguousarray((codes.astype(np.int16) - 128).astype(np.int8).T)
            scheme = "w8a8" if inputs else "int8"
            weight = QuantizedTensor(data, np.ascontiguousarray(scales.T.astype(np.float32)), None, scheme,
                                     group_size)
        else:
            weight = grouped_codes(np.ascontiguousarray(codes.T), unsigned_zeros.T, np.ascontiguousarray(scales.T),
                                   bits, group_size, prefix)
        if order is None:
            return weight
        return InputOrdered(weight, order, order_label(prefix, "weight_g_idx", g_idx, get, names))
