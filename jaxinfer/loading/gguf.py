"""GGUF checkpoints (llama.cpp's format), read with loading/gguf_file.py.

Config comes from the file's metadata, tensors are renamed to HF names and
dequantized to float one at a time on request, and llama.cpp's Q/K row
permutation is undone for the "llama" architecture so the HF rotary pairing in
models/layers.py applies. Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K weights can instead
be read straight into a QuantizedTensor (`get_quantized`), repacking the block
codes and scales so that the values stay exactly the file's, and the K-quants
(Q2_K .. Q6_K) into a KQuantTensor that holds them at the file's size
(blocks_to_kquant, quant/kquant.py; on CPU straight into the kernels' tiles
by native/kquant_repack.cc, the numpy here being its reference and fallback).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.errors import CheckpointError, UnsupportedModelError
from jaxinfer.loading.gguf_file import GGUFFile
from jaxinfer.loading.gguf_package import gguf
from jaxinfer.native import kquant_repack
from jaxinfer.quant.kquant import FORMATS, KQuantTensor, pack_bits
from jaxinfer.quant.mixed_stack import MixedStack
from jaxinfer.quant.tensor import QuantizedTensor, pack_int4

# GGUF `general.architecture` -> ours. Mistral GGUFs say "llama", and so do
# Mixtral's (with {arch}.expert_count set).
_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe",
                  "qwen3moe": "qwen3_moe", "olmoe": "olmoe"}
# Whether llama.cpp renormalises a family's top-k routing weights (its graph
# builders' norm_w, fixed per architecture; {arch}.expert_weights_norm,
# where a file sets it, says so explicitly).
_NORM_TOPK = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": True, "olmoe": False}

# Tensor types we dequantize with gguf.quants: every block format llama.cpp's
# quantizer writes that the package implements in numpy (the classic and
# K-quant blocks, the i-quants, the ternary and FP4 ones). The rest (its
# internal Q8_1 / Q8_K, integer and float64 tensors, formats newer than the
# package) fail with an error naming the type and these.
Q = gguf.GGMLQuantizationType
SUPPORTED_TENSOR_TYPES = frozenset(
    [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
     Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ4_NL, Q.IQ4_XS, Q.TQ1_0, Q.TQ2_0,
     *(getattr(Q, name) for name in ("MXFP4", "NVFP4") if hasattr(Q, name))]
)

# Block types that map onto a QuantizedTensor without loss: (scheme, rows per scale).
# The 5- and 6-bit codes fit int8 (with offsets for Q5_1 / Q5_K's minimums).
DIRECT_TYPES = {Q.Q8_0: ("int8", 32), Q.Q4_0: ("int4", 32), Q.Q4_1: ("int4", 32), Q.Q5_0: ("int8", 32),
                Q.Q5_1: ("int8", 32), Q.Q4_K: ("int4", 32), Q.Q5_K: ("int8", 32), Q.Q6_K: ("int8", 16)}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # A MoE's: the router, the experts stacked [experts, out, in] (the names
    # loading/experts.py gives a safetensors checkpoint's), the shared expert.
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",  # [hidden] in the file, HF's [1, hidden]
}


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order.

    For adjacent-pair RoPE, llama.cpp's converter interleaves the two halves of
    each head's rows: HF row (half h, index i) lands at row 2*i + h. Reading
    rows as [head, i, h] and swapping the last two axes restores [head, h, i].
    """
    out_dim = weight.shape[0]
    head_dim = out_dim // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _f16(two_bytes: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 holding little-endian float16 -> float32 [...] (exact)."""
    return np.ascontiguousarray(two_bytes).view("<f2")[..., 0].astype(np.float32)


# Blocks dequantized per call of the library's block dequantizer: gguf's own
# loop takes 16 rows a call, whose per-call overhead made a 49,152-row
# embedding table 6x slower to read; a few MB of float32 a call stays in cache.
_CHUNK_BLOCKS = 2048


