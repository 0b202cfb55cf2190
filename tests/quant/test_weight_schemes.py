"""Weight quantization: round-trip bounds of the RTN schemes, the int4 packing,
`linear` against dequantize-then-matmul in float64, GGUF blocks loaded
straight into QuantizedTensors against gguf's own dequantizer, and quantized
models against their float originals (logits, greedy continuations, engine)."""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from jaxinfer import LLM, SamplingParams
from jaxinfer.backends import XlaBackend
from jaxinfer.loading.gguf import blocks_to_quantized, unpermute_rows
from jaxinfer.loading.model import Model
from jaxinfer.native import matmul as cpu_matmul
from jaxinfer.quant.linear import linear
from jaxinfer.quant.params import LINEAR_KEYS, params_nbytes, quantize_params
from jaxinfer.quant.schemes import quantize
from jaxinfer.quant.tensor import QuantizedTensor, dequantize, pack_int4, unpack_int4
from tests.cpu_features import needs_vec16
from tests.gguf_writer import gguf_name, random_k_blocks, write_gguf
from tests.tiny_models import assert_logits_close, make_hf_model, save_hf_model

Q = gguf.GGMLQuantizationType
F32_EPS = 2.0**-23
# (scheme, group_size) pairs, None = the scheme's default (int8/fp8 per channel).
CASES = [("int8", None), ("int8", 32), ("int4", 32), ("int4", 64), ("int4", 128), ("fp8", None)]


def error_bound(w: np.ndarray, qt: QuantizedTensor) -> np.ndarray:
    """Per-element bound on |w - dequantize(qt)| from the scheme's step size,
    plus a few float32 roundings of the quantizer's own arithmetic.

    int8 / int4 round to the nearest step, so the error is at most half a step
    (scale / 2; int4's offset is the group minimum, which is on the grid).
    fp8 e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 relative for normal
    values and 2^-10 (half the smallest subnormal step 2^-9) below them, in
    units of the per-channel scale."""
    scales = np.repeat(np.asarray(qt.scales, np.float64), qt.group_size, axis=-2)
    rounding = 8 * F32_EPS * (np.abs(w) + scales * 16)
    if qt.scheme == "fp8":
        return np.maximum(np.abs(w) * 2.0**-4, scales * 2.0**-10) + rounding
    return scales / 2 + rounding


def check_round_trip(w, scheme, group_size):
    qt = quantize(jnp.asarray(w), scheme, group_size)
    err = np.abs(np.asarray(dequantize(qt), np.float64) - np.asarray(w, np.float64))
    bound = error_bound(np.asarray(w, np.float64), qt)
    worst = float((err / bound).max())
    assert worst <= 1.0, f"{scheme}/{group_size}: error reaches {worst:.3f} x the bound"
    # The bound is not vacuous: RTN of continuous values uses most of it somewhere.
    assert worst > 0.5, f"{scheme}/{group_size}: error only {worst:.3f} x the bound"


@pytest.mark.parametrize("scheme,group_size", CASES)
def test_round_trip_error_bound_random(scheme, group_size):
    rng = np.random.default_rng(1)
    # Stacked [layers, in, out], with outliers and an all-zero group/channel.
    w = rng.standard_t(3, size=(2, 256, 48)).astype(np.float32) * 0.05
    w[1, :, 7] = 0.0
    check_round_trip(w, scheme, group_size)


@pytest.fixture(scope="module")
def default_float():
    return jaxinfer.load(progress=False, quantization=None)


@pytest.mark.parametrize("scheme,group_size", [("int8", None), ("int4", 64), ("fp8", None)])
def test_round_trip_error_bound_real_weights(default_float, scheme, group_size):
    layers = default_float.params["layers"]
    for key in ("wq", "w_down"):
        check_round_trip(np.asarray(layers[key][:2]), scheme, group_size)


