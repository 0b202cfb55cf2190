"""Quantized HF checkpoints (GPTQ, AWQ, compressed-tensors, fp8) load in
their stored forms (loading/prequantized/) and give the logits and greedy
tokens of the float model holding each format's dequantized weights.

GPTQ, AWQ and fp8 checkpoints are written from a tiny HF model by the
formats' published packing rules (GPTQ and AWQ: tests/prequantized_writers.py;
gptqmodel and autoawq do not install on a CPU-only torch); the reference
weights are the formats' dequantization formulas in float64 numpy, loaded
into HF transformers. compressed-tensors
checkpoints are written by the compressed-tensors library, and HF
transformers loads the same directory as the reference.

Act-order checkpoints (GPTQ desc_act; compressed-tensors actorder "group")
hold each group's rows anywhere in the weight (g_idx): the reference is the
same float64 formula with each row's own group, HF holding the values in
the model's row order."""

import re

import ml_dtypes
import numpy as np
import pytest
import torch

import jaxinfer
from jaxinfer import LLM, SamplingParams
from jaxinfer.backends import XlaBackend, cpu_weights
from jaxinfer.convert import convert
from jaxinfer.errors import CheckpointError, UnsupportedModelError
from jaxinfer.loading.checkpoint import open_checkpoint
from jaxinfer.loading.model import _full_logits
from jaxinfer.native import matmul as cpu_matmul
from jaxinfer.quant.input_order import InputOrdered
from jaxinfer.quant.tensor import QuantizedTensor
from tests.prequantized_writers import (awq_checkpoint, compressed_act_order_checkpoint, gptq_checkpoint, linear_names,
                                        with_weights, write)
from tests.tiny_models import hf_greedy, hf_logits, make_hf_model

PROMPTS = [[5, 17, 99, 3, 64, 2, 11, 40], [120, 7, 7, 81, 33, 1]]
NEW_TOKENS = 5


def fp8_checkpoint(hf, directory, block):
    tensors, weights = {}, {}
    for name in linear_names(hf):
        w = hf.get_submodule(name).weight.detach().numpy().astype(np.float64)  # [out, in]
        bo, bi = block
        nb_out, nb_in = -(-w.shape[0] // bo), -(-w.shape[1] // bi)
        scale = np.zeros((nb_out, nb_in), np.float32)
        for r in range(nb_out):
            for c in range(nb_in):
                scale[r, c] = np.abs(w[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi]).max() / 448.0
        s = np.repeat(np.repeat(scale.astype(np.float64), bo, 0), bi, 1)[:w.shape[0], :w.shape[1]]
        q = (w / s).astype(ml_dtypes.float8_e4m3fn)
        tensors[f"{name}.weight"] = q
        tensors[f"{name}.weight_scale_inv"] = scale
        weights[name] = q.astype(np.float64) * s
    config = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=list(block))
    directory = write(hf, directory, {}, config, set(weights))
    _save_with_fp8(directory / "model.safetensors", tensors)
    return directory, with_weights(hf, weights)


def _save_with_fp8(path, fp8_tensors):
    """safetensors.numpy cannot write float8: write F8_E4M3 entries through torch."""
    from safetensors.numpy import load_file
    from safetensors.torch import save_file as save_torch

    state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in load_file(str(path)).items()}
    for k, v in fp8_tensors.items():
        v = torch.from_numpy(np.ascontiguousarray(v).view(np.uint8) if v.dtype == ml_dtypes.float8_e4m3fn
                             else np.ascontiguousarray(v))
        state[k] = v.view(torch.float8_e4m3fn) if v.dtype == torch.uint8 else v
    save_torch(state, str(path))