def dequantize_blocks(data: np.ndarray, qtype) -> np.ndarray:
    """gguf.quants.dequantize(data, qtype), float32 [..., weights per row],
    the block types run in chunks of _CHUNK_BLOCKS blocks over the whole
    tensor (the library's own dequantize_blocks, so the values are its)."""
    qtype = gguf.GGMLQuantizationType(qtype)
    traits = getattr(gguf.quants, "_type_traits", {}).get(qtype)
    if qtype not in _CHUNKED_TYPES or traits is None:
        return gguf.quants.dequantize(data, qtype)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = np.asarray(data, np.uint8).reshape(-1, type_size)
    out = np.empty((blocks.shape[0], block_size), np.float32)
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        out[start:start + _CHUNK_BLOCKS] = traits.dequantize_blocks(blocks[start:start + _CHUNK_BLOCKS])
    return out.reshape(*data.shape[:-1], data.shape[-1] // type_size * block_size)


_CHUNKED_TYPES = frozenset([Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K])


def blocks_to_quantized(raw: np.ndarray, qtype, out_dim: int, in_dim: int, unpermute_heads: int | None = None):
    """Raw GGUF blocks of an [out, in] matrix -> QuantizedTensor [in, out] (numpy leaves).

    Block layouts (ggml-common.h; one block covers consecutive weights of one row):
      Q8_0  32 weights: f16 d, int8 q[32]                w = d * q
      Q4_0  32 weights: f16 d, uint8 qs[16]              w = d * (q - 8)
      Q4_1  32 weights: f16 d, f16 m, uint8 qs[16]       w = d * q + m
      Q5_0  32 weights: f16 d, 5-bit q                   w = d * (q - 16)
      Q5_1  32 weights: f16 d, f16 m, 5-bit q            w = d * q + m
      Q4_K  256 weights in 8 groups of 32: f16 d, f16 dmin, 6-bit sc[8] and m[8],
      Q5_K  4-bit (Q5_K: 5-bit) q                        w = (d * sc) * q - dmin * m
      Q6_K  256 weights in 16 groups of 16: 6-bit q, int8 sc[16], f16 d
                                                         w = (d * sc) * (q - 32)
    For Q4_0 / Q4_1, byte j of qs holds element j in its low nibble and element
    j + 16 in its high nibble; our int4 instead pairs rows 2i / 2i + 1 in one
    byte, so the nibbles are unpacked and repacked. The other types' codes are
    read by the `gguf` package itself (_codes). Every scale is an exact float32
    product (f16 times an integer of at most 8 bits), and each type's
    arithmetic is dequantize()'s (q * scale, plus the offset), so dequantize()
    reproduces gguf's values bit for bit.
    """
    qtype = gguf.GGMLQuantizationType(qtype)
    if qtype not in DIRECT_TYPES:
        raise ValueError(f"GGUF type {qtype.name} has no direct QuantizedTensor form")
    scheme, group_size = DIRECT_TYPES[qtype]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = np.asarray(raw, np.uint8).reshape(out_dim, in_dim // block_size, type_size)
    offsets = None
    if qtype in _UNIT_SCALES:
        q, scales, offsets = _codes(blocks, qtype)
        q, scales = q.reshape(out_dim, in_dim), scales.reshape(out_dim, in_dim // group_size)
        offsets = None if offsets is None else offsets.reshape(scales.shape)
    elif qtype == Q.Q8_0:
        scales = _f16(blocks[..., 0:2])  # [out, in / 32]
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(out_dim, in_dim)
    else:
        scales = _f16(blocks[..., 0:2])
        qs = blocks[..., 4:] if qtype == Q.Q4_1 else blocks[..., 2:]
        offsets = _f16(blocks[..., 2:4]) if qtype == Q.Q4_1 else -8.0 * scales
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(out_dim, in_dim)
    if unpermute_heads:
        q, scales = unpermute_rows(q, unpermute_heads), unpermute_rows(scales, unpermute_heads)
        offsets = None if offsets is None else unpermute_rows(offsets, unpermute_heads)
    q = np.ascontiguousarray(q.T)
    data = q if scheme == "int8" else pack_int4(q)
    scales = np.ascontiguousarray(scales.T)
    offsets = None if offsets is None else np.ascontiguousarray(offsets.T)
    return QuantizedTensor(data, scales, offsets, scheme, group_size)


# Per type: the byte offsets of the f16 d and of the f16 minimum (or None).
_UNIT_SCALES = {Q.Q5_0: (0, None), Q.Q5_1: (0, 2), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208, None)}
_F16_ONE = np.array([1.0], "<f2").view(np.uint8)


def _codes(blocks: np.ndarray, qtype):
    """[..., n, bytes] blocks of a _UNIT_SCALES type -> (integer codes [..., n *
    block size], scales [..., n * groups], offsets or None), float32 scales.

    The K-quants' codes are _k_codes' (integer operations); Q5_0 / Q5_1's
    come from gguf's own dequantizer run on a copy of the blocks whose d is
    1 and minimum 0: the bit layout stays the library's, and its output is
    the integers exactly (Q5_0 and Q6_K include their -16 / -32)."""
    d_at, min_at = _UNIT_SCALES[qtype]
    if qtype in K_QUANT_KINDS:
        codes = _k_codes(blocks.reshape(-1, blocks.shape[-1]), qtype)
        if qtype != Q.Q4_K:  # Q4_K goes to int4: 0..15
            codes = codes.view(np.int8) - np.int8(32 if qtype == Q.Q6_K else 0)
    else:
        unit_blocks = blocks.copy()
        unit_blocks[..., d_at:d_at + 2] = _F16_ONE
        if min_at is not None:
            unit_blocks[..., min_at:min_at + 2] = 0
        codes = dequantize_blocks(unit_blocks, qtype).astype(np.int8)
    d = _f16(blocks[..., d_at:d_at + 2])[..., None]  # [..., n, 1]
    minimum = None if min_at is None else _f16(blocks[..., min_at:min_at + 2])[..., None]
    if qtype in (Q.Q4_K, Q.Q5_K):
        sc, m = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))
        shape = (*blocks.shape[:-1], 8)
        return codes, d * sc.reshape(shape).astype(np.float32), -(minimum * m.reshape(shape).astype(np.float32))
    if qtype == Q.Q6_K:
        return codes, d * np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32), None
    return codes, d, minimum


