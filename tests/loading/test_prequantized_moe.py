"""Quantized mixture-of-experts checkpoints (GPTQ, AWQ, fp8 blocks,
compressed-tensors) load with each layer's experts stacked in their stored
form (loading/experts.py over loading/prequantized/) and give the logits and
greedy tokens of the float HF model holding each format's dequantized
weights (tests/prequantized_moe_writers.py), on the default CPU backend (int4
experts in the native expert kernel, fp8 ones in the reference's ragged_dot)
and on the XLA reference."""

import math

import numpy as np
import pytest

import jaxinfer
from jaxinfer.backends import XlaBackend
from jaxinfer.errors import CheckpointError, UnsupportedModelError
from jaxinfer.loading.model import _full_logits
from jaxinfer.native import expert_matmul
from jaxinfer.native import matmul as cpu_matmul
from jaxinfer.quant.tensor import QuantizedTensor
from tests.prequantized_moe_writers import (awq_moe_checkpoint, compressed_moe_checkpoint, fp8_moe_checkpoint,
                                            gptq_moe_checkpoint)
from tests.tiny_models import hf_greedy, hf_logits, make_hf_model

PROMPT = [5, 17, 99, 3, 64, 2, 11, 40, 120, 7]
NEW_TOKENS = 4

# format -> (tiny_models variant, writer, the experts' scheme, their group size for an input width)
CASES = {
    # Qwen2-MoE: a shared expert and its gate, a dense layer beside the sparse ones.
    "gptq": ("qwen2_moe", lambda hf, d: gptq_moe_checkpoint(hf, d, bits=4, group_size=32, sym=True), "int4",
             lambda n: 32),
    # Mixtral's names (block_sparse_moe.experts.{e}.w1 / w2 / w3).
    "awq": ("mixtral", lambda hf, d: awq_moe_checkpoint(hf, d, group_size=32), "int4", lambda n: 32),
    # Qwen3-MoE, 16 experts in 32 x 48 blocks (partial along the hidden size): groups of gcd(in, 48) rows.
    "fp8": ("qwen3_moe", lambda hf, d: fp8_moe_checkpoint(hf, d, (32, 48)), "fp8",
            lambda n: math.gcd(n, 48)),
    # Asymmetric packed int4: zero points packed along the output.
    "compressed-tensors": ("qwen2_moe", lambda hf, d: compressed_moe_checkpoint(
        hf, d, "pack-quantized", dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32)),
        "int4", lambda n: 32),
}


def native_calls(model) -> dict:
    """How many of each native expert kernel the model's forward calls."""
    text = _full_logits.lower(model.params, model.config, np.zeros((1, 16), np.int32), model.backend).as_text()
    return {"float": text.count(expert_matmul.TARGET_NAME), "quantized": text.count(cpu_matmul.EXPERT_TARGET_NAME)}


@pytest.fixture(scope="module", params=list(CASES))
def written(request, tmp_path_factory):
    """(format, directory, the prompt with the reference's greedy continuation, the reference's logits over it)."""
    variant, write, _, _ = CASES[request.param]
    directory, reference = write(make_hf_model(variant, seed=7), tmp_path_factory.mktemp(request.param))
    tokens = PROMPT + hf_greedy(reference, PROMPT, NEW_TOKENS)
    return request.param, directory, tokens, hf_logits(reference, tokens)


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_experts_load_as_stored(written, backend):
    fmt, directory, tokens, expected = written
    variant, _, scheme, group_size = CASES[fmt]
    model = jaxinfer.load(str(directory), progress=False, backend=XlaBackend() if backend == "xla" else None)
    c = model.config
    assert model.quantization == "stored"
    layers = model.params["layers"]
    for key, shape in [("expert_gate", (c.hidden_size, c.moe_intermediate_size)),
                       ("expert_down", (c.moe_intermediate_size, c.hidden_size))]:
        w = layers[key]
        assert isinstance(w, QuantizedTensor) and (w.scheme, w.group_size) == (scheme, group_size(shape[0])), (key, w)
        assert w.shape == (c.num_layers, c.num_experts, *shape)
    assert not isinstance(layers["router"], QuantizedTensor)
    if c.shared_expert_intermediate_size:
        assert isinstance(layers["shared_w_down"], QuantizedTensor)
        assert not isinstance(layers["shared_expert_gate"], QuantizedTensor)
    # The CPU backend's expert kernel takes int4 stacks; fp8 experts, and every form on the XLA
    # backend, go through the reference's ragged_dot on the dequantized layer.
    kernels = 2 if backend == "cpu" and scheme == "int4" else 0
    assert native_calls(model) == {"float": 0, "quantized": kernels}

    actual = model.logits(tokens)
    err = np.abs(actual - expected).max() / np.abs(expected).max()
    assert err <= 1e-3, f"relative error {err:.3g}"
    # Each position's argmax is the reference's next greedy token: the same greedy decode.
    assert actual[len(PROMPT) - 1:-1].argmax(-1).tolist() == tokens[len(PROMPT):]


def test_an_expert_stored_float_beside_quantized_ones_is_refused(tmp_path):
    directory, _ = fp8_moe_checkpoint(make_hf_model("qwen2_moe", seed=8), tmp_path, (32, 32),
                                      left_float={"model.layers.0.mlp.experts.3.up_proj"})
    with pytest.raises(CheckpointError, match=r"experts\.3\.up_proj\.weight is stored float beside quantized"):
        jaxinfer.load(str(directory), progress=False)


def test_act_order_experts_are_refused(tmp_path):
    """GPTQ desc_act: experts 0 .. 2 in their own row order load as plain
    weights, expert 3's rows in act-order groups are refused, naming it."""
    directory, _ = gptq_moe_checkpoint(make_hf_model("qwen2_moe", seed=9), tmp_path, bits=4, group_size=32, sym=True,
                                       act_order={"model.layers.0.mlp.experts.3.gate_proj"})
    with pytest.raises(UnsupportedModelError, match=r"experts\.3\.gate_proj\.weight stores its input rows in act"):
        jaxinfer.load(str(directory), progress=False)
