"""float8_e4m3fn weights with float32 scales as quant/tensor.py's fp8 form:
per output channel (group_size = in), or per block of the weight
[block_out, block_in] (Qwen3 / DeepSeek -FP8's 128 x 128 `weight_scale_inv`,
compressed-tensors' "block" strategy), which becomes groups of input rows
with one scale per output column: each block's scale repeated over its
columns (a thirty-second of the codes' bytes for 128-row groups in float32).
w = q * scale either way; activations stay float (the checkpoint's own
activation quantization is not applied)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from jaxinfer.errors import CheckpointError, UnsupportedModelError
from jaxinfer.quant.tensor import QuantizedTensor


def channel_fp8(weight: np.ndarray, scales: np.ndarray, name: str) -> QuantizedTensor:
    """weight fp8 [out, in]; scales: one (per tensor) or [out] (per channel)."""
    out_features, in_features = weight.shape
    scales = np.broadcast_to(np.asarray(scales, np.float32).reshape(-1), (out_features,))
    return QuantizedTensor(_codes(weight, name), np.ascontiguousarray(scales[None]), None, "fp8", in_features)


def grouped_fp8(weight: np.ndarray, scales: np.ndarray, group_size: int, name: str) -> QuantizedTensor:
    """weight fp8 [out, in]; scales [out, in // group_size]."""
    out_features, in_features = weight.shape
    if in_features % group_size or scales.shape != (out_features, in_features // group_size):
        raise CheckpointError(f"{name}: scales {scales.shape} do not fit a {weight.shape} weight in groups "
                              f"of {group_size}")
    return QuantizedTensor(_codes(weight, name), np.ascontiguousarray(scales.astype(np.float32).T), None, "fp8",
                           group_size)


def block_fp8(weight: np.ndarray, scales: np.ndarray, block: tuple[int, int], name: str) -> QuantizedTensor:
    """weight fp8 [out, in]; scales [ceil(out / block_out), ceil(in / block_in)]
    (the last block of an axis may be partial)."""
    out_features, in_features = weight.shape
    block_out, block_in = block
    expected = (math.ceil(out_features / block_out), math.ceil(in_features / block_in))
    if tuple(scales.shape) != expected:
        raise CheckpointError(f"{name}: block scales {scales.shape} do not fit a {weight.shape} weight in "
                              f"{block_out} x {block_in} blocks (expected {expected})")
    # Groups that divide both the input width and the block (a partial last
    # block then still holds whole groups).
    group_size = math.gcd(in_features, block_in)
    per_column = np.repeat(np.asarray(scales, np.float32), block_out, axis=0)[:out_features]  # [out, in blocks]
    per_group = np.repeat(per_column, block_in // group_size, axis=1)[:, :in_features // group_size]
    return grouped_fp8(weight, per_group, group_size, name)


def _codes(weight: np.ndarray, name: str) -> np.ndarray:
    if weight.dtype != ml_dtypes.float8_e4m3fn:
        raise UnsupportedModelError(f"{name}: fp8 weights stored as {weight.dtype} are not supported "
                                    "(supported: float8_e4m3fn)")
    return np.ascontiguousarray(weight.T)


class Fp8Format:
    """quant_method "fp8" (transformers' fine-grained FP8: `weight` float8_e4m3fn
    and `weight_scale_inv`, a multiplier despite its name, per block of
    `weight_block_size`)."""

    name = "fp8"

    def __init__(self, config: dict, where: str):
        if str(config.get("fmt", "e4m3")).lower() != "e4m3":
            raise UnsupportedModelError(f"{where}: fp8 fmt {config.get('fmt')!r} is not supported (supported: e4m3)")
        block = config.get("weight_block_size")
        if not block or len(block) != 2:
            raise UnsupportedModelError(f"{where}: fp8 without weight_block_size is not supported")
        self.block = (int(block[0]), int(block[1]))

    def is_quantized(self, prefix: str, names) -> bool:
        return f"{prefix}.weight_scale_inv" in names

    def read(self, prefix: str, get, names) -> QuantizedTensor:
        return block_fp8(get(f"{prefix}.weight"), np.asarray(get(f"{prefix}.weight_scale_inv")), self.block, prefix)