# K-quant block types held as stored (quant/kquant.py), and the byte offsets
# of the f16 d and dmin in a block.
K_QUANT_KINDS = {Q.Q2_K: "q2_k", Q.Q3_K: "q3_k", Q.Q4_K: "q4_k", Q.Q5_K: "q5_k", Q.Q6_K: "q6_k"}
_K_D_AT = {Q.Q2_K: (80, 82), Q.Q3_K: (108, None), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208, None)}


def _bit_fields(packed: np.ndarray, width: int, shifts: int, run: int) -> np.ndarray:
    """uint8 [n, bytes] -> [n, bytes * shifts]: each run of `run` bytes read
    `shifts` times, shifted by 0, width, 2 * width, ..., masked to `width` bits
    (the K-quants' code planes, ggml-common.h's layouts)."""
    n = packed.shape[0]
    by = (np.arange(shifts, dtype=np.uint8) * width).reshape(1, 1, shifts, 1)
    fields = (packed.reshape(n, -1, 1, run) >> by) & np.uint8((1 << width) - 1)
    return fields.reshape(n, -1)


def _k_codes(blocks: np.ndarray, qtype) -> np.ndarray:
    """[n, bytes] K-quant blocks -> uint8 codes [n, 256] as quant/kquant.py
    holds them (code = the signed value gguf's dequantizer multiplies + bias),
    in integer operations over the whole tensor. The bit layouts are the ones
    gguf.quants' dequantize_blocks reads; tests/quant/test_kquant.py holds
    every kind to gguf.quants.dequantize bit for bit."""
    if qtype == Q.Q2_K:
        return _bit_fields(blocks[:, 16:80], 2, 4, 32)
    if qtype == Q.Q3_K:  # the high bit is stored inverted: set means "no -4", code = low + 4 * bit
        return _bit_fields(blocks[:, 32:96], 2, 4, 32) | (_bit_fields(blocks[:, 0:32], 1, 8, 32) << 2)
    if qtype == Q.Q4_K:
        return _bit_fields(blocks[:, 16:144], 4, 2, 32)
    if qtype == Q.Q5_K:
        return _bit_fields(blocks[:, 48:176], 4, 2, 32) | (_bit_fields(blocks[:, 16:48], 1, 8, 32) << 4)
    # Q6_K: 4 low bits in 2 runs of 64 bytes, 2 high bits in 4 fields of 2 runs of 32
    return _bit_fields(blocks[:, 0:128], 4, 2, 64) | (_bit_fields(blocks[:, 128:192], 2, 4, 32) << 4)