def test_int4_packing_every_value_at_every_row_parity():
    a, b = np.meshgrid(np.arange(16), np.arange(16), indexing="ij")
    # Rows 0..3: (a, b) then (b, a), so every value sits at even and odd rows.
    values = np.stack([a.ravel(), b.ravel(), b.ravel(), a.ravel()]).astype(np.uint8)  # [4, 256]
    packed = np.asarray(pack_int4(jnp.asarray(values)))
    assert packed.shape == (2, 256) and packed.dtype == np.uint8
    np.testing.assert_array_equal(packed[0], a.ravel() | (b.ravel() << 4))
    np.testing.assert_array_equal(np.asarray(unpack_int4(jnp.asarray(packed))), values)
    qt = QuantizedTensor(jnp.asarray(packed), jnp.ones((1, 256)), jnp.zeros((1, 256)), "int4", 4)
    np.testing.assert_array_equal(np.asarray(dequantize(qt)), values.astype(np.float32))


@pytest.mark.parametrize("scheme,group_size", CASES)
def test_linear_matches_dequantize_then_matmul(scheme, group_size):
    rng = np.random.default_rng(2)
    w = quantize(jnp.asarray(rng.normal(size=(256, 40)), jnp.float32), scheme, group_size)
    reference_w = np.asarray(dequantize(w), np.float64)
    x = rng.normal(size=(3, 5, 256)).astype(np.float32)
    expected = x.astype(np.float64) @ reference_w
    ours = jax.jit(linear)(jnp.asarray(x), w)
    assert ours.dtype == jnp.float32 and ours.shape == (3, 5, 40)
    # float32 accumulation over 256 terms of size ~|x||w|.
    np.testing.assert_allclose(np.asarray(ours), expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    # bfloat16 activations: the weight is cast to bfloat16 (2^-9 relative) in the grouped path.
    x16 = jnp.asarray(x, jnp.bfloat16)
    ours16 = jax.jit(linear)(x16, w)
    assert ours16.dtype == jnp.bfloat16
    expected16 = np.asarray(x16, np.float64) @ reference_w
    np.testing.assert_allclose(np.asarray(ours16, np.float64), expected16, atol=2e-2 * np.abs(expected16).max())


@pytest.mark.parametrize("group_size", [256, 64])
def test_linear_with_offsets_matches_float64(group_size):
    """int8 with an offset a group (asymmetric GPTQ int8 loads so), one group
    a column included: the value is data * scale + offset."""
    rng = np.random.default_rng(group_size)
    data = rng.integers(-128, 128, (256, 40), dtype=np.int8)
    scales = rng.uniform(0.001, 0.01, (256 // group_size, 40)).astype(np.float32)
    offsets = rng.uniform(-0.1, 0.1, (256 // group_size, 40)).astype(np.float32)
    w = QuantizedTensor(jnp.asarray(data), jnp.asarray(scales), jnp.asarray(offsets), "int8", group_size)
    value = data * np.repeat(scales, group_size, 0).astype(np.float64) + np.repeat(offsets, group_size, 0)
    x = rng.normal(size=(3, 256)).astype(np.float32)
    expected = x.astype(np.float64) @ value
    np.testing.assert_allclose(np.asarray(jax.jit(linear)(jnp.asarray(x), w)), expected, rtol=0,
                               atol=1e-5 * np.abs(expected).max())


def test_linear_with_stacked_weight_and_plain_array():
    rng = np.random.default_rng(3)
    w = quantize(jnp.asarray(rng.normal(size=(2, 64, 16)), jnp.float32), "int4", 32)
    x = rng.normal(size=(2, 3, 64)).astype(np.float32)
    expected = np.einsum("lri,lio->lro", x.astype(np.float64), np.asarray(dequantize(w), np.float64))
    np.testing.assert_allclose(np.asarray(linear(jnp.asarray(x), w)), expected, atol=1e-4)
    plain = rng.normal(size=(64, 16)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(linear(jnp.asarray(x), jnp.asarray(plain))), x @ plain, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="32 features but the weight expects 64"):
        linear(jnp.ones((3, 32)), w)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1], ids=lambda q: q.name)
def test_gguf_blocks_repack_exactly(qtype):
    """Random blocks: our repacked tensor dequantizes to gguf's own values, bit for bit."""
    rng = np.random.default_rng(4)
    w = (rng.normal(size=(24, 96)) * rng.uniform(0.01, 3, size=(24, 1))).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    expected = gguf.quants.dequantize(raw, qtype)  # [out, in]
    qt = blocks_to_quantized(raw, qtype, 24, 96)
    assert (qt.scheme, qt.group_size, qt.shape) == ("int4" if qtype in (Q.Q4_0, Q.Q4_1) else "int8", 32, (96, 24))
    np.testing.assert_array_equal(np.asarray(dequantize(jax.device_put(qt))), expected.T)


@pytest.fixture(scope="module")
def tiny_llama():
    return make_hf_model("llama", seed=9)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_gguf_direct_load_equals_dequantized_load(tmp_path, tiny_llama, qtype):
    """quantization="gguf" keeps every linear weight (Q/K rows un-permuted)
    quantized, and each dequantizes to exactly the float load's tensor
    (gguf.quants.dequantize, verified against HF in test_gguf.py). On CPU the
    untied head is loaded dequantized (the faster form there), the same numbers."""
    path = write_gguf(tiny_llama, tmp_path / "m.gguf", qtype)
    direct = jaxinfer.load(str(path), progress=False, quantization="gguf")
    reference = jaxinfer.load(str(path), progress=False, quantization=None)
    scheme = "int8" if qtype == Q.Q8_0 else "int4"
    for key in LINEAR_KEYS:
        w = direct.params["layers"][key]
        assert isinstance(w, QuantizedTensor) and (w.scheme, w.group_size) == (scheme, 32), key
        np.testing.assert_array_equal(np.asarray(dequantize(w)), np.asarray(reference.params["layers"][key]), key)
    head = direct.params["lm_head"]
    assert isinstance(head, QuantizedTensor) == direct.backend.keeps_gguf_head_quantized()
    head = dequantize(head) if isinstance(head, QuantizedTensor) else head
    np.testing.assert_array_equal(np.asarray(head), np.asarray(reference.params["lm_head"]))
    np.testing.assert_array_equal(np.asarray(direct.params["embed"]), np.asarray(reference.params["embed"]))
    tokens = np.arange(1, 40)
    assert_logits_close(direct.logits(tokens), reference.logits(tokens), rtol=1e-5)


def test_gguf_layers_of_mixed_types(tmp_path, tiny_llama):
    """One layer's ffn_up stored Q8_0 among Q4_1 layers: the two stack as one
    regrouped int8 tensor holding each layer's exact values; one layer's
    ffn_gate stored BF16 (no direct form): that weight loads dequantized."""
    layer1 = tiny_llama.model.layers[1].mlp
    override = {"blk.1.ffn_up.weight": (gguf.quants.quantize(layer1.up_proj.weight.detach().numpy(), Q.Q8_0), Q.Q8_0),
                "blk.1.ffn_gate.weight": (gguf.quants.quantize(layer1.gate_proj.weight.detach().numpy(), Q.BF16),
                                          Q.BF16)}
    path = write_gguf(tiny_llama, tmp_path / "m.gguf", Q.Q4_1, tensor_type_override=override)
    direct = jaxinfer.load(str(path), progress=False, quantization="gguf")
    reference = jaxinfer.load(str(path), progress=False, quantization=None)
    up, gate = direct.params["layers"]["w_up"], direct.params["layers"]["w_gate"]
    assert isinstance(up, QuantizedTensor) and (up.scheme, up.group_size) == ("int8", 32)
    np.testing.assert_array_equal(np.asarray(dequantize(up)), np.asarray(reference.params["layers"]["w_up"]))
    assert not isinstance(gate, QuantizedTensor)
    np.testing.assert_array_equal(np.asarray(gate), np.asarray(reference.params["layers"]["w_gate"]))
    assert isinstance(direct.params["layers"]["w_down"], QuantizedTensor)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
@pytest.mark.parametrize("heads", [None, 4])
def test_gguf_k_quant_blocks_repack_exactly(qtype, heads):
    """Random K-quant blocks, with and without the Q/K row un-permutation:
    our tensor dequantizes to gguf's own values, bit for bit."""
    raw = random_k_blocks(np.random.default_rng(5), qtype, 24, 512)
    expected = gguf.quants.dequantize(raw, qtype)  # [out, in]
    if heads:
        expected = unpermute_rows(expected, heads)
    qt = blocks_to_quantized(raw, qtype, 24, 512, heads)
    assert (qt.scheme, qt.group_size) == {Q.Q4_K: ("int4", 32), Q.Q5_K: ("int8", 32), Q.Q6_K: ("int8", 16)}[qtype]
    np.testing.assert_array_equal(np.asarray(dequantize(jax.device_put(qt))), expected.T)


def test_gguf_k_quant_model_loads_quantized(tmp_path):
    """A Q4_K_M-like file (Q4_K, with Q6_K for layer 1's attn_v and ffn_down
    and Q5_K for layer 0's ffn_up) on a backend without K-quant kernels
    (XlaBackend; the CPU keeps the file's own form: tests/quant/test_kquant.py):
    every linear weight stays quantized (the mixed ones as one regrouped int8
    stack), with logits equal to the dequantized float load's."""
    hf_model = make_hf_model("llama_kquant", seed=13)
    rng = np.random.default_rng(6)
    override = {}
    for name, param in hf_model.state_dict().items():
        if name.endswith("proj.weight"):
            target = gguf_name(name)
            qtype = {"blk.1.attn_v.weight": Q.Q6_K, "blk.1.ffn_down.weight": Q.Q6_K,
                     "blk.0.ffn_up.weight": Q.Q5_K}.get(target, Q.Q4_K)
            override[target] = (random_k_blocks(rng, qtype, *param.shape), qtype)
    path = write_gguf(hf_model, tmp_path / "m.gguf", tensor_type_override=override)
    direct = jaxinfer.load(str(path), "float32", progress=False, quantization="gguf", backend=XlaBackend())
    reference = jaxinfer.load(str(path), "float32", progress=False, quantization=None, backend=XlaBackend())
    for key in LINEAR_KEYS:
        w = direct.params["layers"][key]
        assert isinstance(w, QuantizedTensor), key
        expected = {"wv": ("int8", 16), "w_down": ("int8", 16), "w_up": ("int8", 32)}.get(key, ("int4", 32))
        assert (w.scheme, w.group_size) == expected, key
        np.testing.assert_array_equal(np.asarray(dequantize(w)), np.asarray(reference.params["layers"][key]), key)
    tokens = np.arange(1, 40)
    assert_logits_close(direct.logits(tokens), reference.logits(tokens), rtol=1e-5)


def greedy(model, prompt, steps):
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(model.logits(tokens)[-1].argmax()))
    return tokens[len(prompt) :]


def test_default_model_gguf_quantized_matches_float_load(default_float):
    """The shipped Q4_1 file kept quantized, which is what the default
    (quantization="auto") picks on CPU: the weights are the same numbers as
    the float load's, so logits agree to float32 rounding (1e-4 of the logit
    scale) and greedy decoding picks the same tokens."""
    model = jaxinfer.load(progress=False)
    assert model.quantization == "gguf" and default_float.quantization is None
    assert all(isinstance(model.params["layers"][k], QuantizedTensor) for k in LINEAR_KEYS)
    held = {k: v for k, v in model.params.items() if k != "few_row_head"}
    assert params_nbytes(held) < 0.4 * params_nbytes(default_float.params)
    prompt = model.tokenizer.encode("The capital of France is")
    assert_logits_close(model.logits(prompt), default_float.logits(prompt), rtol=1e-4)
    assert greedy(model, prompt, 6) == greedy(default_float, prompt, 6)


@needs_vec16
def test_default_model_head_reads_the_files_blocks(default_float):
    """On CPU the tied Q8_0 head is kept as stored, for the exact kernel,
    and only so: its values are the float table's exactly, the embedding
    lookup reads its columns (the same numbers, no float copy kept), and
    the logits of one row, a batch of 64 and one of 200 (past
    FEW_ROW_HEAD_MAX_ROWS, where the float table used to serve) through it
    match the float model's."""
    from jaxinfer.backends.cpu_weights import FEW_ROW_HEAD_MAX_ROWS, max_exact_rows
    from jaxinfer.models.llama import embed_tokens

    model = jaxinfer.load(progress=False)
    head = model.params["few_row_head"]
    assert (head.scheme, head.group_size) == ("int8", 32) and "embed" not in model.params
    table = np.asarray(default_float.params["embed"])
    np.testing.assert_array_equal(np.asarray(dequantize(head)).T, table)
    tokens = np.array([[0, 1, 5, 49151, 1234, 7]])
    np.testing.assert_array_equal(np.asarray(jax.jit(embed_tokens)(model.params, tokens)), table[tokens])
    logits = jax.jit(model.backend.logits)
    for rows in (1, 64, 200):
        assert rows <= FEW_ROW_HEAD_MAX_ROWS or FEW_ROW_HEAD_MAX_ROWS < rows <= max_exact_rows()
        hidden = jax.random.normal(jax.random.key(rows), (1, rows, model.config.hidden_size), jnp.float32)
        assert cpu_matmul.TARGET_NAME in logits.lower(model.params, hidden).as_text()
        assert_logits_close(logits(model.params, hidden), default_float.backend.logits(default_float.params, hidden),
                            rtol=1e-4)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_hf_model(make_hf_model("llama", seed=12), tmp_path_factory.mktemp("tiny_quant"))


def relative_rms(actual, expected):
    return float(np.sqrt(((actual - expected) ** 2).mean() / (expected**2).mean()))


def dequantized_model(model):
    """The float model whose linear weights are the quantized model's
    dequantized values (tensor.dequantize, the reference), head untied."""
    params = jax.tree_util.tree_map(
        lambda w: dequantize(w) if isinstance(w, QuantizedTensor) else w,
        model.params,
        is_leaf=lambda w: isinstance(w, QuantizedTensor),
    )
    return Model(model.config, params, None, model.dtype)


def test_int8_load_close_to_float(tiny_dir):
    float_model = jaxinfer.load(str(tiny_dir), progress=False)
    # "auto" leaves a float checkpoint as stored: every faster scheme changes its numbers.
    assert float_model.quantization is None and not isinstance(float_model.params["layers"]["wq"], QuantizedTensor)
    model = jaxinfer.load(str(tiny_dir), progress=False, quantization="int8")
    tokens = np.random.default_rng(5).integers(0, 128, 48)
    ours, exact = model.logits(tokens), float_model.logits(tokens)
    # Against its own dequantized weights: float32 rounding only.
    assert_logits_close(ours, dequantized_model(model).logits(tokens), rtol=1e-4)
    # Against the float model: per-channel int8 errs by <= absmax/254 per
    # weight (~0.5% RMS here), which this random 2-layer net amplifies to
    # ~2.5% of the logits (test_gguf.py sees ~3% for Q8_0).
    assert relative_rms(ours, exact) < 0.05
    assert (ours.argmax(-1) == exact.argmax(-1)).mean() > 0.9
    # Load-time quantization is quantize_params on the float32 params (stored
    # in the CPU kernels' tiles on a CPU that takes them: the same values).
    expected = quantize_params(float_model.params, "int8")
    for key in LINEAR_KEYS:
        loaded = model.params["layers"][key].untiled()
        np.testing.assert_array_equal(np.asarray(loaded.data), np.asarray(expected["layers"][key].data))
        np.testing.assert_array_equal(np.asarray(loaded.scales), np.asarray(expected["layers"][key].scales))
    # Bytes: int8 data + one float32 scale per output channel per layer.
    c = model.config
    linear_floats = sum(np.prod(float_model.params["layers"][k].shape) for k in LINEAR_KEYS)
    scales = sum(c.num_layers * float_model.params["layers"][k].shape[-1] for k in LINEAR_KEYS)
    assert params_nbytes(model.params) == params_nbytes(float_model.params) - 3 * linear_floats + 4 * scales


def test_quantized_tied_head(tmp_path):
    """include_head on tied embeddings: a quantized lm_head (embed.T) takes
    over the projection while the gather keeps the float table."""
    hf_model = make_hf_model("llama_mqa_tied", seed=13)
    float_model = jaxinfer.load(str(save_hf_model(hf_model, tmp_path)), progress=False)
    assert "lm_head" not in float_model.params
    params = quantize_params(float_model.params, "int4", 32, include_head=True)
    head = params["lm_head"]
    assert isinstance(head, QuantizedTensor) and head.shape == (64, 128)
    assert params["embed"] is float_model.params["embed"]
    np.testing.assert_array_equal(
        np.asarray(head.data), np.asarray(quantize(float_model.params["embed"].T, "int4", 32).data)
    )
    model = Model(float_model.config, params, None, float_model.dtype)
    tokens = np.arange(5, 37)
    assert_logits_close(model.logits(tokens), dequantized_model(model).logits(tokens), rtol=1e-4)


def test_engine_generates_with_int8_weights(tiny_dir):
    """The paged engine (prefill + decode over the KV cache) on int8 weights
    reproduces greedy decoding by the same quantized model's uncached forward."""
    llm = LLM(str(tiny_dir), quantization="int8", progress=False, max_num_seqs=4, max_num_batched_tokens=64)
    prompt = [3, 14, 15, 92, 65, 35]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == greedy(llm.model, prompt, 8)


def test_bad_quantization_arguments(tiny_dir):
    with pytest.raises(ValueError, match="quantization must be None, 'auto' or one of.*'int3'"):
        jaxinfer.load(str(tiny_dir), progress=False, quantization="int3")
    with pytest.raises(ValueError, match='quantization="gguf" needs a GGUF checkpoint'):
        jaxinfer.load(str(tiny_dir), progress=False, quantization="gguf")
    params = jaxinfer.load(str(tiny_dir), progress=False, quantization="int8").params
    with pytest.raises(ValueError, match="already quantized"):
        quantize_params(params, "int4")
    with pytest.raises(ValueError, match=r"group_size 48 must divide"):
        quantize_params(jaxinfer.load(str(tiny_dir), progress=False).params, "int4", 48)


@pytest.mark.parametrize("tile", [0, 64])
def test_columns_are_the_dequantized_columns(tile):
    """QuantizedTensor.columns (a tied model's embeddings from its head):
    exactly dequantize's columns, plain or tiled, with groups and offsets."""
    rng = np.random.default_rng(3)
    w = QuantizedTensor(jnp.asarray(rng.integers(-127, 128, (96, 128)), jnp.int8),
                        jnp.asarray(rng.uniform(0.01, 1, (3, 128)), jnp.float32),
                        jnp.asarray(rng.standard_normal((3, 128)), jnp.float32), "int8", 32)
    reference = np.asarray(dequantize(w)).T  # [out, in]
    stored = w.tiled(tile) if tile else w
    indices = np.array([[0, 127, 64], [63, 5, 5]])
    np.testing.assert_array_equal(np.asarray(stored.columns(indices)), reference[indices])
