"""W8A8 (int8 weights per channel, activations quantized to int8 per row on
the fly): `linear` against float64 numpy with the activation-rounding bound,
rows independent of their batch, the quantized head and the embedding lookup
it serves, loading, the engine, and the default model's perplexity within the
bound BENCHMARKS.md states for this opt-in scheme."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from jaxinfer import LLM, SamplingParams
from jaxinfer.models.llama import embed_tokens
from jaxinfer.perplexity import perplexity_of_text
from jaxinfer.quant.linear import linear
from jaxinfer.quant.params import LINEAR_KEYS
from jaxinfer.quant.schemes import quantize
from jaxinfer.quant.tensor import QuantizedTensor, dequantize
from tests.tiny_models import make_hf_model, save_hf_model

F32_EPS = 2.0**-23
# The default model's shapes (in, out): q/o, k/v, gate/up, down, and a head slice.
SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 4096)]


def activation_bound(x: np.ndarray, w_deq: np.ndarray) -> np.ndarray:
    """|x @ w - q(x) @ w| per output, q(x) = x rounded to a step of absmax(row) / 127:
    each activation moves by at most half a step, so an output moves by at
    most step / 2 * sum_i |w[i, o]|; plus float32 accumulation slack."""
    step = np.abs(x).max(-1, keepdims=True) / 127.0
    abs_w = np.abs(w_deq).sum(0)
    return step / 2 * abs_w + 64 * F32_EPS * (np.abs(x) @ np.abs(w_deq))


@pytest.mark.parametrize("rows", [1, 2, 7, 64])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_w8a8_linear_within_activation_bound(rows, shape):
    rng = np.random.default_rng(rows * 7 + shape[1])
    w = quantize(jnp.asarray(rng.standard_t(4, size=shape) * 0.05, jnp.float32), "w8a8")
    assert w.scheme == "w8a8" and w.data.dtype == jnp.int8 and w.scales.shape == (1, shape[1])
    w_deq = np.asarray(dequantize(w), np.float64)
    x = rng.standard_t(3, size=(rows, shape[0])).astype(np.float32)  # heavy tails, like real activations
    ours = np.asarray(jax.jit(linear)(jnp.asarray(x), w), np.float64)
    error = np.abs(ours - x.astype(np.float64) @ w_deq)
    bound = activation_bound(x.astype(np.float64), w_deq)
    worst = float((error / bound).max())
    assert worst <= 1.0, f"error reaches {worst:.3f} x the activation-rounding bound"
    # Not vacuous: a float product would sit near 1e-6 of the bound.
    assert worst > 0.05, f"error only {worst:.4f} x the bound: activations were not quantized"


def test_w8a8_rows_do_not_depend_on_their_batch():
    """int32 accumulation is exact and each row has its own scale, so a row's
    output is bit-identical alone (the padded one-row path), in 7 rows or in 64."""
    rng = np.random.default_rng(4)
    w = quantize(jnp.asarray(rng.normal(size=(576, 192)), jnp.float32), "w8a8")
    x = jnp.asarray(rng.normal(size=(64, 576)), jnp.float32)
    f = jax.jit(linear)
    full = np.asarray(f(x, w))
    np.testing.assert_array_equal(np.asarray(f(x[:7], w)), full[:7])
    for row in (0, 5, 63):
        np.testing.assert_array_equal(np.asarray(f(x[row:row + 1], w)), full[row:row + 1])


def test_w8a8_zero_rows_and_stacked_weights():
    rng = np.random.default_rng(5)
    w = quantize(jnp.asarray(rng.normal(size=(3, 64, 16)), jnp.float32), "w8a8")
    x = rng.normal(size=(3, 4, 64)).astype(np.float32)
    x[1, 2] = 0.0
    ours = np.asarray(linear(jnp.asarray(x), w), np.float64)
    w_deq = np.asarray(dequantize(w), np.float64)
    expected = np.einsum("lri,lio->lro", x.astype(np.float64), w_deq)
    assert np.all(ours[1, 2] == 0.0)
    for layer in range(3):
        bound = activation_bound(x[layer].astype(np.float64), w_deq[layer])
        assert np.all(np.abs(ours[layer] - expected[layer]) <= bound + 1e-12)
    with pytest.raises(ValueError, match="w8a8 is per output channel only"):
        quantize(jnp.ones((64, 16)), "w8a8", 32)


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    return save_hf_model(make_hf_model("llama_mqa_tied", seed=21), tmp_path_factory.mktemp("w8a8_tied"))


def test_w8a8_load_quantizes_head_and_drops_tied_table(tied_dir):
    float_model = jaxinfer.load(str(tied_dir), progress=False)
    model = jaxinfer.load(str(tied_dir), progress=False, quantization="w8a8")
    head = model.params["lm_head"]
    assert "embed" not in model.params and isinstance(head, QuantizedTensor) and head.scheme == "w8a8"
    assert all(model.params["layers"][k].scheme == "w8a8" for k in LINEAR_KEYS)
    table = np.asarray(float_model.params["embed"], np.float64)
    # Per channel RTN of the head (= embed.T): half a step per weight.
    step = np.abs(table).max(-1, keepdims=True) / 127.0
    head_deq = np.asarray(dequantize(head), np.float64)
    assert np.all(np.abs(head_deq.T - table) <= step / 2 * (1 + 1e-5))
    # The lookup reads the head's columns: exactly the dequantized numbers.
    tokens = jnp.asarray([[0, 5, 127], [64, 64, 3]])
    np.testing.assert_array_equal(np.asarray(embed_tokens(model.params, tokens)),
                                  head_deq.T[np.asarray(tokens)].astype(np.float32))


def test_w8a8_engine_matches_uncached_forward(tied_dir):
    """The paged engine on w8a8 weights reproduces greedy decoding by the same
    quantized model's uncached forward, with batched and lone requests alike."""
    llm = LLM(str(tied_dir), quantization="w8a8", progress=False, max_num_seqs=4, max_num_batched_tokens=64)
    prompts = [[3, 14, 15, 92, 65, 35], [2, 7, 1, 8], [99, 98]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        tokens = list(prompt)
        for _ in range(6):
            tokens.append(int(llm.model.logits(tokens)[-1].argmax()))
        assert out.outputs[0].token_ids == tokens[len(prompt):]


@pytest.mark.slow
def test_w8a8_default_model_perplexity_within_stated_bound(default_llm):
    """Opt-in because it changes numbers: BENCHMARKS.md states +3.4% perplexity
    on the eval text at window 1024; at the shorter windows used here the
    bound checked is 6%. Measured at these windows on an AVX2 CPU: +4.4% to
    +5.2%, moved by changes that only round floats differently (a vector exp
    for libm's in attention, LLVM's optimization level): rounding the
    activations to int8 turns an ulp of difference into another code, and
    3,000 characters of text average few tokens."""
    text = open("tests/data/eval_text.txt").read()[:3000]
    model = jaxinfer.load(progress=False, quantization="w8a8")
    options = dict(context_len=256, stride=256, chunk_size=256)
    exact = perplexity_of_text(default_llm.model, text, **options).perplexity
    ours = perplexity_of_text(model, text, **options).perplexity
    assert exact < ours < 1.06 * exact