def _k_sub_scales(blocks: np.ndarray, qtype) -> tuple[np.ndarray, np.ndarray | None]:
    """[..., n, bytes] K-quant blocks -> (sub-scale bytes [..., n * groups], sub-minimums or None),
    as quant/kquant.py holds them."""
    groups = (*blocks.shape[:-1], -1)
    if qtype == Q.Q2_K:  # the file's byte: scale | minimum << 4
        return np.ascontiguousarray(blocks[..., 0:16]).reshape(groups), None
    if qtype == Q.Q6_K:
        return np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).reshape(groups), None
    if qtype == Q.Q3_K:  # 6-bit scales: low nibbles in bytes 96..103, high 2 bits in 104..107
        flat = blocks.reshape(-1, blocks.shape[-1])
        low = _bit_fields(flat[:, 96:104], 4, 2, 8)
        high = _bit_fields(flat[:, 104:108], 2, 4, 4)
        return ((low | (high << 4)).astype(np.int8) - np.int8(32)).reshape(groups), None
    sc, m = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))
    return sc.astype(np.uint8).reshape(groups), m.astype(np.uint8).reshape(groups)


def blocks_to_kquant(raw: np.ndarray, qtype, out_dim: int, in_dim: int,
                     unpermute_heads: int | None = None) -> KQuantTensor:
    """Raw K-quant blocks of an [out, in] matrix -> KQuantTensor [in, out]
    (numpy leaves) holding the same codes and scales (quant/kquant.py): its
    dequantize() is gguf's, bit for bit. Integer operations over the whole
    tensor (_k_codes): no float pass, nothing per row."""
    qtype = gguf.GGMLQuantizationType(qtype)
    kind = K_QUANT_KINDS[qtype]
    f = FORMATS[kind]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = np.asarray(raw, np.uint8).reshape(out_dim, in_dim // block_size, type_size)
    codes = _k_codes(blocks.reshape(-1, type_size), qtype).reshape(out_dim, in_dim)
    sub_scales, sub_mins = _k_sub_scales(blocks, qtype)
    sub_scales = sub_scales.reshape(out_dim, in_dim // f.group)
    sub_mins = None if sub_mins is None else sub_mins.reshape(out_dim, in_dim // f.group)
    d_at, dmin_at = _K_D_AT[qtype]
    d = np.ascontiguousarray(blocks[..., d_at:d_at + 2]).view("<f2")[..., 0]
    dmin = None if dmin_at is None else np.ascontiguousarray(blocks[..., dmin_at:dmin_at + 2]).view("<f2")[..., 0]
    rows = [codes, sub_scales, sub_mins, d, dmin]
    if unpermute_heads:
        rows = [None if a is None else unpermute_rows(a, unpermute_heads) for a in rows]
    codes, sub_scales, sub_mins, d, dmin = (None if a is None else np.ascontiguousarray(a.T) for a in rows)
    low = codes & ((1 << f.low_bits) - 1)
    high = pack_bits(codes >> f.low_bits, f.high_bits) if f.high_bits else None
    return KQuantTensor(pack_bits(low, f.low_bits), high, sub_scales, sub_mins, d.astype(np.float16),
                        None if dmin is None else dmin.astype(np.float16), kind)


def config_from_gguf(reader: GGUFFile, path) -> ModelConfig:
    arch = reader.fields.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: unknown architecture {arch!r}; supported GGUF architectures: {', '.join(_ARCHITECTURES)}"
        )

    def meta(key, default=None):
        value = reader.fields.get(f"{arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"{path} lacks the metadata key {arch}.{key}")
        return value

    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise UnsupportedModelError(f"{path}: rope_freqs.weight (precomputed RoPE factors) is not supported yet")
    scaling_type = reader.fields.get(f"{arch}.rope.scaling.type")
    rope_scaling = None
    if scaling_type == "linear":
        rope_scaling = (("factor", float(meta("rope.scaling.factor"))), ("rope_type", "linear"))
    elif scaling_type not in (None, "none"):
        raise UnsupportedModelError(f"{path}: rope scaling type {scaling_type!r} is not supported")
    hidden = int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    vocab = reader.fields.get(f"{arch}.vocab_size") or (
        len(tokens) if tokens is not None else int(embed.shape[-1]) if embed is not None else None
    )
    sliding_window = reader.fields.get(f"{arch}.attention.sliding_window")
    architecture = _ARCHITECTURES[arch]
    num_experts = int(reader.fields.get(f"{arch}.expert_count") or 0)
    moe = {}
    if num_experts:
        architecture = "mixtral" if architecture == "llama" else architecture
        if architecture not in _NORM_TOPK:
            raise UnsupportedModelError(f"{path}: {arch} with experts is not supported")
        num_layers = int(meta("block_count"))
        q_norm = next((t for t in reader.tensors if t.name == "blk.0.attn_q_norm.weight"), None)
        moe = dict(
            num_experts=num_experts,
            num_experts_per_tok=int(meta("expert_used_count")),
            moe_intermediate_size=int(reader.fields.get(f"{arch}.expert_feed_forward_length")
                                      or meta("feed_forward_length")),
            norm_topk_prob=bool(reader.fields.get(f"{arch}.expert_weights_norm", _NORM_TOPK[architecture])),
            shared_expert_intermediate_size=int(reader.fields.get(f"{arch}.expert_shared_feed_forward_length") or 0),
            # Layers without a router keep a dense MLP.
            dense_layers=tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names),
            # OLMoE's q norm spans the whole projection, not one head.
            qk_norm_per_head=q_norm is None or int(q_norm.shape[0]) == int(
                meta("attention.key_length", hidden // int(meta("attention.head_count")))),
        )
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=int(meta("attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(meta("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        sliding_window=int(sliding_window) if sliding_window else None,
        **moe,
    )


class GGUFTensors:
    """TensorSource over a GGUF file: HF names, dequantized float32, HF row order."""

    def __init__(self, reader: GGUFFile, config: ModelConfig, path):
        self.description = str(path)
        self._reader = reader
        self._config = config
        self._unpermute = reader.fields.get("general.architecture") == "llama"
        self._tensors = {}
        for tensor in reader.tensors:
            name = hf_name(tensor.name)
            if name is not None:
                self._tensors[name] = tensor

    def names(self):
        return self._tensors.keys()

    @property
    def holds_grouped_blocks(self) -> bool:
        """Whether a tensor is in a classic block type (Q8_0, Q4_0, Q4_1, Q5_0,
        Q5_1), held as grouped int8 / int4 codes (QuantizedTensor)."""
        return any((kind := gguf.GGMLQuantizationType(t.tensor_type)) in DIRECT_TYPES and kind not in K_QUANT_KINDS
                   for t in self._tensors.values())

    @property
    def k_quant_kinds(self) -> frozenset[str]:
        """The K-quant types its tensors are in (K_QUANT_KINDS' names: "q4_k", ...)."""
        return frozenset(K_QUANT_KINDS[kind] for t in self._tensors.values()
                         if (kind := gguf.GGMLQuantizationType(t.tensor_type)) in K_QUANT_KINDS)

    def _unpermute_heads(self, name: str) -> int | None:
        if self._unpermute and name.endswith(("q_proj.weight", "k_proj.weight")):
            return self._config.num_heads if "q_proj" in name else self._config.num_kv_heads
        return None

    def _row_order(self, name: str, out_dim: int) -> np.ndarray | None:
        """The file's row of each of the weight's out_dim rows in HF order
        (llama's q / k un-permuted), or None where they are the same."""
        heads = self._unpermute_heads(name)
        return None if heads is None else unpermute_rows(np.arange(out_dim), heads)

    def get_quantized(self, name: str, k_quants_as_stored: bool = False,
                      tiled: bool = False) -> QuantizedTensor | KQuantTensor | None:
        """The tensor as a QuantizedTensor in params layout [in, out] (numpy
        leaves), or None when its GGUF type has no direct form.
        k_quants_as_stored: a K-quant (Q2_K .. Q6_K) as a KQuantTensor
        (quant/kquant.py, the file's size) instead; tiled: in tiles of
        columns, repacked in native code (native/kquant_repack.py), where
        that is built and the shape tiles, else in the plain layout."""
        tensor = self._tensors[name]
        try:
            return self._quantized(name, tensor, k_quants_as_stored, tiled)
        finally:
            self._reader.release(tensor.data)

    def _quantized(self, name: str, tensor, k_quants_as_stored: bool, tiled: bool):
        qtype = gguf.GGMLQuantizationType(tensor.tensor_type)
        if len(tensor.shape) not in (2, 3):
            return None
        in_dim, out_dim = (int(d) for d in tensor.shape[:2])  # ggml lists the fastest dim first
        if len(tensor.shape) == 3:  # a MoE's experts [experts, out, in]: each expert's blocks, stacked
            if qtype not in DIRECT_TYPES:
                return None
            experts = [blocks_to_quantized(raw, qtype, out_dim, in_dim) for raw in tensor.data]
            first = experts[0]
            return QuantizedTensor(np.stack([e.data for e in experts]), np.stack([e.scales for e in experts]),
                                   None if first.offsets is None else np.stack([e.offsets for e in experts]),
                                   first.scheme, first.group_size)
        if k_quants_as_stored and qtype in K_QUANT_KINDS:
            if tiled and kquant_repack.takes(out_dim, in_dim):
                repacked = kquant_repack.repack(tensor.data, K_QUANT_KINDS[qtype], out_dim, in_dim,
                                                self._row_order(name, out_dim))
                if repacked is not None:
                    return repacked
            return blocks_to_kquant(tensor.data, qtype, out_dim, in_dim, self._unpermute_heads(name))
        if qtype not in DIRECT_TYPES:
            return None
        return blocks_to_quantized(tensor.data, qtype, out_dim, in_dim, self._unpermute_heads(name))

    def stacked_k_quants(self, names: list[str]):
        """The layers `names` (one weight, in layer order) as one tiled stack,
        each layer repacked in native code straight into its place
        (native/kquant_repack.py), instead of read one by one and stacked
        after: a KQuantTensor [layers, in, out], or a MixedStack where the
        layers mix K-quant kinds (quant/mixed_stack.py, one part per kind,
        in the order of their first layers). -> (one callable per layer
        that fills it, a callable giving the stack once they all have run),
        or None where a layer is not a K-quant the repacking tiles or the
        library is not built (read them one by one then)."""
        tensors = [self._tensors[name] for name in names]
        kinds = [K_QUANT_KINDS.get(gguf.GGMLQuantizationType(t.tensor_type)) for t in tensors]
        if not tensors or None in kinds or any(len(t.shape) != 2 for t in tensors) or not kquant_repack.available():
            return None
        in_dim, out_dim = (int(d) for d in tensors[0].shape)
        if any(tuple(t.shape) != tensors[0].shape for t in tensors) or not kquant_repack.takes(out_dim, in_dim):
            return None
        order, part_of_layer, index_in_part = MixedStack.grouping(kinds)
        parts = [kquant_repack.empty(kind, out_dim, in_dim, layers=kinds.count(kind)) for kind in order]
        rows = self._row_order(names[0], out_dim)

        def fill(i: int) -> None:
            layer = jax.tree.map(lambda a: a[index_in_part[i]], parts[part_of_layer[i]])
            try:
                kquant_repack.repack(tensors[i].data, kinds[i], out_dim, in_dim, rows, out=layer)
            finally:
                self._reader.release(tensors[i].data)

        def stack():
            return parts[0] if len(parts) == 1 else MixedStack(tuple(parts), part_of_layer, index_in_part)

        return [functools.partial(fill, i) for i in range(len(names))], stack

    def get(self, name: str) -> np.ndarray:
        tensor = self._tensors[name]
        try:
            return self._float(name, tensor)
        finally:
            self._reader.release(tensor.data)

    def _float(self, name: str, tensor) -> np.ndarray:
        qtype = gguf.GGMLQuantizationType(tensor.tensor_type)
        if qtype not in SUPPORTED_TENSOR_TYPES:
            raise CheckpointError(
                f"{self.description}: tensor {tensor.name} has GGUF type {qtype.name}, which is not supported "
                f"(supported: {', '.join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))})"
            )
        # tensor.shape lists ggml dims fastest-first; numpy wants them reversed.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        array = dequantize_blocks(tensor.data, qtype).reshape(shape)
        if name.endswith("shared_expert_gate.weight") and array.ndim == 1:
            array = array[None]  # llama.cpp stores HF's [1, hidden] as [hidden]
        heads = self._unpermute_heads(name)
        return array if heads is None else unpermute_rows(array, heads)


def open_gguf(path: str | Path):
    """-> (config, TensorSource, reader) for a .gguf file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} not found")
    try:
        reader = GGUFFile(path)
    except Exception as e:  # ValueError, struct.error or UnicodeDecodeError on bad bytes
        raise CheckpointError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None
    config = config_from_gguf(reader, path)
    return config, GGUFTensors(reader, config, path), reader
