"""Integer codes packed into int32 words, low bits first: the layout GPTQ,
AWQ and compressed-tensors' pack-quantized share (AWQ then reorders the
columns of each word, awq.py)."""

from __future__ import annotations

import numpy as np

from jaxinfer.errors import CheckpointError


def unpack_int32(packed: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """int32 [..] with 32 // bits codes per word along `axis` -> uint8 codes,
    that axis 32 // bits times longer: word w's code k is element
    w * (32 // bits) + k."""
    if 32 % bits:
        raise CheckpointError(f"{bits}-bit codes do not fill an int32 word evenly")
    per_word = 32 // bits
    words = np.asarray(packed).view(np.uint32)
    shifts = (np.arange(per_word, dtype=np.uint32) * bits)
    words = np.moveaxis(words, axis, -1)
    codes = (words[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    codes = codes.reshape(*words.shape[:-1], words.shape[-1] * per_word).astype(np.uint8)
    return np.moveaxis(codes, -1, axis)


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """uint8 codes 0..15 [in, out] (in even) -> QuantizedTensor's int4 data
    [in // 2, out]: row 2j in the low nibble of byte j, row 2j + 1 in the high."""
    codes = codes.astype(np.uint8)
    return np.ascontiguousarray(codes[0::2] | (codes[1::2] << 4))