def compressed_checkpoint(variant, seed, directory, fmt, weights, input_activations=None):
    """A compressed-tensors checkpoint written by the library: its scales from each weight's min / max."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams

    hf = make_hf_model(variant, seed)
    args = QuantizationArgs(**weights)
    scheme = QuantizationScheme(targets=["Linear"], weights=args,
                                input_activations=input_activations and QuantizationArgs(**input_activations))
    apply_quantization_config(hf, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"],
                                                     format=fmt))
    for module in hf.modules():
        if hasattr(module, "weight_scale"):
            w = module.weight.data
            if args.strategy == "group":
                g = w.reshape(w.shape[0], -1, args.group_size)
                low, high = g.amin(-1), g.amax(-1)
            elif args.strategy == "channel":
                low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
            else:
                low, high = w.min().reshape(1), w.max().reshape(1)
            scale, zero = calculate_qparams(low, high, args)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(hf, quantization_format=fmt)
    compressor.compress_model(hf)
    hf.save_pretrained(directory)
    compressor.update_config(str(directory))
    # The reference: the library's own decompression of each weight, in a float model.
    compressor.decompress_model(hf)
    weights = {name: hf.get_submodule(name).weight.detach().numpy() for name in linear_names(hf)}
    reference = with_weights(make_hf_model(variant, seed), weights)
    if input_activations:
        for name in linear_names(reference):
            reference.get_submodule(name).register_forward_pre_hook(lambda _, args: (int8_per_token(args[0]),))
    return directory, reference


def int8_per_token(x):
    """Dynamic symmetric int8 per token: each row rounded to absmax / 127 steps."""
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
    return torch.clamp(torch.round(x / scale), -127, 127) * scale


def greedy(model, prompt):
    tokens = list(prompt)
    for _ in range(NEW_TOKENS):
        tokens.append(int(np.argmax(model.logits(tokens)[-1])))
    return tokens[len(prompt):]


def check_rounded_activations(model, reference):
    """w8a8: one activation a float ulp from an int8 rounding boundary rounds
    either way under another summation order, and later positions carry the
    step. Teacher-forced on the reference's greedy continuation: logits within
    2% of their scale, and the same argmax wherever the reference's top two
    are further apart than the difference seen."""
    for prompt in PROMPTS:
        tokens = list(prompt) + hf_greedy(reference, prompt, NEW_TOKENS)
        expected, actual = hf_logits(reference, tokens), model.logits(tokens)
        err = np.abs(actual - expected).max(-1)
        assert err.max() <= 2e-2 * np.abs(expected).max(), err.max()
        top2 = np.sort(expected, -1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 2 * err
        assert clear[len(prompt) - 1:].mean() >= 0.5
        assert np.array_equal(actual.argmax(-1)[clear], expected.argmax(-1)[clear])


def check(directory, reference, scheme, group_size=None, act_order=False, backend=None):
    model = jaxinfer.load(str(directory), progress=False, backend=backend)
    assert model.quantization == "stored"
    w = model.params["layers"]["w_down"]
    if act_order:
        assert isinstance(w, InputOrdered), w
        w = w.weight
    assert isinstance(w, QuantizedTensor) and w.scheme == scheme, w
    if group_size is not None:
        assert w.group_size == group_size
    if scheme == "w8a8":
        return check_rounded_activations(model, reference)
    for prompt in PROMPTS:
        expected = hf_logits(reference, prompt)
        actual = model.logits(prompt)
        err = np.abs(actual - expected).max() / np.abs(expected).max()
        assert err <= 1e-3, f"relative error {err:.3g}"
        assert greedy(model, prompt) == hf_greedy(reference, prompt, NEW_TOKENS)
    return model


@pytest.mark.parametrize("variant,bits,group_size,sym,fmt,scheme,kept_group", [
    ("llama", 4, 32, True, "gptq", "int4", 32),
    ("qwen2", 4, 64, False, "gptq_v2", "int4", 64),
    ("llama", 8, -1, False, "gptq", "int8", None),
    ("qwen2", 8, 32, True, "gptq_v2", "int8", 32),
])
def test_gptq(tmp_path, variant, bits, group_size, sym, fmt, scheme, kept_group):
    directory, reference = gptq_checkpoint(make_hf_model(variant, seed=3), tmp_path, bits, group_size, sym, fmt)
    check(directory, reference, scheme, kept_group)


@pytest.mark.parametrize("variant,bits,group_size,sym,fmt,scheme,backend", [
    ("llama", 4, 32, True, "gptq", "int4", None),
    ("qwen3", 8, 16, False, "gptq_v2", "int8", None),
    ("llama", 4, 16, False, "gptq", "int4", "xla"),
])
def test_gptq_act_order(tmp_path, variant, bits, group_size, sym, fmt, scheme, backend):
    """desc_act: every layer's rows in their own random order, shared by q / k /
    v and by gate / up. The CPU backend (its native kernels where they take
    the weight) and the XLA reference backend."""
    hf = make_hf_model(variant, seed=8)
    directory, reference = gptq_checkpoint(hf, tmp_path, bits, group_size, sym, fmt, act_order_seed=9)
    model = check(directory, reference, scheme, group_size, act_order=True,
                  backend=XlaBackend() if backend == "xla" else None)
    layers = model.params["layers"]
    labels = {key: layers[key].order_of for key in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}
    assert labels["wq"] == labels["wk"] == labels["wv"] and labels["w_gate"] == labels["w_up"], labels
    assert len({labels["wq"], labels["wo"]}) == 2 and len({labels["w_gate"], labels["w_down"]}) == 2, labels
    # A float load of the same directory reads each weight in the model's row order.
    floats = jaxinfer.load(str(directory), progress=False, quantization=None)
    np.testing.assert_allclose(floats.logits(PROMPTS[0]), hf_logits(reference, PROMPTS[0]), rtol=0, atol=1e-4)


def test_gptq_act_order_int4_runs_the_cpu_kernel(tmp_path):
    """int4 act-order on the CPU backend's exact kernel (native/matmul.py): the
    activations gathered once per order, so q / k / v still share one call and
    gate / up another: 4 calls in the layer body, as for a plain GPTQ load.
    Then the engine over it, and convert's refusal."""
    hf = make_hf_model("llama", seed=10)
    directory, reference = gptq_checkpoint(hf, tmp_path / "act_order", 4, 32, True, "gptq", act_order_seed=11)
    model = check(directory, reference, "int4", 32, act_order=True)
    for key in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        assert cpu_weights.kernel_for(1, model.params["layers"][key].weight) is cpu_weights.EXACT, key
    tokens = np.zeros((1, 8), np.int32)
    text = _full_logits.lower(model.params, model.config, tokens, model.backend).as_text()
    assert text.count(f"custom_call @{cpu_matmul.TARGET_NAME}(") == 4
    # The engine's steps (prefill chunks, one-row decodes) with the reference attention.
    llm = LLM(str(directory), progress=False, attention="reference", max_model_len=32, block_size=4, max_num_seqs=2,
              max_num_batched_tokens=16)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(reference, p, NEW_TOKENS) for p in PROMPTS]
    # A jaxinfer checkpoint does not hold the permuted rows: convert refuses, naming the weight.
    with pytest.raises(ValueError, match="act-order"):
        convert(str(directory), tmp_path / "orbax", progress=False, log=lambda *_: None)


