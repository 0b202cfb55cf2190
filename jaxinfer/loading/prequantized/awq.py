"""AWQ checkpoints, GEMM version (AutoAWQ, quant_method "awq").

Per linear: `qweight` int32 [in, out / 8], eight 4-bit codes of one input
row per word, nibble k (bits 4k..4k+3) holding column 8j + ORDER[k] of word
j; `qzeros` int32 [groups, out / 8] packed the same way; `scales` float16
[groups, out]. w = (q - zero) * scale."""

from __future__ import annotations

import numpy as np

from jaxinfer.errors import UnsupportedModelError
from jaxinfer.loading.prequantized.packing import unpack_int32
from jaxinfer.loading.prequantized.stored_codes import grouped_codes
from jaxinfer.quant.tensor import QuantizedTensor

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
NIBBLE_OF_COLUMN = np.argsort(ORDER)  # column c of a word sits in nibble NIBBLE_OF_COLUMN[c]


def _columns(packed: np.ndarray) -> np.ndarray:
    """int32 [rows, out / 8] -> uint8 codes [rows, out] in column order."""
    nibbles = unpack_int32(packed, 4, axis=1)  # column 8j + k holds nibble k
    words = packed.shape[1]
    order = (np.arange(words)[:, None] * 8 + NIBBLE_OF_COLUMN[None, :]).reshape(-1)
    return nibbles[:, order]


class AwqFormat:
    name = "awq"

    def __init__(self, config: dict, where: str):
        version = str(config.get("version", "gemm")).lower()
        bits = int(config.get("bits", config.get("w_bit", 4)))
        if version != "gemm":
            raise UnsupportedModelError(f"{where}: AWQ version {version!r} is not supported (supported: gemm)")
        if bits != 4:
            raise UnsupportedModelError(f"{where}: {bits}-bit AWQ is not supported (supported: 4 bits)")
        if not config.get("zero_point", True):
            raise UnsupportedModelError(f"{where}: AWQ without zero points is not supported")
        self.group_size = int(config.get("group_size", config.get("q_group_size", 128)))

    def is_quantized(self, prefix: str, names) -> bool:
        return f"{prefix}.qweight" in names

    def read(self, prefix: str, get, names) -> QuantizedTensor:
        codes = _columns(np.asarray(get(f"{prefix}.qweight")))
        zeros = _columns(np.asarray(get(f"{prefix}.qzeros")))
        group_size = codes.shape[0] if self.group_size == -1 else self.group_size
        return grouped_codes(codes, zeros, np.asarray(get(f"{prefix}.scales")), 4, group_size, prefix)
