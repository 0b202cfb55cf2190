"""Write quantized mixture-of-experts checkpoints from a tiny HF MoE model:
every linear (attention, dense MLP, each expert, a shared expert) stored as
the format stores it, the routers and the shared expert's gate left float,
as GPTQ, AutoAWQ, fine-grained fp8 and llm-compressor leave them.

The per-expert names are the ones transformers' save_pretrained writes
(mlp.experts.{e}.*_proj, Mixtral's block_sparse_moe.experts.{e}.w1 / w2 /
w3). GPTQ and AWQ codes are packed by tests/prequantized_writers.py's
rules, fp8 blocks here, compressed-tensors weights by the library's own
compressor. Each writer also gives the reference: the HF model holding every
quantized weight's dequantized value (float64 numpy from the format's
formula, or the library's own decompression), read back by transformers
from a float checkpoint."""

from __future__ import annotations

import json
import re
import shutil

import ml_dtypes
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tests.prequantized_writers import awq_pack, dequantized, pack_int32, rtn
from tests.tiny_models import save_hf_model

# A linear's prefix: attention, dense MLP, experts, shared expert (not the
# routers mlp.gate / block_sparse_moe.gate, nor mlp.shared_expert_gate).
LINEAR = re.compile(r"^model\.layers\.\d+\..*(_proj|\.w[123])$")


def _state(hf, directory) -> dict[str, torch.Tensor]:
    save_hf_model(hf, directory)
    return load_file(str(directory / "model.safetensors"))


def linear_prefixes(state) -> list[str]:
    return sorted(k[:-len(".weight")] for k in state if k.endswith(".weight") and LINEAR.match(k[:-len(".weight")]))


def _write(hf, directory, quantize, quantization_config):
    """quantize(prefix, w float64 [out, in]) -> (stored tensors {suffix: numpy or torch}, value [out, in]).
    -> (the checkpoint's directory, directory / "checkpoint", and the reference HF model, read from
    directory / "reference")."""
    reference_dir, directory = directory / "reference", directory / "checkpoint"
    state = _state(hf, directory)
    reference_state = dict(state)
    for prefix in linear_prefixes(state):
        stored, value = quantize(prefix, state.pop(f"{prefix}.weight").double().numpy())
        for suffix, tensor in stored.items():
            state[f"{prefix}.{suffix}"] = tensor if isinstance(tensor, torch.Tensor) else torch.from_numpy(
                np.ascontiguousarray(tensor))
        reference_state[f"{prefix}.weight"] = torch.from_numpy(np.ascontiguousarray(value, np.float32))
    save_file(state, str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(config))
    shutil.copytree(directory, reference_dir)
    save_file(reference_state, str(reference_dir / "model.safetensors"))
    config.pop("quantization_config")
    (reference_dir / "config.json").write_text(json.dumps(config))
    return directory, type(hf).from_pretrained(reference_dir, dtype=torch.float32).eval()


def gptq_moe_checkpoint(hf, directory, bits, group_size, sym, fmt="gptq", act_order=()):
    """act_order: linears whose input rows are quantized in a random order
    (desc_act), group_size consecutive rows of it per group, the codes stored
    back in the model's row order and g_idx[perm[j]] = j // group_size."""
    rng = np.random.default_rng(0)

    def quantize(prefix, w):
        perm = rng.permutation(w.shape[1]) if prefix in act_order else np.arange(w.shape[1])
        permuted_codes, zeros, scales = rtn(w.T[perm], bits, group_size, sym)
        codes = np.empty_like(permuted_codes)
        codes[perm] = permuted_codes
        g_idx = np.empty(w.shape[1], np.int32)
        g_idx[perm] = np.arange(w.shape[1]) // group_size
        stored_zeros = zeros - 1 if fmt == "gptq" else zeros
        return ({"qweight": pack_int32(codes, bits, axis=0),
                 "qzeros": pack_int32(stored_zeros & ((1 << bits) - 1), bits, axis=1), "scales": scales,
                 "g_idx": g_idx},
                ((codes - zeros[g_idx]) * scales[g_idx].astype(np.float64)).T)
    config = dict(quant_method="gptq", bits=bits, group_size=group_size, sym=sym, desc_act=bool(act_order),
                  checkpoint_format=fmt)
    return _write(hf, directory, quantize, config)


def awq_moe_checkpoint(hf, directory, group_size):
    def quantize(prefix, w):
        codes, zeros, scales = rtn(w.T, 4, group_size, sym=False)
        return ({"qweight": awq_pack(codes), "qzeros": awq_pack(zeros), "scales": scales},
                dequantized(codes, zeros, scales, group_size))
    config = dict(quant_method="awq", version="gemm", bits=4, group_size=group_size, zero_point=True)
    return _write(hf, directory, quantize, config)


def fp8_moe_checkpoint(hf, directory, block, left_float=()):
    """Fine-grained fp8: `weight` float8_e4m3fn, `weight_scale_inv` absmax / 448 per block;
    the linears named in left_float stay float (a checkpoint the loader must refuse)."""
    bo, bi = block

    def quantize(prefix, w):
        if prefix in left_float:
            return {"weight": torch.from_numpy(w.astype(np.float32))}, w
        nb_out, nb_in = -(-w.shape[0] // bo), -(-w.shape[1] // bi)
        padded = np.zeros((nb_out * bo, nb_in * bi))
        padded[:w.shape[0], :w.shape[1]] = np.abs(w)
        scale = (padded.reshape(nb_out, bo, nb_in, bi).max((1, 3)) / 448.0).astype(np.float32)
        s = np.repeat(np.repeat(scale.astype(np.float64), bo, 0), bi, 1)[:w.shape[0], :w.shape[1]]
        q = (w / s).astype(ml_dtypes.float8_e4m3fn)
        weight = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
        return {"weight": weight, "weight_scale_inv": scale}, q.astype(np.float64) * s
    config = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=list(block))
    return _write(hf, directory, quantize, config)


def compressed_moe_checkpoint(hf, directory, fmt, weights):
    """compressed-tensors: each linear compressed by the library's compressor
    for `fmt` from scales of its min / max; the routers ignored, as
    llm-compressor's MoE recipes leave them."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(**weights)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    compressor = BaseCompressor.get_value_from_registry(fmt)

    def quantize(prefix, w):
        weight = torch.from_numpy(w.astype(np.float32))
        if args.strategy == "group":
            g = weight.reshape(weight.shape[0], -1, args.group_size)
            low, high = g.amin(-1), g.amax(-1)
        else:
            low, high = weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
        scale, zero = calculate_qparams(low, high, args)
        module = {"weight": weight, "weight_scale": scale, "weight_zero_point": zero}
        stored = compressor.compress(module, scheme)
        value = compressor.decompress(stored, scheme)["weight"]
        return dict(stored), value.double().numpy()
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, quantization_status="compressed",
                                ignore=["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"])
    return _write(hf, directory, quantize, {**config.model_dump(exclude=["quant_method"]),
                                            "quant_method": "compressed-tensors"})
