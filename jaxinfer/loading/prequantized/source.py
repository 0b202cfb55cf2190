"""A HF directory whose config.json carries `quantization_config`: its
tensors as a TensorSource (loading/params.py) that also gives each quantized
linear weight in its stored form (`get_stored`), and refuses what it cannot
read rather than reading integer codes as floats.

  gptq                 4 / 8 bits -> int4 / int8 + zero points (gptq.py);
                       desc_act: the same over rows sorted by group, the
                       activations gathered to match (act_order.py)
  awq (GEMM)           4 bits -> int4 + zero points (awq.py)
  compressed-tensors   int4 / int8 / w8a8 / fp8 (compressed_tensors.py);
                       weight_g_idx likewise
  fp8                  float8_e4m3fn per 128 x 128 block -> fp8 in groups
                       (fp8_weights.py)
  MoE experts          each expert's linear as the format stores it (Qwen2-
                       and Qwen3-MoE, OLMoE: mlp.experts.{e}.*_proj; Mixtral:
                       block_sparse_moe.experts.{e}.w1 / w2 / w3), every form
                       above; loading/experts.py stacks a layer's experts
                       into one QuantizedTensor [experts, in, out]. The
                       router and a shared expert's gate are read as float
                       (dequantized where a file quantizes them); a shared
                       expert is a dense linear like any other.

`get(name)` of a quantized linear's `.weight` gives its dequantized float32
value (a float load, quantization=None, or a round-to-nearest scheme from
it); every other tensor is returned only when it is floating point."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxinfer.errors import CheckpointError, UnsupportedModelError
from jaxinfer.loading.prequantized.awq import AwqFormat
from jaxinfer.loading.prequantized.compressed_tensors import CompressedTensorsFormat
from jaxinfer.loading.prequantized.fp8_weights import Fp8Format
from jaxinfer.loading.prequantized.gptq import GptqFormat
from jaxinfer.quant.input_order import InputOrdered, logical_value
from jaxinfer.quant.tensor import QuantizedTensor

FORMATS = {"gptq": GptqFormat, "awq": AwqFormat, "compressed-tensors": CompressedTensorsFormat, "fp8": Fp8Format}
SUPPORTED = "gptq (4/8-bit), awq (GEMM), compressed-tensors (int4/int8/w8a8/fp8), fp8 (block scales)"


def quantization_config(directory: Path) -> dict | None:
    config = json.loads((Path(directory) / "config.json").read_text())
    return config.get("quantization_config") or config.get("compression_config")


def checkpoint_format(config: dict, where: str):
    """The reader of a quantization_config, or UnsupportedModelError naming the method."""
    method = str(config.get("quant_method", "")).lower()
    if method not in FORMATS:
        raise UnsupportedModelError(f"{where}: quantization_config quant_method {method or None!r} is not supported; "
                                    f"supported: {SUPPORTED}")
    return FORMATS[method](config, where)


class PrequantizedCheckpoint:
    prequantized = True

    def __init__(self, source, fmt):
        self.source = source
        self.format = fmt
        self.description = f"{source.description} ({fmt.name})"
        stored = source.names()
        self._quantized = {f"{prefix}.weight": prefix for prefix in {n.rsplit(".", 1)[0] for n in stored}
                           if fmt.is_quantized(prefix, stored)}
        self._names = set(stored) | set(self._quantized)

    @property
    def stored_dtype(self):
        return self.source.stored_dtype

    def names(self):
        return self._names

    def get_stored(self, name: str) -> QuantizedTensor | InputOrdered | None:
        """A linear weight [in, out] in its stored form (numpy leaves; act-order groups an InputOrdered),
        or None where it is stored float."""
        prefix = self._quantized.get(name)
        if prefix is None:
            return None
        return self.format.read(prefix, self.source.get, self._names)

    def get(self, name: str) -> np.ndarray:
        stored = self.get_stored(name)
        if stored is not None:
            return np.asarray(logical_value(stored, np.float32)).T
        array = self.source.get(name)
        if not np.issubdtype(array.dtype, np.floating) and array.dtype != ml_dtypes.bfloat16:
            raise CheckpointError(f"{self.description}: tensor {name} is stored as {array.dtype}, which this "
                                  f"{self.format.name} reader does not decode")
        return array


def open_prequantized(source, directory: Path):
    """source itself where config.json has no quantization_config, else a
    PrequantizedCheckpoint over it (UnsupportedModelError where the method or
    its options are not supported). A MoE's experts are named per expert
    here; loading/experts.py's ExpertTensors over it stacks them."""
    qc = quantization_config(directory)
    if not qc:
        return source
    return PrequantizedCheckpoint(source, checkpoint_format(qc, str(directory)))
