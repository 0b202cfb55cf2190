"""Write GPTQ and AWQ (GEMM) checkpoints from a HF model by the formats'
published packing rules (gptqmodel and autoawq do not install on a CPU-only
torch), each linear quantized round-to-nearest. Optionally also the
reference: the HF model holding each format's dequantized weights, computed
in float64 numpy from the formulas (not by the loader under test).

Used by tests/loading/test_prequantized.py and scripts/bench_prequantized.py."""

from __future__ import annotations

import json

import numpy as np
import torch
from safetensors.numpy import save_file

from tests.tiny_models import save_hf_model

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def linear_names(hf):
    return [f"model.layers.{i}.{m}" for i in range(hf.config.num_hidden_layers) for m in LINEARS]


def pack_int32(codes, bits, axis):
    """uint codes -> int32 words along `axis`, low bits first (GPTQ's and compressed-tensors' packing)."""
    codes = np.moveaxis(codes.astype(np.uint32), axis, -1)
    per = 32 // bits
    words = codes.reshape(*codes.shape[:-1], -1, per) << (np.arange(per, dtype=np.uint32) * bits)
    return np.moveaxis(np.bitwise_or.reduce(words, axis=-1), -1, axis).view(np.int32)


def rtn(w, bits, group_size, sym):
    """w [in, out] -> codes [in, out], zeros [groups, out] (int), scales [groups, out] float16: round to nearest."""
    g = w.reshape(-1, group_size, w.shape[1])
    top = (1 << bits) - 1
    if sym:
        scales = (np.abs(g).max(1) / ((top + 1) // 2 - 0.5)).astype(np.float16)
        zeros = np.full(scales.shape, (top + 1) // 2)
    else:
        low, high = g.min(1), g.max(1)
        scales = ((high - low) / top).astype(np.float16)
        zeros = np.clip(np.round(-low / scales.astype(np.float64)), 0, top).astype(np.int64)
    s = np.repeat(scales.astype(np.float64), group_size, 0)
    z = np.repeat(zeros, group_size, 0)
    codes = np.clip(np.round(w / s) + z, 0, top).astype(np.int64)
    return codes, zeros, scales


def dequantized(codes, zeros, scales, group_size):
    """w = (q - zero) * scale in float64, [out, in] (HF's layout)."""
    return ((codes - np.repeat(zeros, group_size, 0)) * np.repeat(scales.astype(np.float64), group_size, 0)).T


def write(hf, directory, tensors, quantization_config, replaced):
    """The HF model's own tensors (less `replaced` linears' weights) plus `tensors`, and its config.json
    with quantization_config."""
    save_hf_model(hf, directory)
    state = {k: v.numpy() for k, v in hf.state_dict().items()
             if not (k.endswith(".weight") and k.rsplit(".", 1)[0] in replaced)}
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    # safetensors.numpy writes an array's buffer as it lies: C order first.
    save_file({k: np.ascontiguousarray(v) for k, v in {**state, **tensors}.items()}, str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def with_weights(hf, weights):
    """The HF model with each linear's weight replaced by its float64 dequantized value (rounded to float32)."""
    state = hf.state_dict()
    for name, w in weights.items():
        state[f"{name}.weight"] = torch.tensor(w.astype(np.float32))
    hf.load_state_dict(state)
    return hf


def act_order_permutations(hf, seed):
    """A random input order per layer and input, as GPTQ's desc_act takes from
    the Hessian's diagonal: one for q / k / v (one Hessian: the same
    activations), one for o, one for gate / up, one for down."""
    rng = np.random.default_rng(seed)
    c = hf.config
    q_dim = c.num_attention_heads * (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    sizes = {"attn": c.hidden_size, "o": q_dim, "mlp": c.hidden_size, "down": c.intermediate_size}
    inputs = {"self_attn.q_proj": "attn", "self_attn.k_proj": "attn", "self_attn.v_proj": "attn",
              "self_attn.o_proj": "o", "mlp.gate_proj": "mlp", "mlp.up_proj": "mlp", "mlp.down_proj": "down"}
    perms = {}
    for i in range(c.num_hidden_layers):
        drawn = {k: rng.permutation(n) for k, n in sizes.items()}
        perms.update({f"model.layers.{i}.{m}": drawn[k] for m, k in inputs.items()})
    return perms


def gptq_checkpoint(hf, directory, bits, group_size, sym, fmt, reference=True, act_order_seed=None):
    """-> (directory, the reference model, or None without `reference`; hf itself becomes it).

    act_order_seed: a desc_act checkpoint: each linear's input rows quantized
    in a random order (act_order_permutations), group_size consecutive rows
    of that order per group, the codes stored back in the model's row order
    and g_idx[perm[j]] = j // group_size (GPTQ's g_idx[invperm])."""
    perms = {} if act_order_seed is None else act_order_permutations(hf, act_order_seed)
    tensors, weights = {}, {}
    for name in linear_names(hf):
        w = hf.get_submodule(name).weight.detach().numpy().T.astype(np.float64)  # [in, out]
        group = w.shape[0] if group_size == -1 else group_size
        perm = perms.get(name, np.arange(w.shape[0]))
        permuted_codes, zeros, scales = rtn(w[perm], bits, group, sym)
        codes = np.empty_like(permuted_codes)
        codes[perm] = permuted_codes
        g_idx = np.empty(w.shape[0], np.int32)
        g_idx[perm] = np.arange(w.shape[0]) // group
        stored_zeros = zeros - 1 if fmt == "gptq" else zeros
        tensors[f"{name}.qweight"] = pack_int32(codes, bits, axis=0)
        tensors[f"{name}.qzeros"] = pack_int32(stored_zeros & ((1 << bits) - 1), bits, axis=1)
        tensors[f"{name}.scales"] = scales
        tensors[f"{name}.g_idx"] = g_idx
        if reference:  # w[i] = (q[i] - zero[g_idx[i]]) * scale[g_idx[i]]
            weights[name] = ((codes - zeros[g_idx]) * scales[g_idx].astype(np.float64)).T
    config = dict(quant_method="gptq", bits=bits, group_size=group_size, sym=sym, desc_act=bool(perms),
                  checkpoint_format=fmt)
    directory = write(hf, directory, tensors, config, set(linear_names(hf)))
    return directory, with_weights(hf, weights) if reference else None


def awq_pack(codes):
    """[rows, out] codes -> int32 [rows, out / 8]: nibble k of word j holds column 8j + AWQ_ORDER[k]."""
    rows, out = codes.shape
    by_nibble = codes.reshape(rows, out // 8, 8)[:, :, AWQ_ORDER]
    return pack_int32(by_nibble.reshape(rows, out), 4, axis=1)


def awq_checkpoint(hf, directory, group_size, reference=True):
    """-> (directory, the reference model, or None without `reference`; hf itself becomes it)."""
    tensors, weights = {}, {}
    for name in linear_names(hf):
        w = hf.get_submodule(name).weight.detach().numpy().T.astype(np.float64)
        codes, zeros, scales = rtn(w, 4, group_size, sym=False)
        tensors[f"{name}.qweight"] = awq_pack(codes)
        tensors[f"{name}.qzeros"] = awq_pack(zeros)
        tensors[f"{name}.scales"] = scales
        if reference:
            weights[name] = dequantized(codes, zeros, scales, group_size)
    config = dict(quant_method="awq", version="gemm", bits=4, group_size=group_size, zero_point=True)
    directory = write(hf, directory, tensors, config, set(linear_names(hf)))
    return directory, with_weights(hf, weights) if reference else None


def compressed_act_order_checkpoint(hf, directory, group_size, seed, reference=True):
    """A compressed-tensors pack-quantized int4 checkpoint with actorder "group"
    (llm-compressor's GPTQ before compressed-tensors 0.20 removed it, so the
    library no longer writes one): symmetric signed codes + 8 packed low bits
    first along the input into `weight_packed` [out, in / 8], `weight_scale`
    [out, groups], `weight_g_idx` [in] each input's group, groups in random
    orders as gptq_checkpoint's act order. -> (directory, reference or None)."""
    perms = act_order_permutations(hf, seed)
    tensors, weights = {}, {}
    for name in linear_names(hf):
        w = hf.get_submodule(name).weight.detach().numpy().T.astype(np.float64)  # [in, out]
        perm = perms[name]
        permuted_codes, _, scales = rtn(w[perm], 4, group_size, sym=True)  # unsigned: signed + 8
        codes = np.empty_like(permuted_codes)
        codes[perm] = permuted_codes
        g_idx = np.empty(w.shape[0], np.int32)
        g_idx[perm] = np.arange(w.shape[0]) // group_size
        tensors[f"{name}.weight_packed"] = pack_int32(codes.T, 4, axis=1)
        tensors[f"{name}.weight_scale"] = np.ascontiguousarray(scales.T)
        tensors[f"{name}.weight_shape"] = np.array(w.shape[::-1], np.int64)
        tensors[f"{name}.weight_g_idx"] = g_idx
        if reference:  # w[o, i] = (q[o, i] - 8) * scale[o, g_idx[i]]
            weights[name] = ((codes - 8) * scales[g_idx].astype(np.float64)).T
    scheme = dict(targets=["Linear"], weights=dict(num_bits=4, type="int", symmetric=True, strategy="group",
                                                   group_size=group_size, actorder="group"))
    config = dict(quant_method="compressed-tensors", format="pack-quantized", quantization_status="compressed",
                  config_groups={"group_0": scheme}, ignore=["lm_head"])
    directory = write(hf, directory, tensors, config, set(linear_names(hf)))
    return directory, with_weights(hf, weights) if reference else None
