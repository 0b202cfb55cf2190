"""Integer codes with a zero point and a scale per group of input rows,
w[i, o] = (q[i, o] - zero[g, o]) * scale[g, o] with g = i // group_size, as
one of quant/tensor.py's forms: GPTQ, AWQ and compressed-tensors' integer
formats all reduce to it."""

from __future__ import annotations

import numpy as np

from jaxinfer.errors import CheckpointError
from jaxinfer.loading.prequantized.packing import pack_nibbles
from jaxinfer.quant.tensor import QuantizedTensor


def grouped_codes(codes: np.ndarray, zeros: np.ndarray, scales: np.ndarray, bits: int, group_size: int,
                  name: str) -> QuantizedTensor:
    """codes: unsigned [in, out] in 0 .. 2**bits - 1; zeros and scales
    [in // group_size, out] (zeros in the codes' unsigned range).

    4 bits: the int4 form, the codes as they are, offset = -zero * scale
    (the zero point folded in, as GGUF's Q4_1). 8 bits: the int8 form,
    codes shifted by 128 into int8 and offset = (128 - zero) * scale, so
    (q - 128) * scale + offset = (q - zero) * scale. Either way the native
    CPU kernel multiplies the codes as stored (native/matmul.py)."""
    in_features = codes.shape[0]
    if group_size < 1 or in_features % group_size or scales.shape != (in_features // group_size, codes.shape[1]):
        raise CheckpointError(f"{name}: scales {scales.shape} do not fit {codes.shape} codes in groups of {group_size}")
    scales = scales.astype(np.float32)
    zeros = zeros.astype(np.float32)
    if bits == 4:
        if in_features % 2:
            raise CheckpointError(f"{name}: int4 packs two input rows per byte; {in_features} rows is odd")
        return QuantizedTensor(pack_nibbles(codes), scales, -zeros * scales, "int4", group_size)
    if bits == 8:
        data = (codes.astype(np.int16) - 128).astype(np.int8)
        return QuantizedTensor(data, scales, (128.0 - zeros) * scales, "int8", group_size)
    raise CheckpointError(f"{name}: {bits}-bit codes have no quantized form here (4 and 8 bits do)")
