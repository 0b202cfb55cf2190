"""Write GGUF files from tiny HF models with gguf.GGUFWriter, the way
llama.cpp's converter lays them out (names, metadata, permuted Q/K rows)."""

from __future__ import annotations

import gguf
import numpy as np
import torch

LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    # Mixtures of experts, from transformers' in-memory (fused 3-D) names
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
# transformers model_type -> llama.cpp's architecture (Mixtral is "llama" with experts)
GGUF_ARCHITECTURES = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}
# The routers stay float32, as llama.cpp's converter keeps them.
FLOAT_TENSORS = ("mlp.gate.weight", "mlp.shared_expert_gate.weight")


def llama_cpp_row_order(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's Q/K layout, written as an explicit index loop (independent of
    the reshape trick the loader uses): within each head, HF row h*half + i
    (h in {0, 1}) moves to row 2*i + h."""
    head_dim = weight.shape[0] // num_heads
    half = head_dim // 2
    out = np.empty_like(weight)
    for head in range(num_heads):
        base = head * head_dim
        for h in range(2):
            for i in range(half):
                out[base + 2 * i + h] = weight[base + h * half + i]
    return out


def gguf_name(hf_name: str) -> str:
    if hf_name.endswith(("mlp.experts.gate_exps", "mlp.experts.up_exps")):  # moe_tensors' halves
        _, _, index, rest = hf_name.split(".", 3)
        return f"blk.{index}.ffn_{rest.split('.')[-1]}.weight"
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, index, rest = hf_name.split(".", 3)
    return f"blk.{index}.{LAYER_NAMES[rest]}"


def quantized(array: np.ndarray, qtype, hf_name: str = "") -> bool:
    """llama.cpp quantizes 2-D (and stacked 3-D expert) weights whose rows
    fill whole blocks; 1-D and the routers stay F32."""
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    return array.ndim >= 2 and array.shape[-1] % block == 0 and not hf_name.endswith(FLOAT_TENSORS)


# Per K-quant type: (byte offset of an f16 super-block scale in a block (d,
# then dmin where the type has one), the magnitude it is drawn around), from
# ggml's block layouts.
Q = gguf.GGMLQuantizationType
K_SUPER_SCALES = {Q.Q2_K: [(80, 0.003), (82, 0.002)], Q.Q3_K: [(108, 0.003)], Q.Q4_K: [(0, 0.003), (2, 0.002)],
                  Q.Q5_K: [(0, 0.003), (2, 0.002)], Q.Q6_K: [(208, 2e-4)]}


def random_k_blocks(rng, qtype, out_dim: int, in_dim: int) -> np.ndarray:
    """Valid K-quant blocks of an [out, in] matrix: random codes and sub-block
    scales, with the f16 super-block scales set to modest values (gguf has no
    K-quant quantizer to make them from weights)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (out_dim, in_dim // block_size, type_size), dtype=np.uint8)
    fields = K_SUPER_SCALES[gguf.GGMLQuantizationType(qtype)]
    for offset, scale in fields:
        values = rng.uniform(0.5, 1.5, raw.shape[:2]) * scale
        raw[..., offset:offset + 2] = values.astype("<f2")[..., None].view(np.uint8)
    return raw.reshape(out_dim, -1)


def round_trip(array: np.ndarray, qtype, hf_name: str = "") -> np.ndarray:
    if qtype == gguf.GGMLQuantizationType.F32 or not quantized(array, qtype, hf_name):
        return array
    return gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype)


def moe_tensors(state: dict) -> dict:
    """transformers' fused expert tensors -> llama.cpp's stacked ones: gate_up_proj
    [experts, 2 * ffn, hidden] is the gate's rows then the up's."""
    out = {}
    for name, array in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            ffn = array.shape[1] // 2
            out[prefix + "gate_exps"], out[prefix + "up_exps"] = array[:, :ffn], array[:, ffn:]
        else:
            out[name] = array
    return out


def add_placeholder_vocab(writer, vocab_size: int) -> None:
    """A sentencepiece-style vocabulary of made-up pieces (<unk>, <s>, </s>,
    the 256 byte pieces, then "▁t{i}"): what llama.cpp needs to load a file
    at all (scripts/bench_moe.py times these files with llama-bench)."""
    pieces = (["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
              + [f"\u2581t{i}" for i in range(max(0, vocab_size - 259))])[:vocab_size]
    types = ([2, 3, 3] + [6] * 256 + [1] * max(0, vocab_size - 259))[:vocab_size]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores([0.0] * vocab_size)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def write_gguf(hf_model, path, qtype=gguf.GGMLQuantizationType.F32, arch="llama", tensor_type_override=None,
               vocab=False):
    """tensor_type_override: {gguf tensor name: (numpy array, raw GGML type)} to plant bad tensors.
    vocab: add a placeholder vocabulary (add_placeholder_vocab).
    A mixture of experts is written as llama.cpp's converter writes one
    (stacked experts, expert_count / expert_used_count, arch from GGUF_ARCHITECTURES)."""
    c = hf_model.config
    arch = GGUF_ARCHITECTURES.get(c.model_type, arch)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope_theta = getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"]
    writer.add_rope_freq_base(rope_theta)
    writer.add_vocab_size(c.vocab_size)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    num_experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", 0)
    if num_experts:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        if getattr(c, "moe_intermediate_size", None):
            writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        if getattr(c, "shared_expert_intermediate_size", None):
            writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if vocab:
        add_placeholder_vocab(writer, c.vocab_size)
    state = moe_tensors({k: v.float().numpy() for k, v in hf_model.state_dict().items()})
    if c.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for name, array in state.items():
        if arch == "llama" and name.endswith("q_proj.weight"):
            array = llama_cpp_row_order(array, c.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            array = llama_cpp_row_order(array, c.num_key_value_heads)
        target = gguf_name(name)
        if name.endswith("shared_expert_gate.weight"):
            array = array[0]  # [1, hidden] -> [hidden], as llama.cpp stores it
        if tensor_type_override and target in tensor_type_override:
            data, raw = tensor_type_override[target]
            writer.add_tensor(target, data, raw_dtype=raw)
        elif qtype != gguf.GGMLQuantizationType.F32 and quantized(array, qtype, name):
            writer.add_tensor(target, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(target, np.ascontiguousarray(array, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def round_trip_hf_model(hf_model, qtype):
    """The HF model with every weight replaced by its quantize-dequantize image:
    the exact float model a correct GGUF loader must reproduce."""
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            param.copy_(torch.from_numpy(round_trip(param.float().numpy(), qtype, name)))
    return hf_model


def write_kquant_mix(hf_model, path, mix: dict, seed: int):
    """A GGUF of hf_model whose linear weights and head are random K-quant
    blocks (random_k_blocks), Q4_K except where `mix` ({GGUF name: type})
    says otherwise: layers that mix block types, as a Q4_K_M file's do."""
    rng = np.random.default_rng(seed)
    override = {}
    for name, param in hf_model.state_dict().items():
        target = gguf_name(name)
        if name.endswith("proj.weight") or target == "output.weight" or target in mix:  # mix may name token_embd
            qtype = mix.get(target, gguf.GGMLQuantizationType.Q4_K)
            override[target] = (random_k_blocks(rng, qtype, *param.shape), qtype)
    return write_gguf(hf_model, path, tensor_type_override=override)