def test_gptq_act_order_groups_must_be_whole(tmp_path):
    """A g_idx whose sorted groups are not group_size rows each is refused, naming the tensor."""
    from safetensors.numpy import load_file, save_file

    directory, _ = gptq_checkpoint(make_hf_model("llama", seed=12), tmp_path, 4, 32, True, "gptq",
                                   reference=False, act_order_seed=13)
    tensors = load_file(str(directory / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.g_idx"
    tensors[name][np.flatnonzero(tensors[name] == 0)[0]] = 1  # group 0: 31 rows, group 1: 33
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(CheckpointError, match=re.escape(name)):
        jaxinfer.load(str(directory), progress=False)


@pytest.mark.parametrize("variant,group_size", [("llama", 32), ("qwen2", 64)])
def test_awq_gemm(tmp_path, variant, group_size):
    directory, reference = awq_checkpoint(make_hf_model(variant, seed=4), tmp_path, group_size)
    check(directory, reference, "int4", group_size)


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_fp8_blocks(tmp_path, variant):
    # 32 x 48 blocks: several per weight, the last block of each axis partial (64 = 48 + 16).
    directory, reference = fp8_checkpoint(make_hf_model(variant, seed=5), tmp_path, (32, 48))
    check(directory, reference, "fp8", 16)


@pytest.mark.parametrize("variant,fmt,weights,inputs,scheme", [
    ("llama", "pack-quantized", dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
     None, "int4"),
    ("qwen2", "pack-quantized", dict(num_bits=4, type="int", symmetric=True, strategy="channel"), None, "int4"),
    ("llama", "int-quantized", dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
     dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True), "w8a8"),
    ("qwen2", "float-quantized", dict(num_bits=8, type="float", symmetric=True, strategy="channel"), None, "fp8"),
    ("llama", "naive-quantized", dict(num_bits=8, type="int", symmetric=True, strategy="group", group_size=32),
     None, "int8"),
])
def test_compressed_tensors(tmp_path, variant, fmt, weights, inputs, scheme):
    pytest.importorskip("compressed_tensors")
    directory, reference = compressed_checkpoint(variant, 6, tmp_path, fmt, weights, inputs)
    check(directory, reference, scheme)


@pytest.mark.parametrize("variant,group_size", [("llama", 32), ("qwen2", 16)])
def test_compressed_tensors_act_order(tmp_path, variant, group_size):
    """actorder "group" (weight_g_idx): the same sort at load as GPTQ's desc_act."""
    directory, reference = compressed_act_order_checkpoint(make_hf_model(variant, seed=14), tmp_path, group_size, 15)
    check(directory, reference, "int4", group_size, act_order=True)


@pytest.mark.parametrize("quantization_config,named", [
    (dict(quant_method="bitsandbytes", load_in_4bit=True), "'bitsandbytes'"),
    (dict(quant_method="gptq", bits=3, group_size=32), "3-bit GPTQ"),
    (dict(quant_method="gptq", bits=4, group_size=32, checkpoint_format="marlin"), "'marlin'"),
    (dict(quant_method="gptq_marlin_24", bits=4), "'gptq_marlin_24'"),
    (dict(quant_method="awq", version="gemv", bits=4), "'gemv'"),
    (dict(quant_method="hqq"), "'hqq'"),
    (dict(quant_method="compressed-tensors", format="pack-quantized", sparsity_config=dict(format="sparse-24-bitmask"),
          config_groups={}), "sparsity"),
])
def test_unsupported_methods_are_refused(tmp_path, quantization_config, named):
    hf = make_hf_model("llama")
    directory = write(hf, tmp_path, {}, quantization_config, set())
    with pytest.raises(UnsupportedModelError, match="not supported") as refused:
        jaxinfer.load(str(directory), progress=False)
    assert named in str(refused.value)
    # Refused where any caller opens the directory (convert, calibration), not only by load().
    with pytest.raises(UnsupportedModelError, match="not supported"):
        open_checkpoint(directory)
